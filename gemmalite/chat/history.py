"""A conversation in OpenAI's shape -> the messages and tools Gemma 4's chat template takes.

The template itself renders (`Tokenizer.apply_chat_template`, transformers' way); this module only
puts the messages in the form it reads, checked first:

* ``tool_calls[].function.arguments`` arrive as JSON text (OpenAI's shape) and are parsed into
  objects: the template renders a mapping as Gemma's call syntax, but pastes a string as is
  (``call:f{{"a": 1}}``).
* ``role: "tool"`` results must follow the assistant message whose calls they answer
  (``tool_call_id`` one of its ids, when given): the current template then renders them inside
  that model turn; it would drop a stray one without a word.
* The older template revision (the one embedded in Gemma 4 GGUF files) does not look for
  ``role: "tool"`` at all and renders each as a turn of its own. For it, an assistant message
  with calls, the tool results after it, and a final assistant answer after those are folded into
  one assistant message with ``tool_responses`` (each result's content parsed as JSON where it is
  JSON), as llama.cpp does for such templates; the name of a result is its call's (by id, else by
  position), else the message's ``name``.
* ``reasoning_content`` passes through: the template shows it only for the calls of the current
  turn and strips thoughts from earlier answers (``strip_thinking``).
"""
from __future__ import annotations

import copy
import json
from typing import Any

from ..errors import InputError

#: a template that renders role: tool inside the model turn says so (Gemma 4's current revision)
CURRENT_MARKER = "{#- OpenAI Chat Completions:"
CALL_MARKER = "<|tool_call>call:"
TOOL_CHOICES = ("none", "auto", "required")


def bad(param: str, message: str) -> InputError:
    """An `InputError` that names the offending field (``param``: the server answers it as OpenAI's ``param``)."""
    e = InputError(f"{param}: {message}")
    e.param = param  # type: ignore[attr-defined]
    return e


def template_kind(source: str | None) -> str:
    """"current" (renders role: tool in the model turn), "legacy" (the GGUF revision: needs the fold),
    or "none" (a template without Gemma 4's tool calls)."""
    if not source or CALL_MARKER not in source:
        return "none"
    return "current" if CURRENT_MARKER in source else "legacy"


def check_tools(tools: Any, param: str = "tools") -> list[dict[str, Any]]:
    """OpenAI's ``tools``: a list of ``{"type": "function", "function": {"name", "description"?,
    "parameters"?}}``, names unique; returned as the template reads them (copies)."""
    if not isinstance(tools, list):
        raise bad(param, f"must be a list of {{'type': 'function', 'function': {{...}}}} objects, got {type(tools).__name__}")
    out, names = [], set()
    for i, t in enumerate(tools):
        where = f"{param}[{i}]"
        if not isinstance(t, dict) or t.get("type", "function") != "function" or not isinstance(t.get("function"), dict):
            raise bad(where, "must be {'type': 'function', 'function': {'name': ..., 'parameters': {...}}}")
        f = t["function"]
        name = f.get("name")
        if not isinstance(name, str) or not name or len(name) > 64 or not all(c.isalnum() or c in "_-." for c in name):
            raise bad(f"{where}.function.name", f"must be 1-64 letters, digits, '_', '-' or '.', got {name!r}")
        if name in names:
            raise bad(f"{where}.function.name", f"{name!r} is declared twice")
        names.add(name)
        if f.get("description") is not None and not isinstance(f["description"], str):
            raise bad(f"{where}.function.description", "must be a string")
        params = f.get("parameters")
        if params is not None:
            if not isinstance(params, dict):
                raise bad(f"{where}.function.parameters", "must be a JSON Schema object")
            if params.get("type", "object") != "object":
                raise bad(f"{where}.function.parameters", f"must describe an object (type 'object'), got {params.get('type')!r}")
            if "properties" in params and not isinstance(params["properties"], dict):
                raise bad(f"{where}.function.parameters.properties", "must be an object")
        func = {"name": name, "description": f.get("description") or "", **({"parameters": params} if params else {})}
        out.append({"type": "function", "function": copy.deepcopy(func)})
    return out


def check_tool_choice(choice: Any, tools: list[dict[str, Any]], param: str = "tool_choice") -> str | dict:
    """``tool_choice``: "none" / "auto" / "required", or ``{"type": "function", "function": {"name": NAME}}``
    naming a declared tool. Returned as given (checked)."""
    if isinstance(choice, str):
        if choice not in TOOL_CHOICES:
            raise bad(param, f"must be one of {list(TOOL_CHOICES)} or {{'type': 'function', 'function': {{'name': ...}}}}, got {choice!r}")
        if choice == "required" and not tools:
            raise bad(param, "'required' needs tools")
        return choice
    name = choice.get("function", {}).get("name") if isinstance(choice, dict) and isinstance(choice.get("function"), dict) else None
    if not isinstance(name, str) or choice.get("type", "function") != "function":
        raise bad(param, "must be 'none', 'auto', 'required' or {'type': 'function', 'function': {'name': ...}}")
    if name not in {t["function"]["name"] for t in tools}:
        raise bad(param, f"names the function {name!r}, which is not among the declared tools")
    return choice


def parse_arguments(args: Any, param: str) -> dict[str, Any]:
    """A call's arguments as an object: OpenAI's JSON text parsed, an object as is."""
    if isinstance(args, dict):
        return args
    if not isinstance(args, str):
        raise bad(param, f"must be a JSON object as a string, got {type(args).__name__}")
    try:
        value = json.loads(args)
    except (ValueError, RecursionError) as e:
        raise bad(param, f"is not valid JSON ({e})") from None
    if not isinstance(value, dict):
        raise bad(param, f"must be a JSON object, got {type(value).__name__}")
    return value


def prepare(messages: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    """``messages`` as the template of ``kind`` (`template_kind`) takes them; unchanged (the same
    list) when there are no calls or tool results in them."""
    if not any(m.get("tool_calls") or m.get("role") == "tool" for m in messages):
        return messages
    if kind == "none":
        raise bad("messages", "this model's chat template has no tool calls: it cannot render tool_calls or tool results")
    out: list[dict[str, Any]] = []
    calls: list[dict[str, Any]] | None = None  # the calls the next tool messages answer
    answered = 0
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        role = m.get("role")
        if role == "tool":
            if calls is None:
                raise bad(where, "a tool result must follow the assistant message whose tool_calls it answers")
            tid = m.get("tool_call_id")
            if tid is not None and (not isinstance(tid, str) or tid not in {c.get("id") for c in calls}):
                raise bad(f"{where}.tool_call_id", f"{tid!r} is not the id of a call in the assistant message before it")
            if m.get("name") is not None and not isinstance(m["name"], str):
                raise bad(f"{where}.name", "must be a string")
            out.append(dict(m))
            answered += 1
            continue
        calls = None
        m = dict(m)
        if m.get("tool_calls"):
            if role != "assistant":
                raise bad(f"{where}.tool_calls", "only assistant messages make tool calls")
            if not isinstance(m["tool_calls"], list):
                raise bad(f"{where}.tool_calls", "must be a list")
            calls = []
            for j, c in enumerate(m["tool_calls"]):
                cw = f"{where}.tool_calls[{j}]"
                f = c.get("function") if isinstance(c, dict) else None
                if not isinstance(f, dict) or not isinstance(f.get("name"), str) or not f["name"]:
                    raise bad(cw, "must be {'id': ..., 'type': 'function', 'function': {'name': ..., 'arguments': '{...}'}}")
                if c.get("id") is not None and not isinstance(c["id"], str):
                    raise bad(f"{cw}.id", "must be a string")
                calls.append({**c, "function": {**f, "arguments": parse_arguments(f.get("arguments", {}), f"{cw}.function.arguments")}})
            m["tool_calls"] = calls
            if m.get("content") is None:
                m["content"] = ""
        rc = m.get("reasoning_content")
        if rc is not None and not isinstance(rc, str):
            raise bad(f"{where}.reasoning_content", "must be a string")
        out.append(m)
    return fold_tool_results(out) if kind == "legacy" else out


def _response(content: Any) -> Any:
    """A tool result's content as the older template shows it: JSON where the text is JSON."""
    if isinstance(content, list):  # text parts
        content = "".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")
    if isinstance(content, str):
        try:
            return json.loads(content)
        except (ValueError, RecursionError):
            return content
    return content


def fold_tool_results(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """assistant(tool_calls) -> tool* -> [assistant(content, no calls)]  ==>  one assistant message
    with ``tool_calls``, ``tool_responses`` and that content (the older template's form)."""
    out: list[dict[str, Any]] = []
    i = 0
    while i < len(messages):
        m = messages[i]
        i += 1
        if m.get("role") != "assistant" or not m.get("tool_calls"):
            out.append(m)
            continue
        calls = m["tool_calls"]
        by_id = {c.get("id"): c["function"]["name"] for c in calls if c.get("id")}
        responses = []
        while i < len(messages) and messages[i].get("role") == "tool":
            t = messages[i]
            k = len(responses)
            name = by_id.get(t.get("tool_call_id")) or (calls[k]["function"]["name"] if k < len(calls) else None) \
                or t.get("name") or "unknown"
            responses.append({"name": name, "response": _response(t.get("content"))})
            i += 1
        folded = {k: v for k, v in m.items() if k != "content"}
        folded["content"] = m.get("content") or ""
        if responses:
            folded["tool_responses"] = responses
            nxt = messages[i] if i < len(messages) else None
            if nxt is not None and nxt.get("role") == "assistant" and not nxt.get("tool_calls") and nxt.get("content"):
                folded["content"] = nxt["content"]
                i += 1
        out.append(folded)
    return out


def chat_ids(tokenizer, messages: list[dict[str, Any]], *, tools: list[dict[str, Any]] | None = None,
             thinking: bool = False, **template_kwargs: Any) -> list[int]:
    """The prompt ids of a conversation: `prepare`d for the tokenizer's template, rendered by it
    (`Tokenizer.chat_ids`) with the declarations of ``tools`` (checked: `check_tools`) and, with
    ``thinking``, ``enable_thinking=True``."""
    source = tokenizer.chat_template or tokenizer.fallback_template
    kind = template_kind(source)
    if tools and kind == "none":
        raise bad("tools", "this model's chat template cannot declare tools (it has no Gemma 4 tool calls)")
    if thinking:
        if "enable_thinking" not in source:
            raise bad("thinking", "this model's chat template has no thinking switch (enable_thinking)")
        template_kwargs["enable_thinking"] = True
    return tokenizer.chat_ids(prepare(messages, kind), add_generation_prompt=True, tools=tools or None,
                              **template_kwargs)
