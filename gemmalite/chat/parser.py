"""The one incremental parser of a Gemma 4 chat reply: token ids in, typed events out.

A reply is content, optionally a thought (``<|channel>thought\\n ... <channel|>``) and, when tools
are declared, calls (``<|tool_call>call:NAME{ARGS}<tool_call|>``, several in a row for parallel
calls). Structure is recognised by token id, never by decoded text: the markup tokens are single
vocabulary entries (`ChatTokens`), so a reply that *writes* ``<|channel>`` as text stays text.
Between them, text runs are detokenized as they come (`Tokenizer.stream`). Arguments are
transcoded to JSON on the fly (`ArgumentsTranscoder`), so the `ToolCallArgs` pieces of a call
always join into its final arguments.

Malformed output (a reply generated without a constraint) never raises: a call header that is
not ``call:NAME{`` goes back to content as the text it was; a call whose arguments break the
syntax ends there (`ToolCallEnd` with ``complete=False``) and the rest is content; a reply cut
inside a call header (still ``call:NA...``) drops that header. Stop strings
apply to the content only (a thought or an argument may hold them).
"""
from __future__ import annotations

import re
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Union

from ..errors import InputError
from ..runtime.generate import TextCutter
from ..tokenizer import Tokenizer
from .arguments import ArgumentsTranscoder

_CHANNEL_NAME = "thought\n"  # what follows <|channel> in Gemma 4's thinking channel
_CALL_NAME = re.compile(r"call:([A-Za-z0-9_.\-]{1,128})")
_HEADER_MAX = 160  # characters of "call:NAME" before "{": more is not a call header


@dataclass(frozen=True)
class ChatTokens:
    """The ids of Gemma 4's chat markup in a vocabulary (48-52, 100, 101 in Gemma 4's)."""

    tool_call: int
    tool_call_end: int
    tool_response: int
    string: int
    channel: int
    channel_end: int

    NAMES = {"tool_call": "<|tool_call>", "tool_call_end": "<tool_call|>", "tool_response": "<|tool_response>",
             "string": '<|"|>', "channel": "<|channel>", "channel_end": "<channel|>"}

    @classmethod
    def find(cls, tokenizer: Tokenizer) -> "ChatTokens | None":
        """The markup ids of ``tokenizer``, or None when its vocabulary lacks them (not Gemma 4's)."""
        ids = {k: tokenizer.token_id(v) for k, v in cls.NAMES.items()}
        return None if None in ids.values() else cls(**ids)

    @classmethod
    def of(cls, tokenizer: Tokenizer) -> "ChatTokens":
        """`find`, or `InputError`: tool calls and thinking need Gemma 4's chat format."""
        found = cls.find(tokenizer)
        if found is None:
            missing = [v for v in cls.NAMES.values() if tokenizer.token_id(v) is None]
            raise InputError(f"this model's vocabulary has no {', '.join(missing)}: tool calls and thinking need "
                             "Gemma 4's chat format")
        return found


# -- events ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Reasoning:
    text: str


@dataclass(frozen=True)
class Content:
    text: str


@dataclass(frozen=True)
class ToolCallStart:
    index: int
    id: str
    name: str


@dataclass(frozen=True)
class ToolCallArgs:
    index: int
    text: str  # a piece of the arguments' JSON text


@dataclass(frozen=True)
class ToolCallEnd:
    index: int
    complete: bool  # False: the arguments were cut (by the token budget) or broke the syntax


@dataclass(frozen=True)
class TurnEnd:
    finish_reason: str  # "stop", "length", or "tool_calls" (the turn ended after complete calls)


Event = Union[Reasoning, Content, ToolCallStart, ToolCallArgs, ToolCallEnd, TurnEnd]


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class OutputParser:
    """Push a reply's token ids one at a time (`push`), then `finish`; each returns its events.
    ``tools``: parse tool calls (else their markup is content text); ``max_calls``: the turn ends
    after that many complete calls (OpenAI's ``parallel_tool_calls=False`` is 1). ``stops``: stop
    strings, looked for in the content only. `stopped` once the turn is over (a stop string, or
    ``max_calls``): generation should end."""

    def __init__(self, tokenizer: Tokenizer, *, tools: bool = False, stops: Iterable[str] = (),
                 max_calls: int | None = None, call_id: Callable[[], str] = new_call_id):
        self.tok = tokenizer
        self.ids = ids = ChatTokens.of(tokenizer)
        self.tools = tools
        # markup tokens: always the thinking channel's, with tools <|tool_call>; inside a call, its end and <|"|>
        self.markup = {ids.channel, ids.channel_end} | ({ids.tool_call} if tools else set())
        self.call_markup = {ids.tool_call_end, ids.string}
        self.max_calls = max_calls
        self.call_id = call_id
        self.cutter = TextCutter(tokenizer, list(stops))
        self.stream = tokenizer.stream()
        self.mode = "content"  # content | header | reasoning | call | args
        self.buf = ""  # the channel name or call header read so far
        self.hold = ""  # a reasoning text's last newline (dropped if the thought closes after it)
        self.args: ArgumentsTranscoder | None = None
        self.calls: list[bool] = []  # per call: complete?
        self.out: list[Event] = []
        self.done = False

    @property
    def stopped(self) -> bool:
        return self.cutter.stopped or (self.max_calls is not None and sum(self.calls) >= self.max_calls)

    # -- input ---------------------------------------------------------------------------
    def push(self, token: int) -> list[Event]:
        self.out = []
        if self.done or self.stopped:
            return []
        if token in self.markup or (self.mode in ("args", "call") and token in self.call_markup):
            self._flush_run()
            self._markup(token)
        else:
            text = self.stream.push(token)
            if text:
                self._text(text)
        return self.out

    def finish(self, reason: str | None) -> list[Event]:
        """The reply ended (``reason``: "stop" or "length"): close what is open; the last event is `TurnEnd`."""
        self.out = []
        if self.done:
            return []
        self._flush_run()
        if self.mode == "header":
            self._end_header()
        if self.mode == "reasoning" and self.hold:
            self.out.append(Reasoning(self.hold))
        elif self.mode == "call":  # cut before the call's name was complete: nothing of it was streamed
            self.buf = ""
        elif self.mode == "args":
            self._end_call(self.args.done)
        self.mode, self.hold = "content", ""
        tail = self.cutter.finish()
        if tail:
            self.out.append(Content(tail))
        reason = "stop" if self.stopped else (reason or "stop")
        if reason == "stop" and self.calls and all(self.calls):
            reason = "tool_calls"
        self.out.append(TurnEnd(reason))
        self.done = True
        return self.out

    # -- text ------------------------------------------------------------------------------
    def _flush_run(self) -> None:
        """The text run ends (a markup token, or the reply): what the detokenizer holds, then a fresh one."""
        text = self.stream.flush()
        self.stream = self.tok.stream()
        if text:
            self._text(text)

    def _text(self, text: str) -> None:
        mode = self.mode
        if mode == "content":
            piece = self.cutter.feed(text)
            if piece:
                self.out.append(Content(piece))
        elif mode == "reasoning":
            self._reasoning(text)
        elif mode == "header":
            self.buf += text
            if _CHANNEL_NAME.startswith(self.buf) and len(self.buf) < len(_CHANNEL_NAME):
                return
            rest = self.buf[len(_CHANNEL_NAME):] if self.buf.startswith(_CHANNEL_NAME) else self.buf
            self.mode, self.buf = "reasoning", ""
            self._reasoning(rest)
        elif mode == "call":
            self.buf += text
            head, brace, rest = self.buf.partition("{")
            if brace:
                m = _CALL_NAME.fullmatch(head.strip())
                if m is None:
                    self._call_fallback()
                    return
                index = len(self.calls)
                self.calls.append(False)
                self.out.append(ToolCallStart(index, self.call_id(), m.group(1)))
                self.mode, self.buf, self.args = "args", "", ArgumentsTranscoder()
                self._args_text("{" + rest)
            elif len(self.buf) > _HEADER_MAX or not (_CALL_NAME.match(self.buf.lstrip()) or "call:".startswith(self.buf.lstrip())):
                self._call_fallback()
        elif mode == "args":
            self._args_text(text)

    def _reasoning(self, text: str) -> None:
        text = self.hold + text
        self.hold = "\n" if text.endswith("\n") else ""
        text = text[:-1] if self.hold else text
        if text:
            self.out.append(Reasoning(text))

    def _args_text(self, text: str) -> None:
        piece = self.args.text(text)
        if piece:
            self.out.append(ToolCallArgs(len(self.calls) - 1, piece))
        if self.args.error:
            rest = self.args.rest
            self._end_call(self.args.done)
            self._text(rest)

    # -- markup --------------------------------------------------------------------------------
    def _markup(self, token: int) -> None:
        ids, mode = self.ids, self.mode
        if mode == "args":
            if token == ids.string:
                piece = self.args.delimiter()
                if piece:
                    self.out.append(ToolCallArgs(len(self.calls) - 1, piece))
                if self.args.error:
                    rest = self.args.rest
                    self._end_call(False)
                    self._text(rest)
                return
            if token == ids.tool_call_end:
                self._end_call(self.args.done)
                if not self.calls[-1]:
                    self._text(self.tok.decode([token]))
                return
            self._end_call(self.args.done)  # a channel or another call inside a call: this one ends here
        elif mode == "call":
            if token in (ids.string, ids.tool_call_end):
                self.buf += self.tok.decode([token])
                self._call_fallback()
                return
            self._call_fallback()
        elif mode == "header" and token != ids.channel:
            self._end_header()
        elif mode == "reasoning":
            self.hold = ""
        if token == ids.channel:
            if self.mode != "reasoning":
                self.mode, self.buf = "header", ""
        elif token == ids.channel_end:
            self.mode = "content"  # (a stray one in content is dropped: it is markup)
        elif token == ids.tool_call:
            self.mode, self.buf = "call", ""

    def _end_header(self) -> None:
        """A thought that closes before its channel name was complete: what was read of it is text."""
        buf, self.buf = self.buf, ""
        self.mode = "reasoning"
        if buf and not _CHANNEL_NAME.startswith(buf):
            self._reasoning(buf)

    def _call_fallback(self) -> None:
        """``<|tool_call>`` not followed by ``call:NAME{``: the markup and what followed are content."""
        text, self.buf = self.tok.decode([self.ids.tool_call]) + self.buf, ""
        self.mode = "content"
        self._text(text)

    def _end_call(self, complete: bool) -> None:
        self.calls[-1] = complete
        self.out.append(ToolCallEnd(len(self.calls) - 1, complete))
        self.mode, self.args = "content", None


# -- the reply ----------------------------------------------------------------------------------
@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str = ""  # JSON text (OpenAI's ``function.arguments``)
    complete: bool = False

    def to_openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class ChatReply:
    """A chat reply with its parts apart: what `Model.chat` returns for tools / thinking."""

    content: str = ""
    reasoning: str | None = None
    tool_calls: list[ToolCall] = field(default_factory=list)
    finish_reason: str | None = None  # "stop", "length" or "tool_calls"
    logprobs: list | None = None  # (per-token log-probabilities, when asked for)
    stats: Any = field(default=None, repr=False)  # the call's `GenerationStats` (Model.chat)

    def add(self, ev: Event) -> None:
        if isinstance(ev, Content):
            self.content += ev.text
        elif isinstance(ev, Reasoning):
            self.reasoning = (self.reasoning or "") + ev.text
        elif isinstance(ev, ToolCallStart):
            self.tool_calls.append(ToolCall(ev.id, ev.name))
        elif isinstance(ev, ToolCallArgs):
            self.tool_calls[ev.index].arguments += ev.text
        elif isinstance(ev, ToolCallEnd):
            self.tool_calls[ev.index].complete = ev.complete
        elif isinstance(ev, TurnEnd):
            self.finish_reason = ev.finish_reason

    @classmethod
    def of(cls, events: Iterable[Event]) -> "ChatReply":
        reply = cls()
        for ev in events:
            reply.add(ev)
        return reply

    def message(self) -> dict:
        """The reply as an assistant message for the next turn's ``messages`` (OpenAI's shape)."""
        msg: dict = {"role": "assistant", "content": self.content}
        if self.tool_calls:
            msg["tool_calls"] = [c.to_openai() for c in self.tool_calls]
        if self.reasoning:
            msg["reasoning_content"] = self.reasoning
        return msg


def reply_events(tokens, parser: OutputParser, stats) -> Iterator[Event]:
    """The events of a reply's token stream (a generator: closing it stops the generation); a stop
    string in the content ends it. ``stats`` (`GenerationStats`) gets the final finish reason."""
    try:
        for t in tokens:
            yield from parser.push(t)
            if parser.stopped:
                break
    finally:
        tokens.close()  # (a no-op once they ran out)
    for ev in parser.finish(stats.finish_reason):
        if isinstance(ev, TurnEnd):
            stats.finish_reason = ev.finish_reason
        yield ev
