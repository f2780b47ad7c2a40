"""Audio in -> float32 mono samples at 16 kHz, as transformers' ``load_audio`` (soundfile backend).

The reference is ``transformers.audio_utils._load_audio_soundfile``: soundfile decodes (WAV,
FLAC, OGG, MP3, whatever the bundled libsndfile reads) to float32, channels are averaged, and a
clip at another rate is resampled with ``soxr.resample(..., quality="soxr_hq")`` and padded /
trimmed to ``ceil(n * 16000 / rate)`` samples. Arrays given at 16 kHz are taken as they are
(int16 / int32 scaled to [-1, 1) as soundfile scales them, float converted to float32).

Bad audio raises `AudioError` naming the problem; a file whose header claims more than
``max_seconds`` is refused from the header, before anything is decoded. A truncated file is one
that decodes to fewer samples than its header claims (an MP3's header count is an estimate: 2 %
slack) or, for WAV, whose data chunk claims more bytes than the file holds (libsndfile reads
those without complaint).
"""
from __future__ import annotations

import io
import math
import os
import struct
from typing import Any, BinaryIO, Union

import numpy as np

from ..errors import AudioError

SAMPLE_RATE = 16000
MAX_CHANNELS = 32  # a 2-D array wider than this is taken for channel-first audio and refused
_INT_SCALE = {np.dtype(np.int16): 2.0**15, np.dtype(np.int32): 2.0**31}
#: an MP3's length in its header is an estimate (exact with a Xing / Info frame, as LAME writes):
#: a complete file may decode a little short of it, so a cut is called one past this slack
_MP3_SLACK_FRAMES, _MP3_SLACK_SHARE = 2 * 1152, 0.02

AudioInput = Union[str, os.PathLike, bytes, bytearray, memoryview, BinaryIO, np.ndarray, tuple]


def _soundfile():
    try:
        import soundfile
    except ImportError:  # pragma: no cover - a dependency of the audio extra
        raise ImportError("audio files need soundfile: pip install 'gemmalite[audio]'") from None
    return soundfile


def _resample(x: np.ndarray, rate: int) -> np.ndarray:
    """float32 mono at ``rate`` -> 16 kHz, as transformers does it (soxr_hq, then pad / trim)."""
    if rate == SAMPLE_RATE:
        return x
    try:
        import soxr
    except ImportError:  # pragma: no cover - a dependency of the audio extra
        raise ImportError("resampling audio needs soxr: pip install 'gemmalite[audio]'") from None
    n = math.ceil(x.shape[-1] * SAMPLE_RATE / rate)
    y = soxr.resample(x, rate, SAMPLE_RATE, quality="soxr_hq")
    return np.pad(y, (0, max(0, n - len(y))))[:n]


def _check_length(seconds: float, max_seconds: float | None, where: str, what: str) -> None:
    if max_seconds is not None and seconds > max_seconds:
        raise AudioError(f"{where}: {what} {seconds:.1f} s of audio, more than the {max_seconds:g} s allowed")


def _finish(x: np.ndarray, where: str) -> np.ndarray:
    if x.shape[0] == 0:
        raise AudioError(f"{where}: the audio has no samples")
    if not np.isfinite(x).all():
        raise AudioError(f"{where}: the audio has NaN or infinite samples")
    return np.ascontiguousarray(x, dtype=np.float32)


def _from_array(a: np.ndarray, rate: Any, max_seconds: float | None) -> np.ndarray:
    where = "audio array"
    if isinstance(rate, bool) or not isinstance(rate, (int, np.integer)):
        raise AudioError(f"{where}: the sample rate must be an int, got {type(rate).__name__}")
    if rate <= 0:
        raise AudioError(f"{where}: a sample rate of {rate} Hz")
    if a.dtype.kind == "f":
        x = a.astype(np.float32)
    elif a.dtype in _INT_SCALE:
        x = (a.astype(np.float64) / _INT_SCALE[a.dtype]).astype(np.float32)
    else:
        raise AudioError(f"{where}: samples of dtype {a.dtype} are not supported (float, int16 or int32)")
    if x.ndim == 2:
        if x.shape[1] > MAX_CHANNELS:
            raise AudioError(f"{where}: a 2-D array is (samples, channels), as soundfile returns it; "
                             f"{x.shape} has {x.shape[1]} channels (transpose channel-first audio)")
        if x.shape[1] == 0:
            raise AudioError(f"{where}: the audio has no channels")
        x = x.mean(axis=1, dtype=np.float32) if x.shape[1] > 1 else x[:, 0]
    elif x.ndim != 1:
        raise AudioError(f"{where}: expected 1-D samples or (samples, channels), got shape {a.shape}")
    _check_length(x.shape[0] / rate, max_seconds, where, "holds")
    x = _finish(x, where)  # before resampling: soxr would spread a NaN, or fail on no samples
    return _finish(_resample(x, int(rate)), where)


def _wav_problem(head: bytes, size: int) -> str | None:
    """For a RIFF/WAVE file of ``size`` bytes starting with ``head``: what is wrong with its header
    that libsndfile would not say (a sample rate of 0: "SF_INFO struct incomplete") or would read
    without complaint (a data chunk claiming more bytes than the file holds: truncated), else None."""
    if len(head) < 12 or head[:4] != b"RIFF" or head[8:12] != b"WAVE":
        return None
    pos = 12
    while pos + 8 <= len(head):
        tag, n = head[pos:pos + 4], struct.unpack("<I", head[pos + 4:pos + 8])[0]
        if tag == b"fmt " and pos + 16 <= len(head) and struct.unpack("<I", head[pos + 12:pos + 16])[0] == 0:
            return "a sample rate of 0 Hz in its header"
        if tag == b"data":
            if n not in (0, 0xFFFFFFFF) and pos + 8 + n > size:  # 0 / -1: a stream's size left unset
                return f"truncated WAV file (its data chunk claims {n} bytes, the file holds {size - pos - 8})"
            return None
        pos += 8 + n + (n & 1)
    return None


def _open(source: Any) -> tuple[Any, str, bytes, int]:
    """(what soundfile opens, a name for messages, the first bytes, the size in bytes)."""
    if isinstance(source, (str, os.PathLike)):
        path = os.fspath(source)
        if isinstance(path, str) and path.startswith(("http://", "https://")):
            raise AudioError(f"{path}: audio URLs are not fetched; give a local path or the bytes")
        if not os.path.isfile(path):
            raise AudioError(f"{path}: no such audio file")
        with open(path, "rb") as f:
            head = f.read(1 << 16)
        return path, str(path), head, os.path.getsize(path)
    if isinstance(source, (bytes, bytearray, memoryview)):
        data = bytes(source)
    elif hasattr(source, "read"):
        data = source.read()
        if not isinstance(data, (bytes, bytearray)):
            raise AudioError("audio file object: opened in text mode (open it with 'rb')")
        data = bytes(data)
    else:
        raise AudioError(f"not an audio input: {type(source).__name__} (expected a path, bytes, a file object, "
                         "a numpy array at 16 kHz or (array, sample_rate))")
    return io.BytesIO(data), "audio bytes", data[:1 << 16], len(data)


def load_audio(source: AudioInput, *, max_seconds: float | None = None) -> np.ndarray:
    """float32 mono samples at 16 kHz.

    ``source``: a path (str / Path), bytes, a binary file object (read whole), a float / int16 /
    int32 numpy array at 16 kHz (1-D, or ``(samples, channels)``), or ``(array, sample_rate)``.
    Channels are averaged; other rates resampled as transformers does (soxr_hq). ``max_seconds``
    bounds the clip's length (files: refused from the header, before decoding). Raises
    `AudioError` for anything that is not usable audio."""
    if max_seconds is not None and not max_seconds > 0:
        raise AudioError(f"max_seconds must be positive, got {max_seconds}")
    if isinstance(source, tuple):
        if len(source) != 2 or not isinstance(source[0], np.ndarray):
            raise AudioError("an audio tuple is (numpy array, sample_rate)")
        return _from_array(source[0], source[1], max_seconds)
    if isinstance(source, np.ndarray):
        return _from_array(source, SAMPLE_RATE, max_seconds)
    sf = _soundfile()
    target, where, head, size = _open(source)
    if size == 0:
        raise AudioError(f"{where}: empty file")
    problem = _wav_problem(head, size)
    if problem:
        raise AudioError(f"{where}: {problem}")
    try:
        with sf.SoundFile(target) as f:
            rate, frames, fmt = f.samplerate, f.frames, f.format
            if rate <= 0:
                raise AudioError(f"{where}: a sample rate of {rate} Hz")
            _check_length(frames / rate, max_seconds, where, "its header claims")
            x = f.read(dtype="float32", always_2d=True)
    except AudioError:
        raise
    except (sf.LibsndfileError, RuntimeError, TypeError, ValueError, OSError) as e:
        raise AudioError(f"{where}: cannot decode the audio, not audio or truncated / corrupt ({e})") from None
    slack = max(_MP3_SLACK_FRAMES, int(_MP3_SLACK_SHARE * frames)) if fmt == "MP3" else 0
    if x.shape[0] + slack < frames:
        raise AudioError(f"{where}: truncated {fmt} file (its header claims {frames} samples, {x.shape[0]} decoded)")
    if x.shape[1] == 0:
        raise AudioError(f"{where}: the audio has no channels")
    x = x.mean(axis=1) if x.shape[1] > 1 else x[:, 0]
    x = _finish(x, where)
    return _finish(_resample(x, rate), where)
