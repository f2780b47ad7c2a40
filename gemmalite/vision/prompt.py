"""Pictures in a prompt, placed as transformers' Gemma4Processor places them.

Each image placeholder token (``<|image|>``) in the prompt's ids becomes
``<|image>`` + ``<|image|>`` x N + ``<image|>`` with N the image's soft-token count; the N rows
then take the image's soft tokens instead of the placeholder's embedding. (The processor does
the same replacement on the text before tokenizing; the three are special tokens, so doing it
on the ids gives the same ids.)
"""
from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np

from ..errors import ImageError
from ..runtime.threads import COMPUTE_LOCK
from .preprocess import MAX_PIXELS, ImageInput, ImagePatches, ImageProcessorConfig, preprocess
from .tower import VisionTower

KEY_SPACE = 1 << 62
CACHED_IMAGES = 8  # soft tokens kept for the last images seen: a chat turn re-sends earlier pictures


@dataclass(frozen=True)
class ImageTokenIds:
    image: int = 258880  # <|image|>: the placeholder, and each soft-token row
    begin: int = 255999  # <|image>
    end: int = 258882  # <image|>

    @classmethod
    def from_config(cls, raw: dict) -> "ImageTokenIds":
        return cls(int(raw.get("image_token_id", cls.image)), int(raw.get("boi_token_id", cls.begin)),
                   int(raw.get("eoi_token_id", cls.end)))


@dataclass(frozen=True)
class ImagePrompt:
    """A prompt's ids with its pictures expanded, and what goes into the image rows."""

    ids: np.ndarray  # int64 [T]
    rows: np.ndarray  # int64 [n]: the soft-token rows, in order
    vectors: np.ndarray  # float32 [n, H]
    keys: np.ndarray  # int64 [n], negative: the picture's digest per row (for KV-cache reuse)


class Vision:
    """A checkpoint's vision side: the tower and its image processor settings (both built on first
    use: a text-only caller never pays for them), and the image token ids."""

    def __init__(self, build: Callable[[], tuple[VisionTower, ImageProcessorConfig]], tokens: ImageTokenIds):
        self._build = build
        self._built: tuple[VisionTower, ImageProcessorConfig] | None = None
        self._lock = threading.Lock()
        self.tokens = tokens
        self._cache: OrderedDict[bytes, np.ndarray] = OrderedDict()

    def _parts(self) -> tuple[VisionTower, ImageProcessorConfig]:
        with self._lock:
            if self._built is None:
                self._built = self._build()
            return self._built

    @property
    def tower(self) -> VisionTower:
        return self._parts()[0]

    @property
    def processor(self) -> ImageProcessorConfig:
        return self._parts()[1]

    def soft_tokens(self, patches: ImagePatches) -> tuple[bytes, np.ndarray]:
        """(digest, soft tokens ``[N, H]``) of one image; the last few are kept."""
        h = hashlib.blake2b(digest_size=16)
        h.update(np.asarray(patches.grid, np.int64).tobytes())
        h.update(patches.pixels.tobytes())
        digest = h.digest()
        with self._lock:
            soft = self._cache.get(digest)
            if soft is not None:
                self._cache.move_to_end(digest)
                return digest, soft
        with COMPUTE_LOCK:  # the kernels' thread pool is process-wide: one step at a time (a server decodes meanwhile)
            soft = self.tower(patches)
        with self._lock:
            self._cache[digest] = soft
            while len(self._cache) > CACHED_IMAGES:
                self._cache.popitem(last=False)
        return digest, soft

    def prompt(self, ids: Sequence[int], images: Sequence[ImageInput], *, max_soft_tokens: int | None = None,
               max_pixels: int = MAX_PIXELS) -> ImagePrompt:
        """Expand each placeholder of ``ids`` with the next image (as many placeholders as images);
        an image file over ``max_pixels`` is refused from its header."""
        ids = np.asarray(ids, dtype=np.int64)
        t = self.tokens
        slots = np.flatnonzero(ids == t.image)
        if len(slots) != len(images):
            raise ImageError(f"the prompt has {len(slots)} image placeholder(s) for {len(images)} image(s)")
        pieces, rows, vectors, keys = [], [], [], []
        start = offset = 0
        for slot, image in zip(slots, images):
            digest, soft = self.soft_tokens(preprocess(image, self.processor, max_soft_tokens=max_soft_tokens,
                                                            max_pixels=max_pixels))
            n = soft.shape[0]
            pieces += [ids[start:slot], [t.begin], np.full(n, t.image), [t.end]]
            first = offset + (slot - start) + 1
            rows.append(np.arange(first, first + n))
            vectors.append(soft)
            base = int.from_bytes(digest[:8], "little") % KEY_SPACE
            keys.append(-1 - (base + np.arange(n, dtype=np.int64)) % KEY_SPACE)
            offset = first + n + 1
            start = slot + 1
        pieces.append(ids[start:])
        expanded = np.concatenate([np.asarray(p, dtype=np.int64) for p in pieces])
        if not images:
            return ImagePrompt(expanded, np.zeros(0, np.int64), np.zeros((0, self.tower.text_hidden_size), np.float32),
                               np.zeros(0, np.int64))
        return ImagePrompt(expanded, np.concatenate(rows), np.concatenate(vectors), np.concatenate(keys))


def message_images(messages: Sequence[dict[str, Any]]) -> list[ImageInput]:
    """The images of chat messages in the content-part form transformers' chat templates take
    (``{"type": "image", "image": ...}``, or ``"path"``), in the order the template renders them."""
    out = []
    for m in messages:
        content = m.get("content")
        if not isinstance(content, list):
            continue
        for part in content:
            if isinstance(part, dict) and part.get("type") == "image":
                image = next((part[k] for k in ("image", "path", "url") if part.get(k) is not None), None)
                if image is None:
                    raise ImageError("an image part has no 'image' or 'path'")
                if isinstance(image, str) and image.startswith(("http://", "https://")):
                    raise ImageError(f"{image}: image URLs are not fetched; give a local path or the bytes")
                out.append(image)
    return out
