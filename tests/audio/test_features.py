"""Log-mel features against transformers' Gemma4AudioFeatureExtractor, and the soft-token count
against Gemma4Processor's placeholder count."""
from __future__ import annotations

import math

import numpy as np
import pytest

from gemmalite.audio.decode import load_audio
from gemmalite.errors import AudioError
from gemmalite.audio.features import WINDOW_SAMPLES, log_mel, soft_token_count, windows

pytest.importorskip("transformers")
from transformers.models.gemma4.feature_extraction_gemma4 import Gemma4AudioFeatureExtractor  # noqa: E402

FE = Gemma4AudioFeatureExtractor()
LENGTHS = [1, 159, 160, 161, 16000, 480000, 496000]  # samples: 1 s, 30 s, 31 s at the end


def _speechy(n: int, seed: int) -> np.ndarray:
    """Tones, a glide and noise: every mel band gets energy, and some frames are near silent."""
    rng = np.random.default_rng(seed)
    t = np.arange(n) / 16000
    x = 0.3 * np.sin(2 * np.pi * (200 + 300 * t) * t) + 0.1 * np.sin(2 * np.pi * 3100 * t)
    x *= 0.5 + 0.5 * np.sin(2 * np.pi * 1.3 * t)
    return x + 0.02 * rng.standard_normal(n)


def _reference(x: np.ndarray, truncate: bool = True) -> tuple[np.ndarray, int]:
    out = FE([x]) if truncate else FE([x], truncation=False, max_length=None)
    return out["input_features"][0], int(out["input_features_mask"][0].sum())


def _assert_close(ours: tuple[np.ndarray, int], ref: tuple[np.ndarray, int]) -> None:
    (f, v), (r, rv) = ours, ref
    assert f.dtype == np.float32 and f.shape == r.shape and v == rv, (f.shape, r.shape, v, rv)
    if r.size:
        assert np.abs(f - r).max() <= 1e-5 * np.abs(r).max()
        assert (f[v:] == 0).all()


@pytest.mark.parametrize("n", LENGTHS)
@pytest.mark.parametrize("kind", ["float32", "float64", "int16", "stereo"])
def test_features_match_the_extractor(n, kind):
    x = _speechy(n, n)
    if kind == "int16":
        given = np.round(x * 32767).astype(np.int16)
        ref_in = given.astype(np.float32) / np.float32(32768)  # soundfile's scaling
    elif kind == "stereo":
        given = np.stack([x, 0.5 * _speechy(n, n + 1)], 1).astype(np.float32)
        ref_in = given.T.mean(axis=0)
    else:
        given = x.astype(kind)
        ref_in = given
    samples = load_audio(given)
    assert samples.dtype == np.float32 and samples.shape == (n,)
    ours = log_mel(samples)
    if n <= WINDOW_SAMPLES:
        _assert_close(ours, _reference(ref_in))
    else:  # the reference truncates at 30 s; untruncated, it is the whole clip; each window is a clip
        _assert_close(ours, _reference(ref_in, truncate=False))
        for a, b in windows(n):
            _assert_close(log_mel(samples[a:b]), _reference(ref_in[a:b]))


def test_soft_token_count_is_the_processors():
    """``Gemma4Processor.replace_audio_token``'s count (the valid mask after two ``[::2]``) for clips
    up to 30 s; a longer clip counts its 30 s windows."""
    for n in [1, 160, 161, 320, 321, 480, 481, 639, 640, 641, 799, 16000, 16161, 160000, 479999, 480000]:
        mask = FE([np.zeros(n, np.float32)])["input_features_mask"][0]
        for _ in range(2):  # replace_audio_token's subsampling of the mask
            mask = mask[::2][:(len(mask) + 2 - 3) // 2 + 1]
        assert soft_token_count(n) == int(mask.sum()) == math.ceil(max(0, math.ceil(n / 160) - 1) / 4), n
    assert soft_token_count(16000) == 25 and soft_token_count(480000) == 750
    assert soft_token_count(480000 + 16000) == 750 + 25
    assert windows(2 * WINDOW_SAMPLES + 5) == [(0, WINDOW_SAMPLES), (WINDOW_SAMPLES, 2 * WINDOW_SAMPLES),
                                               (2 * WINDOW_SAMPLES, 2 * WINDOW_SAMPLES + 5)]


@pytest.mark.parametrize("x", [np.zeros((10, 2), np.float32), np.zeros(10, np.int16), np.array([0.0, np.nan])])
def test_log_mel_refuses_what_load_audio_would_not_give(x):
    with pytest.raises(AudioError):
        log_mel(x)
