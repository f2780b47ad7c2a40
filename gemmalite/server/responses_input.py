"""A Responses API request (``/v1/responses``) -> the chat-completions fields of the server's core.

`read_request` checks the body (every field the server does not implement is a 400 naming it,
unless at its neutral value) and translates it: function ``tools`` to chat tools, ``tool_choice``,
``text.format`` to ``response_format``, ``reasoning.effort`` to ``reasoning_effort``,
``max_output_tokens`` to ``max_tokens``. `conversation_messages` turns input items (messages,
``function_call``, ``function_call_output``, ``reasoning``) into chat messages, with where each
came from, so that the core's errors can name the Responses field (`rename`).
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from .protocol import APIError, bad

#: request fields read here; `NEUTRAL` ones only at their neutral value
FIELDS = {"model", "input", "instructions", "tools", "tool_choice", "parallel_tool_calls", "text", "reasoning",
          "max_output_tokens", "temperature", "top_p", "stream", "store", "previous_response_id", "metadata",
          # identifiers that change no reply (OpenAI's abuse monitoring and cache routing)
          "user", "safety_identifier", "prompt_cache_key",
          # this server's sampling extensions, as in chat completions
          "seed", "top_k", "min_p", "repetition_penalty"}
NEUTRAL: dict[str, tuple] = {"include": ([],), "truncation": ("disabled",), "background": (False,),
                             "service_tier": ("auto", "default"), "top_logprobs": (0,), "max_tool_calls": (),
                             "stream_options": ({}, {"include_obfuscation": False}), "prompt": (), "conversation": (),
                             "context_management": (), "prompt_cache_retention": (), "prompt_cache_options": ()}
SAMPLING = ("temperature", "top_p", "seed", "top_k", "min_p", "repetition_penalty")
MAX_METADATA = 16


def unsupported(key: str) -> APIError:
    return bad(f"'{key}' is not supported by this server", key, "unsupported_parameter")


def _neutral(body: dict, key: str, values: tuple, where: str | None = None) -> None:
    v = body.get(key)
    if v is not None and v not in values:
        raise unsupported(where or key)


def _str(v: Any, where: str, optional: bool = True) -> str | None:
    if (v is None and optional) or isinstance(v, str):
        return v
    raise bad(f"'{where}' must be a string, got {type(v).__name__}", where)


@dataclass
class ResponseRequest:
    """A checked Responses request: ``chat`` (the core's chat-completions fields, no messages),
    its new input ``items``, and what the response object echoes."""

    chat: dict[str, Any]
    items: list[dict[str, Any]]
    instructions: str | None
    previous: str | None
    store: bool
    stream: bool
    echo: dict[str, Any] = field(default_factory=dict)


def read_request(body: dict) -> ResponseRequest:
    for key in body:
        if key not in FIELDS and key not in NEUTRAL:
            raise unsupported(key)
    for key, values in NEUTRAL.items():
        _neutral(body, key, values)
    chat: dict[str, Any] = {k: body[k] for k in SAMPLING if body.get(k) is not None}
    tools = _tools(body.get("tools"))
    if tools:
        chat["tools"] = tools
    if body.get("tool_choice") is not None:
        chat["tool_choice"] = _tool_choice(body["tool_choice"])
    if body.get("parallel_tool_calls") is not None:
        chat["parallel_tool_calls"] = body["parallel_tool_calls"]
    text = body.get("text")
    if text is not None:
        if not isinstance(text, dict):
            raise bad("'text' must be an object", "text")
        for key in text:
            if key not in ("format", "verbosity"):
                raise unsupported(f"text.{key}")
        _neutral(text, "verbosity", ("medium",), "text.verbosity")
        if text.get("format") is not None:
            chat["response_format"] = _format(text["format"])
    reasoning = body.get("reasoning")
    if reasoning is not None:
        if not isinstance(reasoning, dict):
            raise bad("'reasoning' must be an object", "reasoning")
        for key in reasoning:
            if key not in ("effort", "summary", "generate_summary"):
                raise unsupported(f"reasoning.{key}")
        _neutral(reasoning, "summary", ("auto",), "reasoning.summary")  # (no summaries: the thought itself)
        _neutral(reasoning, "generate_summary", ("auto",), "reasoning.generate_summary")
        if reasoning.get("effort") is not None:
            chat["reasoning_effort"] = reasoning["effort"]
    if body.get("max_output_tokens") is not None:
        chat["max_tokens"] = body["max_output_tokens"]
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise bad(f"'stream' must be a boolean, got {stream!r}", "stream")
    chat["stream"] = bool(stream)
    store = body.get("store")
    if store is not None and not isinstance(store, bool):
        raise bad(f"'store' must be a boolean, got {store!r}", "store")
    for key in ("user", "safety_identifier", "prompt_cache_key"):
        _str(body.get(key), key)
    previous = _str(body.get("previous_response_id"), "previous_response_id")
    instructions = _str(body.get("instructions"), "instructions")
    echo = {"instructions": instructions, "metadata": _metadata(body.get("metadata")),
            "tools": body.get("tools") or [], "tool_choice": body.get("tool_choice") or ("auto" if tools else "none"),
            "parallel_tool_calls": body.get("parallel_tool_calls", True), "max_output_tokens": body.get("max_output_tokens"),
            "temperature": body.get("temperature"), "top_p": body.get("top_p"),
            "text": {"format": (text or {}).get("format") or {"type": "text"}},
            "reasoning": {"effort": (reasoning or {}).get("effort"), "summary": None},
            "previous_response_id": previous, "store": store is not False, "truncation": "disabled",
            "user": body.get("user")}
    return ResponseRequest(chat, input_items(body.get("input")), instructions, previous, store is not False,
                           bool(stream), echo)


def _metadata(m: Any) -> dict[str, str] | None:
    if m is None:
        return None
    if (not isinstance(m, dict) or len(m) > MAX_METADATA
            or not all(isinstance(k, str) and len(k) <= 64 and isinstance(v, str) and len(v) <= 512 for k, v in m.items())):
        raise bad(f"'metadata' must be at most {MAX_METADATA} string keys (64 characters) to strings (512)", "metadata")
    return m


def _tools(tools: Any) -> list[dict[str, Any]]:
    """Function tools (``{"type": "function", "name", "description", "parameters", "strict"}``) as
    chat tools; any other tool type is a 400 naming it."""
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise bad("'tools' must be a list", "tools")
    out = []
    for i, t in enumerate(tools):
        where = f"tools[{i}]"
        kind = t.get("type") if isinstance(t, dict) else None
        if kind != "function":
            raise bad(f"{where}: tools of type {kind!r} are not supported by this server (only 'function')",
                      f"{where}.type", "unsupported_tool")
        for key, value in t.items():
            if key in ("type", "name", "description", "parameters", "strict"):
                continue
            if value not in (None, False, [], {}):
                raise unsupported(f"{where}.{key}")
        if t.get("strict") is not None and not isinstance(t["strict"], bool):
            raise bad(f"'{where}.strict' must be a boolean", f"{where}.strict")
        func = {k: t[k] for k in ("name", "description", "parameters") if t.get(k) is not None}
        out.append({"type": "function", "function": func})
    return out


def _tool_choice(choice: Any) -> str | dict:
    if isinstance(choice, str):
        return choice  # (checked by the core)
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise bad(f"'tool_choice' must be 'none', 'auto', 'required' or {{'type': 'function', 'name': ...}} on this "
              f"server, got {choice!r}", "tool_choice", "unsupported_parameter" if kind else None)


def _format(fmt: Any) -> dict[str, Any]:
    """``text.format`` as chat's ``response_format``."""
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind in ("text", "json_object"):
        if set(fmt) - {"type"}:
            raise unsupported(f"text.format.{min(set(fmt) - {'type'})}")
        return {"type": kind}
    if kind == "json_schema":
        unknown = set(fmt) - {"type", "name", "schema", "strict", "description"}
        if unknown:
            raise unsupported(f"text.format.{min(unknown)}")
        return {"type": "json_schema", "json_schema": {k: v for k, v in fmt.items() if k != "type"}}
    raise bad("'text.format' must be {'type': 'text'}, {'type': 'json_object'} or "
              "{'type': 'json_schema', 'name': ..., 'schema': {...}, 'strict': bool}", "text.format")


# -- input items --------------------------------------------------------------------------------
ITEM_KEYS = {  # per item type: the keys read (besides "type"), and metadata an output item carries back
    "message": {"role", "content", "id", "status", "phase"},
    "function_call": {"call_id", "name", "arguments", "id", "status"},
    "function_call_output": {"call_id", "output", "id", "status"},
    "reasoning": {"content", "summary", "id", "status", "encrypted_content"},
}
PART_KEYS = {"input_text": {"text"}, "output_text": {"text", "annotations", "logprobs"},
             "input_image": {"image_url", "detail", "file_id"}, "input_audio": {"input_audio"}}


def input_items(x: Any) -> list[dict[str, Any]]:
    """``input``: a string (one user message) or a list of items, each checked; returned as items."""
    if isinstance(x, str):
        return [{"type": "message", "role": "user", "content": x}]
    if not isinstance(x, list) or not x:
        raise bad("'input' must be a string or a non-empty list of items", "input")
    out = []
    for i, item in enumerate(x):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise bad(f"{where} must be an object", where)
        kind = item.get("type", "message" if "role" in item else None)
        if kind not in ITEM_KEYS:
            raise bad(f"{where}: input items of type {kind!r} are not supported by this server (message, "
                      "function_call, function_call_output, reasoning)", f"{where}.type", "unsupported_parameter")
        for key, value in item.items():
            if key != "type" and key not in ITEM_KEYS[kind] and value not in (None, [], {}):
                raise unsupported(f"{where}.{key}")
        out.append({**item, "type": kind})
    return out


def _parts(content: Any, where: str, role: str) -> str | list[dict[str, Any]]:
    """A message item's content as chat content (a string, or text, image_url and input_audio parts)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad(f"{where}.content must be a string or a list of content parts", f"{where}.content")
    out: list[dict[str, Any]] = []
    for j, p in enumerate(content):
        pw = f"{where}.content[{j}]"
        kind = p.get("type") if isinstance(p, dict) else None
        allowed = ("output_text", "input_text") if role == "assistant" else ("input_text", "input_image", "input_audio")
        if not isinstance(kind, str) or kind not in allowed:
            raise bad(f"{pw}: content parts of type {kind!r} are not supported in a {role} message here "
                      f"({', '.join(allowed)})", f"{pw}.type", "unsupported_parameter")
        for key, value in p.items():
            if key != "type" and key not in PART_KEYS[kind] and value not in (None, [], {}):
                raise unsupported(f"{pw}.{key}")
        if kind in ("input_text", "output_text"):
            out.append({"type": "text", "text": _str(p.get("text"), f"{pw}.text", optional=False)})
        elif kind == "input_image":
            if p.get("file_id") is not None:
                raise bad(f"{pw}: file ids are not supported by this server; send the picture as a data URL in "
                          "image_url", f"{pw}.file_id", "unsupported_parameter")
            _neutral(p, "detail", ("auto",), f"{pw}.detail")
            out.append({"type": "image_url", "image_url": {"url": p.get("image_url")}})
        else:
            out.append({"type": "input_audio", "input_audio": p.get("input_audio")})
    return out


def _output_text(output: Any, where: str) -> str:
    """A ``function_call_output``'s output: a string, or ``input_text`` parts (joined)."""
    if isinstance(output, str):
        return output
    if isinstance(output, list) and all(isinstance(p, dict) and p.get("type") == "input_text"
                                        and isinstance(p.get("text"), str) for p in output):
        return "".join(p["text"] for p in output)
    raise bad(f"{where}.output must be a string or a list of input_text parts on this server", f"{where}.output")


def _reasoning_text(item: dict, where: str) -> str:
    if item.get("encrypted_content") is not None:
        raise unsupported(f"{where}.encrypted_content")
    parts = item.get("content") or item.get("summary") or []
    if not isinstance(parts, list) or not all(isinstance(p, dict) and isinstance(p.get("text"), str) for p in parts):
        raise bad(f"{where}.content must be a list of {{'type': 'reasoning_text', 'text': ...}} parts", f"{where}.content")
    return "".join(p["text"] for p in parts)


@dataclass
class Origin:
    """Where a chat message came from: its item's field path, and its calls' (for `rename`)."""

    where: str
    calls: list[str] = field(default_factory=list)


def conversation_messages(items: list[tuple[str, dict]], instructions: str | None) -> tuple[list[dict], list[Origin]]:
    """``(where, item)`` pairs -> chat messages (OpenAI chat shape) and their `Origin`s. A turn's
    reasoning, text and function calls join into one assistant message (``reasoning_content``,
    ``content``, ``tool_calls``); each ``function_call_output`` is a ``role: "tool"`` message."""
    msgs: list[dict] = []
    origins: list[Origin] = []
    if instructions:
        msgs.append({"role": "system", "content": instructions})
        origins.append(Origin("instructions"))

    def assistant(where: str, fresh: bool) -> dict:
        last = msgs[-1] if msgs else None
        if fresh or last is None or last["role"] != "assistant":
            msgs.append({"role": "assistant", "content": None})
            origins.append(Origin(where))
        return msgs[-1]

    for where, item in items:
        kind = item["type"]
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise bad(f"{where}.role must be 'user', 'assistant', 'system' or 'developer', got {role!r}",
                          f"{where}.role")
            content = _parts(item.get("content"), where, role)
            if role == "assistant":
                last = msgs[-1] if msgs else None
                # after its own thought (only), the text is the same turn's
                joins = last is not None and last["role"] == "assistant" and last["content"] is None \
                    and not last.get("tool_calls")
                m = assistant(where, fresh=not joins)
                m["content"] = content if isinstance(content, str) else "\n".join(p["text"] for p in content)  # (as chat's)
            else:
                msgs.append({"role": role, "content": content})
                origins.append(Origin(where))
        elif kind == "reasoning":
            assistant(where, fresh=True)["reasoning_content"] = _reasoning_text(item, where)
        elif kind == "function_call":
            for key in ("call_id", "name", "arguments"):
                _str(item.get(key), f"{where}.{key}", optional=False)
            m = assistant(where, fresh=False)
            m.setdefault("tool_calls", []).append({"id": item["call_id"], "type": "function",
                                                   "function": {"name": item["name"], "arguments": item["arguments"]}})
            origins[-1].calls.append(where)
        else:  # function_call_output
            _str(item.get("call_id"), f"{where}.call_id", optional=False)
            msgs.append({"role": "tool", "tool_call_id": item["call_id"], "content": _output_text(item.get("output"), where)})
            origins.append(Origin(where))
    return msgs, origins


_MESSAGE_PATH = re.compile(r"messages\[(\d+)\](?:\.tool_calls\[(\d+)\](?:\.function)?)?")
_RENAMES = [(re.compile(r"\btools\[(\d+)\]\.function\b"), r"tools[\1]"),
            (re.compile(r"\bresponse_format\.json_schema\b"), "text.format"),
            (re.compile(r"\bresponse_format\b"), "text.format"),
            (re.compile(r"\breasoning_effort\b"), "reasoning.effort"),
            (re.compile(r"\bmax_tokens\b"), "max_output_tokens")]


def rename(e: APIError, origins: list[Origin]) -> APIError:
    """The core's error with its chat field names (param and message) as the Responses request's."""
    def item(m: re.Match) -> str:
        k = int(m.group(1))
        if k >= len(origins):
            return "input"
        o = origins[k]
        if m.group(2) is not None and int(m.group(2)) < len(o.calls):
            return o.calls[int(m.group(2))]
        return o.where

    def fix(s: str | None) -> str | None:
        if s is None:
            return None
        s = _MESSAGE_PATH.sub(item, s)
        for pattern, repl in _RENAMES:
            s = pattern.sub(repl, s)
        return "input" if s == "messages" else s

    out = APIError(e.status, fix(e.message) or "", type=e.type, code=e.code, param=fix(e.param), headers=e.headers)
    return out
