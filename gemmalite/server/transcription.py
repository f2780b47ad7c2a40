"""OpenAI's audio endpoints, Whisper-complete: ``/v1/audio/transcriptions`` and
``/v1/audio/translations`` (multipart forms), answered by the chat model with Google's speech
instructions for Gemma 4 (`transcription_messages`, `translation_messages`).

A clip is decoded once and cut into consecutive windows of `WINDOW_S` seconds (the audio tower's
30 s); each window is its own request to the scheduler (they run batched), and its reply is one
segment, from the window's start to its end. ``response_format``: ``json`` / ``text`` (the
segments' texts joined by a space), ``verbose_json`` (language, duration, segments with their
token ids and mean log-probability), ``srt``, ``vtt``; ``stream=true`` sends the text as
server-sent ``transcript.text.delta`` events then ``transcript.text.done`` (gpt-4o-transcribe's
stream), the windows in order.
"""
from __future__ import annotations

import json
import math
import zlib
from dataclasses import dataclass
from typing import Any, AsyncIterator

import numpy as np
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from ..audio.decode import SAMPLE_RATE, load_audio
from ..audio.prompt import TOKENS_PER_SECOND
from ..errors import AudioError
from .protocol import (TRANSCRIPTION_TOKENS_PER_SECOND, TRANSCRIPTION_TOKENS_SLACK, WARNING_HEADER, APIError, ClientGone,
                       Generation, bad, clip_bytes, require_model)
from .scheduler import Finish, Piece

WINDOW_S = 30.0  # seconds of audio per segment (the audio tower's window)
MIN_TAIL_S = 0.1  # a shorter tail joins the window before it
FORMATS = ("json", "text", "verbose_json", "srt", "vtt")
TRANSCRIPTION_FIELDS = ("file", "model", "prompt", "language", "response_format", "temperature",
                        "timestamp_granularities[]", "stream")
TRANSLATION_FIELDS = ("file", "model", "prompt", "response_format", "temperature")
LANGUAGES = {"en": "English", "fr": "French", "de": "German", "es": "Spanish", "it": "Italian", "pt": "Portuguese",
             "nl": "Dutch", "ru": "Russian", "pl": "Polish", "tr": "Turkish", "ar": "Arabic", "hi": "Hindi",
             "ja": "Japanese", "ko": "Korean", "zh": "Chinese", "sv": "Swedish", "uk": "Ukrainian", "id": "Indonesian",
             "vi": "Vietnamese", "th": "Thai"}
MAX_TRANSCRIPTION_PROMPT = 2000
TARGET = "English"  # OpenAI's translations are into English


def audio_routes(srv: Any) -> list[Route]:
    """The audio routes on ``srv`` (the app's `Server`), answering errors in OpenAI's shape."""
    async def transcriptions(request: Request) -> Response:
        return await transcribe(srv, request, translate=False)

    async def translations(request: Request) -> Response:
        return await transcribe(srv, request, translate=True)

    return [srv.route("/v1/audio/transcriptions", transcriptions, ["POST"]),
            srv.route("/v1/audio/translations", translations, ["POST"])]


@dataclass
class Transcription:
    """The checked fields of a transcription or translation form (besides ``file`` and ``model``)."""

    language: str | None
    prompt: str | None
    response_format: str  # one of FORMATS
    temperature: float
    stream: bool = False


def transcription_options(form: dict[str, Any], translate: bool = False) -> Transcription:
    fields = TRANSLATION_FIELDS if translate else TRANSCRIPTION_FIELDS
    unknown = sorted(k for k in form if k not in fields)
    if unknown:
        raise bad(f"'{unknown[0]}' is not supported by this server", unknown[0], "unsupported_parameter")
    for key in fields[1:]:
        if key in form and not isinstance(form[key], str):
            raise bad(f"'{key}' must be a form field, not a file", key)
    fmt = form.get("response_format") or "json"
    if fmt not in FORMATS:
        raise bad(f"'response_format' must be one of {list(FORMATS)}, got {fmt!r}", "response_format")
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
    gran = form.get("timestamp_granularities[]")
    if gran is not None:
        if gran != "segment":
            raise bad(f"'timestamp_granularities[]' takes only 'segment' on this server, got {gran!r}",
                      "timestamp_granularities[]", "unsupported_parameter")
        if fmt != "verbose_json":
            raise bad("'timestamp_granularities[]' needs response_format 'verbose_json'", "timestamp_granularities[]")
    stream = form.get("stream") or "false"
    if stream not in ("true", "false"):
        raise bad(f"'stream' must be 'true' or 'false', got {stream!r}", "stream")
    if stream == "true" and fmt not in ("json", "text"):
        raise bad(f"'stream' takes response_format 'json' or 'text', got {fmt!r}", "stream")
    return Transcription(lang.lower() if lang else None, prompt, fmt, temperature, stream == "true")


RULES = ("Follow these specific instructions for formatting the answer:\n"
         "* Only output the transcription, with no newlines.\n"
         "* When transcribing numbers, write the digits, i.e. write 1.7 and not one point seven, "
         "and write 3 instead of three.")


def transcription_messages(clip: Any, language: str | None = None, prompt: str | None = None) -> list[dict[str, Any]]:
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
    text = (f"Transcribe the following speech segment in {name} into {name} text.\n\n" + RULES if name else
            "Transcribe the following speech segment in its original language. " + RULES)
    if prompt:
        text += f"\n* The speech may continue this text or use its words: {prompt}"
    return [{"role": "user", "content": [{"type": "audio", "audio": clip}, {"type": "text", "text": text}]}]


def translation_messages(clip: Any, prompt: str | None = None) -> list[dict[str, Any]]:
    """The chat turn a translation request is answered with: the clip, then the Gemma 4 model
    card's speech-translation (AST) instruction into English ("Transcribe the following speech
    segment in {SOURCE_LANGUAGE}, then translate it into {TARGET_LANGUAGE}." a newline, then its
    formatting sentence), the source language "its original language" (OpenAI's translations
    name none); the reply's translation follows its ``English: `` line (`translation_text`)."""
    src = "its original language"
    text = (f"Transcribe the following speech segment in {src}, then translate it into {TARGET}.\n"
            f"When formatting the answer, first output the transcription in {src}, then one newline, then output "
            f"the string '{TARGET}: ', then the translation in {TARGET}.")
    if prompt:
        text += f"\nThe speech may continue this text or use its words: {prompt}"
    return [{"role": "user", "content": [{"type": "audio", "audio": clip}, {"type": "text", "text": text}]}]


def translation_text(reply: str) -> str | None:
    """The translation in an AST reply: what follows its last ``English: `` line start (None: no such line)."""
    marker = f"{TARGET}: "
    at = reply.rfind("\n" + marker)
    if at >= 0:
        return reply[at + 1 + len(marker):].strip()
    return reply[len(marker):].strip() if reply.startswith(marker) else None


def windows(samples: np.ndarray, seconds: float | None = None) -> list[tuple[int, np.ndarray]]:
    """(first sample, samples) of each consecutive window of ``seconds`` (default `WINDOW_S`);
    a tail shorter than `MIN_TAIL_S` joins the window before it."""
    size = int(round((seconds or WINDOW_S) * SAMPLE_RATE))
    starts = list(range(0, max(len(samples), 1), size))
    if len(starts) > 1 and len(samples) - starts[-1] < MIN_TAIL_S * SAMPLE_RATE:
        starts.pop()
    ends = starts[1:] + [len(samples)]
    return [(a, samples[a:b]) for a, b in zip(starts, ends)]


def _clock(t: float, sep: str) -> str:
    ms = int(round(t * 1000))
    return f"{ms // 3600000:02d}:{ms // 60000 % 60:02d}:{ms // 1000 % 60:02d}{sep}{ms % 1000:03d}"


def subtitles(segments: list[dict], fmt: str) -> str:
    """The segments as SubRip (``srt``) or WebVTT (``vtt``) cues."""
    if fmt == "srt":
        return "".join(f"{i + 1}\n{_clock(s['start'], ',')} --> {_clock(s['end'], ',')}\n{s['text'].strip()}\n\n"
                       for i, s in enumerate(segments))
    return "WEBVTT\n\n" + "".join(f"{_clock(s['start'], '.')} --> {_clock(s['end'], '.')}\n{s['text'].strip()}\n\n"
                                  for s in segments)


def _segment(i: int, first: int, n: int, text: str, lps: list, temperature: float) -> dict[str, Any]:
    raw = text.encode()
    return {"id": i, "seek": int(round(first / SAMPLE_RATE * 100)), "start": first / SAMPLE_RATE,
            "end": (first + n) / SAMPLE_RATE, "text": text, "tokens": [e.token for e in lps],
            "temperature": temperature, "avg_logprob": float(np.mean([e.logprob for e in lps])) if lps else 0.0,
            "compression_ratio": len(raw) / len(zlib.compress(raw)) if raw else 0.0, "no_speech_prob": None}


async def transcribe(srv: Any, request: Request, translate: bool) -> Response:
    """One transcription (or translation) request: the clip's windows through the scheduler."""
    form = await srv.read_form(request)
    require_model(form, srv.model_id, "translation" if translate else "transcription")
    opts = transcription_options(form, translate)
    clip = form.get("file")
    if not isinstance(clip, bytes):
        raise bad("'file' must be an uploaded audio file", "file")
    clip = clip_bytes(clip, "file", srv.limits)
    if getattr(srv.model, "audio", None) is None:
        raise bad(f"the model {srv.model_id!r} has no audio tower: it takes no audio", "file", "audio_not_supported")
    try:
        samples = await run_in_threadpool(load_audio, clip, max_seconds=srv.limits.max_audio_seconds)
    except AudioError as e:
        raise bad(str(e), "file", "invalid_audio") from None
    parts = windows(samples)
    gen = Generation(max_tokens=None, stream=opts.stream, include_usage=False,
                     sampling={"temperature": opts.temperature})
    seqs = []
    for _, part in parts:
        msgs = translation_messages(part, opts.prompt) if translate else \
            transcription_messages(part, opts.language, opts.prompt)
        seq = await srv._chat_sequence(msgs, gen, param="file")
        seconds = len(seq.soft.rows) / TOKENS_PER_SECOND if seq.soft is not None else 0.0  # this window's clip
        seq.max_tokens = min(seq.max_tokens,
                             math.ceil(seconds * TRANSCRIPTION_TOKENS_PER_SECOND) + TRANSCRIPTION_TOKENS_SLACK)
        seq.logprobs = 0  # each token's id and log-probability (verbose_json's segments)
        seqs.append(seq)
    events = srv.relay(request, seqs)
    if opts.stream:
        return StreamingResponse(_stream(srv, events, len(seqs)), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    texts: list[str] = [""] * len(seqs)
    lps: list[list] = [[] for _ in seqs]
    done: list[Finish | None] = [None] * len(seqs)
    try:
        async for i, ev in events:
            if isinstance(ev, Piece):
                texts[i] += ev.text
                lps[i] += ev.logprobs
            elif isinstance(ev, Finish):
                srv._check_finish(ev)
                lps[i] += ev.logprobs
                done[i] = ev
    except ClientGone:
        return Response(status_code=499)
    finally:
        await events.aclose()
    warning = None
    if translate:
        found = [translation_text(t) for t in texts]
        if any(f is None for f in found):
            warning = f"the reply has no '{TARGET}: ' line: the whole reply is the translation"
        texts = [t if f is None else f for t, f in zip(texts, found)]
    headers = {WARNING_HEADER: warning} if warning else {}
    text = " ".join(texts)
    segments = [_segment(i, first, len(part), t, lp, opts.temperature)
                for i, ((first, part), t, lp) in enumerate(zip(parts, texts, lps))]
    fmt = opts.response_format
    if fmt == "text":
        return PlainTextResponse(text, headers=headers)
    if fmt in ("srt", "vtt"):
        return PlainTextResponse(subtitles(segments, fmt), headers=headers)
    usage = _usage([d for d in done if d is not None])
    if fmt == "json":
        return JSONResponse({"text": text, "usage": usage}, headers=headers)
    language = TARGET.lower() if translate else (LANGUAGES.get(opts.language, opts.language).lower()
                                                 if opts.language else None)
    return JSONResponse({"task": "translate" if translate else "transcribe", "language": language,
                         "duration": len(samples) / SAMPLE_RATE, "text": text, "segments": segments,
                         "usage": usage}, headers=headers)


def _usage(done: list[Finish]) -> dict[str, Any]:
    n_in, n_out = sum(d.prompt_tokens for d in done), sum(d.completion_tokens for d in done)
    return {"type": "tokens", "input_tokens": n_in, "output_tokens": n_out, "total_tokens": n_in + n_out}


async def _stream(srv: Any, events, n: int) -> AsyncIterator[str]:
    """``transcript.text.delta`` events, window after window (a later window's pieces wait for the
    ones before it), then ``transcript.text.done`` with the whole text and the usage."""
    def data(obj: dict) -> str:
        return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"

    held: list[list[str]] = [[] for _ in range(n)]
    finished: list[Finish | None] = [None] * n
    cur, text = 0, ""
    try:
        async for i, ev in events:
            if isinstance(ev, Finish):
                try:
                    srv._check_finish(ev)
                except APIError as e:
                    yield data(e.body())
                    return
                finished[i] = ev
            elif ev.text:
                held[i].append(ev.text)
            while cur < n:  # send what the current window has; move on when it is done
                for piece in held[cur]:
                    text += piece
                    yield data({"type": "transcript.text.delta", "delta": piece})
                held[cur] = []
                if finished[cur] is None:
                    break
                cur += 1
                if cur < n:
                    text += " "
                    yield data({"type": "transcript.text.delta", "delta": " "})
        yield data({"type": "transcript.text.done", "text": text,
                    "usage": _usage([f for f in finished if f is not None])})
    except ClientGone:
        return
    finally:
        await events.aclose()
