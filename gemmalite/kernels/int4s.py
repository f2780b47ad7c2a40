"""Symmetric int4 (one float16 scale per 32 values, 4.5 bits per weight) against 8-bit activations.

The format (`gemmalite.weights.quant.Int4Matrix` with ``symmetric``): ``W[r, 32g + i] = d[r, g] *
(n - 8)``, ``n`` in ``0..15``, packed two per byte as the asymmetric int4 (byte ``j`` of a group:
value ``j`` low, ``j + 16`` high), so the unsigned nibbles are the unsigned operand of an 8-bit
dot product as they stand. Decode rounds each activation row to int8 per 32 values (step
``max|x| / 127``, the llama.cpp Q8_0 activations that Q4_0 meets too) and sums each block
exactly in int32: ``sum (n - 8) x = sum n x - 8 sum x``, the second term from the activations
alone (``xc``). 32 bytes of weights (two blocks) take one load, two mask/shift ops and, per
activation row, two ``vpdpbusd`` (VNNI) or two ``vpmaddubsw`` + ``vpmaddwd`` (AVX2): the same
exact integers either way, so both paths give the same bits.

The scale is searched per block (weighted least squares over candidate grids, `i4s_fit`), where
Q4_0 maps the largest magnitude to -8: a lower error at Q4_0's size.
"""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from . import common
from .common import EXACT, FAST, TOKEN_TILE, among, either, h2f, literal_ladder, prefetch, prefetch_ir
from .fdot import _loop
from .simd import (
    _EXACT,
    _F32,
    _I8,
    _I16,
    _I32,
    _I64,
    _c64,
    _codegen,
    _fma,
    _lane_sums,
    _literal,
    _load_vec,
    _open_loop,
    _pmadd,
    _span,
    _splat,
    _vec,
    _vpdpbusd,
    byte_dots,
)

__all__ = ["LANE_GROUP", "activation_pairs", "i4s_fit", "i4s_matvec", "i4s_mm_lanes", "i4s_mm_w4a8", "i4s_mvn_w4a8", "i4s_pack",
           "i4s_task", "int4s_lane_tile", "int4s_rows_dot", "int4s_tile_dot", "lane_strip_tiles", "round_i8_lanes",
           "round_i8_pairs", "token_groups", "unpack_lanes"]

_JIT, _FAST = EXACT, FAST  # every option stated (common.EXACT / FAST say why)

# Does the CPU the code is compiled for have vpdpbusd (whatever GEMMALITE_VNNI says)? Code for it is only emitted then.
_CPU_VNNI = common.target_has_vnni()


# --------------------------------------------------------------------------- quantization


@njit(parallel=True, **_FAST)
def i4s_fit(w, search, d_out):
    """Scale per block of 32 of ``w`` float32 ``[n, k]`` into ``d_out [n, k // 32]``.

    Without ``search``: Q4_0's rule (the value of largest magnitude maps to -8). With it: among
    the grids that map that value to -(8 + s/10) or to 7 + s/10 (``s`` in -8..8), the weighted
    least-squares scale of the one with the least error ``sum v^2 (v - d l)^2`` (at the fitted scale
    ``sum v^2 v^2 - (sum v^2 v l)^2 / sum v^2 l^2``, so only two sums are needed). Weighting by
    ``v^2`` (llama.cpp's choice for its searched formats) keeps the large weights close: on real
    Gemma 3 270M the plain squared error gave a smaller mean logit error than Q4_0 but a worse top-1
    agreement (0.47 vs 0.56); weighted, 13 % less error and top-1 0.565. The 34 grids' two sums
    run side by side, one lane per grid, over the values in order (vectorised across the grids: no
    sum is reordered), with the products of ``wt * v * q`` and ``wt * q * q``."""
    n, k = w.shape
    for r in prange(n):
        isc = np.empty(34, np.float32)  # the grids' inverse scales: family 0 then 1, s from -8 to 8
        svl = np.empty(34, np.float32)  # sum v^2 v l per grid
        sll = np.empty(34, np.float32)  # sum v^2 l l per grid
        for g in range(k // 32):
            v = w[r, g * 32 : g * 32 + 32]
            vmax = np.float32(0.0)
            for i in range(32):
                if abs(v[i]) > abs(vmax):
                    vmax = v[i]
            if vmax == 0:
                d_out[r, g] = 0.0
                continue
            best_d = vmax / np.float32(-8.0)
            if search:
                for s in range(-8, 9):
                    isc[s + 8] = -(np.float32(8.0) + np.float32(0.1) * s) / vmax
                    isc[s + 25] = (np.float32(7.0) + np.float32(0.1) * s) / vmax
                svl[:] = 0
                sll[:] = 0
                for i in range(32):
                    vi = v[i]
                    wt = vi * vi
                    wv = wt * vi
                    for j in range(isc.shape[0]):
                        q = min(max(np.rint(isc[j] * vi), np.float32(-8.0)), np.float32(7.0))
                        svl[j] = svl[j] + wv * q
                        sll[j] = sll[j] + (wt * q) * q
                best = np.float32(-1.0)
                for j in range(isc.shape[0]):
                    if sll[j] > 0 and svl[j] * svl[j] / sll[j] > best:
                        best = svl[j] * svl[j] / sll[j]
                        best_d = svl[j] / sll[j]
            d_out[r, g] = best_d


@njit(parallel=True, **_JIT)
def i4s_pack(w, d, packed):
    """Round with the *stored* (float16, here as float32) scales ``d [n, k // 32]`` and pack:
    ``n = clip(rint(w / d), -8, 7) + 8``, value ``j`` low and ``j + 16`` high nibble of byte ``j``."""
    n, k = w.shape
    for r in prange(n):
        for g in range(k // 32):
            dg = d[r, g]
            inv = np.float32(1.0) / dg if dg != 0 else np.float32(0.0)
            for j in range(16):
                a = min(max(np.rint(w[r, g * 32 + j] * inv), -8.0), 7.0) + 8.0
                b = min(max(np.rint(w[r, g * 32 + 16 + j] * inv), -8.0), 7.0) + 8.0
                packed[r, g * 16 + j] = np.uint8(np.int32(a) | (np.int32(b) << 4))


# --------------------------------------------------------------------------- activations


@njit(inline="always", **_JIT)
def _block_step(x, i, g):  # pragma: no cover - compiled
    """(step, 1 / step or 0) of block ``g`` of row ``i`` of ``x``: max|x| / 127 (the activation
    rounding of every W4A8 kernel here)."""
    amax = np.float32(0.0)
    for j in range(32):
        amax = max(amax, abs(x[i, g * 32 + j]))
    d = amax / np.float32(127.0)
    return d, (np.float32(1.0) / d if d > 0 else np.float32(0.0))


@njit(**_JIT)
def round_i8_pairs(x, xq, xc, xd):
    """Each row of ``x [T, k]`` (k a multiple of 32) -> int8 per block of 32 (step ``max|x| /
    127``, round to nearest; error <= step / 2), laid out for `int4s_rows_dot`: blocks in pairs
    ``p`` (blocks 2p, 2p+1; a last odd block pairs with zeros), ``xq [T, 64 P]`` holding
    ``[2p: 0..15 | 2p+1: 0..15 | 2p: 16..31 | 2p+1: 16..31]`` (what a 32-byte load of packed
    nibbles meets, low nibbles then high); ``xd [T, 2 P]`` float32 the step of each block; ``xc [T, 2 P]``
    int32 -2 times the block's sum of int8 values (the kernel spreads it over the four int32 lanes of
    the block: -8 sum in all; compact, so that a long row's activations stay in L1)    / 4, else 0. The arrays come zeroed. Each row is rounded on its own."""
    t, k = x.shape
    for i in range(t):
        for g in range(k // 32):
            p = g >> 1
            h = g & 1
            d, inv = _block_step(x, i, g)
            s = 0
            for j in range(32):
                q = np.int32(np.rint(x[i, g * 32 + j] * inv))
                s += q
                xq[i, p * 64 + h * 16 + (j & 15) + (j >> 4) * 32] = q
            xc[i, g] = -2 * s
            xd[i, g] = d


@njit(**_JIT)
def activation_pairs(x):
    """``x [T, k]`` float32 as `int4s_rows_dot` takes it (`round_i8_pairs`): ``(xq, xc, xd)``."""
    t, k = x.shape
    npair = (k // 32 + 1) // 2
    xq = np.zeros((t, 64 * npair), dtype=np.int8)
    xc = np.zeros((t, 2 * npair), dtype=np.int32)
    xd = np.zeros((t, 2 * npair), dtype=np.float32)
    round_i8_pairs(x, xq, xc, xd)
    return xq, xc, xd


# --------------------------------------------------------------------------- the dot product


def _pmaddubsw(builder):
    """``llvm.x86.avx2.pmadd.ub.sw``: 32 x u8 * s8, adjacent pairs summed into 16 x int16."""
    return cgutils.get_or_insert_function(
        builder.module, ir.FunctionType(_vec(_I16, 16), [_vec(_I8, 32), _vec(_I8, 32)]), "llvm.x86.avx2.pmadd.ub.sw")


def _dot_u8s8(builder, vnni: bool):
    """``acc + sums of four u8 * s8 products per int32 lane`` for ``(acc <8 x i32>, a, b <32 x i8>)``:
    ``vpdpbusd`` where asked and the CPU has it, else ``vpmaddubsw`` (no saturation: |15 * 127 *
    2| < 2^15) and ``vpmaddwd`` by ones. Exactly the same integers."""
    v8 = _vec(_I32, 8)
    if vnni and _CPU_VNNI:
        fn = _vpdpbusd(builder)
        return lambda acc, a, b: builder.call(fn, [acc, builder.bitcast(a, v8), builder.bitcast(b, v8)])
    mubs, madd = _pmaddubsw(builder), _pmadd(builder)
    ones = ir.Constant(_vec(_I16, 16), [1] * 16)
    return lambda acc, a, b: builder.add(acc, builder.call(madd, [builder.call(mubs, [a, b]), ones]))


PREFETCH = 4096  # bytes ahead the decode kernel prefetches weights (E2B rows at 2 threads: 34 -> 48 GB/s)
UNROLL = 2  # pairs of blocks per loop iteration, each FMA'd into its own accumulators (a power of 2)


def _hsum_tree(builder, v):
    """Sum of the eight lanes of a float vector in a fixed tree (3 dependent adds, not 7)."""
    for width in (4, 2, 1):
        hi = builder.shuffle_vector(v, v, ir.Constant(_vec(_I32, width), list(range(width, 2 * width))))
        lo = builder.shuffle_vector(v, v, ir.Constant(_vec(_I32, width), list(range(width))))
        v = builder.fadd(lo, hi, flags=_EXACT)
    return builder.extract_element(v, ir.Constant(_I32, 0))


def _int4s_codegen(nrows: int, ntok: int, vnni: bool):
    """IR of `int4s_rows_dot` for a tile of ``nrows`` weight rows x ``ntok`` activation rows.

    Per pair of blocks and (row, token): an int32 accumulator starts at the token's ``xc`` and
    takes the low nibbles against ``xq[64p : 64p + 32]`` and the high ones against the next 32
    (lanes 0-3 then hold block 2p's exact sum, 4-7 block 2p+1's), is converted to float32 and
    FMA'd, times ``d_w * xd`` (one rounding, the product of the block's two scales), into eight
    float32 lanes, summed at the end. Every (row, token) takes the same float sequence whatever
    the tile, so each output is bit for bit its 1 x 1 result."""
    def codegen(builder, wa, sa, xqa, xca, xda, r0, t0, oa):
        ng = sa.shape[1]
        dot = _dot_u8s8(builder, vnni)
        rows, toks = _span(builder, r0, nrows), _span(builder, t0, ntok)
        wrow, srow = wa.rows(builder, rows), sa.rows(builder, rows)
        xrow, crow, drow = xqa.rows(builder, toks), xca.rows(builder, toks), xda.rows(builder, toks, xca.shape[1])
        npair = builder.lshr(ng, _c64(1))
        f8 = _vec(_F32, 8)

        def step(p, ws, ss, facc):
            """One pair of blocks: ``ws`` each row's 32 bytes, ``ss`` its scales over eight lanes."""
            nib = [(builder.and_(w, ir.Constant(_vec(_I8, 32), [15] * 32)),
                    builder.lshr(w, ir.Constant(_vec(_I8, 32), [4] * 32))) for w in ws]
            xo = builder.mul(p, _c64(64))
            co = builder.mul(p, _c64(2))
            halves = ir.Constant(_vec(_I32, 8), [0, 0, 0, 0, 1, 1, 1, 1])
            new = {}
            for j in range(ntok):
                x0 = _load_vec(builder, xrow[j], xo, _vec(_I8, 32))
                x1 = _load_vec(builder, xrow[j], builder.add(xo, _c64(32)), _vec(_I8, 32))
                c = _load_vec(builder, crow[j], co, _vec(_I32, 2))
                c = builder.shuffle_vector(c, c, halves)
                xd = _load_vec(builder, drow[j], co, _vec(_F32, 2))
                xd = builder.shuffle_vector(xd, xd, halves)
                for i in range(nrows):
                    acc = dot(dot(c, nib[i][0], x0), nib[i][1], x1)
                    sc = builder.fmul(ss[i], xd, flags=_EXACT)
                    new[i, j] = _fma(builder, builder.sitofp(acc, f8), sc, facc[i, j])
            return new

        half2 = ir.VectorType(ir.HalfType(), 2)

        def pair(p, facc):
            """A full pair of blocks at ``p`` into ``facc``."""
            ws = [_load_vec(builder, w, builder.mul(p, _c64(32)), _vec(_I8, 32)) for w in wrow]
            ss = []
            for s in srow:
                two = builder.load(builder.bitcast(builder.gep(s, [builder.mul(p, _c64(2))], inbounds=True),
                                                   half2.as_pointer()), align=2)
                two = builder.fpext(two, _vec(_F32, 2))
                ss.append(builder.shuffle_vector(two, two, ir.Constant(_vec(_I32, 8), [0, 0, 0, 0, 1, 1, 1, 1])))
            return step(p, ws, ss, facc)

        def loop(name, start, stop, stride, accs, body_fn):
            """``for p in range(start, stop, stride): accs = body_fn(p, accs)``; the final accs."""
            entry, head, body, done = _open_loop(builder, name)
            p = builder.phi(_I64)
            p.add_incoming(start, entry)
            phis = {}
            for key, v in accs.items():
                phis[key] = builder.phi(f8)
                phis[key].add_incoming(v, entry)
            builder.cbranch(builder.icmp_signed("<", p, stop), body, done)
            builder.position_at_end(body)
            new = body_fn(p, phis)
            for key, v in new.items():
                phis[key].add_incoming(v, builder.block)
            p.add_incoming(builder.add(p, _c64(stride)), builder.block)
            builder.branch(head)
            builder.position_at_end(done)
            return p, phis

        # UNROLL pairs per iteration, each into its own accumulators (the FMA chains then overlap),
        # the remaining pairs and a last odd block into the first ones: a fixed order for every tile
        zero = ir.Constant(f8, [0.0] * 8)
        accs = {(i, j, u): zero for i in range(nrows) for j in range(ntok) for u in range(UNROLL)}

        def unrolled(p, accs):
            if PREFETCH:  # the weights PREFETCH bytes ahead (on into the next rows): one line per iteration
                for w in wrow:
                    prefetch_ir(builder, builder.gep(w, [builder.add(builder.mul(p, _c64(32)), _c64(PREFETCH))]))
            out = dict(accs)
            for u in range(UNROLL):
                sub = {(i, j): accs[i, j, u] for i in range(nrows) for j in range(ntok)}
                for (i, j), v in pair(builder.add(p, _c64(u)), sub).items():
                    out[i, j, u] = v
            return out

        p_end, accs = loop("int4s.main", _c64(0), builder.and_(npair, _c64(-UNROLL)), UNROLL, accs, unrolled)
        first = {(i, j): accs[i, j, 0] for i in range(nrows) for j in range(ntok)}
        _, first = loop("int4s.rest", p_end, npair, 1, first, pair)

        # a last odd block: its 16 bytes with zeros above (its activations' upper half is zero too)
        done = builder.block
        tail = builder.function.append_basic_block("int4s.tail")
        end = builder.function.append_basic_block("int4s.end")
        odd = builder.icmp_unsigned("!=", builder.and_(ng, _c64(1)), _c64(0))
        builder.cbranch(odd, tail, end)
        builder.position_at_end(tail)
        zero16 = ir.Constant(_vec(_I8, 16), [0] * 16)
        ws = [builder.shuffle_vector(_load_vec(builder, w, builder.mul(npair, _c64(32)), _vec(_I8, 16)), zero16,
                                     ir.Constant(_vec(_I32, 32), list(range(32)))) for w in wrow]
        ss = [_splat(builder, builder.fpext(builder.load(builder.bitcast(
            builder.gep(s, [builder.mul(npair, _c64(2))], inbounds=True), ir.HalfType().as_pointer()), align=2),
            _F32), 8) for s in srow]
        tail_acc = step(npair, ws, ss, first)
        tail_end = builder.block
        builder.branch(end)
        builder.position_at_end(end)
        res = {}
        for key, acc in first.items():
            res[key] = builder.phi(f8)
            res[key].add_incoming(acc, done)
            res[key].add_incoming(tail_acc[key], tail_end)
        for (i, j), v in res.items():
            parts = [v] + [accs[i, j, u] for u in range(1, UNROLL)]
            while len(parts) > 1:
                parts = [builder.fadd(a, b, flags=_EXACT) for a, b in zip(parts[0::2], parts[1::2])]
            at = builder.add(builder.mul(toks[j], oa.shape[1]), rows[i])
            builder.store(_hsum_tree(builder, parts[0]), builder.gep(oa.data, [at], inbounds=True))

    return codegen


@intrinsic
def int4s_rows_dot(typingctx, packed, scales, xq, xc, xd, r0, t0, out, nrows, ntok, vnni):
    """``out[t, r] = sum_g f16(scales[r, g]) * step[t, g] * sum_i (n[r, g, i] - 8) * x8[t, g, i]``
    for rows ``r0 .. r0 + nrows - 1`` of a symmetric int4 matrix and activation rows ``t0 .. t0 +
    ntok - 1`` (``xq``/``xc``/``xd`` from `round_i8_pairs`).

    ``packed`` uint8 ``[out, in // 2]``, ``scales`` uint16 float16 bits ``[out, in // 32]``, ``out``
    float32 ``[T, out]``; all C-contiguous. ``nrows`` (1-8), ``ntok`` (1-8) and ``vnni`` (0, 1: use
    ``vpdpbusd`` if the CPU has it) must be literals. Needs AVX2."""
    if not (_literal(nrows, range(1, 9)) and _literal(ntok, range(1, 9)) and _literal(vnni, (0, 1))):
        return None
    inner = _int4s_codegen(nrows.literal_value, ntok.literal_value, bool(vnni.literal_value))
    return types.void(packed, scales, xq, xc, xd, r0, t0, out, nrows, ntok, vnni), _codegen(inner, 8)


ROW_BLOCK = 32  # weight rows per parallel task of the decode kernel


# `int4s_rows_dot` on rows ``lo .. hi - 1`` (in tiles of 4 rows with ``four``: ``hi - lo`` a multiple of 4)
# and tokens ``t0 .. t0+nt-1`` (``nt`` 1..4), the tile sizes as literals, each case a tight loop of its own.
_rows = literal_ladder(
    "_rows(packed, scales, xq, xc, xd, lo, hi, t0, nt, out, four, vnni)",
    "for r in range(lo, hi, {R}):\n    int4s_rows_dot(packed, scales, xq, xc, xd, r, t0, out, {R}, {T}, {V})",
    dict(int4s_rows_dot=int4s_rows_dot), V=either("vnni", 1, 0), R=either("four", 4, 1), T=among("nt", 4, 3, 2, 1))


@njit(inline="always", **_FAST)
def i4s_task(packed, scales, xq, xc, xd, rows_per_task, vnni, b, out):
    """Task ``b`` of `i4s_mvn_w4a8`: weight rows ``b * ROW_BLOCK ..`` against every row of x (a
    compiled decode step runs the same tasks inside its fused products, `weights.operands`)."""
    n = packed.shape[0]
    t_all = xq.shape[0]
    r0 = b * ROW_BLOCK
    r1 = min(n, r0 + ROW_BLOCK)
    r4 = r0 + (r1 - r0) // 4 * 4 if rows_per_task == 4 else r0
    for t0 in range(0, t_all, TOKEN_TILE):
        nt = min(TOKEN_TILE, t_all - t0)
        if r4 > r0:
            _rows(packed, scales, xq, xc, xd, r0, r4, t0, nt, out, True, vnni)
        _rows(packed, scales, xq, xc, xd, r4, r1, t0, nt, out, False, vnni)


@njit(parallel=True, **_FAST)
def i4s_mvn_w4a8(packed, scales, xq, xc, xd, rows_per_task, vnni, out):
    """Rows of x (``xq``/``xc``/``xd`` from `round_i8_pairs`, ``out [T, n]``): a decode step, a
    prompt-lookup step, a batch of sequences. Tasks of ROW_BLOCK weight rows, in tiles of
    ``rows_per_task`` (1 or 4) rows x up to TOKEN_TILE activation rows: each weight row read from
    memory once for all T rows; every row's result bit for bit its T=1 result. ``vnni``: 8-bit dot
    products (where the CPU has them)."""
    for b in prange((packed.shape[0] + ROW_BLOCK - 1) // ROW_BLOCK):
        i4s_task(packed, scales, xq, xc, xd, rows_per_task, vnni, b, out)


@njit(**_FAST)
def i4s_matvec(packed, scales, x, rows_per_task, vnni, out):
    """`round_i8_pairs` of ``x [T, k]`` then `i4s_mvn_w4a8`: one call per product (a decode step
    makes hundreds; each call from Python costs microseconds)."""
    xq, xc, xd = activation_pairs(x)
    i4s_mvn_w4a8(packed, scales, xq, xc, xd, rows_per_task, vnni, out)


# --------------------------------------------------------------------------- prefill tiles


def token_groups(xc: np.ndarray, xd: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """`round_i8_pairs`' per-block terms (``T`` a multiple of 4, an even number of blocks) as the
    prefill tiles take them: per group of 4 activation rows and pair of blocks ``p``, eight lanes
    ``[rows 0-3 of block 2p | rows 0-3 of block 2p+1]`` (the lanes of `int4s_tile_dot`'s block sums):
    ``xc4`` int32 ``-8 * sum`` of the block's int8 values, ``xd4`` float32 its step; ``[T // 4, 4 * nblocks]``."""
    t, nb = xc.shape
    lanes = lambda a: np.ascontiguousarray(a.reshape(t // 4, 4, nb // 2, 2).transpose(0, 2, 3, 1).reshape(t // 4, 4 * nb))  # noqa: E731
    return lanes(4 * xc), lanes(xd)


def _phadd(builder):
    """``llvm.x86.avx2.phadd.d``: pairwise int32 sums of a then b, per 128-bit half."""
    v8 = _vec(_I32, 8)
    return cgutils.get_or_insert_function(builder.module, ir.FunctionType(v8, [v8, v8]), "llvm.x86.avx2.phadd.d")


def _dot2(builder, vnni: bool):
    """``(lo, x0, hi, x1) -> lo . x0 + hi . x1`` per int32 lane (four u8 x s8 products of each pair):
    two ``vpdpbusd`` where asked and the CPU has them, else two ``vpmaddubsw`` summed in int16 (|2 * 2
    * 15 * 127| < 2^15) and one ``vpmaddwd`` by ones. Exactly the same integers."""
    v8 = _vec(_I32, 8)
    if vnni and _CPU_VNNI:
        fn = _vpdpbusd(builder)
        zero = ir.Constant(v8, [0] * 8)
        return lambda lo, x0, hi, x1: builder.call(fn, [builder.call(fn, [zero, builder.bitcast(lo, v8),
                                                                           builder.bitcast(x0, v8)]),
                                                         builder.bitcast(hi, v8), builder.bitcast(x1, v8)])
    mubs, madd = _pmaddubsw(builder), _pmadd(builder)
    ones = ir.Constant(_vec(_I16, 16), [1] * 16)
    return lambda lo, x0, hi, x1: builder.call(madd, [builder.add(builder.call(mubs, [lo, x0]),
                                                                  builder.call(mubs, [hi, x1])), ones])


def _int4s_tile_codegen(nrows: int, vnni: bool):
    """IR of `int4s_tile_dot`: ``nrows`` weight rows x the 4 activation rows of token group ``tg``.

    Per pair of blocks, row and token: the 32 packed bytes' low nibbles against ``xq[64p : 64p +
    32]`` and the high ones against the next 32 (lanes 0-3: block 2p's partial sums, 4-7: block
    2p+1's), the four tokens' vectors folded by two rounds of ``vphaddd`` into one vector of
    exact block sums ``[tokens 0-3 of 2p | tokens 0-3 of 2p+1]``, plus ``xc4`` (the -8 offset),
    converted once and FMA'd, times ``d_w * xd4``, into one float32 lane per (token, block
    parity); the two parities added at the end. One conversion and FMA per 256 products, where
    the decode tile (`int4s_rows_dot`) takes one per 64. Each lane's float sequence is its own
    (token, row), whatever the other tokens: a token's result does not depend on its group."""
    def codegen(builder, wa, sa, xqa, xca, xda, r0, tg, oa):
        npair = builder.lshr(sa.shape[1], _c64(1))
        n = oa.shape[1]
        dot2, phadd = _dot2(builder, vnni), _phadd(builder)
        rows = _span(builder, r0, nrows)
        toks = _span(builder, builder.mul(tg, _c64(4)), 4)
        wrow, srow, xrow = wa.rows(builder, rows), sa.rows(builder, rows), xqa.rows(builder, toks)
        (crow,), (drow,) = xca.rows(builder, [tg]), xda.rows(builder, [tg])
        f8 = _vec(_F32, 8)
        half2 = ir.VectorType(ir.HalfType(), 2)
        spread = ir.Constant(_vec(_I32, 8), [0, 0, 0, 0, 1, 1, 1, 1])
        entry, head, body, done = _open_loop(builder, "int4s.tile")
        p = builder.phi(_I64)
        p.add_incoming(_c64(0), entry)
        facc = []
        for _ in range(nrows):
            facc.append(builder.phi(f8))
            facc[-1].add_incoming(ir.Constant(f8, [0.0] * 8), entry)
        builder.cbranch(builder.icmp_signed("<", p, npair), body, done)

        builder.position_at_end(body)
        xo = builder.mul(p, _c64(64))
        xs = [(_load_vec(builder, x, xo, _vec(_I8, 32)), _load_vec(builder, x, builder.add(xo, _c64(32)), _vec(_I8, 32)))
              for x in xrow]
        c = _load_vec(builder, crow, builder.mul(p, _c64(8)), _vec(_I32, 8))
        xd = _load_vec(builder, drow, builder.mul(p, _c64(8)), f8)
        for i in range(nrows):
            w = _load_vec(builder, wrow[i], builder.mul(p, _c64(32)), _vec(_I8, 32))
            lo = builder.and_(w, ir.Constant(_vec(_I8, 32), [15] * 32))
            hi = builder.lshr(w, ir.Constant(_vec(_I8, 32), [4] * 32))
            a = [dot2(lo, x0, hi, x1) for x0, x1 in xs]
            sums = builder.add(builder.call(phadd, [builder.call(phadd, [a[0], a[1]]),
                                                    builder.call(phadd, [a[2], a[3]])]), c)
            two = builder.load(builder.bitcast(builder.gep(srow[i], [builder.mul(p, _c64(2))], inbounds=True),
                                               half2.as_pointer()), align=2)
            two = builder.fpext(two, _vec(_F32, 2))
            sc = builder.fmul(builder.shuffle_vector(two, two, spread), xd, flags=_EXACT)
            facc[i].add_incoming(_fma(builder, builder.sitofp(sums, f8), sc, facc[i]), body)
        p.add_incoming(builder.add(p, _c64(1)), body)
        builder.branch(head)

        builder.position_at_end(done)
        for i in range(nrows):
            lo = builder.shuffle_vector(facc[i], facc[i], ir.Constant(_vec(_I32, 4), [0, 1, 2, 3]))
            hi = builder.shuffle_vector(facc[i], facc[i], ir.Constant(_vec(_I32, 4), [4, 5, 6, 7]))
            res = builder.fadd(lo, hi, flags=_EXACT)
            for j in range(4):
                at = builder.add(builder.mul(toks[j], n), rows[i])
                builder.store(builder.extract_element(res, ir.Constant(_I32, j)),
                              builder.gep(oa.data, [at], inbounds=True))

    return codegen


@intrinsic
def int4s_tile_dot(typingctx, packed, scales, xq, xc4, xd4, r0, tg, out, nrows, vnni):
    """``out[4tg + j, r] = sum_g f16(scales[r, g]) * step[4tg + j, g] * sum_i (n[r, g, i] - 8) *
    x8[4tg + j, g, i]`` for rows ``r0 .. r0 + nrows - 1`` of a symmetric int4 matrix with an even
    number of blocks per row and the four activation rows of token group ``tg`` (``xq`` from
    `round_i8_pairs`, ``xc4``/``xd4`` from `token_groups`). ``nrows`` (1-4) and ``vnni`` (0, 1)
    literals; needs AVX2."""
    if not (_literal(nrows, range(1, 5)) and _literal(vnni, (0, 1))):
        return None
    inner = _int4s_tile_codegen(nrows.literal_value, bool(vnni.literal_value))
    return types.void(packed, scales, xq, xc4, xd4, r0, tg, out, nrows, vnni), _codegen(inner, 8)


_tile = literal_ladder(
    "_tile(packed, scales, xq, xc4, xd4, r, tg, out, four, vnni)",
    "int4s_tile_dot(packed, scales, xq, xc4, xd4, r, tg, out, {R}, {V})",
    dict(int4s_tile_dot=int4s_tile_dot), V=either("vnni", 1, 0), R=either("four", 4, 1))

PREFETCH_STRIPS = 2  # prefill: 4-row strips ahead whose weights are prefetched


@njit(parallel=True, **_FAST)
def i4s_mm_w4a8(packed, scales, xq, xc4, xd4, g_lo, g_hi, vnni, out):
    """Prefill (W4A8, the decode kernels' activation rounding): token groups ``g_lo .. g_hi - 1``
    (rows ``4 g_lo .. 4 g_hi - 1`` of ``out``), each task one strip of 4 weight rows against all of
    them (the strip stays in L1, the activations in L2), the strip PREFETCH_STRIPS ahead
    prefetched; rows past the last whole strip one at a time."""
    n, kb = packed.shape
    for b in prange((n + 3) // 4):
        r = 4 * b
        ahead = (r + 4 * PREFETCH_STRIPS) * kb
        for off in range(0, min(4 * kb, n * kb - ahead), 64):
            prefetch(packed, ahead + off)
        if r + 4 <= n:
            for tg in range(g_lo, g_hi):
                _tile(packed, scales, xq, xc4, xd4, r, tg, out, True, vnni)
        else:
            for i in range(r, n):
                for tg in range(g_lo, g_hi):
                    _tile(packed, scales, xq, xc4, xd4, i, tg, out, False, vnni)


# --------------------------------------------------------------------------- prefill, block lanes
# On VNNI, rows whose width is a multiple of LANE_GROUP: both operands are laid out so that each
# int32 lane of a 32-byte vector meets one block: in a group of 8 blocks (256 values), vector ``c``
# lane ``b`` holds values ``4c .. 4c + 3`` of block ``b``. Eight ``vpdpbusd`` then leave every lane
# with its block's exact sum, with no horizontal folding, and one conversion and FMA per (row,
# token) covers 256 products, as the int8 tiles'. The weights are unpacked into that order strip by
# strip (4 rows, in L1; a word transpose and two mask ops per 32 bytes, `unpack_lanes`); the
# activations are rounded into it once per product input. Measured against the folding tiles
# (`int4s_tile_dot`): E2B-shape int4 prefill 0.57-0.81x int8's pace -> 0.77-0.98x.

LANE_GROUP = 256


@njit(inline="always", **_JIT)
def _lane_pos(v):  # pragma: no cover - compiled
    """Position within its group of 256 of value ``v`` (0..255) of the group in block-lane order."""
    return 32 * ((v & 31) >> 2) + 4 * (v >> 5) + (v & 3)


@njit(parallel=True, **_JIT)
def round_i8_lanes(x, xs, xc, xd, offset):
    """Each row of ``x [T, k]`` (k a multiple of 32) rounded to int8 per block of 32 exactly as
    `round_i8_pairs` rounds it, in block-lane order: ``xs`` int8 ``[T, K]``, ``xc`` int32 ``[T, K //
    256, 8]`` -``offset`` times each block's sum (the weights go in as unsigned bytes, value +
    ``offset``: 8 for int4 nibbles), ``xd`` float32 the same shape, each block's step. ``K`` >= k,
    a multiple of LANE_GROUP: the lanes past ``k`` are left as they are (zeros from the caller)."""
    t, k = x.shape
    for i in prange(t):
        for g in range(k // 32):
            d, inv = _block_step(x, i, g)
            s = 0
            base = (g >> 3) * LANE_GROUP
            for j in range(32):
                q = np.int32(np.rint(x[i, g * 32 + j] * inv))
                s += q
                xs[i, base + _lane_pos(32 * (g & 7) + j)] = q
            xc[i, g >> 3, g & 7] = -offset * s
            xd[i, g >> 3, g & 7] = d


def _unpack_codegen(nrows: int):
    """IR of `unpack_lanes`: per row and group of 8 blocks (128 packed bytes, four 32-byte loads,
    each two blocks of four 32-bit words), the 8 x 4 word transpose that puts word ``w`` of block
    ``b`` in lane ``b`` of vector ``w`` (two-source shuffles), then each word's low nibbles (vector
    ``w``) and high ones (vector ``w + 4``) by a mask and a shift."""
    def codegen(builder, pa, r0, wa):
        ngrp = builder.sdiv(pa.shape[1], _c64(32))
        v8 = _vec(_I32, 8)
        mask = ir.Constant(v8, [0x0F0F0F0F] * 8)
        four = ir.Constant(v8, [4] * 8)
        src = pa.rows(builder, _span(builder, r0, nrows))
        dst = [builder.bitcast(d, _I32.as_pointer()) for d in wa.rows(builder, [_c64(i) for i in range(nrows)])]

        def group(g, _):
            base, out = builder.mul(g, _c64(32)), builder.mul(g, _c64(64))  # words: 128 bytes in, 256 out
            for i in range(nrows):
                ld = [_load_vec(builder, src[i], builder.add(base, _c64(8 * m)), v8) for m in range(4)]
                for w in range(4):
                    pick = ir.Constant(_vec(_I32, 8), [w, 4 + w, 8 + w, 12 + w, 0, 0, 0, 0])
                    a = builder.shuffle_vector(ld[0], ld[1], pick)
                    b = builder.shuffle_vector(ld[2], ld[3], pick)
                    v = builder.shuffle_vector(a, b, ir.Constant(_vec(_I32, 8), [0, 1, 2, 3, 8, 9, 10, 11]))
                    for c, part in ((w, builder.and_(v, mask)), (w + 4, builder.and_(builder.lshr(v, four), mask))):
                        ptr = builder.gep(dst[i], [builder.add(out, _c64(8 * c))], inbounds=True)
                        builder.store(part, builder.bitcast(ptr, v8.as_pointer()), align=4)
            return []

        _loop(builder, "int4s.unpack", _c64(0), ngrp, 1, [], group)

    return codegen


@intrinsic
def unpack_lanes(typingctx, packed32, r0, wb, nrows):
    """Rows ``r0 .. r0 + nrows - 1`` of a symmetric int4 matrix (``packed32``: its bytes as uint32,
    ``[n, k // 8]``) as unsigned nibbles (0..15) into ``wb [4, k]`` uint8, in block-lane order:
    lane ``b`` of vector ``c`` of a group holds values ``4c .. 4c + 3`` of block ``b`` (value ``j``
    of a block: byte ``j % 16`` of its 16, low nibble for ``j < 16``). ``nrows`` (1-4) literal."""
    if not _literal(nrows, range(1, 5)):
        return None
    return types.void(packed32, r0, wb, nrows), _codegen(_unpack_codegen(nrows.literal_value), 3)


@njit(inline="always", **_JIT)
def _strip_scales(scales, r, nrows, ws):  # pragma: no cover - compiled
    """Rows ``r ..``' float16 block scales as float32, ``ws [4, k // 256, 8]`` (block ``8g + b`` at
    ``[., g, b]``: the lanes of `unpack_lanes`)."""
    for i in range(nrows):
        for g in range(ws.shape[1]):
            for b in range(8):
                ws[i, g, b] = h2f(scales[r + i, 8 * g + b])


def _lane_tile_codegen(rt: int, tt: int):
    """IR of `int4s_lane_tile`: ``rt`` rows of the unpacked strip x ``tt`` tokens. Per group of
    256 and (row, token): the lanes start from the token's offset terms (``xc``), take eight
    ``vpdpbusd`` (nibbles unsigned, activations signed), are converted once and FMA'd times
    ``ws[row] * xd[token]`` (the block steps, lane by lane) into eight float32 lanes; at the end a
    transposing tree (`_lane_sums`) folds each pair's lanes. Every pair's operations are the same
    in any tile: a token's result does not depend on the tokens beside it."""
    npair = rt * tt

    def codegen(builder, wa, wsa, xa, xca, xda, t0, oa, r0):
        ngrp = wsa.shape[1]
        n = oa.shape[1]
        dot = _vpdpbusd(builder)
        v8, f8 = _vec(_I32, 8), _vec(_F32, 8)
        toks = _span(builder, t0, tt)
        wrow = wa.rows(builder, [_c64(i) for i in range(rt)])
        xrow = xa.rows(builder, toks)

        def group(g, facc):  # pairs p = j * rt + i
            base = builder.mul(g, _c64(LANE_GROUP))
            lane = lambda row: builder.mul(builder.add(builder.mul(row, ngrp), g), _c64(8))  # noqa: E731  (a [., ngrp, 8] array's row)
            start = [_load_vec(builder, xca.data, lane(tok), v8) for tok in toks]
            acc = {(i, j): start[j] for i in range(rt) for j in range(tt)}
            acc = byte_dots(builder, dot, acc, wrow, xrow, base, LANE_GROUP // 32, False)
            dw = [_load_vec(builder, wsa.data, lane(_c64(i)), f8) for i in range(rt)]
            nxt = []
            for j in range(tt):
                dx = _load_vec(builder, xda.data, lane(toks[j]), f8)
                for i in range(rt):
                    step = builder.fmul(dw[i], dx, flags=_EXACT)
                    nxt.append(_fma(builder, builder.sitofp(acc[i, j], f8), step, facc[j * rt + i]))
            return nxt

        facc = _loop(builder, "int4s.lanes", _c64(0), ngrp, 1, [ir.Constant(f8, [0.0] * 8)] * (rt * tt), group)
        sums = _lane_sums(builder, facc)
        for j in range(tt):
            for i in range(rt):
                v, ln = divmod(j * rt + i, 8)
                dst = builder.gep(oa.data, [builder.add(builder.mul(toks[j], n), builder.add(r0, _c64(i)))], inbounds=True)
                builder.store(builder.extract_element(sums[v], ir.Constant(_I32, ln)), dst)

    return codegen


@intrinsic
def int4s_lane_tile(typingctx, wb, ws, xs, xc, xd, t0, out, r0, nrows, ntok):
    """``out[t, r0 + i] = sum_g ws[i, g] * xd[t, g] * sum (n - 8) * x8`` over the blocks of the
    unpacked strip ``wb [4, k]`` / ``ws [4, k // 256, 8]`` (`unpack_lanes`, `_strip_scales`) and tokens ``t0 .. t0 +
    ntok - 1`` of ``xs [T, k]`` / ``xc`` / ``xd [T, k // 256, 8]`` (`round_i8_lanes`). ``nrows``
    (1-4) and ``ntok`` (1-3) literals; needs VNNI."""
    if not (_literal(nrows, range(1, 5)) and _literal(ntok, range(1, 4))):
        return None
    inner = _lane_tile_codegen(nrows.literal_value, ntok.literal_value)
    return types.void(wb, ws, xs, xc, xd, t0, out, r0, nrows, ntok), _codegen(inner, 8)


@njit(inline="always", **_FAST)
def lane_strip_tiles(wb, ws, xs, xc, xd, t_lo, t_hi, out, r, whole):  # pragma: no cover - compiled
    """Tokens ``t_lo .. t_hi - 1`` against an unpacked strip (`int4s_lane_tile`): a whole strip of 4
    rows in tiles of 3 tokens, the last ones one at a time; else the strip's one row ``r``."""
    if whole:
        t = t_lo
        while t + 3 <= t_hi:
            int4s_lane_tile(wb, ws, xs, xc, xd, t, out, r, 4, 3)
            t += 3
        while t < t_hi:
            int4s_lane_tile(wb, ws, xs, xc, xd, t, out, r, 4, 1)
            t += 1
    else:
        for t in range(t_lo, t_hi):
            int4s_lane_tile(wb, ws, xs, xc, xd, t, out, r, 1, 1)


@njit(parallel=True, **_FAST)
def i4s_mm_lanes(packed, scales, xs, xc, xd, t_lo, t_hi, out):
    """Prefill on VNNI, rows a multiple of LANE_GROUP wide (``packed`` viewed as uint32 words,
    `round_i8_lanes` activations): each task one strip of 4 weight rows, unpacked into block-lane
    order (in L1), against tokens ``t_lo .. t_hi - 1`` (`lane_strip_tiles`); the rows past the last
    whole strip one at a time."""
    n, k = packed.shape[0], 8 * packed.shape[1]
    for b in prange((n + 3) // 4):
        r = 4 * b
        wb = np.empty((4, k), np.uint8)
        ws = np.empty((4, k // LANE_GROUP, 8), np.float32)
        if r + 4 <= n:
            unpack_lanes(packed, r, wb, 4)
            _strip_scales(scales, r, 4, ws)
            lane_strip_tiles(wb, ws, xs, xc, xd, t_lo, t_hi, out, r, True)
        else:
            for i in range(r, n):
                unpack_lanes(packed, i, wb, 1)
                _strip_scales(scales, i, 1, ws)
                lane_strip_tiles(wb, ws, xs, xc, xd, t_lo, t_hi, out, i, False)
