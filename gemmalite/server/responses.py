"""OpenAI's Responses API: ``POST /v1/responses`` (streamed as typed events or not),
``GET`` / ``DELETE /v1/responses/{id}``, as a translation onto the server's chat core.

A request becomes chat-completions fields (`responses_input`), runs through `Server.chat_request`
and `Server.relay` (the same prompt, grammar and tokens as chat completions), and its chat events
become output items (`OutputItems`: ``reasoning``, ``message`` with ``output_text``,
``function_call``). With ``store`` (the default) the server keeps the conversation (input and
output items; bounded in count and bytes, oldest evicted first), so a follow-up names it in
``previous_response_id`` and sends only its new items; ``instructions`` are not carried over.
"""
from __future__ import annotations

import json
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from ..chat.parser import ChatTokens, Content, Reasoning, ToolCallArgs, ToolCallEnd, ToolCallStart
from .protocol import APIError, ClientGone, bad, chat_messages, require_model
from .responses_input import ResponseRequest, conversation_messages, read_request, rename
from .scheduler import Finish, Part, Piece

MAX_RESPONSES = 1024
MAX_STORED_BYTES = 64 << 20


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


@dataclass
class Stored:
    response: dict[str, Any]
    items: list[dict[str, Any]]  # the whole conversation: every input and output item (not the instructions)
    nbytes: int


class ResponseStore:
    """Stored responses by id: at most ``max_responses`` and ``max_bytes`` (of their
    conversations' JSON), the oldest evicted first; a conversation larger than the bound is not kept."""

    def __init__(self, max_responses: int = MAX_RESPONSES, max_bytes: int = MAX_STORED_BYTES):
        self.max_responses, self.max_bytes = max_responses, max_bytes
        self.entries: OrderedDict[str, Stored] = OrderedDict()
        self.nbytes = 0

    def put(self, response: dict[str, Any], items: list[dict[str, Any]]) -> None:
        size = len(json.dumps(items, ensure_ascii=False).encode()) + len(json.dumps(response).encode())
        if size > self.max_bytes:
            return
        while self.entries and (len(self.entries) >= self.max_responses or self.nbytes + size > self.max_bytes):
            self.nbytes -= self.entries.popitem(last=False)[1].nbytes
        self.entries[response["id"]] = Stored(response, items, size)
        self.nbytes += size

    def get(self, rid: str, param: str | None = None) -> Stored:
        got = self.entries.get(rid)
        if got is None:
            raise APIError(404, f"No response with id {rid!r} found (unknown, deleted, stored with store=false, or "
                           "evicted)", param=param, code="response_not_found")
        return got

    def delete(self, rid: str) -> None:
        self.nbytes -= self.get(rid).nbytes
        del self.entries[rid]


def _event(kind: str, **fields: Any) -> dict[str, Any]:
    return {"type": kind, **fields}


class OutputItems:
    """A reply's chat events -> Responses output items and the stream events that build them
    (``push`` / ``finish`` return the events; ``items`` is the output so far)."""

    def __init__(self):
        self.items: list[dict[str, Any]] = []
        self.open: dict[str, Any] | None = None
        self.text = ""

    def _add(self, item: dict[str, Any], part: dict[str, Any] | None) -> list[dict]:
        self.items.append(item)
        self.open, self.text = item, ""
        i = len(self.items) - 1
        out = [_event("response.output_item.added", output_index=i, item=dict(item))]
        if part is not None:
            out.append(_event("response.content_part.added", item_id=item["id"], output_index=i, content_index=0, part=part))
        return out

    def _close(self, status: str) -> list[dict]:
        item, self.open = self.open, None
        if item is None:
            return []
        i, out = len(self.items) - 1, []
        if item["type"] == "message":
            part = {"type": "output_text", "text": self.text, "annotations": [], "logprobs": []}
            item["content"] = [part]
            out += [_event("response.output_text.done", item_id=item["id"], output_index=i, content_index=0,
                           text=self.text, logprobs=[]),
                    _event("response.content_part.done", item_id=item["id"], output_index=i, content_index=0, part=part)]
        elif item["type"] == "reasoning":
            part = {"type": "reasoning_text", "text": self.text}
            item["content"] = [part]
            out += [_event("response.reasoning_text.done", item_id=item["id"], output_index=i, content_index=0,
                           text=self.text),
                    _event("response.content_part.done", item_id=item["id"], output_index=i, content_index=0, part=part)]
        else:
            out.append(_event("response.function_call_arguments.done", item_id=item["id"], output_index=i,
                              name=item["name"], arguments=item["arguments"]))
        item["status"] = status
        return out + [_event("response.output_item.done", output_index=i, item=item)]

    def _current(self, kind: str) -> dict[str, Any]:
        if self.open is None or self.open["type"] != kind:  # (the chat parser opens a call before its arguments)
            raise RuntimeError(f"a {kind} event with no {kind} item open")
        return self.open

    def push(self, ev: Any) -> list[dict]:
        out: list[dict] = []
        kind = "message" if isinstance(ev, (Content, Piece)) else "reasoning" if isinstance(ev, Reasoning) else None
        if kind is not None:
            if not ev.text:
                return out
            if self.open is None or self.open["type"] != kind:
                out += self._close("completed")
                if kind == "message":
                    out += self._add({"id": _id("msg"), "type": "message", "role": "assistant", "status": "in_progress",
                                      "content": []}, {"type": "output_text", "text": "", "annotations": [], "logprobs": []})
                else:
                    out += self._add({"id": _id("rs"), "type": "reasoning", "summary": [], "content": [],
                                      "status": "in_progress"}, {"type": "reasoning_text", "text": ""})
            self.text += ev.text
            item = self._current(kind)
            i = len(self.items) - 1
            if kind == "message":
                out.append(_event("response.output_text.delta", item_id=item["id"], output_index=i, content_index=0,
                                  delta=ev.text, logprobs=[]))
            else:
                out.append(_event("response.reasoning_text.delta", item_id=item["id"], output_index=i, content_index=0,
                                  delta=ev.text))
        elif isinstance(ev, ToolCallStart):
            out += self._close("completed")
            out += self._add({"id": _id("fc"), "type": "function_call", "call_id": ev.id, "name": ev.name,
                              "arguments": "", "status": "in_progress"}, None)
        elif isinstance(ev, ToolCallArgs):
            item = self._current("function_call")
            item["arguments"] += ev.text
            out.append(_event("response.function_call_arguments.delta", item_id=item["id"],
                              output_index=len(self.items) - 1, delta=ev.text))
        elif isinstance(ev, ToolCallEnd):
            out += self._close("completed" if ev.complete else "incomplete")
        else:
            raise TypeError(f"not a chat event: {ev!r}")
        return out

    def finish(self, reason: str) -> list[dict]:
        return self._close("incomplete" if reason == "length" else "completed")


def reasoning_tokens(tokens: list[int], marks: ChatTokens | None) -> int:
    """How many of a reply's ``tokens`` are its thought (``<|channel>`` ... ``<channel|>``, markup included)."""
    if marks is None:
        return 0
    n, inside = 0, False
    for t in tokens:
        inside = inside or t == marks.channel
        n += inside
        inside = inside and t != marks.channel_end
    return n


class Responses:
    """The ``/v1/responses`` routes of ``srv`` (an `app.Server`: its `chat_request`, `relay`, `_run`),
    and its stored responses."""

    def __init__(self, srv: Any, store: ResponseStore | None = None):
        self.srv = srv
        self.store = store or ResponseStore()
        self.marks = ChatTokens.find(srv.tokenizer)

    async def create(self, request: Request) -> Response:
        srv = self.srv
        body = await srv.read_json(request)
        require_model(body, srv.model_id, "chat")
        req = read_request(body)
        past = self.store.get(req.previous, "previous_response_id").items if req.previous else []
        pairs = [("previous_response_id", it) for it in past] + [(f"input[{i}]", it) for i, it in enumerate(req.items)]
        msgs, origins = conversation_messages(pairs, req.instructions)
        try:
            checked = chat_messages({"messages": msgs}, srv.limits)
            seqs, gen, _ = await srv.chat_request(req.chat, messages=checked, param="input")
        except APIError as e:
            raise rename(e, origins) from None
        rid, created = _id("resp"), int(time.time())
        base = {"id": rid, "object": "response", "created_at": created, "model": srv.model_id, "error": None,
                "incomplete_details": None, **req.echo}
        conversation = past + req.items
        if not gen.stream:
            def final(results: list[tuple[list, Finish]]) -> dict:
                [(events, fin)] = results
                out = OutputItems()
                for ev in events:
                    out.push(ev.event if isinstance(ev, Part) else ev)
                out.finish(fin.reason)
                return self._finished(base, req, conversation, out.items, fin, seqs[0].history[len(seqs[0].ids):])

            return await srv._run(request, seqs, gen, dict, final)
        return StreamingResponse(self._stream(request, seqs, base, req, conversation), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    def _finished(self, base: dict, req: ResponseRequest, conversation: list, items: list, fin: Finish,
                  tokens: list[int]) -> dict:
        """The completed (or cut: incomplete) response object, stored when the request asked."""
        cut = fin.reason == "length"
        usage = {"input_tokens": fin.prompt_tokens, "input_tokens_details": {"cached_tokens": fin.cached_tokens},
                 "output_tokens": fin.completion_tokens,
                 "output_tokens_details": {"reasoning_tokens": reasoning_tokens(tokens, self.marks)},
                 "total_tokens": fin.prompt_tokens + fin.completion_tokens}
        response = {**base, "status": "incomplete" if cut else "completed", "completed_at": int(time.time()),
                    "incomplete_details": {"reason": "max_output_tokens"} if cut else None, "output": items,
                    "usage": usage}
        if req.store:
            self.store.put(response, conversation + items)
        return response

    async def _stream(self, request: Request, seqs: list, base: dict, req: ResponseRequest,
                      conversation: list) -> AsyncIterator[str]:
        seq_no = 0

        def sse(ev: dict) -> str:
            nonlocal seq_no
            ev = {**ev, "sequence_number": seq_no}
            seq_no += 1
            return f"event: {ev['type']}\ndata: {json.dumps(ev, ensure_ascii=False)}\n\n"

        start = {**base, "status": "in_progress", "output": [], "usage": None}
        events = self.srv.relay(request, seqs)
        out = OutputItems()
        try:
            yield sse(_event("response.created", response=start))
            yield sse(_event("response.in_progress", response=start))
            async for _, ev in events:
                if isinstance(ev, (Piece, Part)):
                    for e in out.push(ev.event if isinstance(ev, Part) else ev):
                        yield sse(e)
                    continue
                try:
                    self.srv._check_finish(ev)
                except APIError as e:
                    failed = {**start, "status": "failed", "output": out.items,
                              "error": {"code": "server_error", "message": e.message}}
                    yield sse(_event("response.failed", response=failed))
                    return
                for e in out.finish(ev.reason):
                    yield sse(e)
                done = self._finished(base, req, conversation, out.items, ev, seqs[0].history[len(seqs[0].ids):])
                yield sse(_event("response.incomplete" if done["status"] == "incomplete" else "response.completed",
                                 response=done))
        except ClientGone:
            return
        finally:
            for seq in seqs:
                seq.cancel()
            await events.aclose()

    async def retrieve(self, request: Request) -> Response:
        self._no_query(request)
        return JSONResponse(self.store.get(request.path_params["id"]).response)

    async def delete(self, request: Request) -> Response:
        self._no_query(request)
        rid = request.path_params["id"]
        self.store.delete(rid)
        return JSONResponse({"id": rid, "object": "response.deleted", "deleted": True})

    @staticmethod
    def _no_query(request: Request) -> None:
        for key, value in request.query_params.multi_items():
            if not (key == "stream" and value == "false"):
                raise bad(f"'{key}' is not supported by this server", key, "unsupported_parameter")
