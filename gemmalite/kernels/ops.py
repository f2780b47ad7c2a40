"""Elementwise and attention kernels, float32, written to match transformers' float32 math.

Matrix products live behind `Matrix.matmul` (`gemmalite.weights`); everything else the layers
need is here. The numba loops behind them are in `numba_ops`.
"""
from __future__ import annotations

import numpy as np

from . import blas, common
from .numba_ops import (KEY_BLOCK, attention_blocked, attention_decode, attention_rows, gelu_tanh_mul_flat,
                        gelu_tanh_mul_parallel, key_block_bounds, rms_norm_rows, rms_norm_rows_parallel, rope_rows,
                        softmax_rows_serial)

MASKED = np.float32(-1e30)  # finite: a fully masked row can never turn into NaN
QUERY_BLOCK = 256  # query rows per block of the BLAS attention: bounds its score matrix


_NO_WEIGHT = np.zeros(0, np.float32)
PARALLEL_NORM_MIN = 1 << 16  # values from which RMSNorm and GELU spread over the threads (prefill, not decode)


def rms_norm(x: np.ndarray, weight: np.ndarray | None, eps: float) -> np.ndarray:
    """``x / sqrt(mean(x^2) + eps) * weight`` over the last axis (weight None: scale-free).
    Weights already carry any family offset (Gemma 3's ``1 + w``)."""
    x2 = np.ascontiguousarray(x, dtype=np.float32).reshape(-1, x.shape[-1])
    out = np.empty_like(x2)
    norm = rms_norm_rows_parallel if x2.size >= PARALLEL_NORM_MIN else rms_norm_rows
    norm(x2, _NO_WEIGHT if weight is None else weight, float(eps), out)
    return out.reshape(x.shape)


def gelu_tanh_mul(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``gelu_tanh(a) * b`` (tanh-approximate GELU, ``gelu_pytorch_tanh``) on a fresh buffer, by
    `numba_ops.gelu_tanh_mul_flat` (one vectorised pass; the compiled decode step calls it too), its
    values spread over the threads from PARALLEL_NORM_MIN values on (the same bits)."""
    a = np.ascontiguousarray(a, dtype=np.float32)
    b = np.ascontiguousarray(b if b.shape == a.shape else np.broadcast_to(b, a.shape), dtype=np.float32)
    t = np.empty_like(a)
    gelu = gelu_tanh_mul_parallel if a.size >= PARALLEL_NORM_MIN else gelu_tanh_mul_flat
    gelu(a.reshape(-1), b.reshape(-1), t.reshape(-1))
    return t


def rope_tables(inv_freq: np.ndarray, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin ``[T, D/2]`` with float32 angles, as transformers computes them."""
    ang = positions.astype(np.float32)[:, None] * inv_freq[None, :]
    return np.cos(ang), np.sin(ang)


def apply_rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """Rotate-half RoPE on ``x [T, heads, D]``: dim i pairs with i + D/2."""
    if x.ndim == 3 and cos.dtype == sin.dtype == x.dtype == np.float32 and cos.shape == (x.shape[0], x.shape[2] // 2):
        out = np.empty(x.shape, dtype=np.float32)
        rope_rows(x, np.ascontiguousarray(cos), np.ascontiguousarray(sin), out)
        return out
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    c, s = cos[:, None, :], sin[:, None, :]
    return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)


def softcap(x: np.ndarray, cap: float | None) -> np.ndarray:
    if not cap:
        return x
    c = np.float32(cap)
    return np.tanh(x / c) * c


def attention_numba(q: np.ndarray, k: np.ndarray, v: np.ndarray, q_pos: np.ndarray, k_pos: np.ndarray,
                    window: int | None, scale: float, causal: bool = True) -> np.ndarray:
    """The blocked numba attention (online softmax, key blocks out of every query's reach
    skipped): any length, no BLAS call, O(T x window) on sliding layers."""
    T, nq, D = q.shape
    nkb = (k.shape[0] + KEY_BLOCK - 1) // KEY_BLOCK
    lo, hi = np.empty(nkb, np.int64), np.empty(nkb, np.int64)
    k_pos = np.ascontiguousarray(k_pos, dtype=np.int64)
    key_block_bounds(k_pos, lo, hi)
    out = np.empty((T, nq * D), dtype=np.float32)
    attention_blocked(np.ascontiguousarray(q, dtype=np.float32), k, v, np.ascontiguousarray(q_pos, dtype=np.int64),
                      k_pos, lo, hi, window or 0, np.float32(scale), out, causal)
    return out


def attention(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    q_pos: np.ndarray,
    k_pos: np.ndarray,
    window: int | None,
    scale: float,
    blas: bool = False,
    causal: bool = True,
) -> np.ndarray:
    """GQA attention by absolute positions, causal (decoder) or bidirectional (encoder).

    q ``[T, nq, D]``; k, v ``[N, kv, D]``; key ``j`` is visible to query ``i`` iff ``pos_j >= 0``
    and, causal, ``pos_j <= pos_i`` and (sliding) ``pos_j > pos_i - window`` (a width), or,
    bidirectional, (sliding) ``|pos_j - pos_i| <= window`` (an inclusive radius). Returns ``[T, nq*D]``.
    KV heads are indexed, never repeated: query head h uses KV head ``h // (nq/kv)``.
    Decode rows run `attention_rows` on sliding layers (a task per row and head) and
    `attention_decode` on full ones (split over key blocks, K/V read once); more rows the blocked
    numba kernel (`attention_numba`: key blocks out of reach skipped, so O(T x window) on sliding
    layers), whatever the caller's products run on: their BLAS calls are single-threaded in
    `kernels.blas`'s own threads, so no OpenBLAS pool spins beside numba's. At Gemma 3 270M's
    shapes (4 heads of 256, one KV head), 4,096 tokens in one call: 62 ms a sliding layer (window
    512) against 905 through BLAS, 518 / 904 a full one. With ``blas``, the batched numpy path
    below (BLAS, ``QUERY_BLOCK`` rows at a time): faster at small head sizes over thousands of
    keys (the vision tower), and the reference the numba kernels are tested against.
    """
    T, nq, D = q.shape
    if T <= common.FEW_ROWS and window:  # a sliding ring: every thread streams it, a task per (row, head)
        out = np.empty((T, nq * D), dtype=np.float32)
        attention_rows(np.ascontiguousarray(q, dtype=np.float32), k, v, q_pos, k_pos,
                       window, np.float32(scale), MASKED, out, causal)
        return out
    if T <= common.FEW_ROWS:  # the whole context: split over key blocks, each read once
        out = np.empty((T, nq * D), dtype=np.float32)
        attention_decode(np.ascontiguousarray(q, dtype=np.float32), k, v, np.ascontiguousarray(q_pos, dtype=np.int64),
                         np.ascontiguousarray(k_pos, dtype=np.int64), window or 0, np.float32(scale), out, causal,
                         common.compute_threads())
        return out
    if blas:
        return _attention_blas(q, k, v, q_pos, k_pos, window, scale, causal)
    return attention_numba(q, k, v, q_pos, k_pos, window, scale, causal)


def _attention_blas(q, k, v, q_pos, k_pos, window, scale, causal) -> np.ndarray:
    """The batched BLAS path: per KV head and ``QUERY_BLOCK`` query rows, scores by BLAS, the
    fused softmax in numba, then BLAS again. The heads are spread over the compute threads, each
    calling single-threaded BLAS (`blas.run_single_threaded`): the same numbers on any thread
    count, and no OpenBLAS pool spinning beside numba's (it slowed the numba kernels that follow
    by up to 2x: the vision tower's int8 products 1.2 s alone against 2.5 s)."""
    T, nq, D = q.shape
    kv = k.shape[1]
    g = nq // kv
    kt = np.ascontiguousarray(k.transpose(1, 2, 0))  # [kv, D, N] (strided, BLAS took 2x longer)
    vt = np.ascontiguousarray(v.transpose(1, 0, 2))  # [kv, N, D]
    out = np.empty((T, nq * D), dtype=np.float32)
    heads_out = out.reshape(T, kv, g, D)
    fill = MASKED / np.float32(scale) if scale else MASKED  # MASKED once scaled

    def heads(hs: range) -> None:
        for t0 in range(0, T, QUERY_BLOCK):
            qb = q[t0 : t0 + QUERY_BLOCK]
            tb = qb.shape[0]
            qp = q_pos[t0 : t0 + tb, None]
            kp = k_pos[None, :]
            allowed = (kp >= 0) & (kp <= qp) if causal else np.broadcast_to(kp >= 0, (tb, kp.shape[1]))
            if window is not None:
                allowed = allowed & ((kp > qp - window) if causal else (np.abs(kp - qp) <= window))
            masked = None if allowed.all() else ~allowed
            for h in hs:
                scores = qb[:, h * g : (h + 1) * g].reshape(tb * g, D) @ kt[h]  # rows (token, head of the group)
                if masked is not None:
                    scores3 = scores.reshape(tb, g, -1)
                    scores3[np.broadcast_to(masked[:, None, :], scores3.shape)] = fill
                softmax_rows_serial(scores, np.float32(scale))
                heads_out[t0 : t0 + tb, h] = (scores @ vt[h]).reshape(tb, g, D)

    n = min(kv, common.compute_threads())  # a head's numbers do not depend on which heads share its thread
    blas.run_single_threaded([lambda i=i: heads(range(i, kv, n)) for i in range(n)])
    return out
