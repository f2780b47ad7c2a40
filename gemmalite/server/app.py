"""The OpenAI-compatible HTTP app (Starlette): chat, completions, embeddings, models, health, metrics.

    app = build_app(model, embedder=None, model_id="gemma-4-e2b-it", api_key=None)
    uvicorn.run(app, host="127.0.0.1", port=8080)

Generation goes through the `Scheduler` (one thread, continuous batching); the event loop only
parses, validates, tokenizes (in a worker thread) and relays the scheduler's events.
"""
from __future__ import annotations

import asyncio
import base64
import hmac
import json
import time
import uuid
from contextlib import asynccontextmanager
from typing import Any, Awaitable, Callable

import numpy as np
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from ..runtime.engine import SoftTokens
from ..runtime.generate import PROMPT_LOOKUP_DRAFTS, prompt_lookup_drafts, stop_sets
from ..vision.prompt import message_images
from .metrics import Metrics
from .protocol import (APIError, Generation, Limits, bad, chat_messages, completion_prompt, embedding_inputs,
                       generation, opt_int, require_model)
from .scheduler import Finish, Overloaded, Piece, Scheduler, Sequence

RETRY_AFTER_S = "1"


def _error_response(e: APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


class Server:
    """Everything the routes share: the model, the scheduler, limits, metrics, the key."""

    def __init__(self, model, embedder=None, *, model_id: str = "gemmalite", embedder_id: str | None = None,
                 api_key: str | None = None, max_concurrency: int = 8, max_queue: int = 64, prefix_cache: int = 4,
                 limits: Limits | None = None, prompt_lookup: int | bool = 0):
        self.model = model
        self.tokenizer = model.tokenizer  # a server needs text: fail at start-up, not per request
        self.embedder = embedder
        self.model_id = model_id
        self.embedder_id = embedder_id if embedder is not None else None
        self.api_key = api_key.encode() if api_key else None
        self.limits = limits or Limits()
        self.context = model.context
        self.prompt_lookup = prompt_lookup_drafts(prompt_lookup)  # for requests that do not say (0: plain decoding)
        self.metrics = Metrics()
        self.scheduler = Scheduler(model.engine, self.tokenizer, max_concurrency=max_concurrency,
                                   max_queue=max_queue, prefix_cache=prefix_cache, metrics=self.metrics,
                                   drafter=getattr(model, "drafter", None))
        self.metrics.gauge("gemmalite_active_sequences", lambda: len(self.scheduler.active))
        self.metrics.gauge("gemmalite_queue_depth", lambda: self.scheduler.queue_depth)
        self._embed_lock = asyncio.Lock()
        self.created = int(time.time())

    # -- request plumbing ---------------------------------------------------------------
    def check_key(self, request: Request) -> None:
        if self.api_key is None:
            return
        auth = request.headers.get("authorization", "")
        scheme, _, given = auth.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), self.api_key):
            raise APIError(401, "Invalid or missing API key (send 'Authorization: Bearer KEY')",
                           code="invalid_api_key")

    async def read_json(self, request: Request) -> dict[str, Any]:
        limit = self.limits.max_body_bytes
        too_big = APIError(413, f"request body larger than {limit} bytes", code="request_too_large")
        try:
            if int(request.headers.get("content-length", "0")) > limit:
                raise too_big
        except ValueError:
            raise bad("invalid Content-Length header") from None
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > limit:
                raise too_big
        try:
            data = json.loads(body)
        except (ValueError, UnicodeDecodeError):
            raise bad("request body is not valid JSON") from None
        if not isinstance(data, dict):
            raise bad("request body must be a JSON object")
        return data

    def route(self, path: str, handler: Callable[[Request], Awaitable[Response]], methods: list[str],
              auth: bool = True) -> Route:
        """A route whose errors all answer in the OpenAI shape and which counts its answers."""
        async def endpoint(request: Request) -> Response:
            try:
                if auth:
                    self.check_key(request)
                response = await handler(request)
            except APIError as e:
                response = _error_response(e)
            except Exception as e:  # a bug must answer 500 and leave the server serving
                response = _error_response(APIError(500, f"internal error: {type(e).__name__}: {e}", type="server_error"))
            self.metrics.inc("gemmalite_requests_total", labels={"endpoint": path, "status": str(response.status_code)})
            return response

        return Route(path, endpoint, methods=methods)

    # -- generation ---------------------------------------------------------------------
    async def _prediction_ids(self, gen: Generation) -> list[int]:
        if not gen.prediction:
            return []
        return list(await run_in_threadpool(self.tokenizer.encode, gen.prediction, add_special_tokens=False))

    def _prepare(self, ids: list[int], gen: Generation, chat: bool, soft: SoftTokens | None = None,
                 prediction: list[int] | None = None) -> Sequence:
        n, ctx = len(ids), self.context
        if n >= ctx:
            raise bad(f"This model's maximum context length is {ctx} tokens; the prompt has {n} tokens",
                      "messages" if chat else "prompt", "context_length_exceeded")
        if gen.max_tokens is not None and n + gen.max_tokens > ctx:
            raise bad(f"This model's maximum context length is {ctx} tokens; you requested {n + gen.max_tokens} "
                      f"tokens ({n} in the prompt, {gen.max_tokens} for the completion)",
                      "max_tokens", "context_length_exceeded")
        max_tokens = gen.max_tokens if gen.max_tokens is not None else min(ctx - n, self.limits.max_tokens or ctx)
        try:
            params = self.model.defaults.params(**gen.sampling)
            stop_ids, stop_strings = stop_sets(gen.stop, self.model.defaults, self.tokenizer, chat=chat)
            stop_ids = set() if gen.ignore_eos else stop_ids
        except ValueError as e:
            raise bad(str(e)) from None
        lookup = gen.prompt_lookup
        if lookup is None:  # a prediction asks for drafting from it
            lookup = PROMPT_LOOKUP_DRAFTS if gen.prediction else self.prompt_lookup
        return Sequence(ids=list(ids), max_tokens=max_tokens, params=params, stop_ids=stop_ids,
                        stop_strings=stop_strings, sink=lambda ev: None, soft=soft, lookup=lookup,
                        prediction=prediction or [])

    async def _run(self, request: Request, seq: Sequence, gen: Generation, chunk: Callable[..., dict],
                   final: Callable[[str, Finish], dict]) -> Response:
        """Submit ``seq``; answer with an SSE stream of ``chunk`` events or one ``final`` body."""
        loop, events = asyncio.get_running_loop(), asyncio.Queue()
        seq.sink = lambda ev: loop.call_soon_threadsafe(events.put_nowait, ev)
        try:
            self.scheduler.submit(seq)
        except Overloaded as e:
            raise APIError(503, f"server busy: {e}; retry later", type="server_error", code="overloaded",
                           headers={"Retry-After": RETRY_AFTER_S}) from None
        if gen.stream:
            return StreamingResponse(self._sse(seq, events, gen, chunk), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        text: list[str] = []
        try:
            while True:
                try:
                    ev = await asyncio.wait_for(events.get(), timeout=1.0)
                except asyncio.TimeoutError:
                    if await request.is_disconnected():
                        return Response(status_code=499)  # client closed the request: nobody reads this
                    continue
                if isinstance(ev, Piece):
                    text.append(ev.text)
                    continue
                self._check_finish(ev)
                return JSONResponse(final("".join(text), ev))
        finally:
            seq.cancel()  # a no-op once finished; frees the slot if the client left

    @staticmethod
    def _check_finish(ev: Finish) -> None:
        if ev.reason == "error":
            raise APIError(500, f"generation failed: {ev.error}", type="server_error")
        if ev.reason == "cancelled":
            raise APIError(503, "the server is shutting down", type="server_error",
                           headers={"Retry-After": RETRY_AFTER_S})

    async def _sse(self, seq: Sequence, events: asyncio.Queue, gen: Generation, chunk: Callable[..., dict]):
        def data(obj: Any) -> str:
            return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"

        try:
            yield data(chunk(role=True))
            while True:
                ev = await events.get()
                if isinstance(ev, Piece):
                    yield data(chunk(text=ev.text))
                    continue
                try:
                    self._check_finish(ev)
                except APIError as e:
                    yield data(e.body())
                    return
                yield data(chunk(finish=ev.reason))
                if gen.include_usage:
                    yield data(chunk(usage=_usage(ev)))
                yield "data: [DONE]\n\n"
                return
        finally:
            seq.cancel()  # the client went away mid-stream (or we are done): free the slot

    async def chat_completions(self, request: Request) -> Response:
        body = await self.read_json(request)
        require_model(body, self.model_id, "chat")
        gen = generation(body, self.limits)
        messages = chat_messages(body, self.limits)
        images = message_images(messages)
        if images and self.model.vision is None:
            raise bad(f"the model {self.model_id!r} has no vision tower: it takes no image_url parts", "messages",
                      "images_not_supported")
        try:
            ids = await run_in_threadpool(self.tokenizer.chat_ids, messages, add_generation_prompt=True)
        except ValueError as e:
            raise bad(f"cannot render the conversation: {e}", "messages") from None
        except Exception as e:  # jinja2's TemplateError (the template's raise_exception)
            raise bad(f"the chat template refused the conversation: {e}", "messages") from None
        soft = None
        if images:  # decoded and through the vision tower here (a worker thread), not in the scheduler
            try:
                arr, soft = await run_in_threadpool(self.model.with_images, ids, images,
                                                    max_pixels=self.limits.max_image_pixels)
            except ValueError as e:  # ImageError: not a picture, corrupt, too many pixels, placeholders
                raise bad(str(e), "messages", "invalid_image") from None
            ids = arr.tolist()
        seq = self._prepare(ids, gen, chat=True, soft=soft, prediction=await self._prediction_ids(gen))
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        base = {"id": rid, "created": created, "model": self.model_id, "system_fingerprint": None}

        def chunk(role=False, text=None, finish=None, usage=None) -> dict:
            out = {**base, "object": "chat.completion.chunk"}
            if usage is not None:
                return {**out, "choices": [], "usage": usage}
            delta = {"role": "assistant", "content": ""} if role else ({"content": text} if text is not None else {})
            return {**out, "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]}

        def final(text: str, ev: Finish) -> dict:
            return {**base, "object": "chat.completion", "usage": _usage(ev),
                    "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                                 "logprobs": None, "finish_reason": ev.reason}]}

        return await self._run(request, seq, gen, chunk, final)

    async def completions(self, request: Request) -> Response:
        body = await self.read_json(request)
        require_model(body, self.model_id, "completion")
        gen = generation(body, self.limits)
        prompt = completion_prompt(body, self.model.config.vocab_size)
        ids = prompt if isinstance(prompt, list) else await run_in_threadpool(self.tokenizer.encode, prompt)
        seq = self._prepare(ids, gen, chat=False, prediction=await self._prediction_ids(gen))
        base = {"id": f"cmpl-{uuid.uuid4().hex}", "created": int(time.time()), "model": self.model_id,
                "object": "text_completion", "system_fingerprint": None}

        def chunk(role=False, text=None, finish=None, usage=None) -> dict:
            if usage is not None:
                return {**base, "choices": [], "usage": usage}
            return {**base, "choices": [{"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}]}

        def final(text: str, ev: Finish) -> dict:
            return {**base, "usage": _usage(ev),
                    "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": ev.reason}]}

        return await self._run(request, seq, gen, chunk, final)

    # -- embeddings, models, health, metrics ----------------------------------------------
    async def embeddings(self, request: Request) -> Response:
        body = await self.read_json(request)
        require_model(body, self.embedder_id, "embedding")
        inputs, are_ids = embedding_inputs(body, self.limits)
        dims = opt_int(body, "dimensions", 1)
        fmt = body.get("encoding_format") or "float"
        if fmt not in ("float", "base64"):
            raise bad("'encoding_format' must be 'float' or 'base64'", "encoding_format")
        emb = self.embedder
        if are_ids and not hasattr(emb, "embed_ids"):
            raise bad("this embedder takes text input only", "input")
        kw = {"dimensions": dims} if dims is not None else {}
        fn = emb.embed_ids if are_ids else emb.embed
        async with self._embed_lock:
            try:
                vecs = await run_in_threadpool(fn, inputs, **kw)
            except ValueError as e:  # the project's errors: bad dimensions, too long, ...
                raise bad(str(e), "input") from None
        vecs = np.asarray(vecs, dtype=np.float32)
        self.metrics.inc("gemmalite_embedding_inputs_total", len(inputs))
        n_tokens = sum(len(x) for x in inputs) if are_ids else await run_in_threadpool(self._count_tokens, inputs)
        data = [{"object": "embedding", "index": i,
                 "embedding": base64.b64encode(v.astype("<f4").tobytes()).decode() if fmt == "base64" else v.tolist()}
                for i, v in enumerate(vecs)]
        return JSONResponse({"object": "list", "data": data, "model": self.embedder_id,
                             "usage": {"prompt_tokens": n_tokens, "total_tokens": n_tokens}})

    def _count_tokens(self, texts: list[str]) -> int:
        """The tokens the embedder ran: its default prompt and special tokens included."""
        emb = self.embedder
        if hasattr(emb, "tokenize"):
            return sum(len(x) for x in emb.tokenize(texts, prompt=emb.resolve_prompt(None, None)))
        tok = getattr(emb, "tokenizer", None)
        return sum(len(tok.encode(t)) for t in texts) if tok is not None else 0

    def _model_cards(self) -> list[dict]:
        ids = [self.model_id] + ([self.embedder_id] if self.embedder_id else [])
        return [{"id": i, "object": "model", "created": self.created, "owned_by": "gemmalite"} for i in ids]

    async def models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": self._model_cards()})

    async def model_card(self, request: Request) -> Response:
        name = request.path_params["name"]
        for card in self._model_cards():
            if card["id"] == name:
                return JSONResponse(card)
        raise APIError(404, f"The model {name!r} does not exist", param="model", code="model_not_found")

    async def health(self, request: Request) -> Response:
        if not self.scheduler.alive:
            return JSONResponse({"status": "error", "detail": "scheduler stopped"}, status_code=503)
        return JSONResponse({"status": "ok"})

    async def metrics_text(self, request: Request) -> Response:
        return PlainTextResponse(self.metrics.render(), media_type="text/plain; version=0.0.4")


def _usage(ev: Finish) -> dict:
    return {"prompt_tokens": ev.prompt_tokens, "completion_tokens": ev.completion_tokens,
            "total_tokens": ev.prompt_tokens + ev.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": ev.cached_tokens},
            "completion_tokens_details": {"accepted_prediction_tokens": ev.accepted,
                                          "rejected_prediction_tokens": ev.drafted - ev.accepted}}


def build_app(model, embedder=None, **options: Any) -> Starlette:
    """The Starlette app serving ``model`` (and ``embedder``); options go to `Server`."""
    srv = Server(model, embedder, **options)

    @asynccontextmanager
    async def lifespan(app):
        srv.scheduler.start()
        try:
            yield
        finally:
            await run_in_threadpool(srv.scheduler.close)

    async def http_error(request: Request, exc: HTTPException) -> Response:
        msg = {404: f"no route {request.url.path}", 405: f"method {request.method} not allowed here"}
        e = APIError(exc.status_code, msg.get(exc.status_code, str(exc.detail)))
        srv.metrics.inc("gemmalite_requests_total", labels={"endpoint": "other", "status": str(exc.status_code)})
        return _error_response(e)

    routes = [
        srv.route("/v1/chat/completions", srv.chat_completions, ["POST"]),
        srv.route("/v1/completions", srv.completions, ["POST"]),
        srv.route("/v1/embeddings", srv.embeddings, ["POST"]),
        srv.route("/v1/models", srv.models, ["GET"]),
        srv.route("/v1/models/{name:path}", srv.model_card, ["GET"]),
        srv.route("/health", srv.health, ["GET"], auth=False),
        srv.route("/metrics", srv.metrics_text, ["GET"]),
    ]
    app = Starlette(routes=routes, lifespan=lifespan, exception_handlers={HTTPException: http_error})
    app.state.server = srv
    return app
