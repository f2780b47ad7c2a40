"""BLAS products in fixed tiles: float32 math within the reference's own float32 error, and the
same numbers bit for bit on any thread count, whatever OpenBLAS's own thread count is."""
from __future__ import annotations

import numba
import numpy as np
import pytest
from threadpoolctl import threadpool_info, threadpool_limits

from gemmalite.kernels import blas

torch = pytest.importorskip("torch")

# (tokens, cols, rows): shapes where OpenBLAS's sgemm gives other sums on 1 and 2 threads
SHAPES = [(100, 64, 128), (100, 2048, 512), (300, 640, 1100), (5, 96, 70)]


def _operands(t: int, cols: int, rows: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.standard_normal((t, cols), dtype=np.float32), rng.standard_normal((rows, cols), dtype=np.float32)


def _products(x: np.ndarray, w: np.ndarray, threads: int) -> np.ndarray:
    before = numba.get_num_threads()
    numba.set_num_threads(threads)
    try:
        return blas.products(x, w.shape[0], lambda r0, r1: w[r0:r1])
    finally:
        numba.set_num_threads(before)


@pytest.mark.parametrize("shape", SHAPES)
def test_products_are_float32_math(shape, monkeypatch):
    """Against float64, within twice torch's own float32 error on the same operands (relative to
    |x| @ |w|.T), in several tiles with a ragged last one."""
    monkeypatch.setattr(blas, "TILE_BYTES", 4 * 64 * shape[1])  # tiles of 64 rows or fewer
    x, w = _operands(*shape)
    ref = x.astype(np.float64) @ w.astype(np.float64).T
    scale = np.abs(x.astype(np.float64)) @ np.abs(w.astype(np.float64)).T
    torch_err = np.max(np.abs((torch.from_numpy(x) @ torch.from_numpy(w).T).numpy() - ref) / scale)
    got = _products(x, w, numba.config.NUMBA_NUM_THREADS)
    assert got.shape == (shape[0], shape[2]) and got.dtype == np.float32
    assert np.max(np.abs(got - ref) / scale) <= 2 * torch_err


@pytest.mark.skipif(numba.config.NUMBA_NUM_THREADS < 2, reason="needs 2 threads")
@pytest.mark.parametrize("shape", SHAPES)
def test_same_numbers_on_any_thread_count(shape):
    x, w = _operands(*shape, seed=1)
    with threadpool_limits(2, user_api="blas"):  # OpenBLAS's own count, as numpy leaves it
        two = _products(x, w, 2)
        one = _products(x, w, 1)
    with threadpool_limits(1, user_api="blas"):
        again = _products(x, w, 2)
    np.testing.assert_array_equal(one, two)
    np.testing.assert_array_equal(again, two)


def test_blas_thread_count_is_left_as_it_was():
    x, w = _operands(100, 64, 128)
    with threadpool_limits(2, user_api="blas"):
        _products(x, w, 2)
        assert {i["num_threads"] for i in threadpool_info() if i["user_api"] == "blas"} == {2}


def test_empty_products():
    assert _products(np.zeros((0, 8), np.float32), np.ones((3, 8), np.float32), 2).shape == (0, 3)
    assert _products(np.ones((2, 8), np.float32), np.ones((0, 8), np.float32), 2).shape == (2, 0)


@pytest.mark.parametrize("rows, cols", [(1, 1), (70, 96), (1024, 640), (2048, 640), (640, 2048), (262_144, 640)])
def test_tiles_are_even_and_bounded(rows, cols):
    """Tiles of 16k rows, at most TILE_BYTES and one 16-row step; where the rows divide
    evenly, equal tiles in a multiple of TILE_GROUP (2 or 4 threads share them evenly)."""
    step = blas.tile_rows(rows, cols)
    assert step % 16 == 0
    assert (step - 16) * cols * 4 < blas.TILE_BYTES
    if rows % (16 * blas.TILE_GROUP) == 0 and rows * cols * 4 <= 64 * blas.TILE_BYTES:
        assert rows % step == 0 and (rows // step) % blas.TILE_GROUP == 0


def test_tasks_run_and_errors_surface():
    done = []
    blas.run_single_threaded([lambda i=i: done.append(i) for i in range(5)])
    assert sorted(done) == list(range(5))

    def boom() -> None:
        raise ValueError("tile failed")

    with pytest.raises(ValueError, match="tile failed"):
        blas.run_single_threaded([boom, boom])

    class Interrupted(BaseException):  # as KeyboardInterrupt: it crosses the compiled region too
        pass

    def stop() -> None:
        raise Interrupted

    with pytest.raises(Interrupted):
        blas.run_single_threaded([lambda: None, stop, lambda: None])
    assert not blas._CALLS  # nothing of a finished call is kept


@pytest.mark.skipif(numba.config.NUMBA_NUM_THREADS < 2, reason="needs 2 threads")
def test_tasks_run_on_numbas_own_threads():
    """The tiles run on numba's threads (Python threads of our own shared the cores with numba's
    workers, which spin after every region), each thread its share."""
    import threading

    before = numba.get_num_threads()
    numba.set_num_threads(2)
    try:
        seen = []
        blas.run_single_threaded([lambda: seen.append((numba.get_thread_id(), threading.get_ident()))] * 6)
    finally:
        numba.set_num_threads(before)
    assert sorted({t for t, _ in seen}) == [0, 1] and len(seen) == 6
    assert len({ident for _, ident in seen}) == 2
