"""BLAS products whose numbers depend on neither the thread count nor OpenBLAS's own pool.

OpenBLAS's sgemm orders its sums by its thread count and by the shape it is handed (measured,
``x @ w.T`` on 1 and 2 threads: 2-22 % of the outputs differ, by up to 1e-4 at widths of 2,048),
so a prefill through BLAS gave other logits with ``threads=1`` than with 2, or when the thread
governor dropped to one thread on a busy machine. Here a product is cut into tiles of weight rows
fixed by the matrix's shape alone, each multiplied by single-threaded BLAS, and the compute
threads take the tiles: the same numbers on any thread count, and no OpenBLAS worker spinning
beside numba's.

The compute threads are numba's own: one parallel region whose iterations call back into Python
to run the tasks (numpy's BLAS and the nogil kernels release the GIL). Python threads of our own
would share the cores with numba's workers, which spin for a while after every region
(`settings.GOMP_SPIN`, what decode needs) and took their cores from the tiles of the prompt that
followed: on the real Gemma 3 270M a 128-token prompt runs in 0.78x the time on numba's threads
(the same bits).
"""
from __future__ import annotations

import ctypes
import itertools
from typing import Any, Callable

import numpy as np
from numba import njit, prange, types

from . import common
from .calls import Kernel, call0, signature_hash

TILE_BYTES = 1 << 20  # float32 weight bytes per tile, at most
TILE_GROUP = 4  # tiles per product: a multiple of this

_CONTROLLER: Any = None
_CALLS: dict[int, tuple[list[Callable[[], None]], int, list[BaseException]]] = {}  # call id -> tasks, shares, errors
_IDS = itertools.count()
_CALLBACK: tuple | None = None


def _run_share(call: int, i: int) -> None:
    """Share ``i`` of call ``call``'s tasks (every ``n``-th from ``i``), run on a numba thread
    through a ctypes callback (which takes the GIL); an error is kept for the caller."""
    tasks, n, errors = _CALLS[call]
    try:
        for task in tasks[i::n]:
            task()
    except BaseException as e:  # noqa: BLE001 - re-raised by run_single_threaded
        errors.append(e)


@njit(nogil=True, cache=True)
def _share(share, call, i):  # pragma: no cover - compiled
    """Share ``i``: the callback (not inlined into the loop: a call that may raise would stop the
    loop's parallel split)."""
    call0(share, (call, np.int64(i)))


@njit(parallel=True, nogil=True, cache=True)
def _drive(share, call, n):  # pragma: no cover - compiled
    for i in prange(n):
        _share(share, call, i)


def _callback() -> tuple[Kernel, Any]:
    """`_run_share` as a C function pointer, passed to `_drive` as a `calls.Kernel` (code naming a
    Python function or a ctypes pointer cannot be cached: it would compile in every process), and
    the ctypes object that must outlive its pointer's use."""
    global _CALLBACK
    if _CALLBACK is None:
        fn = ctypes.CFUNCTYPE(None, ctypes.c_int64, ctypes.c_int64)(_run_share)
        _CALLBACK = Kernel(ctypes.cast(fn, ctypes.c_void_p).value, signature_hash((types.int64,) * 2, types.none)), fn
    return _CALLBACK


def controller() -> Any:
    """threadpoolctl's controller, which sets the BLAS thread limit the tasks run under."""
    global _CONTROLLER
    if _CONTROLLER is None:
        from threadpoolctl import ThreadpoolController

        _CONTROLLER = ThreadpoolController()
    return _CONTROLLER


def run_single_threaded(tasks: list[Callable[[], None]]) -> None:
    """Run ``tasks`` on the compute threads, BLAS on one thread inside each; the tasks' results
    must not depend on which thread runs them. The first error a task raises is raised here,
    after every share has ended."""
    n = min(len(tasks), common.compute_threads())
    with controller().limit(limits=1, user_api="blas"):
        if n <= 1:
            for task in tasks:
                task()
            return
        call = next(_IDS)
        errors: list[BaseException] = []
        _CALLS[call] = (tasks, n, errors)
        try:
            _drive(_callback()[0], call, n)
        finally:
            del _CALLS[call]
        if errors:
            raise errors[0]


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
