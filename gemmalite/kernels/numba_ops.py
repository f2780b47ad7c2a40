"""numba kernels behind `ops` and the float matrices: norms, attention, few-row float products.

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


@njit(parallel=True, cache=True, fastmath=True, boundscheck=False)
def f32_matmul_small(x, w, out):  # pragma: no cover - compiled
    """out[t, r] = sum_c x[t, c] * w[r, c] for a few rows of x, each weight row read once.
    Decode runs every product on numba's threads: a BLAS call between numba kernels wakes
    OpenBLAS's workers, and the two pools then spin against each other on the two cores."""
    R, C = w.shape
    T = x.shape[0]
    for r in prange(R):
        for t in range(T):
            acc = np.float32(0.0)
            for c in range(C):
                acc += x[t, c] * w[r, c]
            out[t, r] = acc


@njit(cache=True, boundscheck=False)
def rope_rows(x, cos, sin, out):  # pragma: no cover - compiled
    """Rotate-half RoPE over ``x [T, heads, D]`` with ``cos``/``sin`` ``[T, D/2]``: the numpy
    expression's products and sums in the same order (no fastmath: no fused multiply-add), so
    the result is the same to the bit, without its four temporaries."""
    T, nh, D = x.shape
    half = D // 2
    for t in range(T):
        for h in range(nh):
            for i in range(half):
                a = x[t, h, i]
                b = x[t, h, i + half]
                c = cos[t, i]
                s = sin[t, i]
                out[t, h, i] = a * c - b * s
                out[t, h, i + half] = b * c + a * s


@njit(cache=True, boundscheck=False)
def rms_norm_rows(x, w, eps, out):  # pragma: no cover - compiled
    """out = x / sqrt(mean(x^2) + eps) * w per row of 2-D ``x`` (``w`` empty: scale-free).

    The mean of squares accumulates in float64 (at least as exact as torch's float32
    reduction); the two multiplications round in float32 like transformers'."""
    rows, d = x.shape
    has_w = w.shape[0] > 0
    for r in range(rows):
        s = 0.0
        for c in range(d):
            v = np.float64(x[r, c])
            s += v * v
        inv = np.float32((s / d + eps) ** -0.5)
        if has_w:
            for c in range(d):
                out[r, c] = (x[r, c] * inv) * w[c]
        else:
            for c in range(d):
                out[r, c] = x[r, c] * inv


@njit(parallel=True, cache=True, fastmath=True, boundscheck=False)
def attention_rows(q, k, v, q_pos, k_pos, window, scale, masked, out, causal=True):  # pragma: no cover - compiled
    """Attention without BLAS (decode rows, moderate prefills): one task per (row, query head).

    Same math and mask as kernels.attention (scores * scale, finite mask, max-subtracted
    softmax, weighted sum of V); ``window`` 0 means no sliding window. It keeps OpenBLAS's
    worker threads asleep, so they never spin against numba's."""
    T, nq, D = q.shape
    N, kv = k.shape[0], k.shape[1]
    g = nq // kv
    for task in prange(T * nq):
        t = task // nq
        h = task % nq
        kh = h // g
        qp = q_pos[t]
        s = np.empty(N, np.float32)
        best = masked
        for j in range(N):
            kp = k_pos[j]
            if kp < 0 or (causal and (kp > qp or (window > 0 and kp <= qp - window))) \
                    or (not causal and window > 0 and abs(kp - qp) > window):
                s[j] = masked
            else:
                acc = np.float32(0.0)
                for d in range(D):
                    acc += q[t, h, d] * k[j, kh, d]
                s[j] = acc * scale
                best = max(best, s[j])
        tot = np.float32(0.0)
        for j in range(N):
            e = np.exp(s[j] - best)
            s[j] = e
            tot += e
        inv = np.float32(1.0) / tot
        o = out[t, h * D : (h + 1) * D]
        o[:] = 0
        for j in range(N):
            p = s[j] * inv
            if p != 0:
                for d in range(D):
                    o[d] += p * v[j, kh, d]
