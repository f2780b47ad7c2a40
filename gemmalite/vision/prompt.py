"""Pictures in a prompt, placed as transformers' Gemma4Processor / EmbeddingGemma2Processor place them.

Each image placeholder token (``<|image|>``) in the prompt's ids becomes
``<|image>`` + ``<|image|>`` x N + ``<image|>`` with N the image's soft-token count; the N rows
then take the image's soft tokens instead of the placeholder's embedding. (The processor does
the same replacement on the text before tokenizing; the three are special tokens, so doing it
on the ids gives the same ids.) A video placeholder (``<|video|>``) becomes one such block per
frame, ``<|image>`` + ``<|video|>`` x N + ``<image|>``, without timestamps (the EmbeddingGemma 2
video processor's default): frames are images sized by the video processor's settings.
"""
from __future__ import annotations

import hashlib
import json
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from ..errors import ConfigError, ImageError
from ..runtime.engine import Block, place_blocks
from ..runtime.media_cache import SoftTokenCache
from .preprocess import MAX_PIXELS, ImageInput, ImagePatches, ImageProcessorConfig, preprocess
from .tower import VisionTower, build_vision_tower, vision_prefixes

CACHED_IMAGES = 8  # soft tokens kept for the last images seen: a chat turn re-sends earlier pictures


@dataclass(frozen=True)
class ImageTokenIds:
    image: int = 258880  # <|image|>: the placeholder, and each soft-token row
    begin: int = 255999  # <|image>
    end: int = 258882  # <image|>
    video: int = 258884  # <|video|>: a video's placeholder, and each of its frames' soft-token rows

    @classmethod
    def from_config(cls, raw: dict) -> "ImageTokenIds":
        return cls(int(raw.get("image_token_id", cls.image)), int(raw.get("boi_token_id", cls.begin)),
                   int(raw.get("eoi_token_id", cls.end)), int(raw.get("video_token_id", cls.video)))


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

    def __init__(self, build: Callable[[], tuple[VisionTower, ImageProcessorConfig]], tokens: ImageTokenIds,
                 video: VideoProcessorConfig | None = None):
        self._build = build
        self._built: tuple[VisionTower, ImageProcessorConfig] | None = None
        self._lock = threading.Lock()
        self.tokens = tokens
        self.video = video or VideoProcessorConfig()
        self._cache = SoftTokenCache(CACHED_IMAGES)

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
        return h.digest(), self._cache.get(h.digest(), lambda: self.tower(patches))

    def blocks(self, ids: np.ndarray, images: Sequence[ImageInput], *, max_soft_tokens: int | None = None,
               videos: Sequence[Sequence[ImageInput]] = (), max_pixels: int = MAX_PIXELS) -> list[tuple[int, list[Block]]]:
        """(placeholder position, its blocks) for each image placeholder of ``ids`` (the next image)
        and each video placeholder (the next video's frames), as many placeholders of each kind as
        inputs; an image file over ``max_pixels`` is refused from its header."""
        t = self.tokens
        image_slots, video_slots = np.flatnonzero(ids == t.image), np.flatnonzero(ids == t.video)
        if len(image_slots) != len(images):
            raise ImageError(f"the prompt has {len(image_slots)} image placeholder(s) for {len(images)} image(s)")
        if len(video_slots) != len(videos):
            raise ImageError(f"the prompt has {len(video_slots)} video placeholder(s) for {len(videos)} video(s)")
        media = sorted([(int(s), t.image, [im]) for s, im in zip(image_slots, images)]
                       + [(int(s), t.video, self.video.frames(v)) for s, v in zip(video_slots, videos)])
        out = []
        for slot, token, frames in media:
            blocks = []
            for frame in frames:
                cfg, budget = (self.processor, max_soft_tokens) if token == t.image else (self.video.image, None)
                digest, soft = self.soft_tokens(preprocess(frame, cfg, max_soft_tokens=budget, max_pixels=max_pixels))
                blocks.append(Block(t.begin, token, t.end, soft, digest))
            out.append((slot, blocks))
        return out

    def prompt(self, ids: Sequence[int], images: Sequence[ImageInput], **options: Any) -> ImagePrompt:
        """Expand each image (video) placeholder of ``ids`` with the next image (video); ``options``: `blocks`'s."""
        ids = np.asarray(ids, dtype=np.int64)
        expanded, soft = place_blocks(ids, self.blocks(ids, images, **options), 0)
        if soft is None:
            return ImagePrompt(expanded, np.zeros(0, np.int64), np.zeros((0, self.tower.text_hidden_size), np.float32),
                               np.zeros(0, np.int64))
        return ImagePrompt(expanded, soft.rows, soft.vectors, soft.keys)


@dataclass(frozen=True)
class VideoProcessorConfig:
    """The EmbeddingGemma 2 video processor's settings: frames are sized as images with their own
    budget (70 soft tokens by default); decoded frames carry no frame rate, so every frame is
    kept, then at most ``max_frames`` picked uniformly (its ``overflow_strategy`` "uniform")."""

    image: ImageProcessorConfig = ImageProcessorConfig(max_soft_tokens=70)
    max_frames: int | None = 32
    overflow_strategy: str = "uniform"
    fps: float | None = 1.0  # a video file is sampled at this rate (decoded frames have no rate)

    @classmethod
    def from_folder(cls, folder: str | Path, vision_config: dict | None = None) -> "VideoProcessorConfig":
        path = Path(folder) / "processor_config.json"
        d = read_processor_entry(path, "video_processor") if path.exists() else None
        if d is None:
            return cls(ImageProcessorConfig.from_dict({"max_soft_tokens": 70}, vision_config))
        strategy = d.get("overflow_strategy", "uniform")
        if strategy not in ("uniform", "truncate", None):
            raise ConfigError(f"{path}: video_processor.overflow_strategy {strategy!r} not supported")
        try:
            image = ImageProcessorConfig.from_dict({"max_soft_tokens": 70, **d}, vision_config)
        except ConfigError as e:
            raise ConfigError(f"{path}: video_processor: {e}") from None
        fps = d.get("fps", 1.0)
        return cls(image, d.get("max_frames", 32) if strategy else None, strategy or "uniform",
                   None if fps is None else float(fps))

    def frames(self, video: Sequence[ImageInput] | os.PathLike) -> list[ImageInput]:
        """The frames the reference keeps of a list of decoded frames, or of a video file."""
        if isinstance(video, os.PathLike):
            return self.decode(video)
        if isinstance(video, (str, bytes)) or not hasattr(video, "__len__") or len(video) == 0:
            raise ImageError("a video is a non-empty list of frames (images)")
        return self._cap(list(video))

    def _cap(self, frames: list) -> list:
        if self.max_frames is not None and len(frames) > self.max_frames:
            if self.overflow_strategy == "truncate":
                return frames[:self.max_frames]
            return [frames[i] for i in np.linspace(0, len(frames) - 1, self.max_frames, dtype=int)]
        return frames


    def decode(self, path: os.PathLike) -> list[np.ndarray]:
        """RGB frames of a video file, sampled as transformers' PyAV loader and the EmbeddingGemma 2
        video processor sample them: at ``fps`` from the stream's average rate and frame count,
        then capped at ``max_frames``. Needs PyAV (``pip install 'gemmalite[video]'``)."""
        try:
            import av
        except ImportError:
            raise ImageError("decoding video files needs PyAV: pip install 'gemmalite[video]' (or give the frames)") from None
        try:
            with av.open(os.fspath(path)) as container:
                stream = container.streams.video[0]
                total, rate = int(stream.frames), stream.average_rate
                if self.fps is None or not rate:
                    indices = np.arange(total)
                else:
                    step, duration = float(rate) / self.fps, total / float(rate)
                    indices = np.array([min(total - 1, int(i * step)) for i in range(max(1, int(duration * self.fps)))])
                indices = self._cap(list(indices))
                wanted, frames = set(int(i) for i in indices), []
                for i, frame in enumerate(container.decode(video=0)):
                    if i > indices[-1]:
                        break
                    if i in wanted:
                        frames.append(frame.to_ndarray(format="rgb24"))
        except (av.error.FFmpegError, IndexError, OSError) as e:
            raise ImageError(f"{path}: cannot decode the video ({e})") from None
        if not frames:
            raise ImageError(f"{path}: the video has no frames")
        return frames


def read_processor_entry(path: Path, key: str) -> dict | None:
    """``processor_config.json``'s ``key`` entry (None when absent)."""
    try:
        d = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: not valid JSON ({e})") from None
    entry = d.get(key) if isinstance(d, dict) else None
    return entry if isinstance(entry, dict) else None


def folder_vision(folder: str | Path, raw: dict, tensors: Mapping[str, Any], quant: str | None,
                  check: Callable[[], None] | None = None) -> Vision | None:
    """A checkpoint folder's vision side (the tower built on first use, after ``check``), or None
    when it has no vision tower. ``tensors``: every tensor under its stored name (memory-mapped)."""
    if not isinstance(raw.get("vision_config"), dict) or vision_prefixes(tensors) is None:
        return None

    def build() -> tuple[VisionTower, ImageProcessorConfig]:
        if check is not None:
            check()
        return (build_vision_tower(tensors, raw, quant=quant),
                ImageProcessorConfig.from_folder(folder, raw["vision_config"]))

    return Vision(build, ImageTokenIds.from_config(raw), VideoProcessorConfig.from_folder(folder, raw["vision_config"]))


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
