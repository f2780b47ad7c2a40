"""`kernels.fdot`: the sums are in the order its docstring writes out (against a numpy emulation of
that order, on inputs whose products are exact so that fusing a product into its sum changes
nothing), each pair's sum is the same in every tile of as many lanes, and the values are within
float32's rounding of float64 math."""
from __future__ import annotations

import itertools

import numpy as np
import pytest
from numba import njit

from gemmalite.kernels.fdot import CHUNK, LANES, dot_tile, lane_sum, sum_squares64, weighted_rows

LENGTHS = [0, 1, LANES - 1, LANES, LANES + 1, 40, 4 * LANES - 1, 4 * LANES, 130]


def _lanes(nx: int, nw: int) -> int:
    """Lanes per sum of an ``nx`` x ``nw`` tile, as the module's docstring says."""
    return LANES * max(1, 4 // (nx * nw))


@njit
def _dot(xs, ws):
    return dot_tile(xs, ws)


@njit
def _sum(x):
    return lane_sum(x)


@njit
def _squares(x):
    return sum_squares64(x)


def _ordered(terms: np.ndarray, width: int = LANES) -> np.ndarray:
    """The module's order over the last axis: lane ``c % width`` for the whole lanes, halves, plus the tail."""
    n = terms.shape[-1]
    body = n - n % width
    lanes = np.zeros(terms.shape[:-1] + (width,), terms.dtype)
    for c in range(body):
        lanes[..., c % width] += terms[..., c]
    while width > 1:
        width //= 2
        lanes = lanes[..., :width] + lanes[..., width : 2 * width]
    tail = np.zeros(terms.shape[:-1], terms.dtype)
    for c in range(body, n):
        tail += terms[..., c]
    return lanes[..., 0] + tail


def _exact_products(rng, shape) -> np.ndarray:
    """float32 values of 12 significant bits: every product of two is exact in float32 (no rounding
    for a fused multiply-add to skip), while the sums still round."""
    return (rng.integers(-2048, 2048, size=shape) * 2.0 ** rng.integers(-14, -2, size=shape)).astype(np.float32)


@pytest.mark.parametrize("n", LENGTHS)
@pytest.mark.parametrize("nx, nw", [(4, 4), (4, 3), (1, 4), (2, 1), (1, 1)])
def test_dot_tile_sums_in_the_written_order(n, nx, nw):
    rng = np.random.default_rng(n)
    x, w = _exact_products(rng, (nx, n)), _exact_products(rng, (nw, n))
    terms = x[:, None, :] * w[None, :, :]  # products exact, sums in float32
    want = _ordered(terms, _lanes(nx, nw))
    got = np.array(_dot(tuple(x), tuple(w))).reshape(nx, nw)
    np.testing.assert_array_equal(got, want)
    if n >= 2 * _lanes(nx, nw):  # the order matters on these inputs: a plain running sum differs somewhere
        assert not np.array_equal(np.cumsum(terms, axis=-1, dtype=np.float32)[..., -1], want)


@pytest.mark.parametrize("n", LENGTHS)
def test_int8_rows_are_converted_exactly(n):
    rng = np.random.default_rng(300 + n)
    x = _exact_products(rng, (2, n))  # 12 bits times 8 bits: exact products again
    q = rng.integers(-128, 128, (3, n)).astype(np.int8)
    got = np.array(_dot(tuple(x), tuple(q))).reshape(2, 3)
    np.testing.assert_array_equal(got, _ordered(x[:, None, :] * q[None, :, :].astype(np.float32)))


@pytest.mark.parametrize("n", LENGTHS)
def test_each_pair_is_the_same_in_every_tile_of_as_many_lanes(n):
    """Any values: a pair's sum in any tile equals its sum in the first tile of as many lanes per sum
    (4 x 4 for three sums or more, 1 x 2 for two, 1 x 1), and is within float32's rounding."""
    rng = np.random.default_rng(100 + n)
    x = rng.standard_normal((4, n)).astype(np.float32)
    w = rng.standard_normal((4, n)).astype(np.float32)
    exact = x.astype(np.float64) @ w.T.astype(np.float64)
    bound = 2 * n * np.finfo(np.float32).eps * (np.abs(x).astype(np.float64) @ np.abs(w).T) + 1e-30
    ref = {_lanes(4, 4): np.array(_dot(tuple(x), tuple(w))).reshape(4, 4),
           _lanes(1, 2): np.array([[_dot((x[i],), (w[j], w[j]))[0] for j in range(4)] for i in range(4)]),
           _lanes(1, 1): np.array([[_dot((x[i],), (w[j],))[0] for j in range(4)] for i in range(4)])}
    assert sorted(ref) == [LANES, 2 * LANES, 4 * LANES]
    for nx, nw in itertools.product(range(1, 5), repeat=2):
        rows = rng.choice(4, nx, replace=False)
        cols = rng.choice(4, nw, replace=False)
        got = np.array(_dot(tuple(x[rows]), tuple(w[cols]))).reshape(nx, nw)
        np.testing.assert_array_equal(got, ref[_lanes(nx, nw)][np.ix_(rows, cols)], err_msg=f"{nx} x {nw}")
        assert np.all(np.abs(got - exact[np.ix_(rows, cols)]) <= bound[np.ix_(rows, cols)]), f"{nx} x {nw}"


@pytest.mark.parametrize("n", LENGTHS)
def test_lane_sum_and_sum_squares_in_the_written_order(n):
    rng = np.random.default_rng(200 + n)
    x = _exact_products(rng, n)
    assert _sum(x) == _ordered(x)
    y = rng.standard_normal(n).astype(np.float32)  # squares of float32 are exact in float64: any values
    assert _squares(y) == _ordered(y.astype(np.float64) ** 2)


def test_rows_of_other_layouts_are_refused():
    from numba.core.errors import TypingError

    x = np.zeros((4, 32), np.float32)
    with pytest.raises(TypingError):
        _dot((x[:, 0],), (x[0],))  # a strided column
    with pytest.raises(TypingError):
        _sum(x[0].astype(np.float64))


@njit
def _weighted(p, r0, v, j0, kh, jlo, jhi, acc):
    weighted_rows(p, r0, v, j0, kh, jlo, jhi, acc)


@pytest.mark.parametrize("d", [CHUNK, 2 * CHUNK + 5, 3])
def test_weighted_rows_adds_each_key_in_order(d):
    """``acc[r0 + i] += p[r0 + i, j] * v[j0 + j, kh]`` for j in [jlo, jhi), key by key: on exact
    products, equal to numpy adding the terms one by one (every other row and column untouched),
    whether a column falls in a register chunk or the scalar tail."""
    rng = np.random.default_rng(d)
    p = _exact_products(rng, (8, 16))
    v = _exact_products(rng, (30, 2, d))
    acc = _exact_products(rng, (8, d))
    want = acc.copy()
    for j in range(3, 13):
        want[4:8] = want[4:8] + p[4:8, j, None] * v[10 + j, 1]
    got = acc.copy()
    _weighted(p, 4, v, 10, 1, 3, 13, got)
    np.testing.assert_array_equal(got, want)
    same = acc.copy()
    _weighted(p, 4, v, 10, 1, 5, 5, same)  # no keys: nothing added
    np.testing.assert_array_equal(same, acc)
