"""What `Embedder.embed` takes: texts, images, videos, and inputs that interleave them.

An input is one of
* a ``str``: always text (never a path);
* an image: ``pathlib.Path`` (any ``os.PathLike``), bytes, a file object, a PIL image or a
  uint8 array (decoded and converted by `gemmalite.vision.preprocess`);
* a video: ``{"video": [frame, ...]}`` (frames are images) or ``{"video": Path("clip.mp4")}``
  (decoded with PyAV, the ``video`` extra, sampled as the reference samples files);
* an audio clip: ``{"audio": clip}`` (a path, bytes, a file object, a 16 kHz array or
  ``(array, sample_rate)``, decoded by `gemmalite.audio.decode.load_audio`; a list: several);
* a list or tuple of such parts, or a dict ``{"text": ..., "image": ..., "video": ..., "audio":
  ...}`` whose parts follow the key order (as sentence-transformers and egemma2 take them): ONE input.

``embed(x)`` with a single input gives one row; a list gives one row per element.
"""
from __future__ import annotations

import os
from typing import Any, Union

import numpy as np

from ..errors import InputError

IMAGE_PLACEHOLDER = "<|image|>"
VIDEO_PLACEHOLDER = "<|video|>"
AUDIO_PLACEHOLDER = "<|audio|>"
#: what goes between two parts of one input in the processor's text: nothing, as egemma2 0.3.2
#: joins them (measured on the real-shape synth checkpoint: "a photo of<|image|>" matches its
#: vectors to cosine 0.99997, the image-alone level; with " " or "\n" 0.998-0.999)
PART_SEPARATOR = ""

Part = Union[str, tuple[str, Any]]  # text, or ("image", image) / ("video", frames) / ("audio", clip)
Item = Union[str, list[Part]]  # a text input, or the parts of an input with pictures


def is_image(x: Any) -> bool:
    """An image value (not text, not a list of parts)."""
    if isinstance(x, (os.PathLike, bytes, bytearray, memoryview)) or hasattr(x, "read"):
        return True
    if isinstance(x, np.ndarray):
        return True
    return hasattr(x, "convert") and hasattr(x, "size") and hasattr(x, "mode")  # a PIL image


def parse_inputs(inputs: Any) -> list[Item]:
    """One item per input: a text, or a list of parts (texts and ("image" | "video", value))."""
    if isinstance(inputs, (str, dict)) or is_image(inputs):
        inputs = [inputs]
    elif not isinstance(inputs, (list, tuple)) and not hasattr(inputs, "__iter__"):
        raise InputError(f"inputs must be a string, an image, a list of parts or a list of inputs, "
                         f"not {type(inputs).__name__}")
    items: list[Item] = []
    for i, x in enumerate(inputs):
        if isinstance(x, str):
            if not x:
                raise InputError(f"texts[{i}] is an empty string")
            items.append(x)
        elif isinstance(x, (list, tuple)):
            if not x:
                raise InputError(f"inputs[{i}] is an empty list of parts")
            parts: list[Part] = []
            for j, p in enumerate(x):
                parts += _parts(p, f"inputs[{i}][{j}]")
            items.append(parts)
        elif isinstance(x, dict) or is_image(x):
            items.append(_parts(x, f"inputs[{i}]"))
        else:
            raise InputError(f"texts[{i}] is a {type(x).__name__}, not a string, an image or a list of parts")
    return items


def _parts(x: Any, where: str) -> list[Part]:
    if isinstance(x, str):
        if not x:
            raise InputError(f"{where} is an empty string")
        return [x]
    if isinstance(x, dict):
        if not x:
            raise InputError(f"{where} is an empty dict")
        out: list[Part] = []
        for key, value in x.items():
            if key == "text":
                out += _parts(value if isinstance(value, str) else str(value), f"{where}['text']")
            elif key == "image":
                images = value if isinstance(value, (list, tuple)) else [value]
                out += [("image", _image(v, f"{where}['image']")) for v in images]
            elif key == "audio":
                clips = value if isinstance(value, list) else [value]  # a tuple is (array, sample_rate)
                if not clips or any(c is None or isinstance(c, str) and not c for c in clips):
                    raise InputError(f"{where}['audio'] must be a clip or a non-empty list of clips")
                out += [("audio", c) for c in clips]
            elif key == "video":
                if isinstance(value, os.PathLike):  # a file, decoded with PyAV (the video extra)
                    out.append(("video", value))
                    continue
                if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)) or not value:
                    raise InputError(f"{where}['video'] must be a non-empty list of frames or a pathlib.Path")
                out.append(("video", [_image(v, f"{where}['video']") for v in value]))
            else:
                raise InputError(f"{where} has an unknown part {key!r} (text, image, video or audio)")
        return out
    return [("image", _image(x, where))]


def _image(x: Any, where: str) -> Any:
    if not is_image(x):
        raise InputError(f"{where} is a {type(x).__name__}, not an image (a str is text: give a "
                         "pathlib.Path for a file)")
    return x


def placeholder_text(parts: list[Part], prompt: str = "") -> tuple[str, list[Any], list[list[Any]], list[Any]]:
    """The processor's text for one input (a placeholder per picture or clip, parts joined by
    `PART_SEPARATOR`, the prompt first), its images, its videos and its audio clips, each in order."""
    pieces, images, videos, clips = [], [], [], []
    placeholder = {"image": (IMAGE_PLACEHOLDER, images), "video": (VIDEO_PLACEHOLDER, videos),
                   "audio": (AUDIO_PLACEHOLDER, clips)}
    for p in parts:
        if isinstance(p, str):
            pieces.append(p)
        else:
            mark, into = placeholder[p[0]]
            pieces.append(mark)
            into.append(p[1])
    return prompt + PART_SEPARATOR.join(pieces), images, videos, clips
