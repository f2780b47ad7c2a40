"""Images -> patches for the Gemma 4 vision tower, as transformers' Gemma 4 image processor (PIL path).

The reference is ``transformers/models/gemma4/image_processing_pil_gemma4.py``: convert to RGB,
resize (aspect preserved, bicubic) to the largest size whose sides are multiples of
``pooling_kernel_size * patch_size`` and that holds at most ``max_soft_tokens * k^2`` patches,
rescale by 1/255, cut into ``patch_size`` squares (row-major, each flattened as (row, col,
channel)) and give each patch its ``(x, y)`` grid position. The reference pads every image to
``max_patches`` for batching; one image goes through the tower alone here, so no padding.

How an input becomes RGB follows the reference for that kind of input:

* a file (path, bytes, file object) is decoded like transformers' ``load_image``: EXIF
  orientation applied, then ``convert("RGB")`` (alpha dropped; 16-bit clipped to 255), then
  the PIL-image rule below (a transparency colour kept by the conversion goes white);
* a PIL image is converted like the processor's ``convert_to_rgb``: images with an alpha band
  or a ``transparency`` entry are composited onto white, others ``convert("RGB")``;
* a uint8 array ``[H, W]``, ``[H, W, 1]``, ``[H, W, 3]`` or ``[H, W, 4]`` (channels last) is
  converted by the processor's numpy rules (grey repeated, RGBA blended onto white and rounded).

Bad images raise `ImageError`; a file larger than ``max_pixels`` is refused from its header,
before anything is decoded or allocated.
"""
from __future__ import annotations

import io
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Union

import numpy as np

from ..errors import ConfigError, ImageError

SUPPORTED_SOFT_TOKENS = (70, 140, 280, 560, 1120)
MAX_PIXELS = 1 << 27  # 134 M pixels (a 100-megapixel photo loads; a decompression bomb does not)

ImageInput = Union[str, os.PathLike, bytes, bytearray, memoryview, BinaryIO, np.ndarray, Any]


def _pil():
    try:
        from PIL import Image, ImageOps
    except ImportError:  # pragma: no cover - pillow is a dependency of the vision extra
        raise ImportError("images need Pillow: pip install 'gemmalite[vision]'") from None
    return Image, ImageOps


@dataclass(frozen=True)
class ImageProcessorConfig:
    """The processor settings that change the patches (defaults: Gemma 4's)."""

    patch_size: int = 16
    pooling_kernel_size: int = 3
    max_soft_tokens: int = 280
    resample: int = 3  # PIL.Image.Resampling.BICUBIC
    rescale_factor: float = 1 / 255

    def __post_init__(self) -> None:
        if self.max_soft_tokens not in SUPPORTED_SOFT_TOKENS:
            raise ConfigError(f"max_soft_tokens must be one of {SUPPORTED_SOFT_TOKENS}, got {self.max_soft_tokens}")
        if self.patch_size < 1 or self.pooling_kernel_size < 1:
            raise ConfigError(f"patch_size and pooling_kernel_size must be positive, got {self.patch_size}, "
                              f"{self.pooling_kernel_size}")

    @property
    def max_patches(self) -> int:
        return self.max_soft_tokens * self.pooling_kernel_size**2

    @classmethod
    def from_dict(cls, d: dict, vision_config: dict | None = None) -> "ImageProcessorConfig":
        """From an image-processor dict (``preprocessor_config.json``, or the ``image_processor``
        entry of ``processor_config.json``); sizes missing there come from the vision config."""
        v = vision_config or {}
        unsupported = [k for k, ok in (("do_resize", True), ("do_convert_rgb", True)) if d.get(k, ok) is not ok]
        if d.get("do_normalize") and (list(d.get("image_mean", [0.0] * 3)) != [0.0] * 3
                                      or list(d.get("image_std", [1.0] * 3)) != [1.0] * 3):
            unsupported.append("do_normalize")
        if unsupported:
            raise ConfigError(f"image processor settings not supported: {', '.join(unsupported)}")
        return cls(
            patch_size=int(d.get("patch_size", v.get("patch_size", cls.patch_size))),
            pooling_kernel_size=int(d.get("pooling_kernel_size", v.get("pooling_kernel_size", cls.pooling_kernel_size))),
            max_soft_tokens=int(d.get("max_soft_tokens", d.get("image_seq_length", cls.max_soft_tokens))),
            resample=int(d.get("resample", cls.resample)),
            rescale_factor=float(d.get("rescale_factor", cls.rescale_factor)) if d.get("do_rescale", True) else 1.0,
        )

    @classmethod
    def from_folder(cls, folder: str | Path, vision_config: dict | None = None) -> "ImageProcessorConfig":
        """From a checkpoint folder's processor files; defaults (with the vision config's sizes)
        when it has none."""
        folder = Path(folder)
        for name, key in (("processor_config.json", "image_processor"), ("preprocessor_config.json", None)):
            path = folder / name
            if not path.exists():
                continue
            try:
                d = json.loads(path.read_text())
            except json.JSONDecodeError as e:
                raise ConfigError(f"{path}: not valid JSON ({e})") from None
            if key is not None:
                if not isinstance(d.get(key), dict):
                    continue
                d = d[key]
            try:
                return cls.from_dict(d, vision_config)
            except ConfigError as e:
                raise ConfigError(f"{path}: {e}") from None
        return cls.from_dict({}, vision_config)


@dataclass(frozen=True)
class ImagePatches:
    """One image, ready for the tower."""

    pixels: np.ndarray  # float32 [N, patch_size^2 * 3], values in [0, 1]
    positions: np.ndarray  # int64 [N, 2]: (x, y) = (column, row) in the patch grid
    grid: tuple[int, int]  # patch rows, patch columns (both multiples of the pooling kernel)
    num_soft_tokens: int  # N / k^2: the tokens this image takes in a prompt


def target_size(height: int, width: int, cfg: ImageProcessorConfig, max_soft_tokens: int | None = None) -> tuple[int, int]:
    """The reference's ``get_aspect_ratio_preserving_size``: the largest (height, width) with
    sides multiple of ``k * patch_size`` and at most ``max_patches`` patches."""
    k, p = cfg.pooling_kernel_size, cfg.patch_size
    max_patches = (max_soft_tokens or cfg.max_soft_tokens) * k * k
    target_px = max_patches * p * p
    factor = math.sqrt(target_px / (height * width))
    m = k * p
    th = int(math.floor(factor * height / m)) * m
    tw = int(math.floor(factor * width / m)) * m
    if th == 0 and tw == 0:  # unreachable for a supported budget; kept as the reference has it
        raise ImageError(f"an image of {width}x{height} pixels resizes to nothing")
    max_side = (max_patches // (k * k)) * m
    if th == 0:
        th, tw = m, min(int(math.floor(width / height)) * m, max_side)
    elif tw == 0:
        tw, th = m, min(int(math.floor(height / width)) * m, max_side)
    return th, tw


def preprocess(image: ImageInput, cfg: ImageProcessorConfig | None = None, *, max_soft_tokens: int | None = None,
               max_pixels: int = MAX_PIXELS) -> ImagePatches:
    """Patches and positions of one image (see the module docstring for the accepted inputs).
    ``max_soft_tokens`` overrides the config's budget for this call."""
    cfg = cfg or ImageProcessorConfig()
    if max_soft_tokens is not None and max_soft_tokens not in SUPPORTED_SOFT_TOKENS:
        raise ValueError(f"max_soft_tokens must be one of {SUPPORTED_SOFT_TOKENS}, got {max_soft_tokens}")
    rgb = to_rgb(image, max_pixels=max_pixels)
    h, w = rgb.shape[:2]
    th, tw = target_size(h, w, cfg, max_soft_tokens)
    if (th, tw) != (h, w):
        Image, _ = _pil()
        rgb = np.asarray(Image.fromarray(rgb).resize((tw, th), resample=cfg.resample))
    return patchify(rgb, cfg)


def patchify(rgb: np.ndarray, cfg: ImageProcessorConfig) -> ImagePatches:
    """Rescale a uint8 ``[H, W, 3]`` image (sides multiple of the patch size) and cut it up."""
    p, k = cfg.patch_size, cfg.pooling_kernel_size
    h, w, c = rgb.shape
    rows, cols = h // p, w // p
    # the reference rescales in float64 and rounds to float32: a 256-entry table does the same
    lut = (np.arange(256, dtype=np.float64) * cfg.rescale_factor).astype(np.float32)
    pixels = lut[rgb].reshape(rows, p, cols, p, c).transpose(0, 2, 1, 3, 4).reshape(rows * cols, p * p * c)
    gx, gy = np.meshgrid(np.arange(cols), np.arange(rows), indexing="xy")
    positions = np.stack([gx, gy], axis=-1).reshape(rows * cols, 2).astype(np.int64)
    return ImagePatches(np.ascontiguousarray(pixels), positions, (rows, cols), rows * cols // (k * k))


# ------------------------------------------------------------------------------------------
# decoding and RGB conversion
# ------------------------------------------------------------------------------------------

def to_rgb(image: ImageInput, *, max_pixels: int = MAX_PIXELS) -> np.ndarray:
    """uint8 ``[H, W, 3]`` RGB of any accepted input, converted as the reference converts it."""
    Image, _ = _pil()
    if isinstance(image, np.ndarray):
        return _array_to_rgb(image)
    if isinstance(image, Image.Image):
        _check_size(image.size, max_pixels, "image")
        _load(image, "image")
        return _pil_to_rgb(image)
    if isinstance(image, (bytes, bytearray, memoryview)):
        return _decode(io.BytesIO(bytes(image)), "image bytes", max_pixels)
    if isinstance(image, (str, os.PathLike)):
        path = Path(image)
        if not path.is_file():
            raise ImageError(f"{path}: no such image file")
        with open(path, "rb") as f:
            return _decode(f, str(path), max_pixels)
    if hasattr(image, "read"):
        return _decode(image, getattr(image, "name", None) or "image file", max_pixels)
    raise ImageError(f"not an image input: {type(image).__name__} (expected a path, bytes, a file object, "
                     "a PIL image or a uint8 array)")


def _check_size(size: tuple[int, int], max_pixels: int, where: str) -> None:
    w, h = size
    if w < 1 or h < 1:
        raise ImageError(f"{where}: empty image ({w}x{h} pixels)")
    if w * h < 2:
        raise ImageError(f"{where}: a 1x1 image carries no picture")
    if w * h > max_pixels:
        raise ImageError(f"{where}: {w}x{h} pixels is more than the {max_pixels} allowed (refused before decoding)")


def _load(im, where: str) -> None:
    try:
        im.load()
    except ImageError:
        raise
    except Exception as e:  # Pillow's decoders raise OSError, SyntaxError, ValueError, zlib.error...
        raise ImageError(f"{where}: cannot decode the image, truncated or corrupt ({e})") from e


def _decode(fp: BinaryIO, where: str, max_pixels: int) -> np.ndarray:
    """A file as ``load_image`` reads it: header, size checks, decode, EXIF orientation, RGB."""
    import warnings

    Image, ImageOps = _pil()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)  # our own limit decides
            im = Image.open(fp)
    except Image.DecompressionBombError as e:
        raise ImageError(f"{where}: refused before decoding, too many pixels ({e})") from e
    except Image.UnidentifiedImageError:
        raise ImageError(f"{where}: not an image (no format Pillow reads)") from None
    except Exception as e:
        raise ImageError(f"{where}: cannot read the image header, truncated or corrupt ({e})") from e
    _check_size(im.size, max_pixels, where)
    _load(im, where)
    try:
        rgb = ImageOps.exif_transpose(im).convert("RGB")
    except Exception as e:
        raise ImageError(f"{where}: cannot convert a {im.mode} image to RGB ({e})") from e
    # then the processor's own conversion: an RGB image that kept a transparency colour (from a
    # palette or a tRNS chunk) gets that colour composited onto white
    return _pil_to_rgb(rgb)


def _pil_to_rgb(im) -> np.ndarray:
    """The processor's ``convert_to_rgb`` for PIL images: alpha (or a transparency entry)
    is composited onto white."""
    Image, _ = _pil()
    try:
        if "A" in im.getbands() or im.info.get("transparency") is not None:
            rgba = im.convert("RGBA")
            white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
            return np.asarray(Image.alpha_composite(white, rgba).convert("RGB"))
        return np.asarray(im.convert("RGB"))
    except Exception as e:
        raise ImageError(f"image: unsupported mode {im.mode!r} ({e})") from e


def _array_to_rgb(a: np.ndarray) -> np.ndarray:
    """The processor's ``convert_to_rgb`` for channels-last uint8 arrays."""
    if a.dtype != np.uint8:
        raise ImageError(f"image array: dtype {a.dtype} not supported (uint8 expected)")
    if a.ndim == 2:
        a = a[:, :, None]
    if a.ndim != 3 or a.shape[2] not in (1, 3, 4):
        raise ImageError(f"image array: shape {a.shape} not supported ([H, W] or [H, W, C] with C in 1, 3, 4)")
    _check_size((a.shape[1], a.shape[0]), 1 << 62, "image array")
    if a.shape[2] == 1:
        return np.repeat(a, 3, axis=2)
    if a.shape[2] == 4:
        alpha = a[..., 3:4] / 255
        return np.round(alpha * a[..., :3] + (1 - alpha) * 255).astype(np.uint8)
    return np.ascontiguousarray(a)
