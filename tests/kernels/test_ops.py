"""The numba attention path against the batched numpy (BLAS) path it stands in for."""
import numpy as np
import pytest

from gemmalite.kernels import common
from gemmalite.kernels import ops as kernels


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("t", [1, 3, 24])
def test_numba_attention_matches_batched(t, window, monkeypatch):
    rng = np.random.default_rng(t)
    nq, kv, d, n = 8, 2, 16, 24
    q = rng.standard_normal((t, nq, d)).astype(np.float32)
    k = rng.standard_normal((n, kv, d)).astype(np.float32)
    v = rng.standard_normal((n, kv, d)).astype(np.float32)
    k_pos = rng.permutation(n).astype(np.int64)  # a ring: slot order is not position order
    k_pos[[2, 7]] = -1  # empty slots
    q_pos = np.arange(n - t, n, dtype=np.int64)
    fast = kernels.attention(q, k, v, q_pos, k_pos, window, 0.25)
    monkeypatch.setattr(common, "FEW_ROWS", 0)
    ref = kernels.attention(q, k, v, q_pos, k_pos, window, 0.25, blas=True)
    np.testing.assert_allclose(fast, ref, rtol=2e-5, atol=2e-6)
    # a query that sees nothing but masked slots still gives finite numbers
    monkeypatch.setattr(common, "FEW_ROWS", 4)
    assert np.isfinite(kernels.attention(q[:1], k, v, np.array([-5]), k_pos, window, 0.25)).all()


def _qkv(rng, t, n, nq, kv, d):
    q = rng.standard_normal((t, nq, d)).astype(np.float32)
    k = rng.standard_normal((n, kv, d)).astype(np.float32)
    v = rng.standard_normal((n, kv, d)).astype(np.float32)
    return q, k, v


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
@pytest.mark.parametrize("window", [None, 37, 200])
@pytest.mark.parametrize("t,past", [(5, 0), (130, 0), (67, 150), (300, 41)])
def test_blocked_attention_matches_batched(t, past, window, causal):
    """The blocked online-softmax kernel (every prefill of a BLAS-free model, and the encoder's
    bidirectional attention) against the batched numpy path: ring order, empty slots, several
    key blocks, partial blocks, GQA."""
    rng = np.random.default_rng(t + past)
    nq, kv, d = 6, 3, 24
    n = past + t + 9  # 9 empty slots
    q, k, v = _qkv(rng, t, n, nq, kv, d)
    k_pos = np.full(n, -1, np.int64)
    k_pos[: past + t] = np.arange(past + t)
    k_pos = k_pos[rng.permutation(n)] if past else k_pos  # a wrapped ring: slots out of order
    q_pos = np.arange(past, past + t, dtype=np.int64)
    fast = kernels.attention(q, k, v, q_pos, k_pos, window, 0.3, causal=causal)
    ref = kernels.attention(q, k, v, q_pos, k_pos, window, 0.3, blas=True, causal=causal)
    np.testing.assert_allclose(fast, ref, rtol=2e-5, atol=3e-6)
    # float64 softmax of the same inputs: both float32 paths are close to it
    q64, k64, v64 = (a.astype(np.float64) for a in (q, k, v))
    g = nq // kv
    for i in (0, t // 2, t - 1):
        vis = (k_pos >= 0) & ((k_pos <= q_pos[i]) if causal else True)
        if window:
            vis &= (k_pos > q_pos[i] - window) if causal else (np.abs(k_pos - q_pos[i]) <= window)
        for h in (0, nq - 1):
            sc = k64[vis, h // g] @ q64[i, h] * 0.3
            p = np.exp(sc - sc.max())
            o = (p / p.sum()) @ v64[vis, h // g]
            np.testing.assert_allclose(fast[i, h * d : (h + 1) * d], o, rtol=1e-5, atol=2e-6)


def test_blocked_attention_skips_blocks_out_of_reach():
    """A sliding layer reads only the key blocks inside the window: poison (NaN) every key
    and value that no query can see, in whole blocks, and the result does not change."""
    from gemmalite.kernels.numba_ops import KEY_BLOCK

    rng = np.random.default_rng(5)
    t, window, nq, kv, d = 40, 24, 4, 1, 16
    old = 4 * KEY_BLOCK  # positions far behind every query's window
    n = old + t
    q, k, v = _qkv(rng, t, n, nq, kv, d)
    k_pos = np.arange(n, dtype=np.int64)
    q_pos = np.arange(old, n, dtype=np.int64)
    ref = kernels.attention(q, k, v, q_pos, k_pos, window, 0.5, blas=True)
    cut = (old - window) // KEY_BLOCK * KEY_BLOCK  # blocks wholly before the first window
    k[:cut] = np.nan
    v[:cut] = np.nan
    fast = kernels.attention(q, k, v, q_pos, k_pos, window, 0.5)
    np.testing.assert_allclose(fast, ref, rtol=2e-5, atol=3e-6)
    # causal too: a block wholly after every query is never read (empty slots up to the block edge)
    fill = (-n) % KEY_BLOCK
    k2 = np.concatenate([k, np.zeros((fill, kv, d), np.float32), np.full((KEY_BLOCK, kv, d), np.nan, np.float32)])
    v2 = np.concatenate([v, np.zeros((fill, kv, d), np.float32), np.full((KEY_BLOCK, kv, d), np.nan, np.float32)])
    p2 = np.concatenate([k_pos, np.full(fill, -1), np.arange(n + 10, n + 10 + KEY_BLOCK)])
    fast = kernels.attention(q, k2, v2, q_pos, p2, window, 0.5)
    np.testing.assert_allclose(fast, ref, rtol=2e-5, atol=3e-6)


def test_blocked_bidirectional_attention_skips_blocks_out_of_reach():
    """Bidirectional (encoder) with a radius: key blocks farther than the radius from every
    query, before and after, are never read (NaN there changes nothing)."""
    from gemmalite.kernels.numba_ops import KEY_BLOCK

    rng = np.random.default_rng(6)
    radius, nq, kv, d = 10, 2, 1, 8
    n = 8 * KEY_BLOCK
    q0, q1 = 3 * KEY_BLOCK + 20, 4 * KEY_BLOCK + 30  # queries in the middle
    q, k, v = _qkv(rng, q1 - q0, n, nq, kv, d)
    k_pos = np.arange(n, dtype=np.int64)
    q_pos = np.arange(q0, q1, dtype=np.int64)
    ref = kernels.attention(q, k, v, q_pos, k_pos, radius, 0.5, blas=True, causal=False)
    k[: 3 * KEY_BLOCK], v[: 3 * KEY_BLOCK] = np.nan, np.nan
    k[5 * KEY_BLOCK :], v[5 * KEY_BLOCK :] = np.nan, np.nan
    fast = kernels.attention(q, k, v, q_pos, k_pos, radius, 0.5, causal=False)
    np.testing.assert_allclose(fast, ref, rtol=2e-5, atol=3e-6)


def _attention64(q, k, v, q_pos, k_pos, window, scale, causal=True):
    """Reference attention in float64, one query row and head at a time (GQA by index)."""
    t, nq, d = q.shape
    g = nq // k.shape[1]
    out = np.zeros((t, nq * d))
    q64, k64, v64 = (a.astype(np.float64) for a in (q, k, v))
    for i in range(t):
        vis = (k_pos >= 0) & ((k_pos <= q_pos[i]) if causal else True)
        if window:
            vis &= (k_pos > q_pos[i] - window) if causal else (np.abs(k_pos - q_pos[i]) <= window)
        for h in range(nq):
            sc = k64[vis, h // g] @ q64[i, h] * scale
            p = np.exp(sc - sc.max())
            out[i, h * d : (h + 1) * d] = (p / p.sum()) @ v64[vis, h // g]
    return out


@pytest.mark.parametrize("window", [None, 100, 37])
@pytest.mark.parametrize("t", [1, 3])
def test_decode_attention_matches_float64_over_many_key_blocks(t, window):
    """Decode rows (`attention_decode`, split over key blocks) against float64 math: a context of
    several DECODE_BLOCKs, a wrapped ring (slots out of position order, a block straddling the
    window's edge), empty slots, GQA, rows at consecutive positions (each sees a different window)."""
    from gemmalite.kernels.numba_ops import DECODE_BLOCK

    rng = np.random.default_rng(t * 7 + (window or 0))
    nq, kv, d = 6, 2, 40
    n = 2 * DECODE_BLOCK + 45
    past = 3 * DECODE_BLOCK + 10  # positions 0..past+t-1 written, the ring keeps the last n - 5
    q, k, v = _qkv(rng, t, n, nq, kv, d)
    k_pos = np.full(n, -1, np.int64)
    keep = n - 5
    pos = np.arange(past + t - keep, past + t)
    k_pos[pos % n] = pos  # ring slots: position % size; 5 slots empty
    q_pos = np.arange(past, past + t, dtype=np.int64)
    got = kernels.attention(q, k, v, q_pos, k_pos, window, 0.3)
    np.testing.assert_allclose(got, _attention64(q, k, v, q_pos, k_pos, window, 0.3), rtol=1e-5, atol=2e-6)


@pytest.mark.parametrize("n", [93, 254])
def test_decode_rows_are_bit_identical_to_one_row_steps(n):
    """A step of several tokens (prompt-lookup verification) gives each row bit for bit what a
    one-token step gives it, although its call sees more (masked) slots (254: the step's slots
    cross into another key block)."""
    rng = np.random.default_rng(9)
    nq, kv, d = 4, 2, 64
    q, k, v = _qkv(rng, 4, n + 4, nq, kv, d)
    k_pos = np.arange(n + 4, dtype=np.int64)
    q_pos = np.arange(n, n + 4, dtype=np.int64)
    both = kernels.attention(q, k, v, q_pos, k_pos, None, 0.125)
    for i in range(4):
        alone = kernels.attention(q[i : i + 1], k[: n + i + 1], v[: n + i + 1], q_pos[i : i + 1], k_pos[: n + i + 1],
                                  None, 0.125)
        np.testing.assert_array_equal(both[i], alone[0])


@pytest.mark.parametrize("shape", [(18, 4, 256), (1, 8, 512), (37, 3, 64)])
def test_apply_rope_is_the_rotate_half_expression_to_the_bit(shape):
    from gemmalite.kernels.ops import apply_rope, rope_tables

    rng = np.random.default_rng(1)
    x = rng.standard_normal(shape).astype(np.float32)
    inv = (1.0 / 10000 ** (np.arange(shape[2] // 2) * 2 / shape[2])).astype(np.float32)
    cos, sin = rope_tables(inv, np.arange(3, 3 + shape[0]))
    half = shape[2] // 2

    def reference(x):
        x1, x2 = x[..., :half], x[..., half:]
        c, s = cos[:, None, :], sin[:, None, :]
        return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)

    assert np.array_equal(apply_rope(x, cos, sin), reference(x))
    wide = np.concatenate([x, x], axis=-1)[..., : shape[2]]  # a strided view, as the vision tower passes
    assert np.array_equal(apply_rope(wide, cos, sin), reference(wide))


def test_softmax_rows_matches_float64():
    """The fused softmax of the BLAS attention (its own vectorizing exp) against float64."""
    from numba import njit

    from gemmalite.kernels.numba_ops import exp_nonpositive, softmax_rows

    @njit
    def exps(x, out):
        for i in range(x.size):
            out[i] = exp_nonpositive(x[i])

    x = -np.concatenate([np.linspace(0, 87, 100001), [87.5, 100, 1e30]]).astype(np.float32)
    e = np.empty_like(x)
    exps(x, e)
    want = np.exp(x.astype(np.float64))
    # float32 argument reduction: relative error ~ 1.5 |x| 2^-24, plus the polynomial's few ulps
    bound = (5e-7 + 1e-7 * np.abs(x[:-3])) * want[:-3] + 1e-44
    assert np.all(np.abs(e[:-3] - want[:-3]) <= bound) and np.all(e[-3:] == 0)
    rng = np.random.default_rng(0)
    s = (rng.standard_normal((37, 203)) * 20).astype(np.float32)
    s[1, ::3] = -1e30  # masked keys
    s[2] = -1e30  # a row that sees nothing: uniform, as the float64 formula gives
    ref = s.astype(np.float64) * 0.3
    ref = np.exp(ref - ref.max(1, keepdims=True))
    ref /= ref.sum(1, keepdims=True)
    got = s.copy()
    softmax_rows(got, np.float32(0.3))
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-9)
    assert np.all(got[1, ::3] == 0)


def test_gelu_tanh_mul_within_float32_rounding_of_float64():
    """``gelu_tanh(a) * b`` against float64 (the sigmoid form ``a b / (1 + e^{-2u})``, the same
    function as ``0.5 a (1 + tanh u)`` b, which in float64 still rounds ``1 + tanh`` to 0 below
    a = -7): within 4 float32 ulps of the result times the conditioning of ``u``'s own rounding
    (``1 + |2u|``) wherever the result is a normal float, and no larger an error than transformers'
    float32 GELU (its ``1 + tanh`` loses every digit as ``tanh -> -1``: 1e4 times ours relative)."""
    import torch

    from gemmalite.kernels.ops import gelu_tanh_mul

    rng = np.random.default_rng(2)
    a = np.concatenate([np.linspace(-12, 12, 100_000), rng.standard_normal(50_000) * 4]).astype(np.float32)
    b = rng.standard_normal((2, a.size)).astype(np.float32)[1]  # (a strided source is copied: a PLE slice)
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    u = np.sqrt(2 / np.pi) * (a64 + 0.044715 * a64**3)
    ref = a64 * b64 / (1 + np.exp(-2 * u))
    got = gelu_tanh_mul(a.reshape(3, -1), b.reshape(3, -1)).reshape(-1)
    assert got.dtype == np.float32
    err = np.abs(got - ref)
    normal = np.abs(ref) >= 1e-30
    ulp = np.spacing(np.abs(ref).astype(np.float32)).astype(np.float64)
    assert np.all(err[normal] <= 4 * ulp[normal] * (1 + np.abs(2 * u[normal])))
    theirs = (torch.nn.functional.gelu(torch.from_numpy(a), approximate="tanh") * torch.from_numpy(b)).numpy()
    assert err.max() <= 1.25 * np.abs(theirs - ref).max()
    assert np.mean(err[normal] / np.abs(ref[normal])) < 1e-3 * np.mean(np.abs(theirs - ref)[normal] / np.abs(ref[normal]))
    special = np.array([0.0, -0.0, 30.0, -30.0, np.inf, np.nan], np.float32)
    out = gelu_tanh_mul(special, np.full(special.shape, 2.0, np.float32))
    np.testing.assert_array_equal(out[:5], [0.0, 0.0, 60.0, 0.0, np.inf])
    assert np.isnan(out[5])


@pytest.mark.parametrize("shape", [(18, 512), (5, 3, 256), (2, 7)])
def test_rms_norm_matches_float64(shape):
    from gemmalite.kernels.ops import rms_norm

    rng = np.random.default_rng(3)
    x = (rng.standard_normal(shape) * 5).astype(np.float32)
    w = rng.standard_normal(shape[-1]).astype(np.float32)
    x64 = x.astype(np.float64)
    inv = 1 / np.sqrt((x64**2).mean(-1, keepdims=True) + 1e-6)
    np.testing.assert_allclose(rms_norm(x, w, 1e-6), x64 * inv * w, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(rms_norm(x, None, 1e-6), x64 * inv, rtol=1e-6, atol=1e-6)


def test_parallel_gelu_is_the_serial_one_to_the_bit():
    from gemmalite.kernels.numba_ops import GELU_CHUNK, gelu_tanh_mul_flat, gelu_tanh_mul_parallel

    rng = np.random.default_rng(5)
    n = 3 * GELU_CHUNK + 17  # a ragged last chunk
    a, b = (rng.standard_normal((2, n)) * 4).astype(np.float32)
    want, got = np.empty_like(a), np.empty_like(a)
    gelu_tanh_mul_flat(a, b, want)
    gelu_tanh_mul_parallel(a, b, got)
    np.testing.assert_array_equal(got, want)


def _silu64(x):
    return x / (1 + np.exp(-x))


def _within_exp_rounding(got, ref, x):
    """Within 4 float32 ulps of the result times the conditioning of ``exp``'s argument (``1 +
    |x|``: the sigmoid's ``e^-|x|`` is taken of ``x log2(e)`` rounded to float32, as in
    `test_gelu_tanh_mul_within_float32_rounding_of_float64`), wherever the result is a normal float."""
    ref = np.asarray(ref, np.float64)
    normal = np.abs(ref) >= 1e-30
    ulp = np.spacing(np.abs(ref).astype(np.float32)).astype(np.float64)
    err = np.abs(got - ref)
    assert np.all(err[normal] <= 4 * ulp[normal] * (1 + np.abs(x[normal])))
    assert np.all(err[~normal] <= 1e-30)


def test_norm_stage_is_the_stages_one_after_another():
    """The audio tower's fused row stage: clip, RMSNorm, clip, scale and residual bit for bit
    the numpy stages (`ops.rms_norm` and ``np.clip``), in place or not; with SiLU, within a
    few float32 ulps of float64 SiLU of the same normed values."""
    from gemmalite.kernels.numba_ops import norm_stage
    from gemmalite.kernels.ops import rms_norm

    rng = np.random.default_rng(6)
    x = (rng.standard_normal((40, 96)) * 3).astype(np.float32)
    res = rng.standard_normal(x.shape).astype(np.float32)
    w = rng.standard_normal(96).astype(np.float32)
    lo, hi, lo2, hi2 = (np.float32(v) for v in (-2.5, 4.0, -0.7, 0.9))
    normed = rms_norm(np.clip(x, lo, hi), w, 1e-6)
    want = np.clip(normed, lo2, hi2) * np.float32(0.5) + res
    got = np.empty_like(x)
    norm_stage(x, lo, hi, w, 1e-6, False, lo2, hi2, np.float32(0.5), res, got)
    np.testing.assert_array_equal(got, want)
    inplace = x.copy()
    norm_stage(inplace, lo, hi, np.zeros(0, np.float32), 1e-6, False, -np.float32(np.inf), np.float32(np.inf),
               np.float32(1.0), np.zeros((0, 0), np.float32), inplace)
    np.testing.assert_array_equal(inplace, rms_norm(np.clip(x, lo, hi), None, 1e-6))
    norm_stage(x, lo, hi, w, 1e-6, True, lo2, hi2, np.float32(1.0), np.zeros((0, 0), np.float32), got)
    ref = np.clip(_silu64(normed.astype(np.float64)), lo2, hi2)
    _within_exp_rounding(got, ref, normed)


def test_clip_silu_clip_within_float32_rounding_of_float64():
    from gemmalite.kernels.numba_ops import clip_silu_clip

    x = np.concatenate([np.linspace(-40, 40, 4001), [0.0, -0.0, 1e-30]]).astype(np.float32).reshape(1, -1)
    got = x.copy()
    clip_silu_clip(got, np.float32(-30), np.float32(20), np.float32(-0.2), np.float32(15))
    ref = np.clip(_silu64(np.clip(x.astype(np.float64), -30, 20)), -0.2, 15)
    _within_exp_rounding(got, ref, np.clip(x, -30, 20))


def test_glu_causal_conv_matches_float64():
    """Clip, GLU and the causal depthwise taps (oldest first; rows before the first are zeros)."""
    from gemmalite.kernels.numba_ops import glu_causal_conv

    rng = np.random.default_rng(7)
    T, H, K = 23, 16, 5
    h = (rng.standard_normal((T, 2 * H)) * 4).astype(np.float32)
    taps = rng.standard_normal((K, H)).astype(np.float32)
    out = np.empty((T, H), np.float32)
    glu_causal_conv(h, np.float32(-3), np.float32(5), taps, out)
    a = np.clip(h.astype(np.float64), -3, 5)
    g = a[:, :H] / (1 + np.exp(-a[:, H:]))
    gp = np.concatenate([np.zeros((K - 1, H)), g])
    ref = sum(gp[j:j + T] * taps[j].astype(np.float64) for j in range(K))
    bound = 8 * np.finfo(np.float32).eps * sum(np.abs(gp[j:j + T] * taps[j]) for j in range(K))
    assert np.all(np.abs(out - ref) <= bound + 1e-30)


@pytest.mark.parametrize("t, f, c_in, c_out", [(9, 16, 1, 8), (10, 7, 5, 6), (10, 7, 20, 7), (40, 128, 1, 128), (20, 64, 128, 32)])
def test_subsampling_conv_norm_relu_within_the_references_float32_error(t, f, c_in, c_out):
    """The audio tower's subsampling layer (3x3 conv, stride 2, padding 1; LayerNorm over the
    channels; ReLU), odd and even sizes and the real channel counts, against float64: no further
    off than torch's float32 Conv2d + LayerNorm + ReLU (the reference's own arithmetic), plus two
    float32 ulps of the value."""
    import torch

    from gemmalite.kernels.numba_ops import conv3x3s2_norm_relu

    rng = np.random.default_rng(t * f + c_in)
    x = rng.standard_normal((t, f, c_in)).astype(np.float32)
    w = rng.standard_normal((c_out, c_in, 3, 3)).astype(np.float32)
    ln = rng.standard_normal(c_out).astype(np.float32)
    to, fo = (t - 1) // 2 + 1, (f - 1) // 2 + 1
    out = np.empty((to, fo, c_out), np.float32)
    conv3x3s2_norm_relu(x, np.ascontiguousarray(w.transpose(2, 3, 0, 1)), ln, 1e-6, out)

    def reference(dtype):
        xt = torch.from_numpy(x).to(dtype).permute(2, 0, 1)[None]  # [1, C_in, T, F]
        y = torch.nn.functional.conv2d(xt, torch.from_numpy(w).to(dtype), stride=2, padding=1)[0].permute(1, 2, 0)
        y = torch.nn.functional.layer_norm(y, (c_out,), torch.from_numpy(ln).to(dtype), None, 1e-6)
        return torch.relu(y).numpy()

    ref = reference(torch.float64)
    theirs = np.abs(reference(torch.float32) - ref).max()
    ulp = np.spacing(np.abs(ref).astype(np.float32)).astype(np.float64)
    assert np.all(np.abs(out - ref) <= theirs + 2 * ulp)


def test_sparse_bands_is_the_dense_product_in_bin_order():
    """The mel filter product without BLAS: each band's sum over the bins in order, the zero
    weights left out, equals the dense product summed in that order to the bit (the terms are
    non-negative and finite), for the real mel bank and a random banded one."""
    from gemmalite.audio.features import _FILTERS, band_ranges
    from gemmalite.kernels.numba_ops import sparse_bands

    rng = np.random.default_rng(4)
    banded = np.zeros((40, 9))
    for j in range(40):  # each bin in 0, 1 or 2 adjacent bands
        b, n = rng.integers(0, 8), rng.integers(0, 3)
        banded[j, b:b + n] = rng.random(n)
    for filters in (_FILTERS, banded):
        lo, hi = band_ranges(filters)
        assert not np.any(filters[np.arange(filters.shape[1]) < lo[:, None]])
        assert not np.any(filters[np.arange(filters.shape[1]) >= hi[:, None]])
        spec = rng.random((7, filters.shape[0])) * 10
        out = np.empty((7, filters.shape[1]))
        sparse_bands(spec, lo, hi, filters, out)
        ref = np.zeros_like(out)
        for j in range(filters.shape[0]):  # the dense product, bin by bin
            ref += spec[:, j:j + 1] * filters[j]
        np.testing.assert_array_equal(out, ref)
