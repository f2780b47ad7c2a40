"""Ollama's API beside the OpenAI one: ``/api/chat``, ``/api/generate``, ``/api/embed`` (and the
older ``/api/embeddings``), ``/api/tags``, ``/api/show``, ``/api/ps``, ``/api/version``.

A thin translation on the server's request core: an ollama body becomes chat-completions fields
for `Server.chat_request` (or the raw-prompt path of `Server.completions`), the scheduler's events
become ollama's newline-delimited JSON (``stream`` defaults to true) ending with ``done: true``,
``done_reason`` and the timing fields (nanoseconds). Errors answer ``{"error": "..."}`` with a 4xx.

Every ``options`` key is either mapped to our sampling, accepted at its neutral value, or refused
with a 400 naming it; so is every top-level field. ``keep_alive`` is checked and has no effect
(the server keeps its one model loaded): a response to a request that sends it says so in the
``X-Gemmalite-Warning`` header.
"""
from __future__ import annotations

import hashlib
import json
import re
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, AsyncIterator, Awaitable, Callable

import numpy as np
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from ..chat.parser import Content, Reasoning, ToolCallArgs, ToolCallEnd, ToolCallStart
from .protocol import WARNING_HEADER, APIError, ClientGone, bad, chat_messages, generation, opt_bool
from .scheduler import Finish, Part, Piece, Sequence

#: the ollama release whose API this one follows (clients gate features on /api/version)
OLLAMA_VERSION = "0.12.0"
KEEP_ALIVE_WARNING = "keep_alive has no effect: this server keeps its one model loaded"

#: ollama option -> chat-completions field (checked by `protocol.generation`)
SAMPLING = {"temperature": "temperature", "top_k": "top_k", "top_p": "top_p", "min_p": "min_p", "seed": "seed",
            "stop": "stop", "repeat_penalty": "repetition_penalty"}
#: options accepted at their neutral value only (what they do is not implemented)
NEUTRAL = {"presence_penalty": 0, "frequency_penalty": 0, "typical_p": 1, "tfs_z": 1, "mirostat": 0,
           "repeat_last_n": -1}  # our repetition penalty covers the whole context (ollama's -1)
CHAT_FIELDS = {"model", "messages", "tools", "format", "options", "stream", "keep_alive", "think"}
GENERATE_FIELDS = {"model", "prompt", "system", "raw", "images", "format", "options", "stream", "keep_alive", "think",
                   "suffix", "context", "template"}
MESSAGE_FIELDS = {"role", "content", "images", "tool_calls", "tool_name", "thinking"}
THINK_LEVELS = ("low", "medium", "high")
_DURATION = re.compile(r"-?(\d+(\.\d*)?(ns|us|µs|ms|s|m|h))+")


def ollama_routes(srv: Any) -> list[Route]:
    """The routes of ollama's API on ``srv`` (the app's `Server`)."""
    api = Ollama(srv)
    return [api.route("/api/chat", api.chat, ["POST"]),
            api.route("/api/generate", api.generate, ["POST"]),
            api.route("/api/embed", api.embed, ["POST"]),
            api.route("/api/embeddings", api.embeddings, ["POST"]),
            api.route("/api/tags", api.tags, ["GET"]),
            api.route("/api/show", api.show, ["POST"]),
            api.route("/api/ps", api.ps, ["GET"]),
            api.route("/api/version", api.version, ["GET"])]


def _now() -> str:
    return datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")


def _ns(seconds: float) -> int:
    return max(0, int(seconds * 1e9))


def _unknown(body: dict, known: set[str], where: str = "") -> None:
    extra = sorted(set(body) - known)
    if extra:
        raise bad(f"'{where}{extra[0]}' is not supported by this server", extra[0], "unsupported_parameter")


def keep_alive(body: dict) -> str | None:
    """The warning of a request's ``keep_alive`` (None when absent): a number of seconds or a
    duration ("5m", "1h30m", "-1", "0"), checked, with no effect on this server."""
    v = body.get("keep_alive")
    if v is None:
        return None
    ok = (isinstance(v, (int, float)) and not isinstance(v, bool)) or \
        (isinstance(v, str) and (_DURATION.fullmatch(v) is not None or re.fullmatch(r"-?\d+(\.\d+)?", v) is not None))
    if not ok:
        raise bad(f"'keep_alive' must be a number of seconds or a duration such as '5m', got {v!r}", "keep_alive")
    return KEEP_ALIVE_WARNING


def read_options(options: Any, stream: bool) -> tuple[dict[str, Any], int | None]:
    """(chat-completions fields, ``num_ctx``) of ollama's ``options``: sampling mapped, ``num_predict``
    as ``max_tokens`` (-1 and -2: up to the context), neutral values accepted, anything else a 400."""
    if options is None:
        options = {}
    if not isinstance(options, dict):
        raise bad("'options' must be an object", "options")
    out: dict[str, Any] = {"stream": stream}
    num_ctx = None
    for key, v in options.items():
        if v is None:
            continue
        if key in SAMPLING:
            out[SAMPLING[key]] = v
        elif key == "num_predict":
            if isinstance(v, bool) or not isinstance(v, int) or (v < 1 and v not in (-1, -2)):
                raise bad(f"'num_predict' must be an integer >= 1, or -1 / -2 (up to the context), got {v!r}",
                          "num_predict")
            if v > 0:
                out["max_tokens"] = v
        elif key == "num_ctx":
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise bad(f"'num_ctx' must be an integer >= 1, got {v!r}", "num_ctx")
            num_ctx = v
        elif key in NEUTRAL:
            if v != NEUTRAL[key] or isinstance(v, bool):
                raise bad(f"option '{key}' is not supported by this server (only {NEUTRAL[key]!r})", key,
                          "unsupported_parameter")
        else:
            raise bad(f"option '{key}' is not supported by this server", key, "unsupported_parameter")
    return out, num_ctx


def response_format(fmt: Any) -> dict | None:
    """ollama's ``format`` ("json" or a JSON schema) as OpenAI's ``response_format`` (strict: a
    keyword the engine cannot enforce is a 400, never ignored)."""
    if fmt is None or fmt == "":
        return None
    if fmt == "json":
        return {"type": "json_object"}
    if isinstance(fmt, dict):
        return {"type": "json_schema", "json_schema": {"name": "format", "schema": fmt, "strict": True}}
    raise bad(f"'format' must be \"json\" or a JSON schema object, got {fmt!r}", "format")


def _images(images: Any, where: str) -> list[dict]:
    """ollama's base64 ``images`` as OpenAI ``image_url`` parts (checked by `protocol.chat_messages`)."""
    if images is None:
        return []
    if not isinstance(images, list) or not all(isinstance(s, str) for s in images):
        raise bad(f"'{where}' must be a list of base64 strings", where)
    return [{"type": "image_url", "image_url": {"url": f"data:image/*;base64,{s}"}} for s in images]


def openai_messages(messages: Any) -> list[dict[str, Any]]:
    """ollama's messages in OpenAI's shape: ``images`` as image parts before the text, ``tool_calls``
    (arguments as objects) with ids, ``tool_name`` as the result's ``name``, ``thinking`` as
    ``reasoning_content``."""
    if not isinstance(messages, list):
        raise bad("'messages' must be a list", "messages")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad(f"{where} must be an object", where)
        _unknown(m, MESSAGE_FIELDS, f"{where}.")
        content = m.get("content", "")
        if content is None:
            content = ""
        if not isinstance(content, str):
            raise bad(f"{where}.content must be a string", f"{where}.content")
        images = _images(m.get("images"), f"{where}.images")
        msg: dict[str, Any] = {"role": m.get("role"),
                               "content": images + ([{"type": "text", "text": content}] if content else [])
                               if images else content}
        calls = m.get("tool_calls")
        if calls is not None:
            if not isinstance(calls, list):
                raise bad(f"{where}.tool_calls must be a list", f"{where}.tool_calls")
            msg["tool_calls"] = [{"id": f"call_{i}_{j}", "type": "function",
                                  "function": c.get("function") if isinstance(c, dict) else None}
                                 for j, c in enumerate(calls)]
        if m.get("tool_name") is not None:
            msg["name"] = m["tool_name"]
        if m.get("thinking"):
            msg["reasoning_content"] = m["thinking"]
        out.append(msg)
    return out


class Reply:
    """One reply's events as ollama's message pieces: text, thinking, and each tool call whole
    (its arguments an object) when its last piece arrives. A call cut by the token budget
    (``done_reason`` "length") has no arguments to give and is not sent."""

    def __init__(self):
        self.calls: dict[int, list[str]] = {}

    def piece(self, ev: Any) -> dict | None:
        e = ev.event if isinstance(ev, Part) else ev
        if isinstance(e, (Content, Piece)):
            return {"content": e.text} if e.text else None
        if isinstance(e, Reasoning):
            return {"content": "", "thinking": e.text}
        if isinstance(e, ToolCallStart):
            self.calls[e.index] = [e.name, ""]
        elif isinstance(e, ToolCallArgs):
            self.calls[e.index][1] += e.text
        elif isinstance(e, ToolCallEnd) and e.complete:
            name, args = self.calls[e.index]
            return {"content": "", "tool_calls": [{"function": {"name": name, "arguments": json.loads(args or "{}")}}]}
        return None

    def message(self, events: list) -> dict:
        msg: dict[str, Any] = {"role": "assistant", "content": ""}
        for ev in events:
            p = self.piece(ev)
            if p is None:
                continue
            msg["content"] += p["content"]
            if "thinking" in p:
                msg["thinking"] = msg.get("thinking", "") + p["thinking"]
            if "tool_calls" in p:
                msg.setdefault("tool_calls", []).extend(p["tool_calls"])
        return msg


class Ollama:
    """The handlers of ollama's API on a `Server`."""

    def __init__(self, srv: Any):
        self.srv = srv

    def route(self, path: str, handler: Callable[[Request], Awaitable[Response]], methods: list[str]) -> Route:
        """A route of the server's whose errors answer as ollama's do (``{"error": message}``)."""
        return self.srv.route(path, handler, methods, error=_error)

    # -- models ----------------------------------------------------------------------------
    def _model(self, body: dict, embedder: bool = False) -> str:
        served = self.srv.embedder_id if embedder else self.srv.model_id
        name = body.get("model")
        if not isinstance(name, str) or not name:
            raise bad("'model' must be a non-empty string", "model")
        if served is None or name not in (served, f"{served}:latest"):
            raise APIError(404, f"model '{name}' not found (this server has {served!r})", param="model")
        return name

    def _entries(self) -> list[tuple[str, Any, bool]]:
        srv = self.srv
        return [(srv.model_id, srv.model, False)] + ([(srv.embedder_id, srv.embedder, True)] if srv.embedder_id else [])

    def _card(self, name: str, obj: Any, embedder: bool) -> dict:
        """ollama's model entry: name, size and digest of its weight files, details."""
        src = Path(str(getattr(obj, "source", "") or ""))
        files = sorted(src.glob("*.safetensors")) if src.is_dir() else [src] if src.is_file() else []
        size = sum(f.stat().st_size for f in files)
        digest = hashlib.sha256(json.dumps([[f.name, f.stat().st_size] for f in files] + [name]).encode()).hexdigest()
        cfg = getattr(obj, "config", None)
        family = getattr(cfg, "family", None) or ("embeddinggemma" if embedder else "gemma")
        fmt = "gguf" if src.suffix == ".gguf" else "safetensors"
        return {"name": name, "model": name, "modified_at": datetime.fromtimestamp(self.srv.created, timezone.utc)
                .isoformat(), "size": size, "digest": digest,
                "details": {"parent_model": "", "format": fmt, "family": family, "families": [family]}}

    async def tags(self, request: Request) -> Response:
        return JSONResponse({"models": [self._card(*e) for e in self._entries()]})

    async def ps(self, request: Request) -> Response:
        """The loaded models: always both (nothing unloads); ``expires_at`` null."""
        return JSONResponse({"models": [{**self._card(*e), "expires_at": None, "size_vram": 0,
                                         "context_length": self.srv.context if not e[2] else None}
                                        for e in self._entries()]})

    async def version(self, request: Request) -> Response:
        from .. import __version__

        return JSONResponse({"version": OLLAMA_VERSION, "gemmalite": __version__})

    async def show(self, request: Request) -> Response:
        srv = self.srv
        body = await srv.read_json(request)
        _unknown(body, {"model", "name", "verbose"})
        if "model" not in body and "name" in body:
            body = {**body, "model": body["name"]}
        name = body.get("model")
        embedder = srv.embedder_id is not None and name in (srv.embedder_id, f"{srv.embedder_id}:latest")
        name = self._model(body, embedder)
        obj = srv.embedder if embedder else srv.model
        card = self._card(name, obj, embedder)
        family = card["details"]["family"]
        info: dict[str, Any] = {"general.architecture": family}
        if embedder:
            caps = ["embedding"]
            info[f"{family}.embedding_length"] = getattr(obj, "dim", None)
        else:
            caps = ["completion"] + (["vision"] if srv.model.vision is not None else []) + \
                (["audio"] if getattr(srv.model, "audio", None) is not None else []) + \
                (["tools", "thinking"] if srv.chat_format else [])
            cfg = srv.model.config
            info.update({f"{family}.context_length": srv.context, f"{family}.embedding_length": cfg.hidden_size,
                         f"{family}.block_count": cfg.num_hidden_layers, f"{family}.vocab_size": cfg.vocab_size})
        d = getattr(obj, "defaults", None)
        params = [f"{k} {getattr(d, k)}" for k in ("temperature", "top_k", "top_p", "min_p", "repetition_penalty")
                  if d is not None and getattr(d, k, None) is not None]
        template = getattr(srv.tokenizer, "chat_template", None) if not embedder else None
        return JSONResponse({"modelfile": "", "parameters": "\n".join(params), "template": template or "",
                             "details": card["details"], "model_info": info, "capabilities": caps,
                             "modified_at": card["modified_at"]})

    # -- generation ------------------------------------------------------------------------
    def _fields(self, body: dict) -> tuple[dict[str, Any], int | None]:
        """The chat-completions fields common to chat and generate: options, format, think, stream."""
        stream = opt_bool(body, "stream")
        fields, num_ctx = read_options(body.get("options"), True if stream is None else stream)
        rf = response_format(body.get("format"))
        if rf is not None:
            fields["response_format"] = rf
        think = body.get("think")
        if think is not None:
            if think not in (True, False) + THINK_LEVELS:
                raise bad(f"'think' must be true, false or one of {list(THINK_LEVELS)}, got {think!r}", "think")
            if think and not self.srv.chat_format:
                raise bad(f"the model {self.srv.model_id!r} does not support thinking", "think")
            if isinstance(think, str):
                fields["reasoning_effort"] = think
            else:
                fields["chat_template_kwargs"] = {"enable_thinking": think}
        return fields, num_ctx

    def _loaded(self, body: dict, key: str, warnings: list[str]) -> Response:
        """ollama's answer to a request with nothing to generate: the model is loaded."""
        out = {"model": body["model"], "created_at": _now(), "done": True, "done_reason": "load"}
        out[key] = {"role": "assistant", "content": ""} if key == "message" else ""
        return JSONResponse(out, headers=_headers(warnings))

    async def chat(self, request: Request) -> Response:
        srv, t0 = self.srv, time.perf_counter()
        body = await srv.read_json(request)
        _unknown(body, CHAT_FIELDS)
        self._model(body)
        warnings = [w for w in (keep_alive(body), srv.template_warning()) if w]
        fields, num_ctx = self._fields(body)
        if not body.get("messages"):
            return self._loaded(body, "message", warnings)
        oa = {**fields, "messages": openai_messages(body["messages"])}
        if body.get("tools") is not None:
            oa["tools"] = body["tools"]
        seqs, gen, _ = await srv.chat_request(oa, messages=chat_messages(oa, srv.limits))
        return await self._answer(request, body["model"], seqs, gen.stream, num_ctx, t0, "message", warnings)

    async def generate(self, request: Request) -> Response:
        srv, t0 = self.srv, time.perf_counter()
        body = await srv.read_json(request)
        _unknown(body, GENERATE_FIELDS)
        self._model(body)
        for key in ("suffix", "template"):
            if body.get(key):
                raise bad(f"'{key}' is not supported by this server", key, "unsupported_parameter")
        if body.get("context"):
            raise bad("'context' is not supported by this server: send the conversation to /api/chat", "context",
                      "unsupported_parameter")
        prompt, system = body.get("prompt") or "", body.get("system")
        if not isinstance(prompt, str):
            raise bad("'prompt' must be a string", "prompt")
        if system is not None and not isinstance(system, str):
            raise bad("'system' must be a string", "system")
        raw = bool(opt_bool(body, "raw"))
        warnings = [w for w in (keep_alive(body), None if raw else srv.template_warning()) if w]
        fields, num_ctx = self._fields(body)
        images = _images(body.get("images"), "images")
        if not prompt and not images:
            return self._loaded(body, "response", warnings)
        if raw:
            for key in ("images", "system", "think"):
                if body.get(key):
                    raise bad(f"'{key}' needs the chat template: it has no place in a raw prompt", key)
            gen = generation(fields, srv.limits)
            ids = await run_in_threadpool(srv.tokenizer.encode, prompt)
            seq = srv._prepare(ids, gen, chat=False)
            seqs = await run_in_threadpool(srv.choices, seq, fields, False)
        else:
            messages = ([{"role": "system", "content": system}] if system else []) + \
                [{"role": "user", "content": images + [{"type": "text", "text": prompt}] if images else prompt}]
            oa = {**fields, "messages": messages}
            seqs, gen, _ = await srv.chat_request(oa, messages=chat_messages(oa, srv.limits))
        return await self._answer(request, body["model"], seqs, gen.stream, num_ctx, t0, "response", warnings)

    async def _answer(self, request: Request, model: str, seqs: list[Sequence], stream: bool, num_ctx: int | None,
                      t0: float, key: str, warnings: list[str]) -> Response:
        """Relay ``seqs`` (one) as ollama's stream of chunks or one body; ``key``: "message" (chat) or
        "response" (generate). ``num_ctx`` bounds prompt + reply."""
        [seq] = seqs
        if num_ctx is not None:
            if len(seq.ids) >= num_ctx:
                raise bad(f"the prompt has {len(seq.ids)} tokens: more than num_ctx {num_ctx} allows", "num_ctx")
            seq.max_tokens = min(seq.max_tokens, num_ctx - len(seq.ids))
        reply, t_sub = Reply(), time.perf_counter()
        events = self.srv.relay(request, seqs)
        first: list[float] = []

        def chunk(piece: dict) -> dict:
            body = {"role": "assistant", **piece} if key == "message" else piece.get("content", "")
            out = {"model": model, "created_at": _now(), key: body, "done": False}
            if key == "response" and "thinking" in piece:
                out["thinking"] = piece["thinking"]
            return out

        def last(ev: Finish, piece: dict) -> dict:
            t_end = time.perf_counter()
            t_first = first[0] if first else t_end
            out = chunk(piece)
            out.update(done=True, done_reason="length" if ev.reason == "length" else "stop",
                       total_duration=_ns(t_end - t0), load_duration=0, prompt_eval_count=ev.prompt_tokens,
                       prompt_eval_duration=_ns(t_first - t_sub), eval_count=ev.completion_tokens,
                       eval_duration=_ns(t_end - t_first))
            return out

        if stream:
            async def lines() -> AsyncIterator[str]:
                try:
                    async for _, ev in events:
                        if not isinstance(ev, Finish):
                            if not first:
                                first.append(time.perf_counter())
                            p = reply.piece(ev)
                            if p is not None:
                                yield json.dumps(chunk(p), ensure_ascii=False) + "\n"
                            continue
                        try:
                            self.srv._check_finish(ev)
                        except APIError as e:
                            yield json.dumps({"error": e.message}) + "\n"
                            return
                        yield json.dumps(last(ev, {"content": ""}), ensure_ascii=False) + "\n"
                except ClientGone:
                    return
                finally:
                    await events.aclose()

            return StreamingResponse(lines(), media_type="application/x-ndjson", headers=_headers(warnings))
        return await self._collect(events, first, reply, last, key, warnings)

    async def _collect(self, events, first: list[float], reply: Reply, last, key: str, warnings: list[str]) -> Response:
        got, done = [], None
        try:
            async for _, ev in events:
                if isinstance(ev, Finish):
                    self.srv._check_finish(ev)
                    done = ev
                else:
                    if not first:
                        first.append(time.perf_counter())
                    got.append(ev)
        except ClientGone:
            return Response(status_code=499)
        finally:
            await events.aclose()
        piece = {k: v for k, v in reply.message(got).items() if k != "role"}
        return JSONResponse(last(done, piece), headers=_headers(warnings))

    # -- embeddings ------------------------------------------------------------------------
    async def _embed(self, body: dict, texts: list[str], truncate: bool) -> tuple[np.ndarray, int]:
        srv = self.srv
        if srv.embedder is None:
            raise APIError(404, f"model '{body.get('model')}' not found (this server has no embedding model)")
        if body.get("options"):
            raise bad("'options' is not supported by this server's embedder", "options", "unsupported_parameter")
        dims = body.get("dimensions")
        dim = getattr(srv.embedder, "dim", None)
        if dims is not None and (isinstance(dims, bool) or not isinstance(dims, int) or not 1 <= dims <= (dim or dims)):
            raise bad(f"'dimensions' must be an integer in [1, {dim}], got {dims!r}", "dimensions")
        kw = {"dimensions": dims} if dims is not None else {}
        async with srv._embed_lock:
            try:
                vecs = await run_in_threadpool(lambda: srv.embedder.embed(texts, truncate=truncate, **kw))
            except ValueError as e:
                raise bad(str(e), "input") from None
        srv.metrics.inc("gemmalite_embedding_inputs_total", len(texts))
        return np.asarray(vecs, dtype=np.float32), await run_in_threadpool(srv._count_tokens, texts)

    async def embed(self, request: Request) -> Response:
        t0 = time.perf_counter()
        body = await self.srv.read_json(request)
        _unknown(body, {"model", "input", "truncate", "dimensions", "options", "keep_alive"})
        self._model(body, embedder=True)
        warnings = [w for w in (keep_alive(body),) if w]
        x = body.get("input")
        texts = [x] if isinstance(x, str) else x
        if not isinstance(texts, list) or not texts or not all(isinstance(t, str) for t in texts):
            raise bad("'input' must be a string or a non-empty list of strings", "input")
        if len(texts) > self.srv.limits.max_inputs:
            raise bad(f"at most {self.srv.limits.max_inputs} inputs per request, got {len(texts)}", "input")
        truncate = opt_bool(body, "truncate")
        vecs, n = await self._embed(body, texts, True if truncate is None else truncate)
        return JSONResponse({"model": body["model"], "embeddings": vecs.tolist(),
                             "total_duration": _ns(time.perf_counter() - t0), "load_duration": 0,
                             "prompt_eval_count": n}, headers=_headers(warnings))

    async def embeddings(self, request: Request) -> Response:
        """The older endpoint: one ``prompt``, one ``embedding``."""
        body = await self.srv.read_json(request)
        _unknown(body, {"model", "prompt", "options", "keep_alive"})
        self._model(body, embedder=True)
        warnings = [w for w in (keep_alive(body),) if w]
        if not isinstance(body.get("prompt"), str) or not body["prompt"]:
            raise bad("'prompt' must be a non-empty string", "prompt")
        vecs, _ = await self._embed(body, [body["prompt"]], False)
        return JSONResponse({"embedding": vecs[0].tolist()}, headers=_headers(warnings))


def _error(e: APIError) -> Response:
    return JSONResponse({"error": e.message}, status_code=e.status, headers=e.headers)


def _headers(warnings: list[str]) -> dict[str, str]:
    return {WARNING_HEADER: "; ".join(warnings)} if warnings else {}
