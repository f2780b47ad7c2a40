"""OpenAI request bodies -> checked values, and the error shape every failure answers with.

Every check raises `APIError` with the status code and the OpenAI ``{"error": {...}}`` body;
nothing a client sends reaches the engine unchecked.
"""
from __future__ import annotations

import json
import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from ..chat import content
from ..chat.content import AUDIO_FORMATS, sniff_audio  # noqa: F401 (the API modules' names for them)
from ..runtime.generate import prompt_lookup_drafts


WARNING_HEADER = "X-Gemmalite-Warning"  # what a request is told beside its answer (an option with no effect...)


class APIError(Exception):
    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", code: str | None = None,
                 param: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.code, self.param = status, message, type, code, param
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class ClientGone(Exception):
    """The client closed the request: nobody reads the rest (`Server.relay` has cancelled its work)."""


def bad(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


DEFAULT_MAX_TOKENS = 2048  # the reply cap of a request that sets no max_tokens (`serve --default-max-tokens`)
TRANSCRIPTION_TOKENS_PER_SECOND = 12  # a transcription's reply cap: this many tokens a second of audio (speech
TRANSCRIPTION_TOKENS_SLACK = 32  # runs ~3-6 tokens a second, ~10 in the densest scripts), plus these


@dataclass
class Limits:
    """What one request may ask for (the server's command line sets them)."""

    max_body_bytes: int = 4 << 20
    max_json_depth: int = 64  # nesting of a JSON body's arrays and objects
    max_tokens: int | None = None  # the most a request may ask for (None: up to the context)
    default_max_tokens: int | None = DEFAULT_MAX_TOKENS  # for a request that does not say (None: up to the context)
    max_messages: int = 1000  # messages of one conversation
    max_inputs: int = 256  # embedding inputs per request
    max_stop: int = 4
    max_stop_chars: int = 256
    max_images: int = 8  # image_url parts per request
    max_image_bytes: int = 3 << 20  # one decoded picture (its base64 must also fit in the body)
    max_image_pixels: int = 1 << 25  # width x height, read from the header before decoding
    max_audio: int = 4  # audio clips per request (input_audio parts, a transcription's file)
    max_audio_bytes: int = 3 << 20  # one encoded clip (its base64 must also fit in the body)
    max_audio_seconds: float = 120.0  # one clip's length, read from the header before decoding


def parse_json(body: bytes, limits: Limits) -> dict[str, Any]:
    """A request body as a JSON object: valid UTF-8 JSON, nested at most ``max_json_depth`` deep,
    every string text (a lone surrogate escape such as ``"\\ud800"`` is not); else a 400 naming why."""
    try:
        data = json.loads(body)
        problem = _json_problem(data, limits.max_json_depth) if isinstance(data, dict) else None
    except RecursionError:  # deeper than the parser goes
        data, problem = {}, "deep"
    except (ValueError, UnicodeDecodeError) as e:
        raise bad(f"request body is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise bad("request body must be a JSON object")
    if problem == "deep":
        raise bad(f"request body is nested more than {limits.max_json_depth} levels deep", code="json_too_deep")
    if problem is not None:
        raise bad(f"request body holds a string that is not text: {problem}", code="invalid_text")
    return data


def _json_problem(data: Any, max_depth: int) -> str | None:
    """"deep" if ``data`` nests deeper than ``max_depth``; a description of its first string (key
    or value) holding a lone surrogate; else None. Iterative: no recursion on hostile input."""
    stack: list[tuple[Any, int]] = [(data, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > max_depth:
            return "deep"
        items = node.items() if isinstance(node, dict) else enumerate(node)
        for k, v in items:
            for x in (k, v):
                if isinstance(x, str) and not x.isascii():
                    try:
                        x.encode("utf-8")
                    except UnicodeEncodeError as e:
                        return f"a lone surrogate {x[e.start]!r} at position {e.start} of {x[:40]!r}"
            if isinstance(v, (dict, list)):
                stack.append((v, depth + 1))
    return None


def check_messages(messages: list, limits: Limits, param: str = "messages") -> None:
    """A conversation's length: at most ``max_messages`` messages."""
    if len(messages) > limits.max_messages:
        raise bad(f"at most {limits.max_messages} messages per request, got {len(messages)}", param,
                  "too_many_messages")


# -- typed field readers -------------------------------------------------------------------
def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def opt_int(body: dict, key: str, lo: int, hi: int | None = None) -> int | None:
    v = body.get(key)
    if v is None:
        return None
    if not _is_int(v) or v < lo or (hi is not None and v > hi):
        rng = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise bad(f"'{key}' must be an integer {rng}, got {v!r}", key)
    return v


def opt_float(body: dict, key: str, lo: float, hi: float, *, lo_open: bool = False) -> float | None:
    v = body.get(key)
    if v is None:
        return None
    ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
    if not ok or v > hi or v < lo or (lo_open and v == lo):
        raise bad(f"'{key}' must be a number in {'(' if lo_open else '['}{lo}, {hi}], got {v!r}", key)
    return float(v)


def opt_bool(body: dict, key: str) -> bool | None:
    v = body.get(key)
    if v is not None and not isinstance(v, bool):
        raise bad(f"'{key}' must be a boolean, got {v!r}", key)
    return v


def require_model(body: dict, served: str | None, what: str) -> str:
    name = body.get("model")
    if not isinstance(name, str) or not name:
        raise bad("'model' must be a non-empty string", "model")
    if name != served:
        avail = f"this server has {served!r}" if served else f"this server has no {what} model"
        raise APIError(404, f"The model {name!r} does not exist: {avail}", param="model", code="model_not_found")
    return name


def reject_unsupported(body: dict, keys: dict[str, Any]) -> None:
    """Options we do not implement: allowed only at their neutral value, never silently ignored."""
    for key, neutral in keys.items():
        v = body.get(key)
        if v is not None and v != neutral and not (isinstance(neutral, tuple) and v in neutral):
            raise bad(f"'{key}' is not supported by this server", key, "unsupported_parameter")


# -- generation requests --------------------------------------------------------------------
@dataclass
class Generation:
    """The checked sampling part of a chat or completion request."""

    max_tokens: int | None
    stream: bool
    include_usage: bool
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False  # llama.cpp's extension: generate through end-of-sequence tokens (benchmarks)
    sampling: dict[str, Any] = field(default_factory=dict)  # Model._params keywords
    prompt_lookup: int | None = None  # extension: prompt-lookup drafts per step (None: the server's default)
    prediction: str | None = None  # OpenAI's Predicted Outputs: text the reply is expected to repeat


UNSUPPORTED_GEN = {"frequency_penalty": 0, "presence_penalty": 0,  # n, logprobs, response_format: server.constraints
                   "logit_bias": ({},), "functions": ([],), "best_of": 1, "echo": False, "suffix": ""}
CHAT_ONLY = {"tools": ([],), "tool_choice": "none"}  # (chat completions read them: server.chat_format)


def generation(body: dict, limits: Limits) -> Generation:
    reject_unsupported(body, UNSUPPORTED_GEN)
    mt = opt_int(body, "max_completion_tokens", 1)
    mt = opt_int(body, "max_tokens", 1) if mt is None else mt
    if mt is not None and limits.max_tokens is not None and mt > limits.max_tokens:
        raise bad(f"max_tokens is at most {limits.max_tokens} on this server, got {mt}", "max_tokens")
    stream = bool(opt_bool(body, "stream"))
    so = body.get("stream_options")
    if so is not None and not isinstance(so, dict):
        raise bad("'stream_options' must be an object", "stream_options")
    include_usage = bool(opt_bool(so or {}, "include_usage"))
    stop = body.get("stop")
    stop = [stop] if isinstance(stop, str) else stop
    if stop is not None and (not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop)):
        raise bad("'stop' must be a non-empty string or a list of them", "stop")
    stop = stop or []
    if len(stop) > limits.max_stop or any(len(s) > limits.max_stop_chars for s in stop):
        raise bad(f"'stop' takes at most {limits.max_stop} strings of {limits.max_stop_chars} characters", "stop")
    sampling = dict(temperature=opt_float(body, "temperature", 0.0, 2.0), top_p=opt_float(body, "top_p", 0.0, 1.0, lo_open=True),
                    top_k=opt_int(body, "top_k", 0), min_p=opt_float(body, "min_p", 0.0, 1.0),
                    repetition_penalty=opt_float(body, "repetition_penalty", 0.0, 10.0, lo_open=True),
                    seed=opt_int(body, "seed", -(2**63), 2**64 - 1))
    if sampling["seed"] is not None and sampling["seed"] < 0:
        sampling["seed"] = sampling["seed"] % 2**64  # numpy seeds are non-negative
    return Generation(mt, stream, include_usage, stop, bool(opt_bool(body, "ignore_eos")), sampling,
                      prompt_lookup(body), prediction_text(body))


def prompt_lookup(body: dict) -> int | None:
    """``prompt_lookup``: true (the default draft count), false, or a count of drafts per step, read
    as `Model.generate` reads it; None when absent (the server's default applies)."""
    v = body.get("prompt_lookup")
    if v is None:
        return None
    try:
        return prompt_lookup_drafts(v)
    except ValueError as e:
        raise bad(f"'prompt_lookup' must be a boolean or an integer >= 0: {e}", "prompt_lookup") from None


def prediction_text(body: dict) -> str | None:
    """OpenAI's ``prediction``: ``{"type": "content", "content": text or [{"type": "text", "text": ...}]}``."""
    p = body.get("prediction")
    if p is None:
        return None
    content = p.get("content") if isinstance(p, dict) and p.get("type") == "content" else None
    if isinstance(content, list) and all(isinstance(c, dict) and c.get("type") == "text" and isinstance(c.get("text"), str)
                                         for c in content):
        content = "".join(c["text"] for c in content)
    if not isinstance(content, str):
        raise bad("'prediction' must be {\"type\": \"content\", \"content\": a string or a list of text parts}",
                  "prediction")
    return content


CHAT_ROLES = {"system", "developer", "user", "assistant", "tool"}


def chat_messages(body: dict, limits: Limits) -> list[dict[str, Any]]:
    """The conversation as the chat template takes it: roles, and content as one string, or as
    text and ``{"type": "image", "image": bytes}`` parts when it carries pictures (data URLs)."""
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise bad("'messages' must be a non-empty list", "messages")
    check_messages(msgs, limits)
    out, images, clips = [], 0, 0
    for i, m in enumerate(msgs):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad(f"{where} must be an object", where)
        role = m.get("role")
        if role not in CHAT_ROLES:
            raise bad(f"{where}.role must be one of {sorted(CHAT_ROLES)}, got {role!r}", f"{where}.role")
        content = _content(m.get("content"), role, where, limits)
        images += sum(1 for p in content if p["type"] == "image") if isinstance(content, list) else 0
        if images > limits.max_images:
            raise bad(f"at most {limits.max_images} images per request", f"{where}.content")
        clips += sum(1 for p in content if p["type"] == "audio") if isinstance(content, list) else 0
        if clips > limits.max_audio:
            raise bad(f"at most {limits.max_audio} audio clips per request", f"{where}.content")
        msg = {"role": "system" if role == "developer" else role, "content": content}
        for key in ("tool_calls", "tool_call_id", "name", "reasoning_content"):  # (checked by chat.history)
            if m.get(key) is not None:
                msg[key] = m[key]
        out.append(msg)
    return out


def _content(c: Any, role: str, where: str, limits: Limits) -> str | list[dict[str, Any]]:
    if isinstance(c, str):
        return c
    if c is None and role == "assistant":
        return ""
    if not isinstance(c, list):
        raise bad(f"{where}.content must be a string or a list of content parts", f"{where}.content")
    with part_errors():
        return content.content(c, f"{where}.content", max_image_bytes=limits.max_image_bytes,
                               max_audio_bytes=limits.max_audio_bytes, join_text=True)


@contextmanager
def part_errors() -> Iterator[None]:
    """`chat.content`'s errors as 400s naming the part, with its code."""
    try:
        yield
    except content.PartError as e:
        raise bad(str(e), e.where, e.code) from None


def inline_bytes(payload: str | bytes, where: str, limit: int, noun: str, encoded: str, kind: str) -> bytes:
    """Media sent inline, size-checked (`chat.content.inline_bytes`); errors are 400s."""
    with part_errors():
        return content.inline_bytes(payload, where, limit, noun, encoded, kind)


def image_bytes(image_url: Any, where: str, limits: Limits) -> bytes:
    """The picture of an ``image_url`` part (`chat.content.image_url_bytes`); errors are 400s."""
    with part_errors():
        return content.image_url_bytes(image_url, where, limits.max_image_bytes)


def audio_bytes(input_audio: Any, where: str, limits: Limits) -> bytes:
    """The clip of an ``input_audio`` part (`chat.content.input_audio_bytes`); errors are 400s."""
    with part_errors():
        return content.input_audio_bytes(input_audio, where, limits.max_audio_bytes)


def clip_bytes(payload: str | bytes, where: str, limits: Limits) -> bytes:
    """Encoded audio within ``max_audio_bytes``, of a container we decode (`chat.content.clip_bytes`)."""
    with part_errors():
        return content.clip_bytes(payload, where, limits.max_audio_bytes)


def completion_prompt(body: dict, vocab: int) -> str | list[int]:
    """One prompt: a string, or token ids (also as a one-element list)."""
    p = body.get("prompt")
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
        p = p[0]
    if isinstance(p, str):
        return p
    if isinstance(p, list) and p and all(_is_int(t) for t in p):
        if any(t < 0 or t >= vocab for t in p):
            raise bad(f"token ids must be in [0, {vocab})", "prompt")
        return p
    raise bad("'prompt' must be a string or a non-empty list of token ids (one prompt per request)", "prompt")


def embedding_inputs(body: dict, limits: Limits) -> tuple[list[Any], bool]:
    """(inputs, are_token_ids). Extension: an input may be a list of chat content parts (text,
    image_url, input_audio), which is ONE input of those parts interleaved (`Embedder.embed`'s
    list of parts): the parts become texts, picture bytes and ``{"audio": bytes}``."""
    x = body.get("input")
    if isinstance(x, str):
        return [x], False
    if isinstance(x, list) and x:
        if len(x) > limits.max_inputs:
            raise bad(f"at most {limits.max_inputs} inputs per request, got {len(x)}", "input")
        if all(isinstance(s, str) for s in x):
            return x, False
        if all(_is_int(t) for t in x):
            return [x], True
        if all(isinstance(s, list) and s and all(_is_int(t) for t in s) for s in x):
            return x, True
        if all(isinstance(s, str) or (isinstance(s, list) and s and all(isinstance(p, dict) for p in s)) for s in x):
            return _embedding_parts(x, limits), False
    raise bad("'input' must be a string, a list of strings, token ids (a list or a list of lists), or a list of "
              "inputs each a string or a list of content parts", "input")


def _embedding_parts(x: list, limits: Limits) -> list[Any]:
    out: list[Any] = []
    images = clips = 0
    for i, item in enumerate(x):
        if isinstance(item, str):
            out.append(item)
            continue
        parts: list[Any] = []
        for j, part in enumerate(item):
            where, kind = f"input[{i}][{j}]", part.get("type")
            if kind == "text" and isinstance(part.get("text"), str) and part["text"]:
                parts.append(part["text"])
            elif kind == "image_url":
                parts.append(image_bytes(part.get("image_url"), where, limits))
                images += 1
            elif kind == "input_audio":
                parts.append({"audio": audio_bytes(part.get("input_audio"), where, limits)})
                clips += 1
            else:
                raise bad(f"{where} must be a text, image_url or input_audio content part", "input")
        if images > limits.max_images or clips > limits.max_audio:
            raise bad(f"at most {limits.max_images} images and {limits.max_audio} audio clips per request", "input")
        out.append(parts)
    return out
