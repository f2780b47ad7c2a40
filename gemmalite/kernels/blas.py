"""BLAS products whose numbers depend on neither the thread count nor OpenBLAS's own pool.

OpenBLAS's sgemm orders its sums by its thread count and by the shape it is handed (measured,
``x @ w.T`` on 1 and 2 threads: 2-22 % of the outputs differ, by up to 1e-4 at widths of 2,048),
so a prefill through BLAS gave other logits with ``threads=1`` than with 2, or when the thread
governor dropped to one thread on a busy machine. Here a product is cut into tiles of weight rows
fixed by the matrix's shape alone, each multiplied by single-threaded BLAS, and the compute
threads (Python threads: numpy and the nogil kernels release the GIL) take the tiles: the same
numbers on any thread count, and no OpenBLAS worker spinning beside numba's.
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

import numpy as np

from . import common

TILE_BYTES = 1 << 20  # float32 weight bytes per tile, at most
TILE_GROUP = 4  # tiles per product: a multiple of this

_POOL: tuple[ThreadPoolExecutor, Any] | None = None


def pool() -> tuple[ThreadPoolExecutor, Any]:
    """The Python threads that run BLAS tiles (as many as numba's pool) and the BLAS thread limit
    they run under (threadpoolctl)."""
    global _POOL
    if _POOL is None:
        import numba
        from threadpoolctl import ThreadpoolController

        _POOL = ThreadPoolExecutor(numba.config.NUMBA_NUM_THREADS, "gemmalite-blas"), ThreadpoolController()
    return _POOL


def run_single_threaded(tasks: list[Callable[[], None]]) -> None:
    """Run ``tasks`` on the compute threads, BLAS on one thread inside each; the tasks' results
    must not depend on which thread runs them."""
    n = min(len(tasks), common.compute_threads())
    executor, ctl = pool()
    with ctl.limit(limits=1, user_api="blas"):
        if n <= 1:
            for task in tasks:
                task()
            return
        parts = [executor.submit(lambda i=i: [t() for t in tasks[i::n]]) for i in range(n)]
        for f in parts:
            f.result()


def tile_rows(rows: int, cols: int) -> int:
    """Weight rows per tile: equal tiles of TILE_BYTES of float32 or less, as many as a multiple of
    TILE_GROUP (so that 1, 2 or 4 threads share them evenly), rounded up to 16 rows."""
    n = max(1, -(-rows * cols * 4 // TILE_BYTES))
    n = -(-n // TILE_GROUP) * TILE_GROUP
    r = -(-rows // n)
    return max(16, -(-r // 16) * 16)


def products(x: np.ndarray, rows: int, tile: Callable[[int, int], np.ndarray]) -> np.ndarray:
    """``x @ W.T`` for a weight ``W [rows, cols]`` that ``tile(r0, r1)`` gives as float32 rows
    ``r0 .. r1`` (a view of W, or rows decoded by a nogil kernel into the thread's scratch)."""
    t, cols = x.shape
    out = np.empty((t, rows), dtype=np.float32)
    step = tile_rows(rows, cols)

    def task(r0: int) -> Callable[[], None]:
        def run() -> None:
            r1 = min(rows, r0 + step)
            np.matmul(x, tile(r0, r1).T, out=out[:, r0:r1])
        return run

    if t and rows:
        run_single_threaded([task(r0) for r0 in range(0, rows, step)])
    return out
