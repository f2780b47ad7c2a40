"""The OpenAI-compatible HTTP app (Starlette): chat, completions, embeddings, models, health, metrics.

    app = build_app(model, embedder=None, model_id="gemma-4-e2b-it", api_key=None)
    uvicorn.run(app, host="127.0.0.1", port=8080)

Generation goes through the `Scheduler` (one thread, continuous batching); the event loop only
parses, validates, tokenizes (in a worker thread) and relays the scheduler's events. A client
that disconnects cancels its request at once (`Server.relay`, `Server.until_gone`); `Server.drain`
is the graceful shutdown (docs/server-operations.md).
"""
from __future__ import annotations

import asyncio
import base64
import dataclasses
import hmac
import json
import logging
import time
import uuid
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator, Awaitable, Callable

import numpy as np
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from ..audio.prompt import message_audio
from ..chat.parser import ChatTokens
from ..errors import AudioError, ContextError, ImageError, InputError
from ..runtime.engine import SoftTokens
from ..runtime.generate import PROMPT_LOOKUP_DRAFTS, prompt_lookup_drafts, stop_sets
from ..vision.prompt import message_images
from . import chat_format
from .anthropic import Messages
from .constraints import LogprobFormat, read_logprobs, read_n, read_response_format
from .metrics import Metrics
from .ollama import ollama_routes
from .protocol import (CHAT_ONLY, WARNING_HEADER, APIError, ClientGone, Generation, Limits, bad, chat_messages,
                       check_messages, completion_prompt, embedding_inputs, generation, opt_int, parse_json,
                       reject_unsupported, require_model)
from .responses import Responses
from .scheduler import PREFIX_CACHE_BYTES, Finish, Overloaded, Part, Piece, Scheduler, Sequence, ShuttingDown
from .transcription import audio_routes
from .ui import ui_routes

RETRY_AFTER_S = "1"
log = logging.getLogger(__name__)


def _error_response(e: APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


def shutting_down() -> APIError:
    return APIError(503, "the server is shutting down; retry on another instance or later", type="server_error",
                    code="shutting_down", headers={"Retry-After": RETRY_AFTER_S})


def watch_disconnect(request: Request, on_gone: Callable[[], None]) -> asyncio.Task:
    """A task that calls ``on_gone()`` once the client disconnects (the ASGI ``http.disconnect``
    message, which the server sends the moment the connection closes, whether or not anything is
    being written to it). Start it after the body is read; cancel it when the reply is done."""
    async def watch() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass  # (the body is read: nothing else comes)
        on_gone()

    return asyncio.ensure_future(watch())


class Server:
    """Everything the routes share: the model, the scheduler, limits, metrics, the key."""

    def __init__(self, model, embedder=None, *, model_id: str = "gemmalite", embedder_id: str | None = None,
                 api_key: str | None = None, max_concurrency: int = 8, max_queue: int = 64,
                 prefix_cache: int = PREFIX_CACHE_BYTES, limits: Limits | None = None, prompt_lookup: int | bool = 0):
        self.model = model
        self.tokenizer = model.tokenizer  # a server needs text: fail at start-up, not per request
        # a Gemma 4 vocabulary: chat replies are read apart (thought, calls); else they are plain text (Gemma 3)
        self.chat_format = ChatTokens.find(self.tokenizer) is not None
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
        self.logprob_format = LogprobFormat(self.tokenizer)
        self._embed_lock = asyncio.Lock()
        self.created = int(time.time())
        self.draining = False
        warning = self.template_warning()
        if warning:
            log.warning("%s", warning)

    def template_warning(self) -> str | None:
        """What a chat request to a base model (no chat template of its own) is told, in the
        ``X-Gemmalite-Warning`` header (and the log, at start-up); None for a chat model."""
        if self.tokenizer.chat_template is not None:
            return None
        return (f"the model {self.model_id!r} has no chat template of its own (a base model?): the conversation "
                "is rendered with the generic Gemma template and replies may be poor; /v1/completions continues "
                "plain text")

    def drain(self, grace: float) -> None:
        """Begin a graceful shutdown: admit nothing new (new work answers 503 with Retry-After at
        `relay` / `until_gone`; /health answers 503),
        let what runs finish for ``grace`` seconds, then cancel it (each gets a clean end: a 503,
        or an error event on a stream). From any thread (a signal handler starts one to call it)."""
        self.draining = True
        self.scheduler.drain(grace)

    # -- request plumbing ---------------------------------------------------------------
    def check_key(self, request: Request) -> None:
        """The key as a bearer token (OpenAI's clients) or ``x-api-key`` (Anthropic's)."""
        if self.api_key is None:
            return
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        keys = [given.strip()] if scheme.lower() == "bearer" else []
        keys += [request.headers["x-api-key"]] if "x-api-key" in request.headers else []
        if not keys or not all(hmac.compare_digest(k.encode(), self.api_key) for k in keys):
            raise APIError(401, "Invalid or missing API key (send 'Authorization: Bearer KEY' or 'x-api-key: KEY')",
                           code="invalid_api_key")

    async def read_body(self, request: Request, limit: int) -> bytes:
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
        return bytes(body)

    async def read_form(self, request: Request) -> dict[str, Any]:
        """A multipart form (one file at most), its body bounded by the file's bound plus 64 KiB of fields."""
        body = await self.read_body(request, self.limits.max_audio_bytes + (64 << 10))

        async def receive() -> dict:
            return {"type": "http.request", "body": body, "more_body": False}

        try:
            form = await Request(request.scope, receive).form(max_files=1, max_fields=16)
        except AssertionError as e:  # Starlette without python-multipart
            raise APIError(501, f"this server cannot read forms: {e}", type="server_error") from None
        except HTTPException as e:
            raise bad(f"the request is not a valid multipart form: {e.detail}") from None
        except Exception as e:  # the form parser's own errors
            raise bad(f"the request is not a valid multipart form: {e}") from None
        out: dict[str, Any] = {}
        for key, value in form.multi_items():
            if key in out:
                raise bad(f"the form field {key!r} is given twice", key)
            out[key] = await value.read() if hasattr(value, "read") else value
        await form.close()
        return out

    async def read_json(self, request: Request) -> dict[str, Any]:
        """The body as a JSON object, within ``max_body_bytes`` and ``max_json_depth`` (`protocol.parse_json`)."""
        body = await self.read_body(request, self.limits.max_body_bytes)
        return parse_json(body, self.limits)

    def route(self, path: str, handler: Callable[[Request], Awaitable[Response]], methods: list[str],
              auth: bool = True, error: Callable[[APIError], Response] = _error_response) -> Route:
        """A route whose errors all answer in one shape (``error``: OpenAI's by default) and which
        counts its answers."""
        async def endpoint(request: Request) -> Response:
            try:
                if auth:
                    self.check_key(request)
                response = await handler(request)
            except APIError as e:
                response = error(e)
            except (ClientGone, ClientDisconnect):  # (the latter: it left while its body was read)
                response = Response(status_code=499)  # client closed the request: nobody reads this
            except (InputError, ContextError) as e:  # the project's own checks, wherever they ran
                response = error(bad(str(e)))
            except Exception as e:  # a bug must answer 500 and leave the server serving
                response = error(APIError(500, f"internal error: {type(e).__name__}: {e}", type="server_error"))
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
        default = min(self.limits.default_max_tokens or ctx, self.limits.max_tokens or ctx)
        max_tokens = gen.max_tokens if gen.max_tokens is not None else min(ctx - n, default)
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

    def choices(self, seq: Sequence, body: dict, chat: bool, thinking: bool = False, tools=None) -> list[Sequence]:
        """``seq`` and its ``n - 1`` siblings (seeds ``seed + i``; they share its prefill), each with
        its own matcher of the request's ``response_format`` (or of its ``tools``' grammar) and its
        ``logprobs`` setting."""
        n = read_n(body)
        seq.logprobs = read_logprobs(body, chat)
        # the tools' grammar holds the response_format beside the calls (chat_format.tool_constraint)
        grammar = tools if tools is not None else read_response_format(body, self.tokenizer, thinking)
        seqs = [seq]
        for i in range(1, n):
            seed = seq.params.seed
            params = seq.params if seed is None else dataclasses.replace(seq.params, seed=(seed + i) % 2**64)
            seqs.append(dataclasses.replace(seq, params=params))
        if grammar is not None:
            for s in seqs:
                s.matcher = grammar.matcher(s.stop_ids)
        return seqs

    def relay(self, request: Request, seqs: list[Sequence]) -> AsyncIterator[tuple[int, Any]]:
        """The request core every API shares: submit ``seqs`` (a request's choices) at once (a full
        queue is an `APIError` 429, a draining server's a 503, both with Retry-After) and return
        their events: each ``(choice index, event)`` (`Piece`, `Part`, then its `Finish`) until every
        choice has finished. The moment the client disconnects (streamed or not, running or still
        queued), every choice is cancelled (its slot is free at the scheduler's next step; a queued
        one never starts) and the iteration raises `ClientGone`. Leaving the iteration early (an
        error, a closed stream) cancels every choice too. The body must have been read."""
        loop, events = asyncio.get_running_loop(), asyncio.Queue()
        for i, seq in enumerate(seqs):
            seq.sink = lambda ev, i=i: loop.call_soon_threadsafe(events.put_nowait, (i, ev))
        try:
            for seq in seqs:
                self.scheduler.submit(seq)
        except (Overloaded, ShuttingDown) as e:
            for seq in seqs:
                seq.cancel("rejected")
            if isinstance(e, ShuttingDown):
                raise shutting_down() from None
            raise APIError(429, f"server busy: {e}; retry later", type="server_error", code="overloaded",
                           headers={"Retry-After": RETRY_AFTER_S}) from None

        def gone() -> None:
            for seq in seqs:
                seq.cancel("client_gone")
            events.put_nowait((-1, None))

        return self._events(seqs, events, watch_disconnect(request, gone))

    async def _events(self, seqs: list[Sequence], events: asyncio.Queue, watcher: asyncio.Task):
        try:
            done = 0
            while done < len(seqs):
                i, ev = await events.get()
                if i < 0:
                    raise ClientGone()
                done += isinstance(ev, Finish)
                yield i, ev
        finally:
            watcher.cancel()
            for seq in seqs:
                seq.cancel()  # a no-op once finished; frees the slot if the reply was left early

    async def until_gone(self, request: Request, work: Awaitable[Any]) -> Any:
        """``work``'s result, unless the client disconnects first: then ``work`` is cancelled (work
        still waiting never starts; a worker thread already running finishes, its result unread)
        and `ClientGone` is raised. For work that does not go through `relay` (embeddings); a
        draining server refuses it (503), as `relay` does."""
        if self.draining:
            if asyncio.iscoroutine(work):
                work.close()  # (never started)
            raise shutting_down()
        task, gone = asyncio.ensure_future(work), asyncio.Event()
        watcher, waiter = watch_disconnect(request, gone.set), asyncio.ensure_future(gone.wait())
        try:
            await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
            if task.done():
                return task.result()
            task.cancel()
            self.metrics.inc("gemmalite_cancelled_total", labels={"cause": "client_gone"})
            raise ClientGone()
        finally:
            watcher.cancel()
            waiter.cancel()

    async def _run(self, request: Request, seqs: list[Sequence], gen: Generation, chunk: Callable[..., dict],
                   final: Callable[[list[tuple[list, Finish]]], dict | Response]) -> Response:
        """`relay` ``seqs``; answer with an SSE stream of ``chunk`` events or one ``final`` body (or
        response) built from each choice's (events: `Piece`s or `Part`s, `Finish`)."""
        events = self.relay(request, seqs)
        if gen.stream:
            return StreamingResponse(self._sse(seqs, events, gen, chunk), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        got: list[list] = [[] for _ in seqs]
        lps: list[list] = [[] for _ in seqs]
        done: dict[int, Finish] = {}
        try:
            async for i, ev in events:
                if isinstance(ev, (Piece, Part)):
                    got[i].append(ev)
                    lps[i] += ev.logprobs
                    continue
                self._check_finish(ev)
                ev.logprobs = lps[i] + ev.logprobs
                done[i] = ev
        finally:
            await events.aclose()
        out = final([(got[i], done[i]) for i in range(len(seqs))])
        return out if isinstance(out, Response) else JSONResponse(out)

    @staticmethod
    def _check_finish(ev: Finish) -> None:
        if ev.reason == "error":
            raise APIError(500, f"generation failed: {ev.error}", type="server_error")
        if ev.reason == "cancelled":  # (by the server: a client that left reads nothing)
            raise shutting_down()

    async def _sse(self, seqs: list[Sequence], events: AsyncIterator[tuple[int, Any]], gen: Generation,
                   chunk: Callable[..., dict]):
        def data(obj: Any) -> str:
            return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"

        try:
            for i in range(len(seqs)):
                yield data(chunk(i, role=True))
            finished: list[Finish] = []
            async for i, ev in events:
                if isinstance(ev, (Piece, Part)):
                    c = chunk(i, event=ev, logprobs=ev.logprobs)
                    if c is not None:
                        yield data(c)
                    continue
                try:
                    self._check_finish(ev)
                except APIError as e:
                    yield data(e.body())
                    return
                yield data(chunk(i, finish=ev.reason, logprobs=ev.logprobs))
                finished.append(ev)
            if gen.include_usage:
                yield data(chunk(0, usage=_usage(finished)))
            yield "data: [DONE]\n\n"
        except ClientGone:
            return
        finally:  # the client went away mid-stream (or we are done): free the slots
            for seq in seqs:
                seq.cancel()
            await events.aclose()

    async def _chat_sequence(self, messages: list[dict[str, Any]], gen: Generation, param: str = "messages",
                             opts: chat_format.ChatOptions | None = None) -> Sequence:
        """A conversation as the scheduler runs it: rendered (with ``opts``' tools and thinking), its
        pictures and clips through their towers (here, in a worker thread, not in the scheduler),
        checked against the context."""
        check_messages(messages, self.limits, param)
        images, clips = message_images(messages), message_audio(messages)
        if images and self.model.vision is None:
            raise bad(f"the model {self.model_id!r} has no vision tower: it takes no image_url parts", param,
                      "images_not_supported")
        if clips and self.model.audio is None:
            raise bad(f"the model {self.model_id!r} has no audio tower: it takes no audio", param, "audio_not_supported")
        opts = opts if opts is not None else chat_format.chat_options({})
        try:
            ids = await run_in_threadpool(chat_format.prompt_ids, self.tokenizer, messages, opts)
        except APIError:
            raise
        except ValueError as e:
            raise bad(f"cannot render the conversation: {e}", param) from None
        except Exception as e:  # jinja2's TemplateError (the template's raise_exception)
            raise bad(f"the chat template refused the conversation: {e}", param) from None
        soft = None
        if images or clips:
            try:
                arr, soft = await run_in_threadpool(self.model.with_media, ids, images, clips,
                                                    max_pixels=self.limits.max_image_pixels,
                                                    max_seconds=self.limits.max_audio_seconds)
            except AudioError as e:  # not audio, corrupt, too long, non-finite, placeholders
                raise bad(str(e), param, "invalid_audio") from None
            except ValueError as e:  # ImageError: not a picture, corrupt, too many pixels, placeholders
                raise bad(str(e), param, "invalid_image") from None
            ids = arr.tolist()
        return self._prepare(ids, gen, chat=True, soft=soft, prediction=await self._prediction_ids(gen))

    async def chat_request(self, body: dict, messages: list[dict[str, Any]] | None = None,
                           param: str = "messages") -> tuple[list[Sequence], Generation, chat_format.ChatOptions]:
        """The shared core of a chat request in chat-completions terms (each API translates its own
        body to these fields): its choices as scheduler sequences (rendered with its tools and
        thinking, read by the chat parser, constrained by the tools' grammar or ``response_format``),
        the checked generation options and the agent options. ``messages``: already checked
        OpenAI-shaped messages (default: ``body["messages"]``, checked here)."""
        gen = generation(body, self.limits)
        opts = chat_format.chat_options(body)
        if messages is None:
            messages = chat_messages(body, self.limits)
        seq = await self._chat_sequence(messages, gen, param=param, opts=opts)
        seq.thinking_budget = opts.thinking_budget  # (the effort's; its siblings copy it)
        if self.chat_format:
            seq.output = lambda: chat_format.ChatReader(self.tokenizer, seq.stop_strings, opts)
        # (the tools' grammar and a response_format schema compile in a worker thread)
        tools = await run_in_threadpool(chat_format.tool_constraint, self.tokenizer, opts, body.get("response_format"))
        seqs = await run_in_threadpool(self.choices, seq, body, True, opts.thinking, tools)
        return seqs, gen, opts

    async def chat_completions(self, request: Request) -> Response:
        body = await self.read_json(request)
        require_model(body, self.model_id, "chat")
        seqs, gen, _ = await self.chat_request(body)
        seq = seqs[0]
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        base = {"id": rid, "created": created, "model": self.model_id, "system_fingerprint": None}
        fmt = self.logprob_format if seq.logprobs is not None else None

        def chunk(i, role=False, event=None, finish=None, usage=None, logprobs=()) -> dict | None:
            out = {**base, "object": "chat.completion.chunk"}
            if usage is not None:
                return {**out, "choices": [], "usage": usage}
            lp = fmt.chat(list(logprobs)) if fmt is not None and logprobs else None
            delta = {"role": "assistant", "content": ""} if role else \
                (chat_format.delta(event) if event is not None else {})
            if delta is None:  # (a part with no delta of its own: a call's end)
                if lp is None:
                    return None
                delta = {}
            return {**out, "choices": [{"index": i, "delta": delta, "logprobs": lp, "finish_reason": finish}]}

        def final(results: list[tuple[list, Finish]]) -> dict:
            return {**base, "object": "chat.completion", "usage": _usage([ev for _, ev in results]),
                    "choices": [{"index": i, "message": chat_format.message(events),
                                 "logprobs": fmt.chat(ev.logprobs) if fmt is not None else None,
                                 "finish_reason": ev.reason} for i, (events, ev) in enumerate(results)]}

        response = await self._run(request, seqs, gen, chunk, final)
        warning = self.template_warning()
        if warning:
            response.headers[WARNING_HEADER] = warning
        return response

    async def completions(self, request: Request) -> Response:
        body = await self.read_json(request)
        require_model(body, self.model_id, "completion")
        gen = generation(body, self.limits)
        reject_unsupported(body, CHAT_ONLY)
        prompt = completion_prompt(body, self.model.config.vocab_size)
        ids = prompt if isinstance(prompt, list) else await run_in_threadpool(self.tokenizer.encode, prompt)
        seq = self._prepare(ids, gen, chat=False, prediction=await self._prediction_ids(gen))
        seqs = await run_in_threadpool(self.choices, seq, body, False)
        base = {"id": f"cmpl-{uuid.uuid4().hex}", "created": int(time.time()), "model": self.model_id,
                "object": "text_completion", "system_fingerprint": None}
        fmt = self.logprob_format if seq.logprobs is not None else None
        sent = [0] * len(seqs)  # characters streamed per choice (the text_offset of the next chunk)

        def chunk(i, role=False, event=None, finish=None, usage=None, logprobs=()) -> dict:
            if usage is not None:
                return {**base, "choices": [], "usage": usage}
            text = event.text if event is not None else ""
            lp = fmt.completion(list(logprobs), sent[i]) if fmt is not None and logprobs else None
            sent[i] += len(text)
            return {**base, "choices": [{"index": i, "text": text, "logprobs": lp, "finish_reason": finish}]}

        def final(results: list[tuple[list, Finish]]) -> dict:
            return {**base, "usage": _usage([ev for _, ev in results]),
                    "choices": [{"index": i, "text": "".join(p.text for p in pieces), "finish_reason": ev.reason,
                                 "logprobs": fmt.completion(ev.logprobs) if fmt is not None else None}
                                for i, (pieces, ev) in enumerate(results)]}

        return await self._run(request, seqs, gen, chunk, final)

    # -- embeddings, models, health, metrics ----------------------------------------------
    async def embeddings(self, request: Request) -> Response:
        body = await self.read_json(request)
        require_model(body, self.embedder_id, "embedding")
        inputs, are_ids = embedding_inputs(body, self.limits)
        dims = opt_int(body, "dimensions", 1, getattr(self.embedder, "dim", None))
        fmt = body.get("encoding_format") or "float"
        if fmt not in ("float", "base64"):
            raise bad("'encoding_format' must be 'float' or 'base64'", "encoding_format")
        emb = self.embedder
        if are_ids and not hasattr(emb, "embed_ids"):
            raise bad("this embedder takes text input only", "input")
        parts = not are_ids and not all(isinstance(x, str) for x in inputs)  # the content-part extension
        if parts and not hasattr(emb, "prepare"):
            raise bad("this embedder takes text input only", "input")
        kw = {"dimensions": dims} if dims is not None else {}
        fn = emb.embed_ids if are_ids else emb.embed

        async def run() -> tuple[Any, int | None]:  # one embedding at a time; a request waiting here
            async with self._embed_lock:  # whose client leaves never starts (`until_gone`)
                try:
                    if parts:  # pictures and clips through their towers once; usage counts their soft tokens
                        prepared = await run_in_threadpool(emb.prepare, inputs)
                        n = sum(len(x) for x in prepared[0])
                        return await run_in_threadpool(lambda: emb.embed_prepared(prepared, **kw)), n
                    return await run_in_threadpool(fn, inputs, **kw), None
                except AudioError as e:
                    raise bad(str(e), "input", "invalid_audio") from None
                except ImageError as e:
                    raise bad(str(e), "input", "invalid_image") from None
                except ValueError as e:  # the project's errors: bad dimensions, too long, ...
                    raise bad(str(e), "input") from None

        vecs, n_tokens = await self.until_gone(request, run())
        vecs = np.asarray(vecs, dtype=np.float32)
        self.metrics.inc("gemmalite_embedding_inputs_total", len(inputs))
        if n_tokens is None:
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

    async def capabilities(self, request: Request) -> Response:
        """What the loaded checkpoints take, so that a client (the chat page) offers only that."""
        lim = self.limits
        return JSONResponse({
            "model": self.model_id, "embedder": self.embedder_id, "context": self.context,
            "vision": self.model.vision is not None,
            "audio": getattr(self.model, "audio", None) is not None,
            "embeddings": self.embedder is not None,
            "embedding_images": getattr(self.embedder, "vision", None) is not None,
            # replies read into reasoning_content / tool_calls (a Gemma 4 vocabulary: chat_format)
            "thinking": self.chat_format, "tools": self.chat_format,
            "limits": {"max_tokens": lim.max_tokens, "default_max_tokens": lim.default_max_tokens,
                       "max_messages": lim.max_messages, "max_images": lim.max_images,
                       "max_image_bytes": lim.max_image_bytes, "max_inputs": lim.max_inputs,
                       "max_body_bytes": lim.max_body_bytes, "max_audio": lim.max_audio,
                       "max_audio_bytes": lim.max_audio_bytes, "max_audio_seconds": lim.max_audio_seconds},
        })

    async def health(self, request: Request) -> Response:
        if self.draining:
            return JSONResponse({"status": "draining", "detail": "shutting down"}, status_code=503,
                                headers={"Retry-After": RETRY_AFTER_S})
        if not self.scheduler.alive:
            return JSONResponse({"status": "error", "detail": "scheduler stopped"}, status_code=503)
        return JSONResponse({"status": "ok"})

    async def metrics_text(self, request: Request) -> Response:
        return PlainTextResponse(self.metrics.render(), media_type="text/plain; version=0.0.4")


def _usage(evs: list[Finish]) -> dict:
    """A request's usage: its prompt once (its choices share it), the completions of all its choices."""
    first = evs[0]
    done = sum(ev.completion_tokens for ev in evs)
    accepted, drafted = sum(ev.accepted for ev in evs), sum(ev.drafted for ev in evs)
    return {"prompt_tokens": first.prompt_tokens, "completion_tokens": done,
            "total_tokens": first.prompt_tokens + done,
            "prompt_tokens_details": {"cached_tokens": first.cached_tokens},
            "completion_tokens_details": {"accepted_prediction_tokens": accepted,
                                          "rejected_prediction_tokens": drafted - accepted}}


def build_app(model, embedder=None, *, ui: bool = True, **options: Any) -> Starlette:
    """The Starlette app serving ``model`` (and ``embedder``); ``ui``: the chat page at ``/``;
    options go to `Server`."""
    srv = Server(model, embedder, **options)
    messages = Messages(srv)

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

    responses = Responses(srv)
    routes = [
        srv.route("/v1/chat/completions", srv.chat_completions, ["POST"]),
        srv.route("/v1/responses", responses.create, ["POST"]),
        srv.route("/v1/responses/{id}", responses.retrieve, ["GET"]),
        srv.route("/v1/responses/{id}", responses.delete, ["DELETE"]),
        srv.route("/v1/completions", srv.completions, ["POST"]),
        srv.route("/v1/embeddings", srv.embeddings, ["POST"]),
        *audio_routes(srv),
        srv.route("/v1/messages", messages.create, ["POST"], auth=False),  # (Messages checks the key itself)
        srv.route("/v1/messages/count_tokens", messages.count_tokens, ["POST"], auth=False),
        srv.route("/v1/models", srv.models, ["GET"]),
        srv.route("/v1/capabilities", srv.capabilities, ["GET"]),
        srv.route("/v1/models/{name:path}", srv.model_card, ["GET"]),
        srv.route("/health", srv.health, ["GET"], auth=False),
        srv.route("/metrics", srv.metrics_text, ["GET"]),
    ] + ollama_routes(srv) + (ui_routes() if ui else [])
    app = Starlette(routes=routes, lifespan=lifespan, exception_handlers={HTTPException: http_error})
    app.state.server = srv
    return app
