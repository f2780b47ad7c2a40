"""The symmetric int4 kernels (`gemmalite.kernels.int4s`) against float64 math: the scale fit, the
int8 activation layout, and the W4A8 dot product on both the VNNI and the AVX2 instruction paths."""
import numpy as np
import pytest

from gemmalite.kernels import common
from gemmalite.kernels.int4s import (LANE_GROUP, activation_pairs, i4s_fit, i4s_mm_lanes, i4s_mm_w4a8, i4s_mvn_w4a8, i4s_pack,
                                    round_i8_lanes, token_groups)
from gemmalite.weights.quant import Int4Matrix

pytestmark = pytest.mark.skipif(not common.HAVE_AVX2, reason="no AVX2 on this CPU")


def _quantized(n, k, seed, search=True):
    rng = np.random.default_rng(seed)
    w = (0.02 * rng.standard_t(4, size=(n, k))).astype(np.float32)
    w[1] = 0.0
    d = np.empty((n, k // 32), np.float32)
    i4s_fit(w, search, d)
    d16 = d.astype(np.float16)
    packed = np.empty((n, k // 2), np.uint8)
    i4s_pack(w, d16.astype(np.float32), packed)
    return w, packed, d16


def _values(packed):
    """Nibbles - 8 in value order (byte j of a block: value j low, j + 16 high), float64."""
    n = packed.shape[0]
    lo, hi = (packed & 15).reshape(n, -1, 16), (packed >> 4).reshape(n, -1, 16)
    return np.concatenate([lo, hi], axis=2).reshape(n, -1).astype(np.float64) - 8


def _unpair(xq, k):
    """The int8 values per block ``[T, k // 32, 32]`` back from `round_i8_pairs`' layout."""
    t = xq.shape[0]
    out = np.empty((t, k // 32, 32), np.float64)
    for g in range(k // 32):
        p, h = divmod(g, 2)
        out[:, g] = np.concatenate([xq[:, 64 * p + 16 * h: 64 * p + 16 * h + 16],
                                    xq[:, 64 * p + 32 + 16 * h: 64 * p + 48 + 16 * h]], 1)
    return out


def _int8_rows(x):
    """numpy oracle of the activation rounding: int8 per 32 values, step max|x| / 127, each value
    ``rint(x * (1 / step))``, every operation an IEEE float32 one as the format defines it
    (round half to even)."""
    t, k = x.shape
    xr = x.reshape(t, k // 32, 32)
    step = (np.abs(xr).max(2) / np.float32(127)).astype(np.float32)
    inv = np.where(step > 0, np.float32(1) / np.where(step > 0, step, 1), np.float32(0)).astype(np.float32)
    assert inv.dtype == np.float32 and (xr * inv[..., None]).dtype == np.float32
    q = np.rint(xr * inv[..., None])
    return q.astype(np.float64), step.astype(np.float64)


def _activations(t, k, seed):
    """Normal rows with outliers, a zero row, and a block of exact ties: max 127 (step 1), values at
    k + 0.5 (round half to even: 2.5 -> 2, -2.5 -> -2, 0.5 -> 0)."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((t, k)).astype(np.float32)
    x[:, :5] *= 30  # outliers, as in real activations
    x[1] = 0.0
    x[2, :32] = np.r_[127.0, np.arange(31) * (-1.0) ** np.arange(31) + 0.5].astype(np.float32)
    return x


def test_fit_and_pack_match_the_format():
    w, packed, d16 = _quantized(40, 256, seed=0)
    deq = _values(packed) * np.repeat(d16.astype(np.float64), 32, 1)
    d = np.repeat(np.abs(d16.astype(np.float64)), 32, 1)
    inside = np.abs(w / np.where(d > 0, d, 1)) <= 7.5
    err = np.abs(deq - w)
    assert np.all(err[inside] <= d[inside] * 0.5001 + 1e-12)
    assert np.all(deq[1] == 0)
    # the search (weighted squared error, weights w^2) never does worse than Q4_0's rule on a
    # block (up to the float16 rounding of the scale), and better overall
    _, p0, d0 = _quantized(40, 256, seed=0, search=False)
    deq0 = _values(p0) * np.repeat(d0.astype(np.float64), 32, 1)
    wt = w.astype(np.float64) ** 2
    e, e0 = (wt * (deq - w) ** 2).reshape(40, 8, 32).sum(2), (wt * (deq0 - w) ** 2).reshape(40, 8, 32).sum(2)
    assert np.all(e <= e0 * 1.01 + 1e-15)
    assert e.sum() < 0.9 * e0.sum()  # 0.83 here
    # Q4_0's rule: the value of largest magnitude maps to -8 exactly (up to its float16 scale)
    big = np.take_along_axis(w.reshape(40, 8, 32), np.abs(w.reshape(40, 8, 32)).argmax(2)[..., None], 2)[..., 0]
    np.testing.assert_allclose(d0.astype(np.float32), big / -8, rtol=1e-3)


@pytest.mark.parametrize("k", [96, 256])
def test_activation_layout(k):
    x = _activations(64, k, seed=1)
    xq, xc, xd = activation_pairs(x)
    q, step = _int8_rows(x)
    npair = (k // 32 + 1) // 2
    assert xq.shape == (64, 64 * npair) and xc.shape == xd.shape == (64, 2 * npair)
    got = _unpair(xq, k)
    # exactly numpy's rounding: the same float32 step, every value the same integer (ties included)
    np.testing.assert_array_equal(xd[:, : k // 32], step)
    np.testing.assert_array_equal(got, q)
    assert got[2, 0, 1:5].tolist() == [0.0, -0.0, 2.0, -2.0] and np.all(got[1] == 0)  # 0.5, -0.5, 2.5, -2.5
    np.testing.assert_array_equal(xc[:, : k // 32], -2 * q.sum(2))
    if (k // 32) % 2:  # the lone last block's partner is zero
        assert not xq[:, -48:-32].any() and not xq[:, -16:].any() and xd[:, -1].sum() == 0 and not xc[:, -1].any()


@pytest.mark.parametrize("k", [96, 320, 512])
@pytest.mark.parametrize("rows_per_task", [1, 4])
def test_w4a8_dot_against_float64(k, rows_per_task):
    """Both instruction paths: the exact integer block sums times the two scales, to float32
    accumulation error; each activation row bit for bit its one-row result; the two paths equal."""
    n = 37
    _, packed, d16 = _quantized(n, k, seed=2)
    x = _activations(11, k, seed=3)
    xq, xc, xd = activation_pairs(x)
    q, step = _int8_rows(x)  # numpy's rounding (test_activation_layout: the kernel's is the same bits)
    np.testing.assert_array_equal(_unpair(xq, k), q)
    wv = _values(packed).reshape(n, k // 32, 32)
    dw = d16.astype(np.float64)
    terms = np.einsum("tgi,ngi->tng", q, wv) * step[:, None, :] * dw[None]
    ref = terms.sum(2)
    # float32 rounding of each lane's partial sums: relative to sum |q w| (not |sum q w|) per block
    mags = np.einsum("tgi,ngi->tng", np.abs(q), np.abs(wv)) * step[:, None, :] * np.abs(dw)[None]
    bound = 1e-6 * mags.sum(2) + 1e-30
    outs = []
    for vnni in (True, False):
        out = np.empty((11, n), np.float32)
        i4s_mvn_w4a8(packed, d16.view(np.uint16), xq, xc, xd, rows_per_task, vnni, out)
        assert np.all(np.abs(out - ref) <= bound), float((np.abs(out - ref) / bound).max())
        for t in (0, 4, 10):
            one = np.empty((1, n), np.float32)
            i4s_mvn_w4a8(packed, d16.view(np.uint16), xq[t:t + 1], xc[t:t + 1], xd[t:t + 1], 1, vnni, one)
            np.testing.assert_array_equal(one[0], out[t])
        outs.append(out)
    np.testing.assert_array_equal(outs[0], outs[1])
    # and against the float64 product of the unrounded x: within the activation rounding
    wd = _values(packed) * np.repeat(dw, 32, 1)
    exact = x.astype(np.float64) @ wd.T
    act = np.repeat(step / 2, 32, 1) @ np.abs(wd).T
    assert np.all(np.abs(outs[0] - exact) <= act * 1.0001 + bound)


def _oracle(packed, d16, xq, xd, k):
    """float64 products of the exact integer block sums and the two scales (the kernel's inputs as
    they are: its own activation rounding), and the sum of their magnitudes per output."""
    n = packed.shape[0]
    q, step = _unpair(xq, k), xd[:, : k // 32].astype(np.float64)
    wv = _values(packed).reshape(n, k // 32, 32)
    terms = np.einsum("tgi,ngi->tng", q, wv) * step[:, None, :] * d16.astype(np.float64)[None]
    return terms.sum(2), np.abs(terms).sum(2)


def _tiles(packed, d16, x, vnni, lo=0, hi=None):
    xq, xc, xd = activation_pairs(x)
    xc4, xd4 = token_groups(xc, xd)
    out = np.full((x.shape[0], packed.shape[0]), np.nan, np.float32)
    i4s_mm_w4a8(packed, d16.view(np.uint16), xq, xc4, xd4, lo, x.shape[0] // 4 if hi is None else hi, vnni, out)
    return out, xq, xd


@pytest.mark.parametrize("k", [64, 512, 1536])
def test_w4a8_prefill_tiles_against_float64(k):
    """The prefill tiles (4 weight rows x 4 tokens, 37 rows: a tail row) on both instruction paths:
    the exact integer block sums times the two scales, within the float32 rounding of the scale
    application (a lane's chain: one product of the scales, k / 64 FMAs, one final add: at most
    (k / 64 + 3) * 2^-24 of the sum of |terms|; the integer sums are exact, so nothing else); the two
    paths bit for bit equal; a token's result independent of the tokens it is grouped with."""
    n, t = 37, 12
    _, packed, d16 = _quantized(n, k, seed=2)
    rng = np.random.default_rng(4)
    x = rng.standard_normal((t, k)).astype(np.float32)
    x[:, :5] *= 30
    x[5] = 0.0
    outs = [_tiles(packed, d16, x, vnni) for vnni in (1, 0)]
    (out, xq, xd), (out2, _, _) = outs
    ref, mags = _oracle(packed, d16, xq, xd, k)
    bound = (k // 64 + 3) * 2.0**-24 * mags + 1e-30
    assert np.all(np.abs(out - ref) <= bound), float((np.abs(out - ref) / bound).max())
    assert np.all(out[5] == 0)
    np.testing.assert_array_equal(out, out2)
    perm = rng.permutation(t)
    np.testing.assert_array_equal(_tiles(packed, d16, x[perm], 1)[0], out[perm])
    # a group range: only its rows written
    part, _, _ = _tiles(packed, d16, x, 1, 1, 2)
    assert np.isnan(part[:4]).all() and np.isnan(part[8:]).all()
    np.testing.assert_array_equal(part[4:8], out[4:8])


def test_int4_prefill_is_each_row_alone_and_the_prepared_input_the_same():
    """Int4Matrix prefill (T > FEW_ROWS) through the tiles: rows padded to a group of 4 come out as
    the kernel computes them, each row bit for bit the same among other rows (``independent_rows``),
    the prepared input (rounded once for q/k/v) the same product, and close to the float64 product
    of the unrounded x (within the activation rounding: half a step per value)."""
    w = (0.02 * np.random.default_rng(5).standard_t(4, size=(203, 320))).astype(np.float32)
    m = Int4Matrix.quantize(w, symmetric=True)
    assert m.independent_rows and not m.uses_blas_for(64)
    rng = np.random.default_rng(6)
    x = rng.standard_normal((23, 320)).astype(np.float32)
    x[:, :5] *= 30
    y = m.matmul(x)
    xp = np.concatenate([x, np.zeros((1, 320), np.float32)])
    np.testing.assert_array_equal(y, _tiles(m.packed, m.scales, xp, 1)[0][:23])
    np.testing.assert_array_equal(m.matmul(x[7:13]), y[7:13])
    np.testing.assert_array_equal(m.matmul_prepared(m.prepare(x)), y)
    d = m.dense().astype(np.float64)
    step = np.repeat(np.abs(x.reshape(23, 10, 32)).max(2).astype(np.float64) / 127, 32, 1)
    err = np.abs(y - x.astype(np.float64) @ d.T)
    assert np.all(err <= step / 2 @ np.abs(d).T * 1.0001 + 1e-5 * (np.abs(x) @ np.abs(d).T))


def _lanes(packed, d16, x, lo=0, hi=None):
    t, k = x.shape
    xs, xc, xd = np.empty((t, k), np.int8), np.empty((t, k // LANE_GROUP, 8), np.int32), np.empty((t, k // LANE_GROUP, 8), np.float32)
    round_i8_lanes(x, xs, xc, xd, 8)
    out = np.full((t, packed.shape[0]), np.nan, np.float32)
    i4s_mm_lanes(packed.view(np.uint32), d16.view(np.uint16), xs, xc, xd, lo, t if hi is None else hi, out)
    return out, xs, xc, xd


vnni_only = pytest.mark.skipif(not common.HAVE_VNNI, reason="no VNNI on this CPU (or GEMMALITE_VNNI=0)")


@vnni_only
@pytest.mark.parametrize("k", [256, 1536])
def test_w4a8_block_lane_tiles_against_float64(k):
    """The block-lane prefill tiles (4 weight rows x 3 tokens; 37 rows and 11 tokens: tails of
    both): the activations rounded to the integers `round_i8_pairs` gives, each block's offset and
    step in its lane; the products the exact integer block sums times the two scales within the
    float32 rounding of their application (a lane's chain: the scales' product and k / 256 FMAs,
    then three adds folding the lanes: at most (k / 256 + 5) * 2^-24 of the sum of |terms|); a
    token's result independent of the tokens beside it, a token range writing only its rows."""
    n, t = 37, 11
    _, packed, d16 = _quantized(n, k, seed=7)
    x = _activations(t, k, seed=8)
    out, xs, xc, xd = _lanes(packed, d16, x)
    q, step = _int8_rows(x)
    xq, xcp, xdp = activation_pairs(x)
    np.testing.assert_array_equal(_unpair(xq, k), q)  # the same integers as the decode rounding
    pos = np.array([32 * ((v & 31) >> 2) + 4 * (v >> 5) + (v & 3) for v in range(LANE_GROUP)])
    lanes = xs.reshape(t, k // LANE_GROUP, LANE_GROUP)[:, :, pos].reshape(t, k // 32, 32)
    np.testing.assert_array_equal(lanes, q)
    np.testing.assert_array_equal(xc.reshape(t, -1), -8 * q.sum(2))
    np.testing.assert_array_equal(xd.reshape(t, -1), step.astype(np.float32))
    wv = _values(packed).reshape(n, k // 32, 32)
    terms = np.einsum("tgi,ngi->tng", q, wv) * step[:, None, :] * d16.astype(np.float64)[None]
    ref, mags = terms.sum(2), np.abs(terms).sum(2)
    bound = (k // LANE_GROUP + 5) * 2.0**-24 * mags + 1e-30
    assert np.all(np.abs(out - ref) <= bound), float((np.abs(out - ref) / bound).max())
    assert np.all(out[1] == 0)
    perm = np.random.default_rng(9).permutation(t)
    np.testing.assert_array_equal(_lanes(packed, d16, x[perm])[0], out[perm])
    part = _lanes(packed, d16, x, 4, 9)[0]
    assert np.isnan(part[:4]).all() and np.isnan(part[9:]).all()
    np.testing.assert_array_equal(part[4:9], out[4:9])


@vnni_only
def test_int4_prefill_takes_the_block_lanes_where_the_width_allows():
    """Int4Matrix prefill of rows a multiple of 256 wide: the block-lane tiles' output as they
    compute it, each row the same among other rows, the prepared input the same product."""
    w = (0.02 * np.random.default_rng(10).standard_t(4, size=(70, 512))).astype(np.float32)
    m = Int4Matrix.quantize(w, symmetric=True)
    x = _activations(29, 512, seed=11)
    y = m.matmul(x)
    np.testing.assert_array_equal(y, _lanes(m.packed, m.scales, x)[0])
    np.testing.assert_array_equal(m.matmul(x[7:20]), y[7:20])
    p = m.prepare(x)
    assert p.kind == "w4a8-lanes"
    np.testing.assert_array_equal(m.matmul_prepared(p), y)
