"""Audio clips in a prompt, placed as transformers' Gemma4Processor / EmbeddingGemma2Processor place them.

Each audio placeholder token (``<|audio|>``, what the chat template writes for an audio part) in
the prompt's ids becomes ``<|audio>`` + ``<|audio|>`` x N + ``<audio|>`` with N the clip's
soft-token count (25 per second: `features.soft_token_count`); the N rows then take the audio
tower's soft tokens instead of the placeholder's embedding. A clip longer than the reference's
30 s is encoded in consecutive 30 s windows (`AudioTower.encode`), their soft tokens in one run.
"""
from __future__ import annotations

import hashlib
import threading
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from ..errors import AudioError
from ..runtime.engine import Block
from ..runtime.media_cache import SoftTokenCache
from .decode import SAMPLE_RATE, load_audio
from .features import HOP, SUBSAMPLING, soft_token_count
from .tower import audio_prefixes, build_audio_tower

TOKENS_PER_SECOND = SAMPLE_RATE / (HOP * SUBSAMPLING)  # 25: soft tokens per second of audio
CACHED_CLIPS = 8  # soft tokens kept for the last clips seen: a chat turn re-sends earlier clips


@dataclass(frozen=True)
class AudioTokenIds:
    audio: int = 258881  # <|audio|>: the placeholder, and each soft-token row
    begin: int = 256000  # <|audio>
    end: int = 258883  # <audio|>

    @classmethod
    def from_config(cls, raw: dict) -> "AudioTokenIds":
        end = raw.get("eoa_token_id", raw.get("eoa_token_index", cls.end))  # Gemma4Config says eoa_token_index
        return cls(int(raw.get("audio_token_id", cls.audio)), int(raw.get("boa_token_id", cls.begin)), int(end))


class Audio:
    """A checkpoint's audio side: the tower (built on first use: a text-only caller never pays
    for it) and the audio token ids."""

    def __init__(self, build: Callable[[], Any], tokens: AudioTokenIds):
        self._build = build
        self._tower = None
        self._lock = threading.Lock()
        self.tokens = tokens
        self._cache = SoftTokenCache(CACHED_CLIPS)

    @property
    def tower(self):
        with self._lock:
            if self._tower is None:
                self._tower = self._build()
            return self._tower

    def soft_tokens(self, samples: np.ndarray) -> tuple[bytes, np.ndarray]:
        """(digest, soft tokens ``[N, H]``) of one clip (16 kHz mono float32); the last few are kept."""
        digest = hashlib.blake2b(np.ascontiguousarray(samples, np.float32).tobytes(), digest_size=16).digest()
        tower = self.tower  # built (on first use) outside the compute slot
        return digest, self._cache.get(digest, lambda: np.asarray(tower.encode(samples), dtype=np.float32))

    def blocks(self, ids: np.ndarray, clips: Sequence[Any], *, max_seconds: float | None = None
               ) -> list[tuple[int, list[Block]]]:
        """(placeholder position, its block) for each audio placeholder of ``ids`` with the next
        clip (as many placeholders as clips); a clip is decoded by `load_audio` (``max_seconds``:
        the bound on its length, refused from a file's header before decoding)."""
        t = self.tokens
        slots = np.flatnonzero(np.asarray(ids) == t.audio)
        if len(slots) != len(clips):
            raise AudioError(f"the prompt has {len(slots)} audio placeholder(s) for {len(clips)} clip(s)")
        out = []
        for k, (slot, clip) in enumerate(zip(slots, clips)):
            samples = load_audio(clip, max_seconds=max_seconds)
            if soft_token_count(len(samples)) == 0:
                raise AudioError(f"audio clip {k} is too short: {len(samples)} samples at 16 kHz give no soft token "
                                 "(it takes more than 160)")
            digest, soft = self.soft_tokens(samples)
            out.append((int(slot), [Block(t.begin, t.audio, t.end, soft, digest)]))
        return out


def folder_audio(raw: dict, tensors: Mapping[str, Any], quant: str | None) -> Audio | None:
    """A checkpoint folder's audio side (the tower built on first use), or None when it has no
    audio tower. ``tensors``: every tensor under its stored name (memory-mapped)."""
    if not isinstance(raw.get("audio_config"), dict) or audio_prefixes(tensors) is None:
        return None
    return Audio(lambda: build_audio_tower(tensors, raw, quant=quant), AudioTokenIds.from_config(raw))


def message_audio(messages: Sequence[dict[str, Any]]) -> list[Any]:
    """The clips of chat messages in the content-part form transformers' chat templates take
    (``{"type": "audio", "audio": ...}``, or ``"path"``), in the order the template renders them."""
    out = []
    for m in messages:
        content = m.get("content") if isinstance(m, dict) else None
        if not isinstance(content, list):
            continue
        for part in content:
            if isinstance(part, dict) and part.get("type") == "audio":
                clip = next((part[k] for k in ("audio", "path", "url") if part.get(k) is not None), None)
                if clip is None:
                    raise AudioError("an audio part has no 'audio' or 'path'")
                if isinstance(clip, str) and clip.startswith(("http://", "https://")):
                    raise AudioError(f"{clip}: audio URLs are not fetched; give a local path or the bytes")
                out.append(clip)
    return out
