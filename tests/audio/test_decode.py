"""load_audio: every container soundfile writes decodes as transformers' loader decodes it (and to
the samples written, lossy codecs within a stated bound); every bad input raises AudioError."""
from __future__ import annotations

import io
import numpy as np
import pytest

from gemmalite.audio.decode import load_audio
from gemmalite.errors import AudioError

sf = pytest.importorskip("soundfile")

RATE = 16000
#: (format, subtype, bound on the rms error relative to the signal's rms: lossy codecs)
CONTAINERS = [("WAV", "PCM_16", None), ("WAV", "FLOAT", None), ("FLAC", "PCM_16", None),
              ("OGG", "VORBIS", 0.05), ("OGG", "OPUS", 0.1), ("MP3", "MPEG_LAYER_III", 0.05)]


def _signal(n: int = 2 * RATE, rate: int = RATE) -> np.ndarray:
    t = np.arange(n) / rate
    return (0.3 * np.sin(2 * np.pi * 440 * t) + 0.2 * np.sin(2 * np.pi * 1234 * t)).astype(np.float32)


def _write(x: np.ndarray, rate: int, fmt: str, subtype: str) -> bytes:
    b = io.BytesIO()
    sf.write(b, x, rate, format=fmt, subtype=subtype)
    return b.getvalue()


@pytest.mark.parametrize("fmt,subtype,bound", CONTAINERS, ids=[f"{f}-{s}" for f, s, _ in CONTAINERS])
def test_containers_decode_to_the_samples_written(tmp_path, fmt, subtype, bound):
    from transformers.audio_utils import load_audio as hf_load_audio

    if fmt not in sf.available_formats() or subtype not in sf.available_subtypes(fmt):
        pytest.skip(f"this libsndfile does not write {fmt}/{subtype}")
    x = _signal()
    data = _write(x, RATE, fmt, subtype)
    path = tmp_path / f"clip.{fmt.lower()}"
    path.write_bytes(data)
    got = load_audio(path)
    assert got.dtype == np.float32 and got.shape == x.shape
    for other in (str(path), data, bytearray(data), io.BytesIO(data), open(path, "rb")):
        assert np.array_equal(load_audio(other), got)
    assert np.array_equal(got, hf_load_audio(str(path), backend="soundfile"))
    if bound is None:  # lossless: the samples, up to 16-bit quantization
        assert np.abs(got - x).max() <= (0 if subtype == "FLOAT" else 1.0 / 32768 + 1e-7)
    else:
        assert np.sqrt(np.mean((got - x) ** 2) / np.mean(x**2)) <= bound


@pytest.mark.parametrize("rate,channels", [(44100, 2), (8000, 1), (48000, 3)])
def test_resampled_and_downmixed_as_transformers(tmp_path, rate, channels):
    from transformers.audio_utils import load_audio as hf_load_audio

    x = np.stack([_signal(rate, rate) * (c + 1) / channels for c in range(channels)], 1)
    path = tmp_path / "clip.wav"
    sf.write(path, x, rate, subtype="FLOAT")
    got = load_audio(path)
    ref = hf_load_audio(str(path), backend="soundfile")
    assert got.shape == ref.shape == (RATE,) and np.array_equal(got, ref)
    # the same clip as an array with its rate
    assert np.array_equal(load_audio((x, rate)), ref)


def test_arrays_at_16k():
    x = _signal(1000)
    assert np.array_equal(load_audio(x), x)
    assert np.array_equal(load_audio(x.astype(np.float64)), x)
    i16 = (x * 32767).astype(np.int16)
    assert np.array_equal(load_audio(i16), i16 / np.float32(32768))
    assert np.array_equal(load_audio((x, 16000)), x)
    stereo = np.stack([x, -x * 0.5], 1)
    assert np.allclose(load_audio(stereo), x * 0.25, atol=1e-7)
    assert np.array_equal(load_audio(x[:, None]), x)


def test_header_claiming_too_long_is_refused_before_decoding(tmp_path, monkeypatch):
    path = tmp_path / "long.wav"
    sf.write(path, np.zeros(100_000, np.int16), 1, subtype="PCM_16")  # 100,000 s at 1 Hz, 200 kB
    monkeypatch.setattr(sf.SoundFile, "read", lambda *a, **k: pytest.fail("decoded"))
    with pytest.raises(AudioError, match=r"header claims 100000.0 s .* more than the 3600 s allowed"):
        load_audio(path, max_seconds=3600)


def test_arrays_past_max_seconds_are_refused():
    with pytest.raises(AudioError, match="more than the 1 s allowed"):
        load_audio(np.zeros(16001, np.float32), max_seconds=1)
    with pytest.raises(AudioError, match="more than the 1 s allowed"):
        load_audio((np.zeros(44101, np.float32), 44100), max_seconds=1)
    assert load_audio(np.zeros(16000, np.float32), max_seconds=1).shape == (16000,)


def _bad_files() -> dict[str, tuple[bytes, str]]:
    x = _signal(RATE)
    wav, flac = (_write(x, RATE, f, s) for f, s in (("WAV", "PCM_16"), ("FLAC", "PCM_16")))
    mp3 = _write(x, RATE, "MP3", "MPEG_LAYER_III") if "MP3" in sf.available_formats() else None
    rate0 = bytearray(wav)
    rate0[24:28] = b"\0\0\0\0"  # the fmt chunk's sample rate
    return {k: v for k, v in {
        "text": (b"hello, this is not audio" * 20, "cannot decode"),
        "empty": (b"", "empty file"),
        "wav-header-cut": (wav[:20], "cannot decode"),
        "wav-data-cut": (wav[: len(wav) // 2], "truncated WAV"),
        "flac-cut": (flac[: len(flac) // 2], "cannot decode"),
        "mp3-cut": (mp3[: len(mp3) // 2] if mp3 else None, "truncated MP3"),
        "rate-0": (bytes(rate0), "sample rate of 0 Hz"),
        "no-samples": (_write(np.zeros(0, np.float32), RATE, "WAV", "PCM_16"), "no samples"),
        "nan": (_write(np.array([0.0, np.nan, 0.5], np.float32), RATE, "WAV", "FLOAT"), "NaN or infinite"),
        "inf": (_write(np.array([0.0, np.inf, 0.5], np.float32), RATE, "WAV", "FLOAT"), "NaN or infinite"),
        "unsupported-format": (b"RIFF\x24\x00\x00\x00WAVEfmt \x10\x00\x00\x00\x55\x00\x01\x00\x80\x3e\x00\x00"
                               b"\x00\x7d\x00\x00\x02\x00\x10\x00data\x00\x00\x00\x00", "cannot decode"),
    }.items() if v[0] is not None}


@pytest.mark.parametrize("name", list(_bad_files()))
def test_bad_files_raise_audio_error(tmp_path, name):
    data, message = _bad_files()[name]
    with pytest.raises(AudioError, match=message):
        load_audio(data)
    path = tmp_path / "bad.wav"
    path.write_bytes(data)
    with pytest.raises(AudioError, match=message):
        load_audio(path)


@pytest.mark.parametrize("source,message", [
    (np.zeros(0, np.float32), "no samples"),
    (np.array([0.0, np.nan], np.float32), "NaN or infinite"),
    (np.array([0.0, -np.inf]), "NaN or infinite"),
    (np.zeros(10, np.uint8), "dtype uint8 are not supported"),
    (np.zeros(10, np.int64), "dtype int64 are not supported"),
    (np.zeros(10, np.complex64), "dtype complex64 are not supported"),
    (np.zeros(10, bool), "dtype bool are not supported"),
    (np.zeros(10, object), "dtype object are not supported"),
    (np.zeros((2, 16000), np.float32), "channel-first"),
    (np.zeros((10, 0), np.float32), "no channels"),
    (np.zeros((2, 3, 4), np.float32), "expected 1-D samples"),
    ((np.zeros(10, np.float32), 0), "sample rate of 0 Hz"),
    ((np.zeros(10, np.float32), -8000), "sample rate of -8000 Hz"),
    ((np.zeros(10, np.float32), 16000.0), "must be an int"),
    ((np.zeros(10, np.float32),), "numpy array, sample_rate"),
    (("clip.wav", 16000), "numpy array, sample_rate"),
    ("http://example.com/a.wav", "URLs are not fetched"),
    ("/nonexistent/clip.wav", "no such audio file"),
    (12, "not an audio input: int"),
    ([0.0, 0.1], "not an audio input: list"),
])
def test_bad_inputs_raise_audio_error(source, message):
    with pytest.raises(AudioError, match=message):
        load_audio(source)


def test_text_mode_file_and_bad_max_seconds(tmp_path):
    path = tmp_path / "a.txt"
    path.write_text("not audio")
    with open(path) as f, pytest.raises(AudioError, match="text mode"):
        load_audio(f)
    with pytest.raises(AudioError, match="max_seconds must be positive"):
        load_audio(np.zeros(10, np.float32), max_seconds=0)


def test_audio_error_is_a_value_error():
    assert issubclass(AudioError, ValueError)
