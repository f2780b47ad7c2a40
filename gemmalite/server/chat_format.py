"""Chat completions for agents: OpenAI's ``tools`` / ``tool_choice`` / ``parallel_tool_calls`` /
``reasoning_effort`` (thinking on or off and its budget: `REASONING_EFFORTS`) / ``chat_template_kwargs``
in, ``message.tool_calls`` / ``reasoning_content`` (and their streamed deltas) out, through
gemmalite's Gemma 4 chat format (`gemmalite.chat`).

Every chat reply is read by the `OutputParser`: a thought the model writes goes to
``reasoning_content``, never into ``content``; calls are parsed when tools are declared and
``tool_choice`` is not "none" (which leaves the tools out of the prompt), and the reply is
constrained by the tools' grammar (`chat.tool_grammar`: "auto" free text then calls, "required"
or a named function calls only, each call's arguments following its tool's schema).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..chat import history
from ..chat.tool_grammar import tool_grammar
from ..chat.parser import (Content, Event, OutputParser, Reasoning, ToolCallArgs, ToolCallEnd,
                           ToolCallStart, TurnEnd)
from .protocol import bad
from .scheduler import Part, Piece

#: ``reasoning_effort`` (chat) / ``reasoning.effort`` (Responses) -> (thinking on, its budget in thought
#: tokens, `runtime.budget`; None: unlimited)
REASONING_EFFORTS: dict[str, tuple[bool, int | None]] = {
    "none": (False, None), "minimal": (False, None), "low": (True, 256), "medium": (True, 1024),
    "high": (True, None), "xhigh": (True, None), "max": (True, None)}


@dataclass
class ChatOptions:
    """The agent part of a chat request, checked."""

    tools: list[dict[str, Any]] = field(default_factory=list)
    tool_choice: str | dict = "none"
    parallel: bool = True
    thinking: bool = False
    thinking_budget: int | None = None  # thought tokens before <channel|> is forced (None: unlimited)

    @property
    def parse_calls(self) -> bool:
        return bool(self.tools) and self.tool_choice != "none"


def _check(fn, *args, **kw):
    try:
        return fn(*args, **kw)
    except ValueError as e:  # history's InputError names the field
        raise bad(str(e), getattr(e, "param", None)) from None


def chat_options(body: dict) -> ChatOptions:
    tools = body.get("tools")
    decls = _check(history.check_tools, tools) if tools is not None else []
    choice = body.get("tool_choice")
    choice = _check(history.check_tool_choice, ("auto" if decls else "none") if choice is None else choice, decls)
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise bad(f"'parallel_tool_calls' must be a boolean, got {parallel!r}", "parallel_tool_calls")
    effort = body.get("reasoning_effort")
    if effort is not None and effort not in REASONING_EFFORTS:
        raise bad(f"'reasoning_effort' must be one of {list(REASONING_EFFORTS)}, got {effort!r}", "reasoning_effort")
    kwargs = body.get("chat_template_kwargs")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise bad("'chat_template_kwargs' must be an object", "chat_template_kwargs")
    kwargs = kwargs or {}
    unknown = sorted(set(kwargs) - {"enable_thinking"})
    if unknown:
        raise bad(f"chat_template_kwargs {unknown} are not supported (only enable_thinking)", "chat_template_kwargs",
                  "unsupported_parameter")
    enable = kwargs.get("enable_thinking")
    if enable is not None and not isinstance(enable, bool):
        raise bad("chat_template_kwargs.enable_thinking must be a boolean", "chat_template_kwargs.enable_thinking")
    thinking, budget = REASONING_EFFORTS[effort] if effort is not None else (bool(enable), None)
    if effort is not None and enable is not None and enable != thinking:
        raise bad(f"reasoning_effort {effort!r} and chat_template_kwargs.enable_thinking={enable} disagree",
                  "reasoning_effort")
    return ChatOptions(decls, choice, parallel, thinking, budget)


def prompt_ids(tokenizer, messages: list[dict[str, Any]], opts: ChatOptions) -> list[int]:
    """The prompt (run in a worker thread); a conversation the format refuses is a 400 naming the field."""
    return _check(lambda: history.chat_ids(tokenizer, messages, tools=opts.tools if opts.tool_choice != "none" else None,
                                           thinking=opts.thinking))


def tool_constraint(tokenizer, opts: ChatOptions, response_format=None):
    """The grammar of the tools' calls, with ``response_format`` beside them ("auto": that JSON or
    calls); None without tools or with tool_choice "none". A schema it cannot enforce, or a
    response_format with "required" / a named function, is a 400 naming where."""
    if not opts.parse_calls:
        return None
    return _check(tool_grammar, tokenizer, opts.tools, opts.tool_choice, opts.parallel, thinking=opts.thinking,
                  response_format=response_format)


class ChatReader:
    """The scheduler's reader of a chat sequence (`scheduler.TextReader`'s interface) over the parser."""

    def __init__(self, tokenizer, stops: list[str], opts: ChatOptions):
        self.parser = OutputParser(tokenizer, tools=opts.parse_calls, stops=stops,
                                   max_calls=None if opts.parallel else 1)

    @property
    def stopped(self) -> bool:
        return self.parser.stopped

    def push(self, token: int) -> list[Event]:
        return self.parser.push(token)

    def finish(self, reason: str) -> tuple[list[Event], str]:
        events = self.parser.finish(reason)
        return [e for e in events if not isinstance(e, TurnEnd)], events[-1].finish_reason


def delta(ev) -> dict | None:
    """The ``choices[i].delta`` of one scheduler event: a `Part` of the chat reader, or a `Piece` (a
    model without Gemma 4's chat format). None: nothing to send."""
    ev = ev.event if isinstance(ev, Part) else ev
    if isinstance(ev, (Content, Piece)):
        return {"content": ev.text}
    if isinstance(ev, Reasoning):
        return {"reasoning_content": ev.text}
    if isinstance(ev, ToolCallStart):
        return {"tool_calls": [{"index": ev.index, "id": ev.id, "type": "function",
                                "function": {"name": ev.name, "arguments": ""}}]}
    if isinstance(ev, ToolCallArgs):
        return {"tool_calls": [{"index": ev.index, "function": {"arguments": ev.text}}]}
    return None  # ToolCallEnd


def message(events: list) -> dict:
    """The non-streamed ``choices[0].message``: the same events joined."""
    content, reasoning, calls = [], [], []
    for ev in events:
        ev = ev.event if isinstance(ev, Part) else ev
        if isinstance(ev, (Content, Piece)):
            content.append(ev.text)
        elif isinstance(ev, Reasoning):
            reasoning.append(ev.text)
        elif isinstance(ev, ToolCallStart):
            calls.append({"id": ev.id, "type": "function", "function": {"name": ev.name, "arguments": ""}})
        elif isinstance(ev, ToolCallArgs):
            calls[ev.index]["function"]["arguments"] += ev.text
        elif not isinstance(ev, ToolCallEnd):
            raise TypeError(f"not a chat event: {ev!r}")
    text = "".join(content)
    msg: dict[str, Any] = {"role": "assistant", "content": None if calls and not text else text}
    if reasoning:
        msg["reasoning_content"] = "".join(reasoning)
    if calls:
        msg["tool_calls"] = calls
    return msg
