"""Anthropic's Messages API (``POST /v1/messages``, ``POST /v1/messages/count_tokens``) over the
server's chat core.

A request is translated into chat-completions fields and OpenAI-shaped messages
(`anthropic_request`, then `Server.chat_request`), run (`Server.relay`), and the chat parser's
events are translated back: a thought is a ``thinking`` block, text a ``text`` block, each call a
``tool_use`` block (its arguments streamed as ``input_json_delta``). The non-streamed message is the fold of the very
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
from .anthropic_request import chat_fields, chat_messages, check_fields
from .protocol import APIError, ClientGone, require_model
from .scheduler import Finish, Part, Piece, TextReader

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
        check_fields(body, count)
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

