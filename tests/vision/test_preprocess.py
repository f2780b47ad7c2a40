"""Image preprocessing against transformers' Gemma 4 image processor (PIL backend): identical
patches and positions over sizes, aspect ratios, modes, input kinds and processor settings;
the bad-image table."""
from __future__ import annotations

import io
import json
import math
import struct
import zlib

import numpy as np
import pytest

import vision_oracle as vo
from gemmalite.errors import ConfigError, ImageError
from gemmalite.vision.preprocess import (ImageProcessorConfig, SUPPORTED_SOFT_TOKENS, preprocess,
                                         target_size)

Image = pytest.importorskip("PIL.Image")


def _rgb(h: int, w: int, seed: int = 0) -> np.ndarray:
    rng = np.random.RandomState(seed)
    yy, xx = np.mgrid[0:h, 0:w]
    base = np.stack([np.sin(xx / 9.0 + c) * np.cos(yy / 6.0 - c) for c in range(3)], -1) * 110 + 128
    return np.clip(base + rng.randn(h, w, 3) * 25, 0, 255).astype(np.uint8)


def make_image(mode: str, h: int, w: int, seed: int = 0):
    """A PIL image of ``mode`` with content in every band (alpha from 0 to 255)."""
    rgb = _rgb(h, w, seed)
    im = Image.fromarray(rgb)
    alpha = Image.fromarray(np.linspace(0, 255, h * w).reshape(h, w).astype(np.uint8))
    if mode == "RGBA":
        im.putalpha(alpha)
        return im
    if mode == "LA":
        out = im.convert("L")
        out.putalpha(alpha)
        return out
    if mode == "P+transparency":
        out = im.quantize(16)
        out.info["transparency"] = 3
        return out
    if mode == "I;16":  # 16-bit grey: values past 255 (clipped by the reference's conversion)
        return Image.fromarray((rgb[..., 0].astype(np.uint16) * 3).astype(np.uint16))
    return im.convert(mode)


def _check(ours, ref) -> None:
    pix, pos, n = ref
    assert ours.pixels.dtype == np.float32 and ours.positions.dtype == np.int64
    assert ours.pixels.shape == pix.shape, (ours.pixels.shape, pix.shape)
    assert np.array_equal(ours.pixels, pix)
    assert np.array_equal(ours.positions, pos)
    assert ours.num_soft_tokens == n
    assert ours.grid[0] * ours.grid[1] == len(pos)


SIZES = [(37, 53), (300, 200), (64, 64), (3, 500), (1000, 24), (211, 97)]
MODES = ["RGB", "RGBA", "L", "LA", "P+transparency", "I;16", "1", "CMYK"]
SETTINGS = [(4, 2, 70), (8, 4, 140), (14, 1, 70)]  # patch_size, pooling kernel, max_soft_tokens


@pytest.mark.parametrize("mode", MODES)
def test_pil_images_match_processor(mode):
    for i, (h, w) in enumerate(SIZES):
        patch, k, soft = SETTINGS[i % len(SETTINGS)]
        im = make_image(mode, h, w, i)
        proc = vo.image_processor(patch, k, soft)
        _check(preprocess(im, ImageProcessorConfig(patch, k, soft)), vo.reference_patches(im, proc))


@pytest.mark.parametrize("mode,fmt", [("RGB", "PNG"), ("RGBA", "PNG"), ("LA", "PNG"), ("P+transparency", "PNG"),
                                      ("P+transparency", "GIF"), ("I;16", "PNG"), ("L", "JPEG"), ("CMYK", "JPEG")])
def test_files_match_processor(tmp_path, mode, fmt):
    """Paths go through the reference's load_image; bytes and file objects decode the same way."""
    im = make_image(mode, 90, 130)
    path = tmp_path / f"im.{fmt.lower()}"
    im.save(path, fmt)
    cfg = ImageProcessorConfig(8, 2, 70)
    ref = vo.reference_patches(str(path), vo.image_processor(8, 2, 70))
    _check(preprocess(path, cfg), ref)
    _check(preprocess(str(path), cfg), ref)
    _check(preprocess(path.read_bytes(), cfg), ref)
    with open(path, "rb") as f:
        _check(preprocess(f, cfg), ref)


def test_exif_orientation(tmp_path):
    """A file is turned upright (load_image); an already-open PIL image is taken as it is."""
    path = tmp_path / "rotated.jpg"
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 degrees clockwise to view
    Image.fromarray(_rgb(60, 150)).save(path, "JPEG", exif=exif)
    cfg = ImageProcessorConfig(4, 2, 70)
    proc = vo.image_processor(4, 2, 70)
    upright = preprocess(path, cfg)
    _check(upright, vo.reference_patches(str(path), proc))
    assert upright.grid[0] > upright.grid[1]  # taller than wide once turned
    with Image.open(path) as im:
        _check(preprocess(im, cfg), vo.reference_patches(im, proc))


@pytest.mark.parametrize("channels", [None, 1, 3, 4])
def test_uint8_arrays_match_processor(channels):
    for i, (h, w) in enumerate([(37, 53), (300, 200), (64, 64), (211, 97)]):
        a = _rgb(h, w, i)
        if channels == 4:
            a = np.concatenate([a, np.linspace(0, 255, h * w).reshape(h, w, 1).astype(np.uint8)], -1)
        elif channels in (None, 1):
            a = a[..., :1]
        patch, k, soft = SETTINGS[i % len(SETTINGS)]
        proc = vo.image_processor(patch, k, soft)
        ref = vo.reference_patches(a, proc, input_data_format="channels_last")  # [H, W, 1]: the reference has no 2-D path
        _check(preprocess(a[..., 0] if channels is None else a, ImageProcessorConfig(patch, k, soft)), ref)


@pytest.mark.parametrize("soft", SUPPORTED_SOFT_TOKENS)
def test_default_geometry_every_budget(soft):
    """Gemma 4's 16 x 16 patches and 3 x 3 pooling, every budget; the config's budget
    overridden per call, as the processor's call keyword does."""
    im = make_image("RGB", 480, 640, soft)
    ref = vo.reference_patches(im, vo.image_processor(16, 3, 280), max_soft_tokens=soft)
    ours = preprocess(im, ImageProcessorConfig(), max_soft_tokens=soft)
    _check(ours, ref)
    assert ours.num_soft_tokens <= soft and ours.pixels.shape[1] == 768


def test_target_size_matches_reference():
    from transformers.models.gemma4.image_processing_pil_gemma4 import get_aspect_ratio_preserving_size

    rng = np.random.RandomState(0)
    sizes = [(int(h), int(w)) for h, w in np.exp(rng.uniform(0, math.log(6000), (400, 2)))] + \
        [(1, 2), (2, 1), (1, 10000), (9000, 3), (48, 48), (47, 49)]
    for patch, k in ((16, 3), (4, 2), (14, 1), (8, 4)):
        for soft in SUPPORTED_SOFT_TOKENS:
            cfg = ImageProcessorConfig(patch, k, soft)
            for h, w in sizes:
                assert target_size(h, w, cfg) == get_aspect_ratio_preserving_size(h, w, patch, soft * k * k, k)


def test_processor_config_from_folder(tmp_path):
    vision = {"patch_size": 8, "pooling_kernel_size": 2}
    assert ImageProcessorConfig.from_folder(tmp_path, vision) == ImageProcessorConfig(8, 2, 280)
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({"max_soft_tokens": 140, "patch_size": 16}))
    assert ImageProcessorConfig.from_folder(tmp_path, vision) == ImageProcessorConfig(16, 2, 140)
    (tmp_path / "processor_config.json").write_text(json.dumps(
        {"image_seq_length": 280, "image_processor": {"max_soft_tokens": 560, "pooling_kernel_size": 3, "resample": 3}}))
    assert ImageProcessorConfig.from_folder(tmp_path, vision) == ImageProcessorConfig(8, 3, 560)
    (tmp_path / "processor_config.json").write_text(json.dumps({"image_processor": {"max_soft_tokens": 100}}))
    with pytest.raises(ConfigError, match="processor_config.json: max_soft_tokens must be one of"):
        ImageProcessorConfig.from_folder(tmp_path)
    (tmp_path / "processor_config.json").write_text(json.dumps({"image_processor": {"do_normalize": True, "image_mean": [0.5] * 3}}))
    with pytest.raises(ConfigError, match="do_normalize"):
        ImageProcessorConfig.from_folder(tmp_path)
    with pytest.raises(ValueError, match="max_soft_tokens must be one of"):
        preprocess(make_image("RGB", 20, 20), max_soft_tokens=300)


# ------------------------------------------------------------------------------------------
# bad images
# ------------------------------------------------------------------------------------------

def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)


def png_header_only(w: int, h: int) -> bytes:
    """A PNG that claims ``w x h`` RGB pixels and holds almost no data (a decompression bomb's header)."""
    return (b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0))
            + _chunk(b"IDAT", zlib.compress(b"\0" * 64)) + _chunk(b"IEND", b""))


def _encoded(fmt: str, h: int = 40, w: int = 60) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(_rgb(h, w)).save(buf, fmt)
    return buf.getvalue()


BAD = [
    ("text bytes", lambda: b"this is not a picture at all", "not an image"),
    ("empty bytes", lambda: b"", "not an image"),
    ("truncated PNG", lambda: _encoded("PNG")[:300], "truncated or corrupt"),
    ("truncated JPEG", lambda: _encoded("JPEG")[:400], "truncated or corrupt"),
    ("1x1 PNG", lambda: _encoded("PNG", 1, 1), "1x1"),
    ("1x1 PIL", lambda: Image.new("RGB", (1, 1)), "1x1"),
    ("1x1 array", lambda: np.zeros((1, 1, 3), np.uint8), "1x1"),
    ("0x0 PIL", lambda: Image.new("RGB", (0, 0)), "empty image"),
    ("0-row array", lambda: np.zeros((0, 5, 3), np.uint8), "empty image"),
    ("50000x50000 PNG", lambda: png_header_only(50000, 50000), "too many pixels|more than"),
    ("unsupported mode", lambda: Image.new("La", (8, 8)), "unsupported mode 'La'"),
    ("float array", lambda: np.zeros((8, 8, 3), np.float32), "dtype float32"),
    ("16-bit array", lambda: np.zeros((8, 8, 3), np.uint16), "dtype uint16"),
    ("two-channel array", lambda: np.zeros((8, 8, 2), np.uint8), r"shape \(8, 8, 2\)"),
    ("missing path", lambda: "/nonexistent/picture.png", "no such image file"),
    ("wrong type", lambda: 42, "not an image input: int"),
]


@pytest.mark.parametrize("name,make,message", BAD, ids=[b[0] for b in BAD])
def test_bad_images(name, make, message):
    with pytest.raises(ImageError, match=message) as e:
        preprocess(make())
    assert isinstance(e.value, ValueError) and "\n" not in str(e.value)


def test_bomb_refused_from_header_without_decoding(monkeypatch):
    """Our limit holds even with Pillow's own guard off, and nothing is decoded (load is never
    called), for a file path as for bytes."""
    import PIL.ImageFile

    def no_decoding(self):
        raise AssertionError("decoded an image that should have been refused")

    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", None)
    monkeypatch.setattr(PIL.ImageFile.ImageFile, "load", no_decoding)
    with pytest.raises(ImageError, match="50000x50000 pixels is more than"):
        preprocess(png_header_only(50000, 50000))
    with pytest.raises(ImageError, match="30x20 pixels is more than the 500 allowed"):
        preprocess(_encoded("PNG", 20, 30), max_pixels=500)
