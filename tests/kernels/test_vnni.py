"""int8 prefill on VNNI (`simd.u8_tile_dot` via `quant.i8_mm_vnni`): activations rounded to int8
per block, 8-bit dot products, checked against exact integer math in float64."""
import os
import subprocess
import sys

import numpy as np
import pytest

from gemmalite.kernels import common
from gemmalite.kernels.quant import i8_mm_vnni, round_i16_planes, round_int16_rows, round_u8_rows
from gemmalite.kernels.simd import U8_BLOCK as TILE_BLOCK  # the VNNI kernel's block

pytestmark = pytest.mark.skipif(not (common.HAVE_AVX2 and common.HAVE_VNNI),
                                reason="no AVX-512 VNNI / AVX-VNNI on this CPU (or GEMMALITE_VNNI=0)")


def _activations(t, k, seed):
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((t, k)) * rng.uniform(0.01, 20, (t, 1))).astype(np.float32)
    x[:, 3] *= 50  # an outlier channel
    x[0, :TILE_BLOCK] = 0  # an all-zero block
    if t > 1:
        x[1, :TILE_BLOCK] = np.where(np.arange(TILE_BLOCK) % 2, 7.0, -7.0)  # every value at +-max
    return x


def _weights(n, k, seed):
    rng = np.random.default_rng(seed)
    q = rng.integers(-127, 128, (n, k), dtype=np.int8)
    q[0] = 127  # the largest block sums
    q[-1] = -127
    return q, rng.uniform(1e-3, 1e-1, n).astype(np.float32)


def _rounded(x):
    t, k = x.shape
    xu = np.empty((t, k), dtype=np.uint8)
    xd = np.empty((k // TILE_BLOCK, t), dtype=np.float32)
    round_u8_rows(x, xu, xd)
    return xu, xd


def test_rounding_to_int8_per_block():
    x = _activations(9, 3 * TILE_BLOCK, 0)
    xu, xd = _rounded(x)
    blocks = x.reshape(9, 3, TILE_BLOCK)
    np.testing.assert_allclose(xd.T, np.abs(blocks).max(2) / np.float32(127), rtol=1e-6)  # (fastmath: * 1/127)
    xi = xu.astype(np.int64).reshape(9, 3, TILE_BLOCK) - 128
    assert xi.min() >= -127 and xi.max() <= 127
    assert np.all(xi[0, 0] == 0) and set(np.unique(xi[1, 0])) == {-127, 127}
    d = xd.T[:, :, None].astype(np.float64)
    err = np.abs(xi * d - blocks)  # round to nearest: at most half a step
    assert np.all(err <= d * (0.5 + 1e-5) + 1e-30)


@pytest.mark.parametrize("n,k,t,chunk", [(8, TILE_BLOCK, 2, 2), (37, 3 * TILE_BLOCK, 131, 64),
                                         (5, 2 * TILE_BLOCK, 7, 3), (203, 4 * TILE_BLOCK, 40, 16)])
def test_tiles_match_exact_integer_math(n, k, t, chunk):
    """4x3 tiles, the 4x1 token tail, one-row tails (n % 4), token ranges starting past 0."""
    q, scale = _weights(n, k, n)
    x = _activations(t, k, n + 1)
    xu, xd = _rounded(x)
    out = np.full((t, n), np.nan, dtype=np.float32)
    for t0 in range(0, t, chunk):
        i8_mm_vnni(q, scale, xu, None, xd, t0, min(t, t0 + chunk), out)
    _check_exact(q, scale, xu.astype(np.int64) - 128, xd, out, lambda t0, o: i8_mm_vnni(q, scale, xu, None, xd, t0, t0 + 1, o))


def _check_exact(q, scale, xi, xd, out, one_token):
    """``out`` against the exact integer dot products of ``xi`` (the activations' integers) in
    float64, and each token's results equal to a run of that token alone (``one_token(t0, out)``:
    4x1 and 1x1 tiles only): a result does not depend on the tile it ran in."""
    (t, k), n = xi.shape, q.shape[0]
    dots = np.einsum("tbi,rbi->trb", xi.reshape(t, -1, TILE_BLOCK), q.astype(np.int64).reshape(n, -1, TILE_BLOCK))
    terms = dots * xd.T[:, None, :].astype(np.float64)
    ref = terms.sum(2) * scale.astype(np.float64)
    # float32 conversion, scaling and summing over blocks and lanes: a few ulps of the block terms'
    # magnitudes (the lanes hold exact signed partial dots, never the +128 offset's inflated sums)
    bound = 1e-6 * np.abs(terms).sum(2) * scale + 1e-30
    assert np.all(np.abs(out - ref) <= bound), float((np.abs(out - ref) / bound).max())
    single = np.full((t, n), np.nan, dtype=np.float32)
    for t0 in range(t):
        one_token(t0, single)
    np.testing.assert_array_equal(single, out)


@pytest.mark.parametrize("n,k,t,chunk", [(8, TILE_BLOCK, 2, 2), (37, 3 * TILE_BLOCK, 131, 64), (5, 2 * TILE_BLOCK, 7, 3)])
def test_int16_planes_match_exact_integer_math(n, k, t, chunk):
    """int16 activations as two byte planes through the 8-bit tiles: the planes hold exactly the
    integers `round_int16_rows` gives, and the tiles sum them exactly (the same bound as above)."""
    q, scale = _weights(n, k, n + 7)
    x = _activations(t, k, n + 2)
    xl, xh = np.empty((t, k), np.uint8), np.empty((t, k), np.uint8)
    xd = np.empty((k // TILE_BLOCK, t), np.float32)
    round_i16_planes(x, xl, xh, xd)
    xq, xd16 = np.empty((t, k), np.int16), np.empty((t, k // TILE_BLOCK), np.float32)
    round_int16_rows(x, TILE_BLOCK, xq, xd16)
    xi = (xh.astype(np.int64) - 128) * 256 + xl
    np.testing.assert_array_equal(xi, xq)  # the same integers as the int16 tiles take
    np.testing.assert_array_equal(xd, xd16.T)
    assert xi.min() >= -32767 and xi.max() <= 32767 and set(np.unique(xi[1, :TILE_BLOCK])) == {-32767, 32767}
    out = np.full((t, n), np.nan, dtype=np.float32)
    for t0 in range(0, t, chunk):
        i8_mm_vnni(q, scale, xl, xh, xd, t0, min(t, t0 + chunk), out)
    _check_exact(q, scale, xi, xd, out, lambda t0, o: i8_mm_vnni(q, scale, xl, xh, xd, t0, t0 + 1, o))


def test_env_forces_the_portable_path():
    code = "from gemmalite.kernels import common; print(common.HAVE_VNNI)"
    env = dict(os.environ, GEMMALITE_VNNI="0")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert r.stdout.strip() == "False"
