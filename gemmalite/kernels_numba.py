"""numba kernels for the decode path (a few rows of activations against a big weight).

Compiled once and cached on disk (``cache=True``); parallel over output rows on all cores.
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

ROWS_PER_TASK = 64


@njit(parallel=True, cache=True, fastmath=True, boundscheck=False)
def bf16_matmul_small(x, w, out):  # pragma: no cover - compiled
    """out[t, r] = sum_c x[t, c] * bf16(w[r, c]); w is the raw uint16 bit pattern."""
    R, C = w.shape
    T = x.shape[0]
    for b in prange((R + ROWS_PER_TASK - 1) // ROWS_PER_TASK):
        bits = np.empty(C, np.uint32)
        f = bits.view(np.float32)
        for r in range(b * ROWS_PER_TASK, min(R, (b + 1) * ROWS_PER_TASK)):
            for c in range(C):
                bits[c] = np.uint32(w[r, c]) << 16
            for t in range(T):
                acc = np.float32(0.0)
                for c in range(C):
                    acc += x[t, c] * f[c]
                out[t, r] = acc
