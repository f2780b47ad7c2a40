"""A chat message's content, read one way for the Python API and the server.

Content is a string or a list of parts. Parts in OpenAI's shapes

    {"type": "text", "text": "..."}
    {"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}}
    {"type": "input_audio", "input_audio": {"data": "<base64>", "format": "wav"}}

become the shapes the chat templates take (``{"type": "image", "image": bytes}``,
``{"type": "audio", "audio": bytes}``); with ``local=True`` (the Python API) those shapes are
taken as given too (``"image"`` / ``"path"`` / ``"url"`` keys, as `vision.prompt.message_images`
and `audio.prompt.message_audio` read them). Any other part is a `PartError` naming it: nothing
is dropped. Web addresses are refused (nothing is fetched); inline media is size-checked before
and after decoding when a limit is given.
"""
from __future__ import annotations

import base64
import binascii
from typing import Any

from ..errors import InputError

AUDIO_FORMATS = ("wav", "mp3", "flac", "ogg")


class PartError(InputError):
    """A content part that cannot be read; ``where`` names it, ``code`` says why (the server's error code)."""

    def __init__(self, message: str, where: str, code: str | None = None):
        super().__init__(message)
        self.where, self.code = where, code


def inline_bytes(payload: str | bytes, where: str, limit: int | None, noun: str, encoded: str, kind: str) -> bytes:
    """Media sent inline (base64 text, or the bytes themselves), size-checked before decoding (so
    a huge payload is refused unread) and after; errors name ``noun`` / ``encoded`` and carry the codes
    ``{kind}_too_large`` / ``invalid_{kind}``."""
    too_big = PartError(f"{where}: {noun} is larger than the {limit} bytes allowed", where, f"{kind}_too_large")
    if isinstance(payload, str):
        if limit is not None and len(payload) > 4 * (limit // 3 + 1):
            raise too_big
        try:
            payload = base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            raise PartError(f"{where}: {encoded} is not valid base64", where, f"invalid_{kind}") from None
    if not payload:
        raise PartError(f"{where}: {noun} is empty", where, f"invalid_{kind}")
    if limit is not None and len(payload) > limit:
        raise too_big
    return payload


def image_url_bytes(image_url: Any, where: str, limit: int | None = None) -> bytes:
    """The picture of an ``image_url`` part: a base64 data URL (web addresses are refused)."""
    url = image_url.get("url") if isinstance(image_url, dict) else image_url
    if not isinstance(url, str):
        raise PartError(f"{where}.image_url must be {{'url': 'data:image/...;base64,...'}}", where, "invalid_image")
    if url.startswith(("http://", "https://")):
        raise PartError(f"{where}: image URLs are not fetched; send the picture inline as a data URL "
                        "(data:image/png;base64,...)", where, "image_url_not_supported")
    head, comma, payload = url.partition(",")
    if not (url.startswith("data:") and comma and head.endswith(";base64")):
        raise PartError(f"{where}: the image URL must be a base64 data URL (data:image/png;base64,...)", where,
                        "invalid_image")
    return inline_bytes(payload, where, limit, "the picture", "the data URL", "image")


def sniff_audio(data: bytes) -> str | None:
    """The container of encoded audio from its first bytes (None: none we decode). A client's
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


def clip_bytes(payload: str | bytes, where: str, limit: int | None = None) -> bytes:
    """Encoded audio (base64 text, or the bytes themselves), within ``limit`` bytes and of a
    container we decode (sniffed from the first bytes)."""
    payload = inline_bytes(payload, where, limit, "the audio clip", "the audio data", "audio")
    if sniff_audio(payload) is None:
        raise PartError(f"{where}: not an audio file this runtime decodes (WAV, FLAC, OGG or MP3, sniffed from its "
                        "first bytes)", where, "invalid_audio")
    return payload


def input_audio_bytes(input_audio: Any, where: str, limit: int | None = None) -> bytes:
    """The clip of an ``input_audio`` part (``{"data": base64, "format": "wav" | "mp3" | ...}``);
    addresses are refused."""
    if not isinstance(input_audio, dict) or not isinstance(input_audio.get("data"), str):
        raise PartError(f"{where}.input_audio must be {{'data': base64 string, 'format': 'wav' | 'mp3'}}", where,
                        "invalid_audio")
    fmt, payload = input_audio.get("format"), input_audio["data"]
    if fmt is not None and fmt not in AUDIO_FORMATS:
        raise PartError(f"{where}.input_audio.format must be one of {list(AUDIO_FORMATS)}, got {fmt!r}", where,
                        "invalid_audio")
    if payload.startswith(("http://", "https://", "file:")):
        raise PartError(f"{where}: audio URLs are not fetched; send the clip inline as base64", where,
                        "audio_url_not_supported")
    if payload.startswith("data:"):  # a data URL where the bare base64 belongs: take its payload
        head, comma, payload = payload.partition(",")
        if not (comma and head.endswith(";base64")):
            raise PartError(f"{where}: input_audio.data must be base64", where, "invalid_audio")
    return clip_bytes(payload, where, limit)


def _shown(kind: Any) -> str:
    return f"{kind!r:.40}" if isinstance(kind, str) else f"a part without a 'type' ({type(kind).__name__})"


def content(c: Any, where: str, *, local: bool = False, max_image_bytes: int | None = None,
            max_audio_bytes: int | None = None, join_text: bool = False) -> Any:
    """``c`` (a message's content) with its parts in the templates' shapes. ``where`` names the
    content in errors (``messages[0].content``); ``local``: the Python API, whose own shapes
    (``image`` / ``audio`` parts with paths, arrays, PIL images...) pass as they are;
    ``join_text``: text-only parts become one string, joined by newlines (the server's reading).
    A string, None, or anything not a list is returned as it is (the caller checks it)."""
    if not isinstance(c, list):
        return c
    parts: list[Any] = []
    takes = ("'text', 'image_url' (a data URL), 'input_audio'" + (", 'image', 'audio'" if local else ""))
    for j, part in enumerate(c):
        at = f"{where}[{j}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text":
            if not isinstance(part.get("text"), str):
                raise PartError(f"{at}: a text part needs 'text' as a string", at)
            parts.append({"type": "text", "text": part["text"]} if not local else part)
        elif kind == "image_url":
            parts.append({"type": "image", "image": image_url_bytes(part.get("image_url"), at, max_image_bytes)})
        elif kind == "input_audio":
            parts.append({"type": "audio", "audio": input_audio_bytes(part.get("input_audio"), at, max_audio_bytes)})
        elif local and kind in ("image", "audio"):
            parts.append(part)  # (read by message_images / message_audio, which name a part without its media)
        else:
            raise PartError(f"{at}: content parts of type {_shown(kind)} are not supported (takes {takes})", at,
                            "unsupported_content_part")
    if join_text and all(p["type"] == "text" for p in parts):
        return "\n".join(p["text"] for p in parts)
    return parts


def messages_content(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The Python API's conversation with every message's content read by `content` (``local``):
    OpenAI's parts in the templates' shapes, an unknown part an error. Messages are copied, not changed."""
    out = []
    for i, m in enumerate(messages):
        c = m.get("content") if isinstance(m, dict) else None
        out.append({**m, "content": content(c, f"messages[{i}]['content']", local=True)} if isinstance(c, list) else m)
    return out
