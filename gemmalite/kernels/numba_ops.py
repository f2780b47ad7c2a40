"""numba kernels behind `ops` and the float matrices: norms, attention, few-row float products.

Compiled once and cached on disk (``cache=True``); parallel over output rows on all cores. Every
float sum runs in an order fixed by the source (`fdot`), so a process that compiled these kernels and
one that loaded them from the cache compute the same bits.
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from .common import EXACT, FAST, bits_to_f32, prefetch
from .fdot import dot_tile, lane_sum, sum_squares64, weighted_rows

ROWS_PER_TASK = 64
PREFETCH_STRIPS = 4  # matmul_tiles: 4-row strips ahead whose weights are prefetched


@njit(inline="always", **FAST)
def _store(out, toks, rows, sums):  # pragma: no cover - compiled
    """``out[toks[j], rows[i]] = sums[i * len(toks) + j]`` (`dot_tile`'s order, weight rows outer)."""
    nt = len(toks)
    for i in range(len(rows)):
        for j in range(nt):
            out[toks[j], rows[i]] = sums[i * nt + j]


@njit(parallel=True, **FAST)
def matmul_tiles(x, w, out):  # pragma: no cover - compiled
    """out[t, r] = sum_c x[t, c] * w[r, c] for a short input (a query of a few dozen tokens):
    tiles of 4 weight rows x 4 tokens (`dot_tile`: 16 sums per pass over ``c``), so each float32
    weight is loaded once per 4 tokens and each x
    value once per 4 rows; a task is a 4-row strip against every token (x stays in L1/L2),
    the strip PREFETCH_STRIPS ahead prefetched. T not a multiple of 4 takes 1-3 tiles of 3
    tokens (T = 4a + 3b: 18 tokens = 3 x 4 + 2 x 3, 10 % faster than 5 x 4 with two wasted);
    below 6 tokens a last tile of 4 overlaps the one before; rows (and tokens, T < 4) past the
    end repeat the last (recomputed, stored again).
    No BLAS call: the rows' thread pool is numba's alone. ~100 GFLOP/s per core here, twice
    what OpenBLAS gives on half weights converted to float32 blocks at these sizes."""
    R, C = w.shape
    T = x.shape[0]
    line = 64 // w.itemsize  # values per cache line
    threes = (4 - T % 4) % 4 if T >= 6 else 0
    fours = (T - 3 * threes + 3) // 4
    for b in prange((R + 3) // 4):
        ra = 4 * b
        ahead = (ra + 4 * PREFETCH_STRIPS) * C  # the weights stream from memory: ask for a later strip now
        for off in range(0, min(4 * C, R * C - ahead), line):
            prefetch(w, ahead + off)
        rb = min(ra + 1, R - 1)
        rc = min(ra + 2, R - 1)
        rd = min(ra + 3, R - 1)
        rows = (ra, rb, rc, rd)
        for i in range(fours):
            ta = max(min(4 * i, T - 4), 0)
            tb, tc, td = min(ta + 1, T - 1), min(ta + 2, T - 1), min(ta + 3, T - 1)
            _store(out, (ta, tb, tc, td), rows, dot_tile((w[ra], w[rb], w[rc], w[rd]), (x[ta], x[tb], x[tc], x[td])))
        for i in range(threes):
            t0 = 4 * fours + 3 * i
            _store(out, (t0, t0 + 1, t0 + 2), rows, dot_tile((w[ra], w[rb], w[rc], w[rd]), (x[t0], x[t0 + 1], x[t0 + 2])))


@njit(parallel=True, **FAST)
def f32_matmul_small(x, w, out):  # pragma: no cover - compiled
    """out[t, r] = sum_c x[t, c] * w[r, c] for a few rows of x, each weight row read once (one row
    per task: a single stream per thread reads memory fastest), each sum as `matmul_tiles` takes
    it (`dot_tile`).
    Decode runs every product on numba's threads: a BLAS call between numba kernels wakes
    OpenBLAS's workers, and the two pools then spin against each other on the two cores."""
    for r in prange(w.shape[0]):
        for t in range(x.shape[0]):
            out[t, r] = dot_tile((w[r],), (x[t],))[0]


@njit(inline="always", **EXACT)
def _gelu_tanh_mul_at(a, b, out, i):  # pragma: no cover - compiled
    x = a[i]
    u = x * x
    u = u * x
    u = u * np.float32(0.044715)
    u = u + x
    z = u * np.float32(1.5957691216057308)  # 2 sqrt(2 / pi)
    e = exp_nonpositive(-abs(z))
    s = (np.float32(1.0) if z >= 0 else e) / (np.float32(1.0) + e)
    out[i] = (x * s) * b[i]


@njit(**EXACT)
def gelu_tanh_mul_flat(a, b, out):  # pragma: no cover - compiled
    """``out = gelu_tanh(a) * b`` over flat contiguous arrays, GELU's tanh approximation as
    ``a * sigmoid(2u)`` (``0.5 (1 + tanh u) = sigmoid(2u)``, ``u = sqrt(2/pi) (a + 0.044715 a^3)``):
    ``e = exp(-|2u|)`` by `exp_nonpositive` and ``sigmoid = (1 or e) / (1 + e)``, a few float32 ulps
    relative everywhere, where ``1 + tanh`` in float32 loses all of them as ``tanh -> -1``. Plain
    float arithmetic that vectorises (as fast as numpy's SIMD tanh); no fastmath, so the bits do not
    depend on where it is compiled: the uncompiled and the compiled decode step share it."""
    for i in range(a.shape[0]):
        _gelu_tanh_mul_at(a, b, out, i)


GELU_CHUNK = 8192  # values per task of the parallel GELU


@njit(parallel=True, **EXACT)
def gelu_tanh_mul_parallel(a, b, out):  # pragma: no cover - compiled
    """`gelu_tanh_mul_flat` in chunks spread over the threads (prefill): each value the same bits."""
    n = a.shape[0]
    for c in prange((n + GELU_CHUNK - 1) // GELU_CHUNK):
        lo = c * GELU_CHUNK
        hi = min(n, lo + GELU_CHUNK)
        gelu_tanh_mul_flat(a[lo:hi], b[lo:hi], out[lo:hi])  # its vectorised loop on each chunk


@njit(**EXACT)
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


@njit(inline="always", **EXACT)
def _rms_norm_row(x, w, eps, out, r):  # pragma: no cover - compiled
    d = x.shape[1]
    s = sum_squares64(x[r])
    inv = np.float32((s / d + eps) ** -0.5)
    if w.shape[0] > 0:
        for c in range(d):
            out[r, c] = (x[r, c] * inv) * w[c]
    else:
        for c in range(d):
            out[r, c] = x[r, c] * inv


@njit(**EXACT)
def rms_norm_rows(x, w, eps, out):  # pragma: no cover - compiled
    """out = x / sqrt(mean(x^2) + eps) * w per row of 2-D ``x`` (``w`` empty: scale-free).

    The mean of squares accumulates in float64 (`sum_squares64`: at least as exact as torch's
    float32 reduction); the two multiplications round in float32 like transformers'."""
    for r in range(x.shape[0]):
        _rms_norm_row(x, w, eps, out, r)


@njit(parallel=True, **EXACT)
def rms_norm_rows_parallel(x, w, eps, out):  # pragma: no cover - compiled
    """`rms_norm_rows` with the rows spread over the threads (each row computed the same way)."""
    for r in prange(x.shape[0]):
        _rms_norm_row(x, w, eps, out, r)


@njit(inline="always", **FAST)
def exp_nonpositive(x):  # pragma: no cover - compiled
    """``e^x`` for ``x <= 0`` (softmax after the max is taken out) in plain float arithmetic that
    vectorizes: numba calls a scalar libm ``exp`` (no SVML here). ``2^y = 2^n * 2^f`` with ``n``
    the nearest integer, ``|f| <= 1/2``, ``2^f`` by its degree-7 Taylor polynomial (truncation
    < 1e-8; a few float32 ulps in all); 0 below ``2^-126`` (``x`` < -87.3), as no normal float is."""
    y0 = x * np.float32(1.4426950408889634)
    y = y0 if y0 > np.float32(-126.0) else np.float32(-126.0)  # noqa: FURB136 - max() does not vectorize
    n = np.floor(y + np.float32(0.5))
    f = (y - n) * np.float32(0.6931471805599453)
    p = np.float32(1.0 / 5040.0)
    p = p * f + np.float32(1.0 / 720.0)
    p = p * f + np.float32(1.0 / 120.0)
    p = p * f + np.float32(1.0 / 24.0)
    p = p * f + np.float32(1.0 / 6.0)
    p = p * f + np.float32(0.5)
    p = p * f + np.float32(1.0)
    p = p * f + np.float32(1.0)
    e = p * bits_to_f32((np.int32(n) + 127) << 23)
    return e if y0 > np.float32(-126.0) else np.float32(0.0)


@njit(inline="always", **FAST)
def softmax_row(row, scale):  # pragma: no cover - compiled
    """In place: ``softmax(scale * row)``; one pass for the max (eight running maxima: numba
    leaves a single one scalar), one for ``exp``, the sum (`lane_sum`), one to normalise."""
    n = row.shape[0]
    m = np.full(8, -np.inf, dtype=np.float32)
    for j0 in range(0, n - 7, 8):
        for i in range(8):
            v = row[j0 + i]
            m[i] = v if v > m[i] else m[i]  # noqa: FURB136 - nor here
    best = m.max()
    for j in range(n - n % 8, n):
        best = row[j] if row[j] > best else best  # noqa: FURB136
    best *= scale
    for j in range(n):
        row[j] = exp_nonpositive(row[j] * scale - best)
    inv = np.float32(1.0) / lane_sum(row)
    for j in range(n):
        row[j] *= inv


@njit(parallel=True, **FAST)
def softmax_rows(s, scale):  # pragma: no cover - compiled
    """`softmax_row` on each row of ``s [R, N]``, in parallel over rows."""
    for r in prange(s.shape[0]):
        softmax_row(s[r], scale)


@njit(nogil=True, **FAST)
def softmax_rows_serial(s, scale):  # pragma: no cover - compiled
    """`softmax_row` on each row of ``s [R, N]`` on the calling thread, without the GIL."""
    for r in range(s.shape[0]):
        softmax_row(s[r], scale)


LOWEST = np.float32(-3e38)  # below every score; not -inf, which fastmath ("no infinities") may fold away
DECODE_BLOCK = 128  # key slots per task of the decode attention (fixed by slot index: see attention_decode)


@njit(parallel=True, **FAST)
def attention_rows(q, k, v, q_pos, k_pos, window, scale, masked, out, causal=True):  # pragma: no cover - compiled
    """Attention of a few rows over a sliding ring without BLAS: one task per (row, query head).

    Same math and mask as kernels.attention (scores * scale, finite mask, max-subtracted
    softmax, weighted sum of V); ``window`` 0 means no sliding window. It keeps OpenBLAS's
    worker threads asleep, so they never spin against numba's. A row's result does not depend
    on the other rows of the call, nor on masked slots (later positions): a step of several
    tokens gives each row bit for bit what a one-token step gives it (prompt-lookup
    verification). A query that sees no slot gets zeros (never in the engine: a query sees itself).
    Each thread streams the whole ring (a sliding layer's: ~0.5 MiB at E2B's shape, then in L2 for
    the thread's other heads): in a decode step this beat splitting the ring's few key blocks over
    the threads (`attention_decode`, which wins on full layers' long contexts)."""
    T, nq, D = q.shape
    N, kv = k.shape[0], k.shape[1]
    g = nq // kv
    for task in prange(T * nq):
        t = task // nq
        h = task % nq
        kh = h // g
        qp = q_pos[t]
        qr = q[t, h]
        s = np.empty(N, np.float32)
        best = masked
        for j in range(N):
            kp = k_pos[j]
            if not visible(kp, qp, window, causal):
                s[j] = masked
            else:
                s[j] = dot_tile((qr,), (k[j, kh],))[0] * scale
                best = max(best, s[j])
        o = out[t, h * D : (h + 1) * D]
        o[:] = 0
        tot = np.float32(0.0)
        for j in range(N):  # one pass, in slot order: the sums never depend on how many masked slots follow
            if s[j] > masked:
                e = np.exp(s[j] - best)
                tot += e
                for d in range(D):
                    o[d] += e * v[j, kh, d]
        inv = np.float32(1.0) / tot if tot > 0 else np.float32(0.0)
        for d in range(D):
            o[d] *= inv


@njit(inline="always", **FAST)
def _decode_block(q, k, v, q_pos, k_pos, window, scale, causal, qlo, qhi, kh, b, part_m, part_l, part_o):  # pragma: no cover - compiled
    """One task of `attention_decode`: block ``b`` of KV head ``kh`` for every row and head of the group."""
    T, nq, D = q.shape
    N = k.shape[0]
    g = nq // k.shape[1]
    j0 = b * DECODE_BLOCK
    nk = min(N, j0 + DECODE_BLOCK) - j0
    lo = np.int64(1) << 62
    hi = np.int64(-1)
    for jj in range(nk):
        p = k_pos[j0 + jj]
        if p >= 0:
            lo = min(lo, p)
            hi = max(hi, p)
    if hi < 0:
        return
    if causal and (lo > qhi or (window > 0 and hi <= qlo - window)):
        return
    if not causal and window > 0 and (lo > qhi + window or hi < qlo - window):
        return
    s = np.empty((g, DECODE_BLOCK), np.float32)
    vis = np.empty(DECODE_BLOCK, np.bool_)
    for t in range(T):
        qp = q_pos[t]
        seen = False
        for jj in range(nk):
            vis[jj] = visible(k_pos[j0 + jj], qp, window, causal)
            seen = seen or vis[jj]
        if not seen:
            continue
        h0 = kh * g
        for jj in range(nk):  # scores: each K row once for the group's heads, 4 heads per pass over D
            if vis[jj]:
                kr = k[j0 + jj, kh]
                for hg in range(0, g, 4):  # heads past the group's last repeat it
                    d4 = dot_tile((q[t, h0 + hg], q[t, h0 + min(hg + 1, g - 1)], q[t, h0 + min(hg + 2, g - 1)],
                                   q[t, h0 + min(hg + 3, g - 1)]), (kr,))
                    for i in range(min(4, g - hg)):
                        s[hg + i, jj] = d4[i] * scale
        for hg in range(g):
            best = LOWEST
            for jj in range(nk):
                if vis[jj] and s[hg, jj] > best:
                    best = s[hg, jj]
            for jj in range(DECODE_BLOCK):  # masked slots and slots past the end weigh 0: the sum never depends on them
                e = np.float32(0.0)
                if jj < nk and vis[jj]:
                    e = np.exp(s[hg, jj] - best)
                s[hg, jj] = e
            part_m[kh, b, t, hg] = best
            part_l[kh, b, t, hg] = lane_sum(s[hg])
        o = part_o[kh, b, t]
        o[:, :] = 0
        for jj in range(nk):  # weighted sum of V: each V row once for the group's heads
            if vis[jj]:
                vr = v[j0 + jj, kh]
                for hg in range(g):
                    e = s[hg, jj]
                    for d in range(D):
                        o[hg, d] += e * vr[d]


@njit(parallel=True, **FAST)
def attention_decode(q, k, v, q_pos, k_pos, window, scale, out, causal=True, workers=1):  # pragma: no cover - compiled
    """Attention for a few query rows (decode steps) without BLAS, reading K and V once.

    Split over keys (flash-decoding): one task (`_decode_block`) per (KV head, DECODE_BLOCK slots) computes, for
    every row and every query head of the group, the block's max score, its sum of exponentials
    and its exp-weighted sum of V rows (each K/V row loaded once for all ``T x g`` queries, dot
    products and sums vectorised over the head dim); a second pass merges the blocks in slot
    order. The threads share every layer's keys however few KV heads there are, a sliding ring
    costs its own size, and a block that no row may see (every slot empty, later than the rows or
    out of the window) is never read. Tasks go round-robin to ``workers`` threads (a static split
    of 5 blocks gave one thread 3 of a sliding ring's 4 full ones). In a decode step (K/V cold,
    after the products' weights), reading each row once in slot order beat 4 x 4 register tiles
    (which win when K/V are hot) and slicing the heads over more tasks. Same visibility rule as
    the other kernels (``window`` 0: none). Blocks are fixed by slot index, and within a block and across blocks the sums run in
    slot order over the visible slots only, so a row's result depends on neither the other rows
    of the call nor the masked slots: a step of several tokens gives each row bit for bit what a
    one-token step gives it (prompt-lookup verification). A query that sees no slot gets zeros."""
    T, nq, D = q.shape
    N, kv = k.shape[0], k.shape[1]
    g = nq // kv
    nb = (N + DECODE_BLOCK - 1) // DECODE_BLOCK
    part_m = np.empty((kv, nb, T, g), np.float32)
    part_l = np.zeros((kv, nb, T, g), np.float32)  # 0: the block gave this query nothing
    part_o = np.empty((kv, nb, T, g, D), np.float32)
    qlo = q_pos.min()
    qhi = q_pos.max()
    nw = min(workers, kv * nb)
    for wk in prange(nw):  # tasks dealt round-robin: the ragged last block costs nobody a whole extra block
        for task in range(wk, kv * nb, nw):
            _decode_block(q, k, v, q_pos, k_pos, window, scale, causal, qlo, qhi, task // nb, task % nb,
                          part_m, part_l, part_o)
    for task in range(T * nq):  # merge the blocks, in slot order (serial: microseconds, no second fork)
        t = task // nq
        h = task % nq
        kh = h // g
        hg = h % g
        best = LOWEST
        for b in range(nb):
            if part_l[kh, b, t, hg] > 0 and part_m[kh, b, t, hg] > best:
                best = part_m[kh, b, t, hg]
        o = out[t, h * D : (h + 1) * D]
        o[:] = 0
        tot = np.float32(0.0)
        for b in range(nb):
            if part_l[kh, b, t, hg] > 0:
                c = np.exp(part_m[kh, b, t, hg] - best)
                tot += part_l[kh, b, t, hg] * c
                pb = part_o[kh, b, t, hg]
                for d in range(D):
                    o[d] += c * pb[d]
        inv = np.float32(1.0) / tot if tot > 0 else np.float32(0.0)
        for d in range(D):
            o[d] *= inv


@njit(inline="always", **EXACT)
def visible(kp, qp, window, causal):  # pragma: no cover - compiled
    """May a query at position ``qp`` see the key at ``kp`` (-1: an empty slot)? Causal: not after
    it and (``window`` > 0) within the last ``window`` positions; bidirectional: within a radius."""
    if kp < 0:
        return False
    if causal:
        return kp <= qp and (window <= 0 or kp > qp - window)
    return window <= 0 or abs(kp - qp) <= window


KEY_BLOCK = 64  # keys per block of the blocked attention (one block of K/V stays in L1/L2)
QUERY_ROWS = 16  # query rows per task of the blocked attention (they share each K/V block; a multiple of 4)


@njit(**EXACT)
def key_block_bounds(k_pos, out_min, out_max):  # pragma: no cover - compiled
    """Lowest and highest valid position per KEY_BLOCK keys (max -1: an empty block)."""
    n = k_pos.shape[0]
    for b in range(out_min.shape[0]):
        lo = np.int64(1) << 62
        hi = np.int64(-1)
        for j in range(b * KEY_BLOCK, min(n, (b + 1) * KEY_BLOCK)):
            p = k_pos[j]
            if p >= 0:
                lo = min(lo, p)
                hi = max(hi, p)
        out_min[b] = lo
        out_max[b] = hi


@njit(parallel=True, **FAST)
def attention_blocked(q, k, v, q_pos, k_pos, blk_min, blk_max, window, scale, out, causal=True):  # pragma: no cover - compiled
    """Attention of any length without BLAS: blocked over keys with an online softmax.

    One task per (QUERY_ROWS query rows, query head); keys go by KEY_BLOCK, and a block
    that no query of the task may see (by the positions in ``blk_min`` / ``blk_max``) is
    skipped, so a sliding layer costs O(T x window) whatever the order of the ring's slots.
    Four query rows share each load of K and V (scores: `dot_tile`; a block's sum of exponentials:
    `lane_sum`, masked keys at 0, so a row's result depends on no other row; the weighted sum of
    V: `weighted_rows`, the four rows' accumulators in registers over the keys any of them weighs,
    the others' zero weights adding nothing). Scratch is
    O(QUERY_ROWS x D) per task:
    memory stays flat on long prompts. Same visibility rule as `attention_rows` (``window``
    0: none); a query that sees no key gets zeros (never in the engine: it sees itself)."""
    T, nq, D = q.shape
    N, kv = k.shape[0], k.shape[1]
    g = nq // kv
    nqb = (T + QUERY_ROWS - 1) // QUERY_ROWS
    nkb = blk_min.shape[0]
    for task in prange(nqb * nq):
        b = task // nq
        h = task % nq
        kh = h // g
        t0 = b * QUERY_ROWS
        t1 = min(T, t0 + QUERY_ROWS)
        nr = t1 - t0
        qlo = q_pos[t0]
        qhi = q_pos[t0]
        for t in range(t0, t1):
            qlo = min(qlo, q_pos[t])
            qhi = max(qhi, q_pos[t])
        m = np.zeros(QUERY_ROWS, np.float32)
        tot = np.zeros(QUERY_ROWS, np.float32)
        acc = np.zeros((QUERY_ROWS, D), np.float32)
        s = np.zeros((QUERY_ROWS, KEY_BLOCK), np.float32)  # probabilities of this block (0: masked)
        vm = np.zeros(KEY_BLOCK, np.bool_)  # which keys of the block a row sees
        for kb in range(nkb):
            if blk_max[kb] < 0:
                continue
            if causal and (blk_min[kb] > qhi or (window > 0 and blk_max[kb] <= qlo - window)):
                continue
            if not causal and window > 0 and (blk_min[kb] > qhi + window or blk_max[kb] < qlo - window):
                continue
            j0 = kb * KEY_BLOCK
            nk = min(N, j0 + KEY_BLOCK) - j0
            for jj in range(nk, KEY_BLOCK):
                vm[jj] = False
            # does every row of the task see every filled slot of the block (away from the diagonal
            # and the window's edges)? Then the mask is the filled slots, once for all rows
            if causal:
                all_see = blk_max[kb] <= qlo and (window <= 0 or blk_min[kb] > qhi - window)
            else:
                all_see = window <= 0 or (blk_max[kb] - qlo <= window and qhi - blk_min[kb] <= window)
            if all_see:
                for jj in range(nk):
                    vm[jj] = k_pos[j0 + jj] >= 0
            for r0 in range(0, nr, 4):  # scores: 4 rows x 4 keys per pass over D (rows / keys past the end repeat the last)
                qa = q[t0 + r0, h]
                qb = q[t0 + min(r0 + 1, nr - 1), h]
                qc = q[t0 + min(r0 + 2, nr - 1), h]
                qd = q[t0 + min(r0 + 3, nr - 1), h]
                for jj in range(0, nk, 4):  # (``s`` has room for 4 rows and 4 keys past them)
                    d = dot_tile((qa, qb, qc, qd), (k[j0 + jj, kh], k[j0 + min(jj + 1, nk - 1), kh],
                                                    k[j0 + min(jj + 2, nk - 1), kh], k[j0 + min(jj + 3, nk - 1), kh]))
                    for i in range(4):
                        for c in range(4):
                            s[r0 + i, jj + c] = d[4 * i + c] * scale
            for r in range(nr):  # mask, online softmax: rescale what came before if the max grew
                qp = q_pos[t0 + r]
                if not all_see:
                    for jj in range(nk):
                        vm[jj] = visible(k_pos[j0 + jj], qp, window, causal)
                best = LOWEST
                for jj in range(nk):
                    x = s[r, jj] if vm[jj] else LOWEST
                    best = x if x > best else best  # noqa: FURB136 - max() does not vectorize
                if best == LOWEST:  # this row sees nothing here
                    for jj in range(nk):
                        s[r, jj] = 0
                    continue
                if tot[r] == 0:
                    m[r] = best
                elif best > m[r]:
                    c = np.exp(m[r] - best)
                    tot[r] *= c
                    for d in range(D):
                        acc[r, d] *= c
                    m[r] = best
                mr = m[r]
                for jj in range(KEY_BLOCK):  # branch-free: vectorised exp (exp_nonpositive) and select
                    e = exp_nonpositive(s[r, jj] - mr)
                    s[r, jj] = e if vm[jj] else np.float32(0.0)
                tot[r] += lane_sum(s[r])  # keys past the end weigh 0: the sum never depends on nk
            for r in range(nr, QUERY_ROWS):  # rows past the end weigh nothing
                for jj in range(nk):
                    s[r, jj] = 0
            for r0 in range(0, nr, 4):  # weighted sum of V: 4 rows in registers over the keys any of them weighs
                jlo = nk
                jhi = 0
                for r in range(r0, r0 + 4):
                    for jj in range(nk):
                        if s[r, jj] != 0:
                            jlo = min(jlo, jj)
                            break
                    for jj in range(nk - 1, -1, -1):
                        if s[r, jj] != 0:
                            jhi = max(jhi, jj + 1)
                            break
                if jhi > jlo:
                    weighted_rows(s, r0, v, j0, kh, jlo, jhi, acc)
        for r in range(nr):
            inv = np.float32(1.0) / tot[r] if tot[r] > 0 else np.float32(0.0)
            for d in range(D):
                out[t0 + r, h * D + d] = acc[r, d] * inv


@njit(parallel=True, **FAST)
def banded_attention(q, k, v, relk, band, cap, invalid, out):  # pragma: no cover - compiled
    """Local attention over a band: query ``t`` sees keys ``t - band + 1 .. t`` (keys before 0
    are masked with the logit ``invalid``), as the Gemma 4 audio tower's chunked attention
    amounts to. Logit of window slot ``w`` (key ``t - band + 1 + w``, at distance ``band - 1 -
    w``): ``cap * tanh((q . k + q . relk[distance, h]) / cap)``; softmax over the band; ``out [T,
    H, D]`` the weighted sum of the values, slot by slot. ``q``, ``k``, ``v`` ``[T, H, D]`` (scaled
    as the tower scales them), ``relk [distances >= band, H, D]`` (the relative-position keys).
    One task per query row; both dots of a slot by one `dot_tile` (fixed order): no BLAS call,
    whose spinning pool would slow the numba kernels after it."""
    T, H, D = q.shape
    for t in prange(T):
        s = np.empty(band, np.float32)
        for h in range(H):
            m = np.float32(-np.inf)
            for w in range(band):
                kt = t - band + 1 + w
                if kt < 0:
                    s[w] = invalid
                else:
                    qk, qr = dot_tile((q[t, h],), (k[kt, h], relk[band - 1 - w, h]))
                    x = (qk + qr) / cap
                    s[w] = np.tanh(x) * cap
                m = max(m, s[w])
            tot = np.float32(0.0)
            for w in range(band):
                s[w] = np.exp(s[w] - m)
                tot += s[w]
            o = out[t, h]
            o[:] = 0
            for w in range(band):
                kt = t - band + 1 + w
                if kt >= 0:
                    p = s[w] / tot
                    vr = v[kt, h]
                    for d in range(D):
                        o[d] += p * vr[d]


# --------------------------------------------------------------------------- encoder row stages
# The audio tower's elementwise stages between its products, each fused into one parallel pass over
# the rows: clip bounds (ClippableLinear's, the tower's gradient clamp), RMSNorm, SiLU, the scaled
# residual. Every float operation is the one the stage-by-stage numpy code performs, in its order.


@njit(**EXACT)
def sparse_bands(spec, lo, hi, filters, out):  # pragma: no cover - compiled
    """``out = spec @ filters`` (float64) for a filter bank whose bin ``j`` weighs only the bands
    ``lo[j] .. hi[j] - 1`` (a mel bank: at most two): each band's sum in bin order, its zero terms
    left out (exact: the terms are finite and non-negative). In numba, not BLAS: OpenBLAS's pool,
    once woken, spins beside the numba kernels after it (2^28 cycles by default; gemmalite's
    shorter OPENBLAS_THREAD_TIMEOUT holds only where numpy was not imported first)."""
    for f in range(spec.shape[0]):
        o = out[f]
        o[:] = 0.0
        for j in range(spec.shape[1]):
            s = spec[f, j]
            for b in range(lo[j], hi[j]):
                o[b] += s * filters[j, b]


@njit(inline="always", **EXACT)
def _sigmoid(y):  # pragma: no cover - compiled
    """``sigmoid(y)`` from `exp_nonpositive` of ``-|y|`` (vectorizes; a few ulps)."""
    e = exp_nonpositive(-abs(y))
    r = np.float32(1.0) / (np.float32(1.0) + e)
    return r if y >= 0 else e * r


@njit(inline="always", **EXACT)
def _silu(y):  # pragma: no cover - compiled
    return y * _sigmoid(y)


# Each row goes to a function of its own (compiled on its own, so its loops vectorise; inside a
# prange body they did not: 3x slower).


@njit(**EXACT)
def _norm_stage_row(x, lo, hi, w, eps, silu, lo2, hi2, scale, res, out):  # pragma: no cover - compiled
    d = x.shape[0]
    for c in range(d):
        out[c] = min(max(x[c], lo), hi)
    inv = np.float32((sum_squares64(out) / d + eps) ** -0.5)
    if w.shape[0] > 0:
        for c in range(d):
            out[c] = (out[c] * inv) * w[c]
    else:
        for c in range(d):
            out[c] = out[c] * inv
    if silu:
        for c in range(d):
            out[c] = _silu(out[c])
    for c in range(d):
        out[c] = min(max(out[c], lo2), hi2) * scale
    if res.shape[0] > 0:
        for c in range(d):
            out[c] = out[c] + res[c]


@njit(parallel=True, **EXACT)
def norm_stage(x, lo, hi, w, eps, silu, lo2, hi2, scale, res, out):  # pragma: no cover - compiled
    """Per row of ``x [T, d]``: ``clip(x, lo, hi)``, RMSNorm (`rms_norm_rows`' arithmetic; ``w``
    empty: scale-free), then SiLU if ``silu``, ``clip(·, lo2, hi2)``, ``· * scale`` and ``+ res``
    (``res`` ``[T, d]``, or empty: nothing added) into ``out`` (may be ``x``)."""
    none = out[0, :0]
    for r in prange(x.shape[0]):
        _norm_stage_row(x[r], lo, hi, w, eps, silu, lo2, hi2, scale, res[r] if res.shape[0] > 0 else none, out[r])


@njit(**EXACT)
def _clip_silu_clip_row(x, lo, hi, lo2, hi2):  # pragma: no cover - compiled
    for c in range(x.shape[0]):
        x[c] = min(max(_silu(min(max(x[c], lo), hi)), lo2), hi2)


@njit(parallel=True, **EXACT)
def clip_silu_clip(x, lo, hi, lo2, hi2):  # pragma: no cover - compiled
    """In place on ``x [T, d]``: ``clip(silu(clip(x, lo, hi)), lo2, hi2)`` (a clipped projection's
    output through SiLU into the next one's clipped input)."""
    for r in prange(x.shape[0]):
        _clip_silu_clip_row(x[r], lo, hi, lo2, hi2)


@njit(**EXACT)
def _glu_row(h, lo, hi, g):  # pragma: no cover - compiled
    H = g.shape[0]
    for c in range(H):
        a = min(max(h[c], lo), hi)
        g[c] = a * _sigmoid(min(max(h[H + c], lo), hi))


@njit(**EXACT)
def _taps_row(g, taps, t, out):  # pragma: no cover - compiled
    kk = taps.shape[0]
    for c in range(out.shape[0]):
        out[c] = np.float32(0.0)
    for j in range(max(0, kk - 1 - t), kk):  # a zero row's term adds nothing
        src = g[t - (kk - 1) + j]
        tap = taps[j]
        for c in range(out.shape[0]):
            out[c] += src[c] * tap[c]


@njit(parallel=True, **EXACT)
def glu_causal_conv(h, lo, hi, taps, out):  # pragma: no cover - compiled
    """The light convolution's middle: ``a = clip(h, lo, hi)``, GLU ``a[:, :H] * sigmoid(a[:, H:])``,
    then the causal depthwise convolution ``out[t] = sum_j glu[t - (K - 1) + j] * taps[j]`` (``taps
    [K, H]``, oldest first; rows before the first are zeros), summed in tap order from zero."""
    t_all, H = out.shape
    g = np.empty((t_all, H), dtype=np.float32)
    for t in prange(t_all):
        _glu_row(h[t], lo, hi, g[t])
    for t in prange(t_all):
        _taps_row(g, taps, t, out[t])


@njit(**EXACT)
def _conv_row(x, w, ln_w, eps, to, out):  # pragma: no cover - compiled
    t_all, f_all, c_in = x.shape
    c_out = out.shape[1]
    acc = np.empty(c_out, np.float64)
    for fo in range(out.shape[0]):
        acc[:] = 0
        for a in range(3):
            t = 2 * to + a - 1
            if t < 0 or t >= t_all:
                continue
            for b in range(3):
                f = 2 * fo + b - 1
                if f < 0 or f >= f_all:
                    continue
                if c_in == 1:  # the first layer: one value under each tap
                    xv = np.float64(x[t, f, 0])
                    for co in range(c_out):
                        acc[co] += xv * w[a, b, co, 0]
                    continue
                xr = x[t, f]
                for co in range(0, c_out - 3, 4):  # each tap's channel sum as a float32 dot product
                    d = dot_tile((xr,), (w[a, b, co], w[a, b, co + 1], w[a, b, co + 2], w[a, b, co + 3]))
                    for i in range(4):
                        acc[co + i] += d[i]
                for co in range(c_out - c_out % 4, c_out):
                    acc[co] += dot_tile((xr,), (w[a, b, co],))[0]
        mean = 0.0
        for co in range(c_out):
            mean += acc[co]
        mean /= c_out
        ss = 0.0
        for co in range(c_out):
            acc[co] -= mean
            ss += acc[co] * acc[co]
        inv = 1.0 / np.sqrt(ss / c_out + eps)
        o = out[fo]
        for co in range(c_out):
            v = np.float32(acc[co] * inv * ln_w[co])
            o[co] = v if v > 0 else np.float32(0.0)


@njit(parallel=True, **EXACT)
def conv3x3s2_norm_relu(x, w, ln_w, eps, out):  # pragma: no cover - compiled
    """The audio tower's subsampling layer: Conv2d(3x3, stride 2, padding 1, no bias) over ``x [T,
    F, C_in]`` with the taps ``w [3, 3, C_out, C_in]``, then a LayerNorm over the channels (weight
    only: mean-centred, biased variance) and ReLU, into ``out [ceil(T/2), ceil(F/2), C_out]``: each
    tap's sum over the input channels a float32 dot product (`dot_tile`), the taps' sums and the
    norm in float64, rounded once; one output time step per task."""
    for to in prange(out.shape[0]):
        _conv_row(x, w, ln_w, eps, to, out[to])


@njit(nogil=True, **EXACT)
def top_ids(z, k):  # pragma: no cover - compiled
    """The ids of the ``k`` largest values of ``z`` (1-D), largest first, equal values by the lower
    id (a stable argsort of ``-z``, cut at ``k``), in one pass that keeps the best ``k`` in order:
    for the few top log-probabilities of a 262,144-token vocabulary, where a partition copies and
    reorders all of it (2-3 ms a token)."""
    k = min(k, z.shape[0])
    ids = np.empty(k, np.int64)
    vals = np.empty(k, z.dtype)
    n = 0
    for i in range(z.shape[0]):
        v = z[i]
        if n == k and not v > vals[k - 1]:  # no better than the k-th (a tie keeps its lower id)
            continue
        j = n if n < k else k - 1
        n = min(n + 1, k)
        while j > 0 and vals[j - 1] < v:
            vals[j] = vals[j - 1]
            ids[j] = ids[j - 1]
            j -= 1
        vals[j] = v
        ids[j] = i
    return ids
