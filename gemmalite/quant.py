"""Weight-only quantized matrices: int8 per output row, int4 in groups along the input.

Both classes implement :class:`gemmalite.matrix.Matrix`. Activations stay 16/32-bit: the math
is float32, so ``matmul(x)`` agrees with ``x @ dense().T`` to float32 rounding, except decode
(T=1, AVX2), which rounds ``x`` to int16 per group (the int4 grid's groups; 32 values for
int8; step ``max|x| / 32767``: W8A16 / W4A16, as NPUs run them) so that the products are
exact 16-bit integer multiply-adds (:mod:`gemmalite.simd`); that rounding is ~100 times
smaller than the int8 weight error and ~1e4 times smaller than the int4 one.

Formats (what ``tensors()`` returns and ``from_tensors()`` reads; the converter stores them in
safetensors under ``<name>.<key>``):

``Int8Matrix``   ``q`` int8 ``[out, in]``, ``scale`` float32 ``[out]``.
                 ``W[r, k] = scale[r] * q[r, k]``, symmetric, ``q`` in ``[-127, 127]``.

``Int4Matrix``   ``packed`` uint8 ``[out, in // 2]``, ``scales`` float16 ``[out, in // group]``,
                 ``mins`` float16 ``[out, in // group]``.
                 ``W[r, g*G + i] = scales[r, g] * n + mins[r, g]`` with ``n`` in ``0..15``.
                 The group size is implied by the shapes: ``G = in // scales.shape[1]``.

Int4 layout: within each group of ``G`` values (``G // 2`` bytes), byte ``j`` holds value ``j``
in its low nibble and value ``j + G//2`` in its high nibble (the llama.cpp Q4_0/Q4_1 order).
Unpacking one contiguous run of bytes with ``b & 15`` and ``b >> 4`` thus yields two
*contiguous* runs of values that line up with two contiguous slices of ``x``, so the inner loop
is plain unit-stride SIMD (load bytes, mask/shift, widen, convert, FMA) with no shuffles.

Int4 is asymmetric (scale + min, "Q4_1"-like) rather than symmetric: on Gaussian, Laplace and
Student-t weights the fitted asymmetric grid has 12-25 % lower RMS error than a symmetric one
(with the same scale search), for 2 extra bytes per 32 weights (20 vs 18 bytes, +11 % bytes
read). The kernel cost is the same inner loop: ``sum_g(d_g * sum(n*x) + m_g * sum_g(x))``,
where the group sums of ``x`` are computed once per call. The scale and min are fitted per
group by a weighted least-squares search (llama.cpp ``make_qkx2_quants`` style), which may clip
a few outliers when that lowers the weighted error; the stored values are then used to
re-round, so dequantization error is at most ``scale/2`` for every weight inside the grid.

Kernels: ``matmul`` with ``T <= DECODE_MAX_T`` runs fused numba kernels (``prange`` over output
rows, weights read once for all T columns). Larger T (prefill): int8 runs integer tiles of 4
rows x 2 tokens with int16 activations (``simd.int8_tile_dot``, ~220 GOP/s on this machine,
2-3x the float32 BLAS path); int4, and CPUs without AVX2, dequantize row blocks into one
reused float32 buffer and multiply with BLAS. All kernels are cached on disk. On this 2-core
machine both int8 and int4 decode run near memory bandwidth (the portable float int4 kernel
is bound by nibble unpacking at ~6 GB/s). Thread pools: numba's OpenMP workers and
OpenBLAS's workers each spin after a call; the engine keeps them from overlapping (no BLAS
call in a decode step; ``OPENBLAS_THREAD_TIMEOUT=4``).
"""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic

from .matrix import Matrix
from .simd import (HAVE_AVX2, TILE_BLOCK, int16_activations, int4_rows_dot, int8_rows_dot, int8_tile_dot,
                   round_int16)

__all__ = ["Int8Matrix", "Int4Matrix", "matrix_from_tensors", "DECODE_MAX_T"]

DECODE_MAX_T = 4        # matmul with T <= this uses the fused numba kernels, else dequant + BLAS
TOKEN_CHUNK = 128       # int8 prefill: tokens per pass over the weights (x chunk: 128 * k * 2 bytes)
QUANT_BLOCK = 4096      # rows converted to float32 at a time when quantizing
_PREFILL_ELEMS = 1 << 20  # target elements (4 MiB of float32) per dequantized prefill block

_JIT = dict(cache=True, error_model="numpy", boundscheck=False)
LONG_ROW = 4096  # int8 rows at least this long use the 4-rows-at-a-time decode kernel
LONG_ROW_SIMD = 8192  # same for the int16-activation kernels (measured: only the 12288-wide down projections gain)
_FAST = dict(_JIT, fastmath=True)


# --------------------------------------------------------------------------- helpers


@intrinsic
def _h2f(typingctx, h):
    """float16 bits (uint16) -> float32 (vcvtph2ps with F16C). numba has no CPU float16."""
    sig = types.float32(types.uint16)

    def codegen(context, builder, signature, args):
        return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())

    return sig, codegen


def _as_f32_block(w: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(w, dtype=np.float32)


def _ids(ids) -> np.ndarray:
    return np.ascontiguousarray(np.asarray(ids, dtype=np.int64).reshape(-1))


_scratch = np.empty(0, dtype=np.float32)


def _scratch_buffer(n: int) -> np.ndarray:
    """A module-wide float32 buffer reused by every prefill product (grown on demand)."""
    global _scratch
    if _scratch.size < n:
        _scratch = np.empty(n, dtype=np.float32)
    return _scratch[:n]


def _prefill_rows(cols: int) -> int:
    b = _PREFILL_ELEMS // max(cols, 1)
    return int(min(1024, max(256, b - b % 64)))


def _check_x(x: np.ndarray, cols: int) -> np.ndarray:
    x = np.ascontiguousarray(x, dtype=np.float32)
    if x.ndim != 2 or x.shape[1] != cols:
        raise ValueError(f"x must be [T, {cols}], got {x.shape}")
    return x


# --------------------------------------------------------------------------- int8 kernels


@njit(parallel=True, **_JIT)
def _i8_quantize(w, q, scale):
    n, k = w.shape
    for r in prange(n):
        amax = np.float32(0.0)
        for j in range(k):
            a = abs(w[r, j])
            if a > amax:
                amax = a
        s = amax / np.float32(127.0)
        scale[r] = s
        if s == 0:
            for j in range(k):
                q[r, j] = 0
        else:
            for j in range(k):
                v = np.rint(w[r, j] / s)
                v = min(max(v, np.float32(-127.0)), np.float32(127.0))
                q[r, j] = np.int8(v)


@njit(parallel=True, **_FAST)
def _i8_mv1(q, scale, x, out):
    """out[0, r] = scale[r] * sum_k q[r, k] * x[0, k]."""
    n, k = q.shape
    x0 = x[0]
    for r in prange(n):
        qr = q[r]
        acc = np.float32(0.0)
        for j in range(k):
            acc += np.float32(qr[j]) * x0[j]
        out[0, r] = acc * scale[r]


@njit(parallel=True, **_FAST)
def _i8_mv1_rows4(q, scale, x, out):
    """T=1 for long rows (in >= LONG_ROW): four rows share each load of x. With a row of
    6144-12288 values x no longer fits in L1, and re-reading it per row halved the bandwidth
    (down projections: 13 -> 22 GB/s)."""
    n, k = q.shape
    x0 = x[0]
    for g in prange((n + 3) // 4):
        r = 4 * g
        if r + 4 <= n:
            q0 = q[r]
            q1 = q[r + 1]
            q2 = q[r + 2]
            q3 = q[r + 3]
            a0 = np.float32(0.0)
            a1 = np.float32(0.0)
            a2 = np.float32(0.0)
            a3 = np.float32(0.0)
            for j in range(k):
                xj = x0[j]
                a0 += np.float32(q0[j]) * xj
                a1 += np.float32(q1[j]) * xj
                a2 += np.float32(q2[j]) * xj
                a3 += np.float32(q3[j]) * xj
            out[0, r] = a0 * scale[r]
            out[0, r + 1] = a1 * scale[r + 1]
            out[0, r + 2] = a2 * scale[r + 2]
            out[0, r + 3] = a3 * scale[r + 3]
        else:
            for rr in range(r, n):
                a = np.float32(0.0)
                for j in range(k):
                    a += np.float32(q[rr, j]) * x0[j]
                out[0, rr] = a * scale[rr]


@njit(parallel=True, **_FAST)
def _i8_mv4(q, scale, x, out):
    """2 <= T <= 4 columns in one pass over the weights (rows of x past T-1 repeat the last)."""
    n, k = q.shape
    t = x.shape[0]
    x0 = x[0]
    x1 = x[min(1, t - 1)]
    x2 = x[min(2, t - 1)]
    x3 = x[min(3, t - 1)]
    for r in prange(n):
        qr = q[r]
        a0 = np.float32(0.0)
        a1 = np.float32(0.0)
        a2 = np.float32(0.0)
        a3 = np.float32(0.0)
        for j in range(k):
            w = np.float32(qr[j])
            a0 += w * x0[j]
            a1 += w * x1[j]
            a2 += w * x2[j]
            a3 += w * x3[j]
        s = scale[r]
        out[0, r] = a0 * s
        out[1, r] = a1 * s
        if t > 2:
            out[2, r] = a2 * s
        if t > 3:
            out[3, r] = a3 * s


@njit(parallel=True, **_FAST)
def _i8_mv1_w8a16(q, scale, xq, xd, rows_per_task, out):
    """T=1 with int16 activations (per 32 values): exact int32 sums via 16-bit SIMD
    multiply-add, ``rows_per_task`` (1 or 4) rows sharing each load of x."""
    n = q.shape[0]
    for b in prange((n + rows_per_task - 1) // rows_per_task):
        r = b * rows_per_task
        if rows_per_task == 4 and r + 4 <= n:
            int8_rows_dot(q, xq, xd, r, out, 4)
        else:
            for i in range(r, min(n, r + rows_per_task)):
                int8_rows_dot(q, xq, xd, i, out, 1)
        for i in range(r, min(n, r + rows_per_task)):
            out[i] *= scale[i]


@njit(parallel=True, **_FAST)
def _round_int16_rows(x, block, xq, xd):
    """``simd.round_int16`` for every row of ``x`` (prefill activations), in parallel."""
    for t in prange(x.shape[0]):
        xs = np.empty(xd.shape[1], dtype=np.float32)
        round_int16(x[t], block, xq[t], xd[t], xs)


@njit(parallel=True, **_FAST)
def _i8_mm_w8a16(q, scale, xq, xd, out):
    """Prefill with int16 activations: tiles of 4 rows x 2 tokens (``int8_tile_dot``), each
    task one 4-row strip against all tokens (the strip stays in L1, x in L2)."""
    n = q.shape[0]
    t_all = xq.shape[0]
    for b in prange((n + 3) // 4):
        r = 4 * b
        if r + 4 <= n:
            for t in range(0, t_all - 1, 2):
                int8_tile_dot(q, xq, xd, r, t, out, 4, 2)
            if t_all % 2:
                int8_tile_dot(q, xq, xd, r, t_all - 1, out, 4, 1)
        else:
            for i in range(r, n):
                for t in range(t_all):
                    int8_tile_dot(q, xq, xd, i, t, out, 1, 1)
        for t in range(t_all):
            for i in range(r, min(n, r + 4)):
                out[t, i] *= scale[i]


@njit(**_JIT)
def _i8_dequant_range(q, scale, r0, out):
    m, k = out.shape
    for i in range(m):
        s = scale[r0 + i]
        qr = q[r0 + i]
        o = out[i]
        for j in range(k):
            o[j] = np.float32(qr[j]) * s


@njit(**_JIT)
def _i8_dequant_ids(q, scale, ids, out):
    m, k = out.shape
    for i in range(m):
        r = ids[i]
        s = scale[r]
        qr = q[r]
        o = out[i]
        for j in range(k):
            o[j] = np.float32(qr[j]) * s


# --------------------------------------------------------------------------- int4 kernels


@njit(**_FAST)
def _fit_group(v, wt, nq):
    """Weighted least-squares (scale, min) for one group, v ~ d * n + m, n in 0..15."""
    lo = v.min()
    hi = v.max()
    if hi == lo:
        return np.float32(0.0), lo
    g = v.size
    sw = np.float32(0.0)
    swx = np.float32(0.0)
    for i in range(g):
        sw += wt[i]
        swx += wt[i] * v[i]
    best_d = (hi - lo) / np.float32(15.0)
    best_m = lo
    best_e = np.float32(0.0)
    inv = np.float32(1.0) / best_d
    for i in range(g):
        n = min(max(np.rint((v[i] - lo) * inv), np.float32(0.0)), np.float32(15.0))
        e = best_d * n + lo - v[i]
        best_e += wt[i] * e * e
    for step in range(21):
        iscale = (np.float32(-1.0) + np.float32(0.1) * step + np.float32(15.0)) / (hi - lo)
        swl = np.float32(0.0)
        swl2 = np.float32(0.0)
        swxl = np.float32(0.0)
        for i in range(g):
            n = min(max(np.rint(iscale * (v[i] - lo)), np.float32(0.0)), np.float32(15.0))
            nq[i] = n
            swl += wt[i] * n
            swl2 += wt[i] * n * n
            swxl += wt[i] * n * v[i]
        det = sw * swl2 - swl * swl
        if det <= 0:
            continue
        d = (sw * swxl - swx * swl) / det
        m = (swl2 * swx - swl * swxl) / det
        if d <= 0:
            continue
        e_tot = np.float32(0.0)
        for i in range(g):
            e = d * nq[i] + m - v[i]
            e_tot += wt[i] * e * e
        if e_tot < best_e:
            best_e = e_tot
            best_d = d
            best_m = m
    return best_d, best_m


@njit(parallel=True, **_FAST)
def _i4_quantize(w, group, search, scales_f, mins_f):
    """w float32 [n, k] -> fitted float32 scale and min per group (rounded to float16 later)."""
    n, k = w.shape
    ng = k // group
    for r in prange(n):
        wt = np.empty(group, dtype=np.float32)
        nq = np.empty(group, dtype=np.float32)
        for g in range(ng):
            v = w[r, g * group : (g + 1) * group]
            if search:
                s2 = np.float32(0.0)
                for i in range(group):
                    s2 += v[i] * v[i]
                av = np.sqrt(s2 / group)
                for i in range(group):
                    wt[i] = av + abs(v[i])
                d, m = _fit_group(v, wt, nq)
            else:
                lo = v.min()
                d = (v.max() - lo) / np.float32(15.0)
                m = lo
            scales_f[r, g] = d
            mins_f[r, g] = m


@njit(parallel=True, **_JIT)
def _i4_pack(w, group, d16, m16, packed):
    """Round with the *stored* (float16-rounded, here as float32) scale and min, then pack."""
    n, k = w.shape
    ng = k // group
    h = group // 2
    for r in prange(n):
        for g in range(ng):
            d = d16[r, g]
            m = m16[r, g]
            inv = np.float32(1.0) / d if d > 0 else np.float32(0.0)
            base = g * group
            for j in range(h):
                a = min(max(np.rint((w[r, base + j] - m) * inv), 0.0), 15.0) if d > 0 else 0.0
                b = min(max(np.rint((w[r, base + h + j] - m) * inv), 0.0), 15.0) if d > 0 else 0.0
                packed[r, g * h + j] = np.uint8(np.int32(a) | (np.int32(b) << 4))


@njit(**_FAST)
def _group_sums(x, group, xs):
    t, k = x.shape
    for i in range(t):
        for g in range(k // group):
            s = np.float32(0.0)
            for j in range(group):
                s += x[i, g * group + j]
            xs[i, g] = s


@njit(inline="always", **_FAST)
def _nibbles(byte):
    """(low, high) nibble of a uint8 as float32, computed in float (no int64 promotion)."""
    f = np.float32(byte)
    hi = np.floor(f * np.float32(0.0625))
    return f - np.float32(16.0) * hi, hi


@njit(parallel=True, **_FAST)
def _i4_mv1(packed, scales, mins, x, xs, group, out):
    """out[0, r] = sum_g d_g * sum_j n_j x_j + m_g * sum_g(x)."""
    n = packed.shape[0]
    ng = scales.shape[1]
    h = group // 2
    x0 = x[0]
    xs0 = xs[0]
    for r in prange(n):
        pr = packed[r]
        sr = scales[r]
        mr = mins[r]
        acc = np.float32(0.0)
        for g in range(ng):
            p = pr[g * h : g * h + h]
            xa = x0[g * group : g * group + h]
            xb = x0[g * group + h : g * group + group]
            s = np.float32(0.0)
            for j in range(h):
                lo, hi = _nibbles(p[j])
                s += lo * xa[j] + hi * xb[j]
            acc += _h2f(sr[g]) * s + _h2f(mr[g]) * xs0[g]
        out[0, r] = acc


@njit(inline="always", **_FAST)
def _i4_rows_w4a16(packed, scales, mins, xq, xd, xs, group, r, nrows, out):
    if nrows == 4:
        if group == 32:
            int4_rows_dot(packed, scales, xq, xd, r, out, 32, 4)
        else:
            int4_rows_dot(packed, scales, xq, xd, r, out, 64, 4)
    else:
        if group == 32:
            int4_rows_dot(packed, scales, xq, xd, r, out, 32, 1)
        else:
            int4_rows_dot(packed, scales, xq, xd, r, out, 64, 1)
    for i in range(r, r + nrows):
        m = np.float32(0.0)
        for g in range(scales.shape[1]):
            m += _h2f(mins[i, g]) * xs[g]
        out[i] += m


@njit(parallel=True, **_FAST)
def _i4_mv1_w4a16(packed, scales, mins, xq, xd, xs, group, rows_per_task, out):
    """T=1 with int16 activations: exact int32 sums per group via 16-bit SIMD multiply-add,
    ``rows_per_task`` (1 or 4) rows sharing each load of x."""
    n = packed.shape[0]
    for b in prange((n + rows_per_task - 1) // rows_per_task):
        r = b * rows_per_task
        if r + rows_per_task <= n:
            _i4_rows_w4a16(packed, scales, mins, xq, xd, xs, group, r, rows_per_task, out)
        else:
            for i in range(r, n):
                _i4_rows_w4a16(packed, scales, mins, xq, xd, xs, group, i, 1, out)


@njit(parallel=True, **_FAST)
def _i4_mv4(packed, scales, mins, x, xs, group, out):
    """2 <= T <= 4 columns in one pass over the weights (rows of x past T-1 repeat the last)."""
    n = packed.shape[0]
    ng = scales.shape[1]
    h = group // 2
    t = x.shape[0]
    i1 = min(1, t - 1)
    i2 = min(2, t - 1)
    i3 = min(3, t - 1)
    x0 = x[0]
    x1 = x[i1]
    x2 = x[i2]
    x3 = x[i3]
    for r in prange(n):
        pr = packed[r]
        sr = scales[r]
        mr = mins[r]
        a0 = np.float32(0.0)
        a1 = np.float32(0.0)
        a2 = np.float32(0.0)
        a3 = np.float32(0.0)
        for g in range(ng):
            p = pr[g * h : g * h + h]
            o = g * group
            y0a = x0[o : o + h]
            y0b = x0[o + h : o + group]
            y1a = x1[o : o + h]
            y1b = x1[o + h : o + group]
            y2a = x2[o : o + h]
            y2b = x2[o + h : o + group]
            y3a = x3[o : o + h]
            y3b = x3[o + h : o + group]
            s0 = np.float32(0.0)
            s1 = np.float32(0.0)
            s2 = np.float32(0.0)
            s3 = np.float32(0.0)
            for j in range(h):
                lo, hi = _nibbles(p[j])
                s0 += lo * y0a[j] + hi * y0b[j]
                s1 += lo * y1a[j] + hi * y1b[j]
                s2 += lo * y2a[j] + hi * y2b[j]
                s3 += lo * y3a[j] + hi * y3b[j]
            d = _h2f(sr[g])
            m = _h2f(mr[g])
            a0 += d * s0 + m * xs[0, g]
            a1 += d * s1 + m * xs[i1, g]
            a2 += d * s2 + m * xs[i2, g]
            a3 += d * s3 + m * xs[i3, g]
        out[0, r] = a0
        out[1, r] = a1
        if t > 2:
            out[2, r] = a2
        if t > 3:
            out[3, r] = a3


@njit(inline="always", **_JIT)
def _i4_dequant_group(p, d, mn, oa, ob):
    for j in range(p.shape[0]):
        lo, hi = _nibbles(p[j])
        oa[j] = lo * d + mn
        ob[j] = hi * d + mn


@njit(**_JIT)
def _i4_dequant_row(packed, scales, mins, r, group, o):
    h = group // 2
    pr = packed[r]
    sr = scales[r]
    mr = mins[r]
    for g in range(sr.shape[0]):
        _i4_dequant_group(pr[g * h : g * h + h], _h2f(sr[g]), _h2f(mr[g]),
                          o[g * group : g * group + h], o[g * group + h : g * group + group])


@njit(**_JIT)
def _i4_dequant_range(packed, scales, mins, r0, group, out):
    for i in range(out.shape[0]):
        _i4_dequant_row(packed, scales, mins, r0 + i, group, out[i])


@njit(**_JIT)
def _i4_dequant_ids(packed, scales, mins, ids, group, out):
    for i in range(out.shape[0]):
        _i4_dequant_row(packed, scales, mins, ids[i], group, out[i])


# --------------------------------------------------------------------------- classes


class _Quantized(Matrix):
    def _dequant_range(self, r0: int, out: np.ndarray) -> None:
        raise NotImplementedError

    def _matmul_blocked(self, x: np.ndarray) -> np.ndarray:
        """Prefill: dequantize blocks of rows into a reused buffer, multiply with BLAS.

        The dequantization runs on the calling thread only (serial numba kernel): with a
        parallel one, numba's OpenMP workers and OpenBLAS's spinning workers would alternate
        block by block and oversubscribe the two cores. BLAS uses all cores for the product.
        """
        n, k = self.shape
        out = np.empty((x.shape[0], n), dtype=np.float32)
        b = _prefill_rows(k)
        buf = _scratch_buffer(min(b, n) * k).reshape(-1, k)
        for r0 in range(0, n, b):
            blk = buf[: min(b, n - r0)]
            self._dequant_range(r0, blk)
            np.matmul(x, blk.T, out=out[:, r0 : r0 + blk.shape[0]])
        return out


class Int8Matrix(_Quantized):
    """Symmetric int8 weights, one float32 scale per output row: ``W = scale[:, None] * q``."""

    def __init__(self, q: np.ndarray, scale: np.ndarray):
        q = np.asarray(q)
        scale = np.asarray(scale)
        if q.ndim != 2 or q.dtype != np.int8:
            raise ValueError(f"q must be a 2-D int8 array, got {q.dtype} {q.shape}")
        if scale.dtype != np.float32 or scale.shape != (q.shape[0],):
            raise ValueError(f"scale must be float32 [{q.shape[0]}], got {scale.dtype} {scale.shape}")
        self.q = np.ascontiguousarray(q)  # no copy when already contiguous (memory-mapped)
        self.scale = np.ascontiguousarray(scale)
        self.shape = q.shape

    @property
    def uses_blas(self) -> bool:
        """Prefill takes the integer tiles where they apply, else dequantize + BLAS."""
        return not (HAVE_AVX2 and self.shape[1] % TILE_BLOCK == 0)

    @classmethod
    def quantize(cls, w: np.ndarray) -> "Int8Matrix":
        """Quantize a float32/bfloat16/float16 ``[out, in]`` array, QUANT_BLOCK rows at a time."""
        if w.ndim != 2:
            raise ValueError("w must be 2-D")
        n, k = w.shape
        q = np.empty((n, k), dtype=np.int8)
        scale = np.empty(n, dtype=np.float32)
        for r0 in range(0, n, QUANT_BLOCK):
            r1 = min(n, r0 + QUANT_BLOCK)
            _i8_quantize(_as_f32_block(w[r0:r1]), q[r0:r1], scale[r0:r1])
        return cls(q, scale)

    def tensors(self) -> dict[str, np.ndarray]:
        return {"q": self.q, "scale": self.scale}

    @classmethod
    def from_tensors(cls, d: dict) -> "Int8Matrix":
        return cls(d["q"], d["scale"])

    @property
    def nbytes(self) -> int:
        return self.q.nbytes + self.scale.nbytes

    def rows(self, ids) -> np.ndarray:
        ids = _ids(ids)
        out = np.empty((ids.size, self.shape[1]), dtype=np.float32)
        if ids.size:
            if ids.min() < -self.shape[0] or ids.max() >= self.shape[0]:
                raise IndexError("row id out of range")
            _i8_dequant_ids(self.q, self.scale, ids % self.shape[0], out)
        return out

    def _dequant_range(self, r0, out):
        _i8_dequant_range(self.q, self.scale, r0, out)

    def matmul(self, x: np.ndarray) -> np.ndarray:
        x = _check_x(x, self.shape[1])
        t = x.shape[0]
        if t > DECODE_MAX_T:
            return self._matmul_blocked(x) if self.uses_blas else self._matmul_w8a16(x)
        out = np.empty((t, self.shape[0]), dtype=np.float32)
        if t == 1 and HAVE_AVX2 and self.shape[1] % 32 == 0:
            xq, xd, _ = int16_activations(x[0], 32)
            _i8_mv1_w8a16(self.q, self.scale, xq, xd, 4 if self.shape[1] >= LONG_ROW_SIMD else 1, out[0])
        elif t == 1:
            (_i8_mv1_rows4 if self.shape[1] >= LONG_ROW else _i8_mv1)(self.q, self.scale, x, out)
        elif t > 1:
            _i8_mv4(self.q, self.scale, x, out)
        return out

    def _matmul_w8a16(self, x: np.ndarray) -> np.ndarray:
        """Prefill: x rounded to int16 per TILE_BLOCK values, integer tiles, TOKEN_CHUNK tokens at
        a time (so that a chunk of x stays in L2 while every weight strip passes by)."""
        t, k = x.shape
        xq = np.empty((t, k), dtype=np.int16)
        xd = np.empty((t, k // TILE_BLOCK), dtype=np.float32)
        _round_int16_rows(x, TILE_BLOCK, xq, xd)
        out = np.empty((t, self.shape[0]), dtype=np.float32)
        for t0 in range(0, t, TOKEN_CHUNK):
            t1 = min(t, t0 + TOKEN_CHUNK)
            _i8_mm_w8a16(self.q, self.scale, xq[t0:t1], xd[t0:t1], out[t0:t1])
        return out

    def __repr__(self):
        return f"Int8Matrix{self.shape}"


class Int4Matrix(_Quantized):
    """Asymmetric grouped int4: ``W[r, g*G+i] = scales[r, g] * n + mins[r, g]``, n in 0..15.

    ``packed`` uint8 ``[out, in//2]`` (see the module docstring for the nibble order),
    ``scales`` and ``mins`` float16 ``[out, in//group]``.
    """

    GROUPS = (32, 64)

    def __init__(self, packed: np.ndarray, scales: np.ndarray, mins: np.ndarray,
                 shape: tuple[int, int] | None = None, group: int | None = None):
        packed = np.asarray(packed)
        scales = np.asarray(scales)
        mins = np.asarray(mins)
        if packed.ndim != 2 or packed.dtype != np.uint8:
            raise ValueError(f"packed must be 2-D uint8, got {packed.dtype} {packed.shape}")
        n, k = packed.shape[0], packed.shape[1] * 2
        if shape is not None and tuple(shape) != (n, k):
            raise ValueError(f"shape {tuple(shape)} does not match packed {packed.shape}")
        if scales.ndim != 2 or scales.shape[0] != n or scales.shape[1] == 0:
            raise ValueError(f"scales must be [{n}, in//group], got {scales.shape}")
        g = k // scales.shape[1]
        if group is not None and group != g:
            raise ValueError(f"group {group} does not match the shapes (implied {g})")
        _check_group(k, g)
        if scales.dtype != np.float16 or mins.dtype != np.float16 or mins.shape != scales.shape:
            raise ValueError("scales and mins must be float16 arrays of the same shape")
        self.packed = np.ascontiguousarray(packed)
        self.scales = np.ascontiguousarray(scales)
        self.mins = np.ascontiguousarray(mins)
        self._s16 = self.scales.view(np.uint16)
        self._m16 = self.mins.view(np.uint16)
        self.group = g
        self.shape = (n, k)

    @classmethod
    def quantize(cls, w: np.ndarray, group: int = 32, search: bool = True) -> "Int4Matrix":
        """Quantize a float32/bfloat16/float16 ``[out, in]`` array, QUANT_BLOCK rows at a time.

        ``search`` fits each group's scale/min by weighted least squares (slower, more
        accurate); otherwise the grid spans the group's [min, max] exactly.
        """
        if w.ndim != 2:
            raise ValueError("w must be 2-D")
        n, k = w.shape
        _check_group(k, group)
        ng = k // group
        packed = np.empty((n, k // 2), dtype=np.uint8)
        scales = np.empty((n, ng), dtype=np.float16)
        mins = np.empty((n, ng), dtype=np.float16)
        for r0 in range(0, n, QUANT_BLOCK):
            r1 = min(n, r0 + QUANT_BLOCK)
            wb = _as_f32_block(w[r0:r1])
            d = np.empty((r1 - r0, ng), dtype=np.float32)
            m = np.empty((r1 - r0, ng), dtype=np.float32)
            _i4_quantize(wb, group, search, d, m)
            with np.errstate(over="ignore"):
                d16 = d.astype(np.float16)
                m16 = m.astype(np.float16)
            scales[r0:r1] = d16
            mins[r0:r1] = m16
            _i4_pack(wb, group, d16.astype(np.float32), m16.astype(np.float32), packed[r0:r1])
        return cls(packed, scales, mins)

    def tensors(self) -> dict[str, np.ndarray]:
        return {"packed": self.packed, "scales": self.scales, "mins": self.mins}

    @classmethod
    def from_tensors(cls, d: dict) -> "Int4Matrix":
        return cls(d["packed"], d["scales"], d["mins"])

    @property
    def nbytes(self) -> int:
        return self.packed.nbytes + self.scales.nbytes + self.mins.nbytes

    def rows(self, ids) -> np.ndarray:
        ids = _ids(ids)
        out = np.empty((ids.size, self.shape[1]), dtype=np.float32)
        if ids.size:
            if ids.min() < -self.shape[0] or ids.max() >= self.shape[0]:
                raise IndexError("row id out of range")
            _i4_dequant_ids(self.packed, self._s16, self._m16, ids % self.shape[0], self.group, out)
        return out

    def _dequant_range(self, r0, out):
        _i4_dequant_range(self.packed, self._s16, self._m16, r0, self.group, out)

    def matmul(self, x: np.ndarray) -> np.ndarray:
        x = _check_x(x, self.shape[1])
        t = x.shape[0]
        if t > DECODE_MAX_T:
            return self._matmul_blocked(x)
        out = np.empty((t, self.shape[0]), dtype=np.float32)
        if t == 0:
            return out
        if t == 1 and HAVE_AVX2:
            xq, xd, xs = int16_activations(x[0], self.group)
            _i4_mv1_w4a16(self.packed, self._s16, self._m16, xq, xd, xs, self.group,
                          4 if self.shape[1] >= LONG_ROW_SIMD else 1, out[0])
            return out
        xs = np.empty((t, self.shape[1] // self.group), dtype=np.float32)
        _group_sums(x, self.group, xs)
        if t == 1:
            _i4_mv1(self.packed, self._s16, self._m16, x, xs, self.group, out)
        else:
            _i4_mv4(self.packed, self._s16, self._m16, x, xs, self.group, out)
        return out

    def __repr__(self):
        return f"Int4Matrix{self.shape}(group={self.group})"


def _check_group(k: int, group: int) -> None:
    if group not in Int4Matrix.GROUPS:
        raise ValueError(f"int4 group size must be one of {Int4Matrix.GROUPS}, got {group}")
    if k % group:
        raise ValueError(f"in features ({k}) must be divisible by the group size ({group})")


def matrix_from_tensors(d: dict) -> Matrix:
    """Rebuild a quantized matrix from the dict its ``tensors()`` returned (keys pick the class)."""
    if "packed" in d:
        return Int4Matrix.from_tensors(d)
    if "q" in d:
        return Int8Matrix.from_tensors(d)
    raise ValueError(f"not a quantized matrix: keys {sorted(d)}")


def quantize(w: np.ndarray, kind: str) -> "Int8Matrix | Int4Matrix":
    """``kind`` "int8" or "int4"; int4 falls back to int8 for a matrix whose input width is not a
    multiple of the group (only toy shapes: real Gemma widths are multiples of 256)."""
    if kind == "int4" and w.shape[1] % Int4Matrix.GROUPS[0] == 0:
        return Int4Matrix.quantize(w)
    if kind not in ("int8", "int4"):
        raise ValueError(f"unknown quantization {kind!r}")
    return Int8Matrix.quantize(w)
