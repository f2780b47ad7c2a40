"""Anthropic's Messages API (``POST /v1/messages``, ``POST /v1/messages/count_tokens``) over the
server's chat core.

A request is translated into chat-completions fields and OpenAI-shaped messages
(`Server.chat_request`), run (`Server.relay`), and the chat parser's events are translated back:
a thought is a ``thinking`` block, text a ``text`` block, each call a ``tool_use`` block (its
arguments streamed as ``input_json_delta``). The non-streamed message is the fold of the very
events a stream sends, so the two always agree. ``thinking.budget_tokens`` caps the thought
(`runtime.budget`). Every failure answers in Anthropic's shape (``{"type": "error", "error":
{"type", "message"}}``); a field or block this server does not implement is a 400 naming it.
"""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any, Awaitable, Callable

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from ..chat.parser import Content, Reasoning, ToolCallArgs, ToolCallEnd, ToolCallStart
from .protocol import APIError, ClientGone, Limits, bad, inline_bytes, opt_bool, opt_float, opt_int, require_model
from .scheduler import Finish, Part, Piece, TextReader

MESSAGE_FIELDS = {"model", "max_tokens", "messages", "system", "tools", "tool_choice", "thinking", "stop_sequences",
                  "temperature", "top_p", "top_k", "metadata", "stream", "cache_control"}
COUNT_FIELDS = {"model", "messages", "system", "tools", "tool_choice", "thinking", "cache_control"}
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 529: "overloaded_error"}
OVERLOADED = 529  # Anthropic's status for an overloaded server (its SDK retries it)
# the chat core's names for what Anthropic calls otherwise (in its error messages)
RENAMES = {".function.parameters": ".input_schema", ".function.name": ".name", "'stop'": "'stop_sequences'",
           "parallel_tool_calls": "tool_choice.disable_parallel_tool_use", "image_url parts": "image blocks"}
STOP_REASONS = {"length": "max_tokens", "tool_calls": "tool_use"}


class Messages:
    """The two routes' handlers (``create``, ``count_tokens``), on the app's `Server` ``srv``."""

    def __init__(self, srv):
        self.srv = srv
        self.create = self._endpoint(self._create)
        self.count_tokens = self._endpoint(self._count_tokens)

    def _endpoint(self, handler: Callable[[Request], Awaitable[Response]]) -> Callable[[Request], Awaitable[Response]]:
        """``handler`` behind the key check (``x-api-key`` or a bearer token), every error in Anthropic's shape."""
        async def endpoint(request: Request) -> Response:
            try:
                self.srv.check_key(request)
                return await handler(request)
            except APIError as e:
                return error_response(e)
            except Exception as e:  # a bug answers 500 and leaves the server serving
                return error_response(APIError(500, f"internal error: {type(e).__name__}: {e}", type="server_error"))

        return endpoint

    async def _request(self, body: dict, count: bool):
        """The request's scheduler sequences (`Server.chat_request`) and its thinking budget."""
        srv = self.srv
        unknown = sorted(set(body) - (COUNT_FIELDS if count else MESSAGE_FIELDS))
        if unknown:
            raise bad(f"{', '.join(repr(k) for k in unknown)} {'is' if len(unknown) == 1 else 'are'} not supported "
                      "by this server", unknown[0])
        require_model(body, srv.model_id, "chat")
        fields, budget = chat_fields(body, count)
        messages = chat_messages(body, srv.limits)
        try:
            seqs, gen, _ = await srv.chat_request(fields, messages=messages)
        except APIError as e:
            raise APIError(e.status, renamed(e.message), type=e.type, code=e.code, headers=e.headers) from None
        return seqs, gen, budget

    async def _count_tokens(self, request: Request) -> Response:
        body = await self.srv.read_json(request)
        seqs, _, _ = await self._request(body, count=True)
        return JSONResponse({"input_tokens": len(seqs[0].ids)})

    async def _create(self, request: Request) -> Response:
        srv = self.srv
        body = await srv.read_json(request)
        seqs, gen, budget = await self._request(body, count=False)
        [seq] = seqs
        seq.thinking_budget = budget
        reader = seq.output or (lambda: TextReader(srv.tokenizer, seq.stop_strings))
        seq.output = lambda: StopNaming(reader())
        head = {"id": f"msg_{uuid.uuid4().hex[:24]}", "type": "message", "role": "assistant", "model": srv.model_id}
        events = srv.relay(request, seqs)
        if gen.stream:
            return StreamingResponse(self._stream(seq, head, events), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        blocks, sent = Blocks(), []
        try:
            async for _, ev in events:
                if isinstance(ev, Finish):
                    self.srv._check_finish(ev)
                    sent += blocks.finish(ev)
                else:
                    sent += blocks.push(ev)
        except ClientGone:
            return Response(status_code=499)  # the client closed the request: nobody reads this
        finally:
            await events.aclose()
        return JSONResponse(message(head, sent))

    async def _stream(self, seq, head: dict, events):
        def sse(event: dict) -> str:
            return f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n"

        blocks, started = Blocks(), False
        try:
            async for _, ev in events:
                if not started:  # (the prompt has run: its cached part is known)
                    started = True
                    usage = usage_of(len(seq.ids), seq.cached, 0)
                    yield sse({"type": "message_start", "message": {**head, "content": [], "stop_reason": None,
                                                                    "stop_sequence": None, "usage": usage}})
                if isinstance(ev, Finish):
                    try:
                        self.srv._check_finish(ev)
                    except APIError as e:
                        yield sse(error_body(e)[1])
                        return
                    for out in blocks.finish(ev):
                        yield sse(out)
                else:
                    for out in blocks.push(ev):
                        yield sse(out)
        except ClientGone:
            return
        finally:  # the client went away mid-stream (or we are done): free the slot
            seq.cancel()
            await events.aclose()


# -- requests ------------------------------------------------------------------------------------------
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


# -- replies ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class StopSequence:
    """The stop sequence that ended a reply (a `StopNaming` reader's last part)."""

    text: str


class StopNaming:
    """A sequence's reader (`chat_format.ChatReader` or `TextReader`) that says, at its end, which
    stop sequence cut the reply (Anthropic's ``stop_sequence``)."""

    def __init__(self, inner):
        self.inner = inner
        self.cutter = inner.parser.cutter if hasattr(inner, "parser") else inner.cutter

    @property
    def stopped(self) -> bool:
        return self.inner.stopped

    def push(self, token: int) -> list:
        return self.inner.push(token)

    def finish(self, reason: str) -> tuple[list, str]:
        events, reason = self.inner.finish(reason)
        matched = self.cutter.matched
        return (events + [StopSequence(matched)] if matched is not None else events), reason


def usage_of(prompt: int, cached: int, output: int) -> dict[str, int]:
    """Anthropic's usage: ``input_tokens`` are the prompt's tokens that ran, the reused prefix
    ``cache_read_input_tokens``."""
    return {"input_tokens": prompt - cached, "output_tokens": output, "cache_read_input_tokens": cached,
            "cache_creation_input_tokens": 0}


def tool_use_id(call_id: str) -> str:
    return "toolu_" + call_id.removeprefix("call_")


class Blocks:
    """One reply's stream events (``content_block_*``, then ``message_delta`` / ``message_stop``)
    from the scheduler's events: a new block wherever the kind of content changes."""

    def __init__(self):
        self.index = -1
        self.open: str | None = None
        self.stop_sequence: str | None = None

    def push(self, ev: Any) -> list[dict]:
        ev = ev.event if isinstance(ev, Part) else ev
        if isinstance(ev, (Content, Piece)):
            return self._delta("text", {"type": "text_delta", "text": ev.text}) if ev.text else []
        if isinstance(ev, Reasoning):
            return self._delta("thinking", {"type": "thinking_delta", "thinking": ev.text})
        if isinstance(ev, ToolCallStart):
            return self._close() + self._start({"type": "tool_use", "id": tool_use_id(ev.id), "name": ev.name,
                                                "input": {}})
        if isinstance(ev, ToolCallArgs):
            return [{"type": "content_block_delta", "index": self.index,
                     "delta": {"type": "input_json_delta", "partial_json": ev.text}}]
        if isinstance(ev, ToolCallEnd):
            return self._close()
        if isinstance(ev, StopSequence):
            self.stop_sequence = ev.text
            return []
        raise TypeError(f"not a chat event: {ev!r}")

    def finish(self, ev: Finish) -> list[dict]:
        reason = STOP_REASONS.get(ev.reason) or ("stop_sequence" if self.stop_sequence is not None else "end_turn")
        return self._close() + [
            {"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": self.stop_sequence},
             "usage": usage_of(ev.prompt_tokens, ev.cached_tokens, ev.completion_tokens)},
            {"type": "message_stop"}]

    def _delta(self, kind: str, delta: dict) -> list[dict]:
        out = []
        if self.open != kind:
            out = self._close() + self._start({"type": "text", "text": ""} if kind == "text" else
                                              {"type": "thinking", "thinking": "", "signature": ""})
        return out + [{"type": "content_block_delta", "index": self.index, "delta": delta}]

    def _start(self, block: dict) -> list[dict]:
        self.index += 1
        self.open = block["type"]
        return [{"type": "content_block_start", "index": self.index, "content_block": block}]

    def _close(self) -> list[dict]:
        if self.open is None:
            return []
        self.open = None
        return [{"type": "content_block_stop", "index": self.index}]


def message(head: dict, events: list[dict]) -> dict:
    """The non-streamed message: ``events`` (a stream's, after ``message_start``) folded."""
    content: list[dict] = []
    args: dict[int, str] = {}
    out = {**head, "content": content}
    for e in events:
        kind = e["type"]
        if kind == "content_block_start":
            content.append(dict(e["content_block"]))
        elif kind == "content_block_delta":
            d, block = e["delta"], content[e["index"]]
            if d["type"] == "text_delta":
                block["text"] += d["text"]
            elif d["type"] == "thinking_delta":
                block["thinking"] += d["thinking"]
            else:
                args[e["index"]] = args.get(e["index"], "") + d["partial_json"]
        elif kind == "message_delta":
            out.update(e["delta"])
            out["usage"] = e["usage"]
    for i, text in args.items():
        content[i]["input"] = partial_object(text)
    return out


def partial_object(text: str) -> dict:
    """The object a call's JSON arguments give, or where they were cut (by ``max_tokens``, or a
    call that broke off), the longest prefix of them that closes into an object: an unfinished
    string, key or value is left out (as the SDK reads a cut stream)."""
    try:
        value = json.loads(text)
        return value if isinstance(value, dict) else {}
    except ValueError:
        pass
    closers, in_string, escaped = [], False, False
    states = []  # after each character: (inside a string, the closers its open containers need)
    for c in text:
        if in_string:
            if escaped:
                escaped = False
            elif c == "\\":
                escaped = True
            elif c == '"':
                in_string = False
        elif c == '"':
            in_string = True
        elif c in "{[":
            closers.append("}" if c == "{" else "]")
        elif c in "}]" and closers:
            closers.pop()
        states.append((in_string, "".join(reversed(closers))))
    for k in range(len(text), 0, -1):
        inside, close = states[k - 1]
        head = text[:k].rstrip(",:")
        if inside or not close:
            continue
        try:
            value = json.loads(head + close)
        except ValueError:
            continue
        if isinstance(value, dict):
            return value
    return {}


def error_body(e: APIError) -> tuple[int, dict]:
    """(status, body) of an error in Anthropic's shape; a full queue is its 529 ``overloaded_error``."""
    status = OVERLOADED if e.code == "overloaded" else e.status
    kind = ERROR_TYPES.get(status) or ("api_error" if status >= 500 else "invalid_request_error")
    return status, {"type": "error", "error": {"type": kind, "message": e.message}}


def error_response(e: APIError) -> JSONResponse:
    status, body = error_body(e)
    return JSONResponse(body, status_code=status, headers=e.headers)


def renamed(message: str) -> str:
    """An error message of the chat core with Anthropic's field names."""
    for a, b in RENAMES.items():
        message = message.replace(a, b)
    return message

