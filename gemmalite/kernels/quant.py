"""numba kernels of the int8 / int4 matrices (`gemmalite.weights.quant`): quantization,
decode products (one pass over the weights for a few activation rows), int16-activation SIMD
products, prefill tiles and dequantization. Formats are described in `gemmalite.weights.quant`."""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from .common import EXACT, FAST, TOKEN_TILE, among, either, h2f, literal_ladder, nibbles, prefetch
from .fdot import dot_tile, lane_sum
from .simd import (TILE_BLOCK, U8_BLOCK, int4_rows_dot, int8_rows_dot, int8_tile_dot, int16_step, round_int16, round_u8,
                   u8_lane_corr, u8_tile_dot)

_JIT, _FAST = EXACT, FAST  # every option stated (common.EXACT / FAST say why)


# --------------------------------------------------------------------------- int8 kernels


@njit(parallel=True, **_JIT)
def i8_quantize(w, q, scale):
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
def i8_mv1(q, scale, x, out):
    """out[0, r] = scale[r] * sum_k q[r, k] * x[0, k]: four rows share each load of x (rows past
    the end repeat the last), each row's sum its own (`dot_tile`)."""
    n = q.shape[0]
    x0 = x[0]
    for g in prange((n + 3) // 4):
        r = 4 * g
        rb, rc, rd = min(r + 1, n - 1), min(r + 2, n - 1), min(r + 3, n - 1)
        s = dot_tile((x0,), (q[r], q[rb], q[rc], q[rd]))
        out[0, r] = s[0] * scale[r]
        out[0, rb] = s[1] * scale[rb]
        out[0, rc] = s[2] * scale[rc]
        out[0, rd] = s[3] * scale[rd]


@njit(parallel=True, **_FAST)
def i8_mv4(q, scale, x, out):
    """2 <= T <= 4 columns in one pass over the weights (rows of x past T-1 repeat the last), each
    row's sum as `i8_mv1`'s (`dot_tile`)."""
    t = x.shape[0]
    x0 = x[0]
    x1 = x[min(1, t - 1)]
    x2 = x[min(2, t - 1)]
    x3 = x[min(3, t - 1)]
    for r in prange(q.shape[0]):
        a = dot_tile((x0, x1, x2, x3), (q[r],))
        s = scale[r]
        out[0, r] = a[0] * s
        out[1, r] = a[1] * s
        if t > 2:
            out[2, r] = a[2] * s
        if t > 3:
            out[3, r] = a[3] * s




# Rows ``r .. r+3`` (``four``) or row ``r``, tokens ``t0 .. t0+nt-1`` (``nt`` 1..4), with x in int16 per
# TILE_BLOCK values (``blocks``: `int8_tile_dot`) or per 32 (`int8_rows_dot`), the tile sizes as literals.
_i8_tile = literal_ladder(
    "_i8_tile(q, xq, xd, r, t0, nt, out, four, blocks)", "{F}(q, xq, xd, r, t0, out, {R}, {T})",
    dict(int8_tile_dot=int8_tile_dot, int8_rows_dot=int8_rows_dot),
    F=either("blocks", "int8_tile_dot", "int8_rows_dot"), R=either("four", 4, 1), T=among("nt", 4, 3, 2, 1))


@njit(inline="always", **_FAST)
def i8_w8a16_task(q, scale, xq, xd, rows_per_task, b, out):
    """Task ``b`` of `i8_mvn_w8a16`: weight rows ``b * rows_per_task ..`` against every row of x (a
    compiled decode step runs the same tasks inside its fused products, `weights.operands`)."""
    n, k = q.shape
    t_all = xq.shape[0]
    blocks = xd.shape[1] * TILE_BLOCK == k
    r = b * rows_per_task
    for t0 in range(0, t_all, TOKEN_TILE):
        nt = min(TOKEN_TILE, t_all - t0)
        if rows_per_task == 4 and r + 4 <= n:
            _i8_tile(q, xq, xd, r, t0, nt, out, True, blocks)
        else:
            for i in range(r, min(n, r + rows_per_task)):
                _i8_tile(q, xq, xd, i, t0, nt, out, False, blocks)
    for t in range(t_all):
        for i in range(r, min(n, r + rows_per_task)):
            out[t, i] *= scale[i]


@njit(parallel=True, **_FAST)
def i8_mvn_w8a16(q, scale, xq, xd, rows_per_task, out):
    """Rows of x with int16 activations (``xq``/``xd``/``out`` ``[T, .]``, per 32 values: a decode
    step, a prompt-lookup step, a batch of sequences): exact int32 sums via 16-bit SIMD
    multiply-add, in tiles of ``rows_per_task`` (1 or 4) weight rows x up to TOKEN_TILE
    activation rows: each weight is read from memory once for all T rows and widened once per
    tile, each activation loaded once per tile; every row's result is bit for bit its T=1 result."""
    for b in prange((q.shape[0] + rows_per_task - 1) // rows_per_task):
        i8_w8a16_task(q, scale, xq, xd, rows_per_task, b, out)


@njit(parallel=True, **_FAST)
def round_int16_rows(x, block, xq, xd):
    """``simd.round_int16`` for every row of ``x`` (prefill activations), in parallel."""
    for t in prange(x.shape[0]):
        round_int16(x[t], block, xq[t], xd[t])


PREFETCH_STRIPS = 4  # int8 prefill: 4-row strips ahead whose weights are prefetched (a short query: -10 %)


@njit(parallel=True, **_FAST)
def i8_mm_w8a16(q, scale, xq, xd, out):
    """Prefill with int16 activations: tiles of 4 rows x 3 tokens (``int8_tile_dot``), each
    task one 4-row strip against all tokens (the strip stays in L1, x in L2), the strip
    PREFETCH_STRIPS ahead prefetched (weights stream from memory; with a short input the
    hardware prefetcher alone leaves the tiles waiting)."""
    n, k = q.shape
    t_all = xq.shape[0]
    for b in prange((n + 3) // 4):
        r = 4 * b
        ahead = (r + 4 * PREFETCH_STRIPS) * k
        for off in range(0, min(4 * k, n * k - ahead), 64):
            prefetch(q, ahead + off)
        if r + 4 <= n:
            t = 0
            while t + 3 <= t_all:
                int8_tile_dot(q, xq, xd, r, t, out, 4, 3)
                t += 3
            while t < t_all:
                int8_tile_dot(q, xq, xd, r, t, out, 4, 1)
                t += 1
        else:
            for i in range(r, n):
                for t in range(t_all):
                    int8_tile_dot(q, xq, xd, i, t, out, 1, 1)
        for t in range(t_all):
            for i in range(r, min(n, r + 4)):
                out[t, i] *= scale[i]


@njit(parallel=True, **_FAST)
def round_u8_rows(x, xu, xd):
    """``simd.round_u8`` for every row of ``x`` (prefill activations, ``k`` a multiple of
    U8_BLOCK), in parallel; the scales ``xd`` come transposed, ``[k // U8_BLOCK, T]``."""
    for t in prange(x.shape[0]):
        round_u8(x, xu, xd, t)


@njit(parallel=True, **_FAST)
def round_i16_planes(x, xl, xh, xd):
    """Rows of ``x`` rounded to int16 per U8_BLOCK values exactly as `round_int16_rows` rounds them
    (scale max|x| / 32767), stored as the two byte planes `u8_tile_dot` takes: ``xl`` the low
    byte, ``xh`` the high byte + 128 (both uint8 ``[T, k]``); the scales transposed, ``xd [k //
    U8_BLOCK, T]``."""
    for t in prange(x.shape[0]):
        for g in range(x.shape[1] // U8_BLOCK):
            xg = x[t, g * U8_BLOCK : g * U8_BLOCK + U8_BLOCK]
            d, inv = int16_step(xg)
            xd[g, t] = d
            lo = xl[t, g * U8_BLOCK : g * U8_BLOCK + U8_BLOCK]
            hi = xh[t, g * U8_BLOCK : g * U8_BLOCK + U8_BLOCK]
            for j in range(U8_BLOCK):
                v = np.int32(np.int16(np.rint(xg[j] * inv)))
                lo[j] = np.uint8(v & 255)
                hi[j] = np.uint8((v >> 8) + 128)


@njit(parallel=True, **_FAST)
def i8_mm_vnni(q, scale, xu, xh, xd, t_lo, t_hi, out):
    """Prefill on VNNI (``u8_tile_dot``) with int8 activations (``xh`` None) or int16 ones as two
    byte planes (`round_i16_planes`): tiles of 4 rows x 3 tokens over tokens ``t_lo .. t_hi - 1``
    (24 accumulators and 7 loaded vectors: all of AVX-512's 32 registers, no spills), each task
    one 4-row strip against those tokens (the strip stays in L1, the tokens' activations in L2).
    Tokens past the last whole tile go one at a time, rows past the last whole strip too; every
    tile computes a pair the same way. Each strip first takes its lanes' offset terms
    (`u8_lane_corr`, the cost of one token)."""
    n = q.shape[0]
    nkb = q.shape[1] // U8_BLOCK
    for b in prange((n + 3) // 4):
        r = 4 * b
        lc = np.empty((nkb, 4, 8), dtype=np.int32)
        if r + 4 <= n:
            u8_lane_corr(q, r, lc, 4)
            t = t_lo
            while t + 3 <= t_hi:
                u8_tile_dot(q, lc, xu, xh, xd, r, t, out, scale, 4, 3)
                t += 3
            while t < t_hi:
                u8_tile_dot(q, lc, xu, xh, xd, r, t, out, scale, 4, 1)
                t += 1
        else:
            for i in range(r, n):
                u8_lane_corr(q, i, lc, 1)
                for t in range(t_lo, t_hi):
                    u8_tile_dot(q, lc, xu, xh, xd, i, t, out, scale, 1, 1)


@njit(nogil=True, **_JIT)  # BLAS tiles decode on several threads at once (kernels.blas)
def i8_dequant_range(q, scale, r0, out):
    m, k = out.shape
    for i in range(m):
        s = scale[r0 + i]
        qr = q[r0 + i]
        o = out[i]
        for j in range(k):
            o[j] = np.float32(qr[j]) * s


@njit(**_JIT)
def i8_dequant_ids(q, scale, ids, out):
    m, k = out.shape
    for i in range(m):
        r = ids[i]
        s = scale[r]
        qr = q[r]
        o = out[i]
        for j in range(k):
            o[j] = np.float32(qr[j]) * s


# --------------------------------------------------------------------------- int4 kernels


@njit(**_JIT)
def fit_group(v, wt, nq):
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
def i4_quantize(w, group, search, scales_f, mins_f):
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
                d, m = fit_group(v, wt, nq)
            else:
                lo = v.min()
                d = (v.max() - lo) / np.float32(15.0)
                m = lo
            scales_f[r, g] = d
            mins_f[r, g] = m


@njit(parallel=True, **_JIT)
def i4_pack(w, group, d16, m16, packed):
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
def group_sums(x, group, xs):
    t, k = x.shape
    for i in range(t):
        for g in range(k // group):
            s = np.float32(0.0)
            for j in range(group):
                s += x[i, g * group + j]
            xs[i, g] = s


@njit(inline="always", **_JIT)
def _i4_min(mins, scales, r, g, sym):
    """The group's min: stored, or -8 times the scale for the symmetric format (``sym``; ``mins``
    is then any uint16 array, unread)."""
    return np.float32(-8.0) * h2f(scales[r, g]) if sym else h2f(mins[r, g])


SCRATCH_ROWS = 64  # rows per task of the kernels below that need a scratch row (one allocation per task)


@njit(inline="always", **_FAST)
def _nibble_lanes(p, xa, xb, d, lanes):  # pragma: no cover - compiled
    """``lanes[j] += d lo_j xa[j] + d hi_j xb[j]`` for the bytes ``p`` of one group: a partial sum
    per byte position across the groups (vectorised, no reordering), `lane_sum`'d at the end. Each
    addition takes one product (`common.FAST`: which of two products a fused multiply-add takes
    is LLVM's choice, and it chose differently in the two compiled copies)."""
    for j in range(p.shape[0]):
        lo, hi = nibbles(p[j])
        lanes[j] = (lanes[j] + (d * lo) * xa[j]) + (d * hi) * xb[j]


@njit(parallel=True, **_FAST)
def i4_mv1(packed, scales, mins, x, xs, group, out, sym=False):
    """out[0, r] = sum_g d_g * sum_j n_j x_j + m_g * sum_g(x)."""
    n = packed.shape[0]
    ng = scales.shape[1]
    h = group // 2
    x0 = x[0]
    xs0 = xs[0]
    for b in prange((n + SCRATCH_ROWS - 1) // SCRATCH_ROWS):
        lanes = np.empty(h, np.float32)
        for r in range(b * SCRATCH_ROWS, min(n, b * SCRATCH_ROWS + SCRATCH_ROWS)):
            pr = packed[r]
            sr = scales[r]
            lanes[:] = 0
            m = np.float32(0.0)
            for g in range(ng):
                _nibble_lanes(pr[g * h : g * h + h], x0[g * group : g * group + h],
                              x0[g * group + h : g * group + group], h2f(sr[g]), lanes)
                m += _i4_min(mins, scales, r, g, sym) * xs0[g]
            out[0, r] = lane_sum(lanes) + m


# `int4_rows_dot` on rows ``r .. r+3`` (``four``) or row ``r``, tokens ``t0 .. t0+nt-1`` (``nt`` 1..4), with
# literal tile sizes and group.
_i4_tile = literal_ladder(
    "_i4_tile(packed, scales, xq, xd, r, t0, nt, out, group, four)",
    "int4_rows_dot(packed, scales, xq, xd, r, t0, out, {G}, {R}, {T})", dict(int4_rows_dot=int4_rows_dot),
    G=either("group == 32", 32, 64), R=either("four", 4, 1), T=among("nt", 4, 3, 2, 1))


@njit(parallel=True, **_FAST)
def i4_mvn_w4a16(packed, scales, mins, xq, xd, xs, group, rows_per_task, out):
    """Rows of x with int16 activations (``xq``/``xd``/``xs``/``out`` ``[T, .]``, as `i8_mvn_w8a16`):
    exact int32 sums per group via 16-bit SIMD multiply-add, in tiles of ``rows_per_task`` (1 or 4)
    weight rows x up to TOKEN_TILE activation rows; each weight row read from memory once for all
    T rows, every row's result bit for bit its T=1 result."""
    n = packed.shape[0]
    t_all = xq.shape[0]
    for b in prange((n + rows_per_task - 1) // rows_per_task):
        r = b * rows_per_task
        r1 = min(n, r + rows_per_task)
        for t0 in range(0, t_all, TOKEN_TILE):
            nt = min(TOKEN_TILE, t_all - t0)
            if r + 4 == r1 and rows_per_task == 4:
                _i4_tile(packed, scales, xq, xd, r, t0, nt, out, group, True)
            else:
                for i in range(r, r1):
                    _i4_tile(packed, scales, xq, xd, i, t0, nt, out, group, False)
    for b in prange((n + SCRATCH_ROWS - 1) // SCRATCH_ROWS):  # + sum_g m_g xs[t, g]; a row's mins in float32 first
        mrow = np.empty(scales.shape[1], np.float32)
        for i in range(b * SCRATCH_ROWS, min(n, b * SCRATCH_ROWS + SCRATCH_ROWS)):
            for g in range(scales.shape[1]):
                mrow[g] = h2f(mins[i, g])
            for t0 in range(0, t_all, 4):  # four tokens per pass (past the last, it repeats): 16 lanes each
                s4 = dot_tile((xs[t0], xs[min(t0 + 1, t_all - 1)], xs[min(t0 + 2, t_all - 1)],
                               xs[min(t0 + 3, t_all - 1)]), (mrow,))
                for j in range(min(4, t_all - t0)):
                    out[t0 + j, i] += s4[j]


@njit(parallel=True, **_FAST)
def i4_mv4(packed, scales, mins, x, xs, group, out, sym=False):
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
    for b in prange((n + SCRATCH_ROWS - 1) // SCRATCH_ROWS):
        lanes = np.empty((4, h), np.float32)
        for r in range(b * SCRATCH_ROWS, min(n, b * SCRATCH_ROWS + SCRATCH_ROWS)):
            pr = packed[r]
            sr = scales[r]
            lanes[:, :] = 0
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
                d = h2f(sr[g])
                _nibble_lanes(p, y0a, y0b, d, lanes[0])
                _nibble_lanes(p, y1a, y1b, d, lanes[1])
                _nibble_lanes(p, y2a, y2b, d, lanes[2])
                _nibble_lanes(p, y3a, y3b, d, lanes[3])
                m = _i4_min(mins, scales, r, g, sym)
                a0 += m * xs[0, g]
                a1 += m * xs[i1, g]
                a2 += m * xs[i2, g]
                a3 += m * xs[i3, g]
            out[0, r] = lane_sum(lanes[0]) + a0
            out[1, r] = lane_sum(lanes[1]) + a1
            if t > 2:
                out[2, r] = lane_sum(lanes[2]) + a2
            if t > 3:
                out[3, r] = lane_sum(lanes[3]) + a3


@njit(inline="always", **_JIT)
def i4_dequant_group(p, d, mn, oa, ob):
    for j in range(p.shape[0]):
        lo, hi = nibbles(p[j])
        oa[j] = lo * d + mn
        ob[j] = hi * d + mn


@njit(**_JIT)
def i4_dequant_row(packed, scales, mins, r, group, o, sym):
    h = group // 2
    pr = packed[r]
    sr = scales[r]
    for g in range(sr.shape[0]):
        i4_dequant_group(pr[g * h : g * h + h], h2f(sr[g]), _i4_min(mins, scales, r, g, sym),
                          o[g * group : g * group + h], o[g * group + h : g * group + group])


@njit(nogil=True, **_JIT)  # BLAS tiles decode on several threads at once (kernels.blas)
def i4_dequant_range(packed, scales, mins, r0, group, out, sym=False):
    for i in range(out.shape[0]):
        i4_dequant_row(packed, scales, mins, r0 + i, group, out[i], sym)


@njit(**_JIT)
def i4_dequant_ids(packed, scales, mins, ids, group, out, sym=False):
    for i in range(out.shape[0]):
        i4_dequant_row(packed, scales, mins, ids[i], group, out[i], sym)
