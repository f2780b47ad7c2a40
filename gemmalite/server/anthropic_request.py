"""Anthropic Messages requests -> the chat core's fields and OpenAI-shaped messages, checked.

`chat_fields` gives the chat-completions fields of a request (all but its messages) and its
thinking budget; `chat_messages` its ``system`` and ``messages`` as the chat template takes them
(pictures decoded). A field, block type or tool this server does not implement is a 400 naming
it (`APIError`), never dropped.
"""
from __future__ import annotations

from typing import Any

from .protocol import Limits, bad, inline_bytes, opt_bool, opt_float, opt_int

MESSAGE_FIELDS = {"model", "max_tokens", "messages", "system", "tools", "tool_choice", "thinking", "stop_sequences",
                  "temperature", "top_p", "top_k", "metadata", "stream", "cache_control"}
COUNT_FIELDS = {"model", "messages", "system", "tools", "tool_choice", "thinking", "cache_control"}


def check_fields(body: dict, count: bool) -> None:
    """Only the fields this server implements (``count``: of a count_tokens request)."""
    unknown = sorted(set(body) - (COUNT_FIELDS if count else MESSAGE_FIELDS))
    if unknown:
        raise bad(f"{', '.join(repr(k) for k in unknown)} {'is' if len(unknown) == 1 else 'are'} not supported "
                  "by this server", unknown[0])


def chat_fields(body: dict, count: bool = False) -> tuple[dict[str, Any], int | None]:
    """The chat-completions fields of a request (all but its messages) and its thinking budget."""
    out: dict[str, Any] = {}
    if not count:
        if body.get("max_tokens") is None:
            raise bad("'max_tokens' is required", "max_tokens")
        out["max_tokens"] = opt_int(body, "max_tokens", 1)
        out["stream"] = opt_bool(body, "stream")
        out["temperature"] = opt_float(body, "temperature", 0.0, 1.0)
        out["top_p"] = opt_float(body, "top_p", 0.0, 1.0, lo_open=True)
        out["top_k"] = opt_int(body, "top_k", 0)
        stop = body.get("stop_sequences")
        if stop is not None and not isinstance(stop, list):
            raise bad("'stop_sequences' must be a list of strings", "stop_sequences")
        out["stop"] = stop or None
        metadata = body.get("metadata")  # (user_id: an opaque id for abuse tracking; nothing to do with it here)
        if metadata is not None and (not isinstance(metadata, dict) or set(metadata) - {"user_id"}
                                     or not isinstance(metadata.get("user_id", ""), (str, type(None)))):
            raise bad("'metadata' must be {'user_id': string}", "metadata")
    tools = body.get("tools")
    if tools is not None:
        out["tools"] = [_tool(t, f"tools[{k}]") for k, t in enumerate(tools)] if isinstance(tools, list) else tools
    if body.get("tool_choice") is not None:
        out["tool_choice"], out["parallel_tool_calls"] = _tool_choice(body["tool_choice"])
    thinking, budget = _thinking(body.get("thinking"), None if count else out["max_tokens"])
    out["chat_template_kwargs"] = {"enable_thinking": thinking}
    return {k: v for k, v in out.items() if v is not None}, budget


def _keys(obj: Any, allowed: set[str], where: str) -> dict:
    if not isinstance(obj, dict):
        raise bad(f"{where} must be an object", where)
    extra = sorted(set(obj) - allowed)
    if extra:
        raise bad(f"{where}: {', '.join(repr(k) for k in extra)} {'is' if len(extra) == 1 else 'are'} not supported "
                  "by this server", where)
    return obj


def _tool(t: Any, where: str) -> dict:
    kind = t.get("type") if isinstance(t, dict) else None
    if kind not in (None, "custom"):
        raise bad(f"{where}: the tool type {kind!r} (a server tool) is not supported by this server; declare "
                  "tools by name, description and input_schema", where)
    t = _keys(t, {"type", "name", "description", "input_schema", "cache_control"}, where)
    schema = t.get("input_schema")
    if not isinstance(schema, dict):
        raise bad(f"{where}.input_schema must be a JSON Schema object", f"{where}.input_schema")
    fn = {"name": t.get("name"), "parameters": schema}
    if t.get("description") is not None:
        fn["description"] = t["description"]
    return {"type": "function", "function": fn}


def _tool_choice(c: Any) -> tuple[Any, bool]:
    """(OpenAI's tool_choice, parallel_tool_calls)."""
    kind = c.get("type") if isinstance(c, dict) else None
    if kind not in ("auto", "any", "tool", "none"):
        raise bad("'tool_choice' must be {'type': 'auto' | 'any' | 'tool' | 'none', ...}", "tool_choice")
    c = _keys(c, {"type", "disable_parallel_tool_use"} | ({"name"} if kind == "tool" else set()), "tool_choice")
    one = opt_bool(c, "disable_parallel_tool_use")
    if kind == "tool":
        if not isinstance(c.get("name"), str):
            raise bad("tool_choice.name must be the name of a tool", "tool_choice.name")
        choice: Any = {"type": "function", "function": {"name": c["name"]}}
    else:
        choice = {"auto": "auto", "any": "required", "none": "none"}[kind]
    return choice, not one


def _thinking(t: Any, max_tokens: int | None) -> tuple[bool, int | None]:
    """(thinking on, its budget in tokens): "enabled" with a budget, "adaptive" (the model thinks as
    long as it likes), "disabled"."""
    if t is None:
        return False, None
    kind = t.get("type") if isinstance(t, dict) else None
    if kind not in ("enabled", "adaptive", "disabled"):
        raise bad("'thinking' must be {'type': 'enabled', 'budget_tokens': N}, {'type': 'adaptive'} or "
                  "{'type': 'disabled'}", "thinking")
    _keys(t, {"type", "display"} | ({"budget_tokens"} if kind == "enabled" else set()), "thinking")
    if t.get("display") not in (None, "summarized"):
        raise bad(f"thinking.display {t['display']!r} is not supported by this server (the thought is returned "
                  "as it is: 'summarized')", "thinking.display")
    if kind != "enabled":
        return kind == "adaptive", None
    budget = t.get("budget_tokens")
    if not isinstance(budget, int) or isinstance(budget, bool) or budget < 1:
        raise bad(f"thinking.budget_tokens must be an integer >= 1, got {budget!r}", "thinking.budget_tokens")
    if max_tokens is not None and budget >= max_tokens:
        raise bad(f"thinking.budget_tokens ({budget}) must be less than max_tokens ({max_tokens})",
                  "thinking.budget_tokens")
    return True, budget


def chat_messages(body: dict, limits: Limits) -> list[dict[str, Any]]:
    """``system`` and ``messages`` as the chat core's OpenAI-shaped messages: text and pictures
    (decoded) in user turns, ``tool_result`` blocks as ``role: "tool"`` messages, ``tool_use``
    blocks as ``tool_calls`` (input as an object), ``thinking`` blocks as ``reasoning_content``."""
    out: list[dict[str, Any]] = []
    system = body.get("system")
    if system is not None:
        out.append({"role": "system", "content": _text(system, "system")})
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise bad("'messages' must be a non-empty list", "messages")
    calls: set[str] = set()  # the tool_use ids of the assistant turn just before
    images = 0
    for i, m in enumerate(msgs):
        where = f"messages[{i}]"
        m = _keys(m, {"role", "content"}, where)
        role, content = m.get("role"), m.get("content")
        if role not in ("user", "assistant"):
            raise bad(f"{where}.role must be 'user' or 'assistant', got {role!r}", f"{where}.role")
        blocks = [{"type": "text", "text": content}] if isinstance(content, str) else content
        if not isinstance(blocks, list) or not blocks:
            raise bad(f"{where}.content must be a string or a non-empty list of content blocks", f"{where}.content")
        if role == "assistant":
            out.append(_assistant(blocks, where))
            calls = {c["id"] for c in out[-1].get("tool_calls", [])}
            continue
        parts: list[dict[str, Any]] = []
        for j, b in enumerate(blocks):
            bw = f"{where}.content[{j}]"
            kind = b.get("type") if isinstance(b, dict) else None
            if kind == "tool_result":
                if parts:
                    raise bad(f"{bw}: tool_result blocks come first in a user message, before any other block", bw)
                b = _keys(b, {"type", "tool_use_id", "content", "is_error", "cache_control"}, bw)
                if b.get("tool_use_id") not in calls:
                    raise bad(f"{bw}.tool_use_id {b.get('tool_use_id')!r} is not the id of a tool_use block in the "
                              "assistant message just before", f"{bw}.tool_use_id")
                text = _text(b.get("content", ""), f"{bw}.content")
                if opt_bool(b, "is_error"):
                    text = "Error: " + text
                out.append({"role": "tool", "tool_call_id": b["tool_use_id"], "content": text})
            elif kind == "text":
                parts.append({"type": "text", "text": _text_block(b, bw)})
            elif kind == "image":
                images += 1
                if images > limits.max_images:
                    raise bad(f"at most {limits.max_images} images per request", bw)
                parts.append({"type": "image", "image": _image(b, bw, limits)})
            else:
                raise bad(f"{bw}: the block type {kind!r} is not supported in user messages by this server "
                          "(text, image, tool_result)", bw)
        calls = set()
        if parts:
            text_only = all(p["type"] == "text" for p in parts)
            out.append({"role": "user", "content": "\n".join(p["text"] for p in parts) if text_only else parts})
    if msgs[-1].get("role") != "user":
        raise bad("the last message must be a user message: this server does not continue an assistant prefill",
                  f"messages[{len(msgs) - 1}]")
    return out


def _assistant(blocks: list, where: str) -> dict[str, Any]:
    text, thought, calls = [], [], []
    for j, b in enumerate(blocks):
        bw = f"{where}.content[{j}]"
        kind = b.get("type") if isinstance(b, dict) else None
        if kind == "text":
            text.append(_text_block(b, bw))
        elif kind == "thinking":  # (its signature is not checked: this server signs nothing)
            b = _keys(b, {"type", "thinking", "signature"}, bw)
            if not isinstance(b.get("thinking"), str):
                raise bad(f"{bw}.thinking must be a string", bw)
            thought.append(b["thinking"])
        elif kind == "tool_use":
            b = _keys(b, {"type", "id", "name", "input", "cache_control"}, bw)
            if not isinstance(b.get("id"), str) or not b["id"] or not isinstance(b.get("name"), str):
                raise bad(f"{bw} must have a string 'id' and 'name'", bw)
            if not isinstance(b.get("input"), dict):
                raise bad(f"{bw}.input must be an object", f"{bw}.input")
            calls.append({"id": b["id"], "type": "function", "function": {"name": b["name"], "arguments": b["input"]}})
        else:
            raise bad(f"{bw}: the block type {kind!r} is not supported in assistant messages by this server "
                      "(text, thinking, tool_use)", bw)
    msg: dict[str, Any] = {"role": "assistant", "content": "".join(text)}
    if calls:
        msg["tool_calls"] = calls
    if thought:
        msg["reasoning_content"] = "".join(thought)
    return msg


def _text(value: Any, where: str) -> str:
    """A string, or text blocks joined by newlines."""
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise bad(f"{where} must be a string or a list of text blocks", where)
    return "\n".join(_text_block(b, f"{where}[{j}]") for j, b in enumerate(value))


def _text_block(b: Any, where: str) -> str:
    kind = b.get("type") if isinstance(b, dict) else None
    if kind != "text":
        raise bad(f"{where}: the block type {kind!r} is not supported here by this server (text only)", where)
    b = _keys(b, {"type", "text", "cache_control", "citations"}, where)
    if b.get("citations"):
        raise bad(f"{where}.citations are not supported by this server", where)
    if not isinstance(b.get("text"), str):
        raise bad(f"{where}.text must be a string", where)
    return b["text"]


def _image(b: dict, where: str, limits: Limits) -> bytes:
    b = _keys(b, {"type", "source", "cache_control"}, where)
    src = b.get("source")
    kind = src.get("type") if isinstance(src, dict) else None
    if kind == "url":
        raise bad(f"{where}: image sources of type 'url' are not fetched by this server; send the picture as "
                  "{'type': 'base64', 'media_type': ..., 'data': ...}", where)
    if kind != "base64":
        raise bad(f"{where}.source must be {{'type': 'base64', 'media_type': 'image/png', 'data': ...}}, got "
                  f"type {kind!r}", where)
    src = _keys(src, {"type", "media_type", "data"}, f"{where}.source")
    if not isinstance(src.get("data"), str):
        raise bad(f"{where}.source.data must be a base64 string", where)
    return inline_bytes(src["data"], where, limits.max_image_bytes, "the picture", "source.data", "image")
