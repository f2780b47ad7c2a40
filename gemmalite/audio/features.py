"""16 kHz samples -> log-mel features, as transformers' ``Gemma4AudioFeatureExtractor`` (numpy).

The reference is ``transformers/models/gemma4/feature_extraction_gemma4.py`` with the
published settings: samples (float32) padded right to a multiple of 128, 160 zeros
prepended, frames of 321 samples every 160 with the last sample dropped (320), a periodic
Hann window, ``|rfft(n=512)|``, 128 HTK mel bands over 0-8000 Hz (float64 filters), then
``ln(mel + 1e-3)``. Frame ``i`` is valid when sample ``160 i + 160`` is real audio (not
padding), so a clip of ``n`` samples has ``ceil(n / 160) - 1`` valid frames; the others are 0.

The reference truncates a clip at 30 s (480,000 samples); `log_mel` does not (the tower
encodes a longer clip in consecutive 30 s windows, see `windows`).
"""
from __future__ import annotations

import math

import numpy as np

from ..errors import AudioError
from ..kernels.numba_ops import sparse_bands

SAMPLE_RATE = 16000
FRAME, HOP, FFT, MEL_BINS = 320, 160, 512, 128
PAD_MULTIPLE = 128
MEL_FLOOR = 1e-3
WINDOW_SAMPLES = 30 * SAMPLE_RATE  # the reference's longest clip (its max_length)
#: the tower's time subsampling: two stride-2 convolutions (kernel 3, padding 1)
SUBSAMPLING = 4


def _hz_to_mel(f):
    return 2595.0 * np.log10(1.0 + f / 700.0)


def _mel_to_hz(m):
    return 700.0 * (np.power(10, m / 2595.0) - 1.0)


def mel_filters(num_bins: int = FFT // 2 + 1, num_mel: int = MEL_BINS, f_min: float = 0.0,
                f_max: float = 8000.0, rate: int = SAMPLE_RATE) -> np.ndarray:
    """float64 ``[num_bins, num_mel]`` triangular HTK filters, unnormalised (transformers'
    ``mel_filter_bank(norm=None, mel_scale="htk")``)."""
    filter_freqs = _mel_to_hz(np.linspace(_hz_to_mel(f_min), _hz_to_mel(f_max), num_mel + 2))
    fft_freqs = np.linspace(0, rate // 2, num_bins)
    diff = np.diff(filter_freqs)
    slopes = filter_freqs[None, :] - fft_freqs[:, None]
    down, up = -slopes[:, :-2] / diff[:-1], slopes[:, 2:] / diff[1:]
    return np.maximum(np.zeros(1), np.minimum(down, up))


def band_ranges(filters: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(lo, hi) int64 ``[num_bins]``: the bands ``lo .. hi - 1`` each bin of ``filters`` weighs
    (nothing outside them), as `numba_ops.sparse_bands` takes them."""
    spans = [(nz[0], nz[-1] + 1) if nz.size else (0, 0) for nz in map(np.flatnonzero, filters)]
    return np.array([a for a, _ in spans], np.int64), np.array([b for _, b in spans], np.int64)


_FILTERS = mel_filters()
_BANDS = band_ranges(_FILTERS)
_WINDOW = np.hanning(FRAME + 1)[:-1].astype(np.float32)  # periodic Hann


def valid_frames(num_samples: int) -> int:
    """Frames of a clip of ``num_samples`` whose whole analysis window is real audio."""
    return max(0, math.ceil(num_samples / HOP) - 1)


def log_mel(samples: np.ndarray) -> tuple[np.ndarray, int]:
    """(float32 ``[frames, 128]`` log-mel features, the number of valid frames) of one clip of
    float32 mono samples at 16 kHz (as `load_audio` returns them). ``frames`` counts the
    reference's padding to a multiple of 128 samples too; frames past the valid ones are 0,
    and only the valid ones reach the tower."""
    x = np.asarray(samples)
    if x.ndim != 1 or x.dtype.kind != "f":
        raise AudioError(f"log_mel takes 1-D float samples at 16 kHz (load_audio makes them), got {x.dtype} {x.shape}")
    x = x.astype(np.float32, copy=False)
    if not np.isfinite(x).all():
        raise AudioError("the audio has NaN or infinite samples")
    n = x.shape[0]
    padded = -(-n // PAD_MULTIPLE) * PAD_MULTIPLE
    wave = np.zeros(FRAME // 2 + padded, np.float32)
    wave[FRAME // 2:FRAME // 2 + n] = x
    count = (wave.shape[0] - (FRAME + 1)) // HOP + 1
    if count <= 0:
        return np.zeros((0, MEL_BINS), np.float32), 0
    frames = np.lib.stride_tricks.as_strided(wave, (count, FRAME), (wave.strides[0] * HOP, wave.strides[0]))
    spec = np.abs(np.fft.rfft(frames * _WINDOW, n=FFT, axis=-1))
    mel = np.empty((count, MEL_BINS), np.float64)
    sparse_bands(spec, _BANDS[0], _BANDS[1], _FILTERS, mel)  # spec @ _FILTERS, without BLAS
    feats = np.log(mel + np.float64(MEL_FLOOR)).astype(np.float32)
    valid = min(valid_frames(n), count)
    feats[valid:] = 0.0
    return feats, valid


def windows(num_samples: int) -> list[tuple[int, int]]:
    """The ``[start, stop)`` sample ranges a clip is encoded in: consecutive 30 s windows (the
    last one shorter), each encoded as the reference encodes a clip of that length."""
    return [(s, min(s + WINDOW_SAMPLES, num_samples)) for s in range(0, num_samples, WINDOW_SAMPLES)]


def tokens_for_frames(valid: int) -> int:
    """Soft tokens the tower gives for ``valid`` feature frames: ``ceil(valid / 4)`` (the valid
    mask after two ``[::2]`` steps, as ``Gemma4Processor.replace_audio_token`` counts them)."""
    return -(-valid // SUBSAMPLING)


def soft_token_count(num_samples: int) -> int:
    """``<|audio|>`` placeholders (= rows `AudioTower.encode` returns) for a clip of
    ``num_samples`` at 16 kHz: ``ceil(valid_frames / 4)`` per 30 s window, summed (25 a second,
    750 for 30 s; a clip of 160 samples or fewer gives 0)."""
    return sum(tokens_for_frames(valid_frames(b - a)) for a, b in windows(int(num_samples)))
