"""OpenAI request bodies -> checked values, and the error shape every failure answers with.

Every check raises `APIError` with the status code and the OpenAI ``{"error": {...}}`` body;
nothing a client sends reaches the engine unchecked.
"""
from __future__ import annotations

import base64
import binascii
import math
from dataclasses import dataclass, field
from typing import Any

from ..runtime.generate import prompt_lookup_drafts


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


@dataclass
class Limits:
    """What one request may ask for (the server's command line sets them)."""

    max_body_bytes: int = 4 << 20
    max_tokens: int | None = None  # None: up to the context
    max_inputs: int = 256  # embedding inputs per request
    max_stop: int = 4
    max_stop_chars: int = 256
    max_images: int = 8  # image_url parts per request
    max_image_bytes: int = 3 << 20  # one decoded picture (its base64 must also fit in the body)
    max_image_pixels: int = 1 << 25  # width x height, read from the header before decoding
    max_audio: int = 4  # audio clips per request (input_audio parts, a transcription's file)
    max_audio_bytes: int = 3 << 20  # one encoded clip (its base64 must also fit in the body)
    max_audio_seconds: float = 120.0  # one clip's length, read from the header before decoding


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
    parts: list[dict[str, Any]] = []
    for j, part in enumerate(c):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str):
            parts.append({"type": "text", "text": part["text"]})
        elif kind == "image_url":
            parts.append({"type": "image", "image": image_bytes(part.get("image_url"), f"{where}.content[{j}]", limits)})
        elif kind == "input_audio":
            parts.append({"type": "audio", "audio": audio_bytes(part.get("input_audio"), f"{where}.content[{j}]", limits)})
        elif kind == "file":
            raise bad(f"{where}.content[{j}]: file parts are not supported by this server", f"{where}.content")
        else:
            raise bad(f"{where}.content[{j}] must be {{'type': 'text', 'text': str}}, "
                      "{'type': 'image_url', 'image_url': {'url': 'data:...'}} or "
                      "{'type': 'input_audio', 'input_audio': {'data': base64, 'format': 'wav'}}", f"{where}.content")
    if all(p["type"] == "text" for p in parts):
        return "\n".join(p["text"] for p in parts)
    return parts


def image_bytes(image_url: Any, where: str, limits: Limits) -> bytes:
    """The picture of an ``image_url`` part: a base64 data URL, size-checked before and after
    decoding. Web addresses are refused: this server never fetches anything."""
    url = image_url.get("url") if isinstance(image_url, dict) else image_url
    if not isinstance(url, str):
        raise bad(f"{where}.image_url must be {{'url': 'data:image/...;base64,...'}}", where)
    if url.startswith(("http://", "https://")):
        raise bad(f"{where}: image URLs are not fetched by this server; send the picture inline as a data URL "
                  "(data:image/png;base64,...)", where, "image_url_not_supported")
    head, comma, payload = url.partition(",")
    if not (url.startswith("data:") and comma and head.endswith(";base64")):
        raise bad(f"{where}: the image URL must be a base64 data URL (data:image/png;base64,...)", where, "invalid_image")
    return inline_bytes(payload, where, limits.max_image_bytes, "the picture", "the data URL", "image")


def inline_bytes(payload: str | bytes, where: str, limit: int, noun: str, encoded: str, kind: str) -> bytes:
    """Media sent inline (base64 text, or the bytes themselves), size-checked before decoding (so
    a huge body is refused unread) and after; errors name ``noun`` / ``encoded`` and carry the codes
    ``{kind}_too_large`` / ``invalid_{kind}``."""
    too_big = bad(f"{where}: {noun} is larger than the {limit} bytes allowed", where, f"{kind}_too_large")
    if isinstance(payload, str):
        if len(payload) > 4 * (limit // 3 + 1):
            raise too_big
        try:
            payload = base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            raise bad(f"{where}: {encoded} is not valid base64", where, f"invalid_{kind}") from None
    if not payload:
        raise bad(f"{where}: {noun} is empty", where, f"invalid_{kind}")
    if len(payload) > limit:
        raise too_big
    return payload


AUDIO_FORMATS = ("wav", "mp3", "flac", "ogg")


def sniff_audio(data: bytes) -> str | None:
    """The container of encoded audio from its first bytes (None: none we decode). The client's
    ``format`` is not trusted: the decoder reads what the bytes are."""
    if data[:4] == b"RIFF" and data[8:12] == b"WAVE":
        return "wav"
    if data[:4] == b"fLaC":
        return "flac"
    if data[:4] == b"OggS":
        return "ogg"
    if data[:3] == b"ID3" or (len(data) > 1 and data[0] == 0xFF and data[1] & 0xE0 == 0xE0):
        return "mp3"
    return None


def audio_bytes(input_audio: Any, where: str, limits: Limits) -> bytes:
    """The clip of an ``input_audio`` part (``{"data": base64, "format": "wav" | "mp3" | ...}``),
    size-checked before and after decoding, its container sniffed from the bytes. Addresses are
    refused: this server never fetches anything."""
    if not isinstance(input_audio, dict) or not isinstance(input_audio.get("data"), str):
        raise bad(f"{where}.input_audio must be {{'data': base64 string, 'format': 'wav' | 'mp3'}}", where, "invalid_audio")
    fmt, payload = input_audio.get("format"), input_audio["data"]
    if fmt is not None and fmt not in AUDIO_FORMATS:
        raise bad(f"{where}.input_audio.format must be one of {list(AUDIO_FORMATS)}, got {fmt!r}", where, "invalid_audio")
    if payload.startswith(("http://", "https://", "file:")):
        raise bad(f"{where}: audio URLs are not fetched by this server; send the clip inline as base64", where,
                  "audio_url_not_supported")
    if payload.startswith("data:"):  # a data URL where the bare base64 belongs: take its payload
        head, comma, payload = payload.partition(",")
        if not (comma and head.endswith(";base64")):
            raise bad(f"{where}: input_audio.data must be base64", where, "invalid_audio")
    return clip_bytes(payload, where, limits)


def clip_bytes(payload: str | bytes, where: str, limits: Limits) -> bytes:
    """Encoded audio (base64 text, or the bytes themselves), within ``max_audio_bytes`` and of a
    container we decode (sniffed from the first bytes)."""
    payload = inline_bytes(payload, where, limits.max_audio_bytes, "the audio clip", "the audio data", "audio")
    if sniff_audio(payload) is None:
        raise bad(f"{where}: not an audio file this server decodes (WAV, FLAC, OGG or MP3, sniffed from its first bytes)",
                  where, "invalid_audio")
    return payload


# -- audio transcriptions ---------------------------------------------------------------------
@dataclass
class Transcription:
    """The checked fields of a ``/v1/audio/transcriptions`` form (besides ``file`` and ``model``)."""

    language: str | None
    prompt: str | None
    response_format: str  # "json" or "text"
    temperature: float


TRANSCRIPTION_FIELDS = ("file", "model", "prompt", "language", "response_format", "temperature")
LANGUAGES = {"en": "English", "fr": "French", "de": "German", "es": "Spanish", "it": "Italian", "pt": "Portuguese",
             "nl": "Dutch", "ru": "Russian", "pl": "Polish", "tr": "Turkish", "ar": "Arabic", "hi": "Hindi",
             "ja": "Japanese", "ko": "Korean", "zh": "Chinese", "sv": "Swedish", "uk": "Ukrainian", "id": "Indonesian",
             "vi": "Vietnamese", "th": "Thai"}
MAX_TRANSCRIPTION_PROMPT = 2000


def transcription_options(form: dict[str, Any]) -> Transcription:
    unknown = sorted(k for k in form if k not in TRANSCRIPTION_FIELDS)
    if unknown:
        raise bad(f"'{unknown[0]}' is not supported by this server", unknown[0], "unsupported_parameter")
    for key in TRANSCRIPTION_FIELDS[1:]:
        if key in form and not isinstance(form[key], str):
            raise bad(f"'{key}' must be a form field, not a file", key)
    fmt = form.get("response_format") or "json"
    if fmt not in ("json", "text"):
        raise bad(f"'response_format' must be 'json' or 'text' on this server, got {fmt!r}", "response_format",
                  "unsupported_parameter")
    lang = form.get("language") or None
    if lang is not None and not (2 <= len(lang) <= 3 and lang.isascii() and lang.isalpha()):
        raise bad(f"'language' must be an ISO-639-1 code such as 'en', got {lang!r}", "language")
    prompt = form.get("prompt") or None
    if prompt is not None and len(prompt) > MAX_TRANSCRIPTION_PROMPT:
        raise bad(f"'prompt' takes at most {MAX_TRANSCRIPTION_PROMPT} characters", "prompt")
    try:
        temperature = float(form.get("temperature") or 0.0)
    except ValueError:
        temperature = math.nan
    if not 0.0 <= temperature <= 1.0:
        raise bad(f"'temperature' must be a number in [0, 1], got {form.get('temperature')!r}", "temperature")
    return Transcription(lang.lower() if lang else None, prompt, fmt, temperature)


def transcription_messages(clip: bytes, language: str | None = None, prompt: str | None = None) -> list[dict[str, Any]]:
    """The chat turn a transcription request is answered with: the clip, then Google's
    speech-recognition instruction for Gemma 4.

    Wording and order from the Gemma 4 model card (huggingface.co/google/gemma-4-E2B-it):
    with a language, its "Best Practices / Audio" ASR prompt ("Transcribe the following speech
    segment in {LANGUAGE} into {LANGUAGE} text." then a blank line and the two formatting rules);
    without one, the instruction of its "Code for processing Audio" example ("... in its original
    language." and the same rules, joined by a space, not a blank line); the audio before the text, as
    that example places it ("Prompt - add audio before text") and as its "Modality order" practice
    says. The line for OpenAI's ``prompt`` field is this server's own (Google documents no wording
    for a transcription hint)."""
    name = LANGUAGES.get(language, language) if language else None
    rules = ("Follow these specific instructions for formatting the answer:\n"
             "* Only output the transcription, with no newlines.\n"
             "* When transcribing numbers, write the digits, i.e. write 1.7 and not one point seven, "
             "and write 3 instead of three.")
    text = (f"Transcribe the following speech segment in {name} into {name} text.\n\n" + rules if name else
            "Transcribe the following speech segment in its original language. " + rules)
    if prompt:
        text += f"\n* The speech may continue this text or use its words: {prompt}"
    return [{"role": "user", "content": [{"type": "audio", "audio": clip}, {"type": "text", "text": text}]}]


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
