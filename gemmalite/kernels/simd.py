"""Integer SIMD dot products for numba kernels, written as LLVM IR (``numba.extending.intrinsic``).

numba types every integer operation as int64, so a plain loop of ``nibble * int16`` never
becomes the 16-bit multiply-add instructions the CPU has (``vpmaddwd``; ``vpdpwssd`` with
AVX-512 VNNI, which LLVM fuses in by itself, into one dependent chain where a sum runs long: the
int8 decode tile writes its chains out, `TILE_CHAINS`). The intrinsics here emit them directly: they
turn int4 decode from compute-bound (float nibble unpacking, ~6 GB/s of weights per two
cores) into memory-bound (~28 GB/s from L3 on this machine), and lift int8 decode from
~21 to ~27 GB/s on E2B's matrices (half the instructions per weight of int8 -> float32 FMA).

Only x86 with AVX2 has ``llvm.x86.avx2.pmadd.wd``; ``kernels.common.HAVE_AVX2`` says whether the
host has it, and callers keep a plain-numba path for other CPUs.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from .common import FAST, half_to_f32_ir, prefetch_ir, target_has_vnni

__all__ = ["int16_activation_rows", "int16_step", "round_int16", "round_u8", "int4_rows_dot", "int8_rows_dot",
           "int8_tile_dot", "u8_tile_dot", "u8_lane_corr", "block_row_dot", "TILE_BLOCK", "U8_BLOCK"]

_I8, _I16, _I32, _I64, _F32 = (ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64),
                               ir.FloatType())


@njit(inline="always", **FAST)
def int16_step(xg):  # pragma: no cover - compiled
    """A group's int16 step ``max|x| / 32767`` and its inverse (0 for an all-zero group)."""
    amax = np.float32(0.0)
    for j in range(xg.shape[0]):
        amax = max(amax, abs(xg[j]))
    d = amax / np.float32(32767.0)
    return d, (np.float32(1.0) / d if d > 0 else np.float32(0.0))


@njit(**FAST)
def round_int16(x, group, xq, xd):  # pragma: no cover - compiled
    """One activation row -> int16 per group of ``group`` (scale ``xd`` = max|x| / 32767, round to
    nearest). Rounding error <= xd / 2 per value. This is the activation format every dot product
    below takes. On slices indexed from 0, which vectorise: numba's gathers on ``range(g * group,
    ...)``, with a float sum of each group beside them (which only the asymmetric int4 rows read:
    `quant.group_sums` gives it them), took 1.8 ns a value, 22 us for E2B's 12,288-wide down
    projection input while the other thread waited."""
    for g in range(x.shape[0] // group):
        xg = x[g * group : g * group + group]
        qg = xq[g * group : g * group + group]
        d, inv = int16_step(xg)
        xd[g] = d
        for j in range(group):
            qg[j] = np.int16(np.rint(xg[j] * inv))


@njit(cache=True, error_model="numpy", boundscheck=False, fastmath=False)
def int16_activation_rows(x, group):  # pragma: no cover - compiled
    """Each row of ``x`` ``[T, k]`` as int16 per group (``round_int16``): values ``[T, k]`` and
    scales ``[T, k//group]``; the input of the decode kernels, each row rounded on its own. One
    compiled call (from Python or from a compiled decode step: the same code either way)."""
    t, k = x.shape
    xq = np.empty((t, k), dtype=np.int16)
    xd = np.empty((t, k // group), dtype=np.float32)
    for i in range(t):
        round_int16(x[i], group, xq[i], xd[i])
    return xq, xd


def _vec(t: ir.Type, n: int) -> ir.VectorType:
    return ir.VectorType(t, n)


def _c64(v: int) -> ir.Constant:
    return ir.Constant(_I64, v)


class _Array(NamedTuple):
    """An array argument inside a codegen: pointer to its first element, its dimensions (IR int64)."""

    data: ir.Value
    shape: tuple

    def rows(self, builder, index, row_len=None) -> list:
        """Pointers to the rows ``index`` (IR integers) of this C-contiguous 2-D array, ``row_len``
        elements apart (its own width unless given)."""
        step = self.shape[1] if row_len is None else row_len
        return [builder.gep(self.data, [builder.mul(i, step)], inbounds=True) for i in index]


def _span(builder, first, n: int) -> list:
    """``first, first + 1 .. first + n - 1`` as IR integers: a tile's rows or tokens."""
    return [builder.add(first, _c64(i)) for i in range(n)]


def _codegen(inner, n: int):
    """numba codegen of an intrinsic: ``inner(builder, *args)`` on its first ``n`` arguments (the
    rest are literal tile sizes, built into ``inner``), arrays as `_Array`, scalars as IR values."""
    def codegen(context, builder, signature, args):
        vals = []
        for ty, v in zip(signature.args[:n], args[:n]):
            if isinstance(ty, types.Array):
                a = context.make_array(ty)(context, builder, v)
                v = _Array(a.data, tuple(cgutils.unpack_tuple(builder, a.shape)))
            vals.append(v)
        inner(builder, *vals)
        return context.get_dummy_value()

    return codegen


def _load_vec(builder, base, index, vty):
    """Load ``vty`` (unaligned) starting at element ``index`` of the array pointer ``base``."""
    p = builder.bitcast(builder.gep(base, [index], inbounds=True), vty.as_pointer())
    return builder.load(p, align=1)


def _word_bits(builder, w, shift: int, mask: int, to: int = 0):
    """Of each 16-bit lane of ``w`` (``<8 x i32>``: sixteen 16-bit lanes seen two at a time), bits
    ``shift ..`` under ``mask``, moved up by ``to`` (``mask << to`` stays within 16 bits, so lanes
    never mix). The nibble unpackers work on 32-bit lanes because on 16-bit ones LLVM narrows the
    masks and shifts to the bytes and widens afterwards: two more shuffles per 16 values (Q4_K
    decode rows 1.2x slower)."""
    def splat(v):
        return ir.Constant(_vec(_I32, 8), [v] * 8)

    v = builder.and_(builder.lshr(w, splat(shift)) if shift else w, splat(mask * 0x10001))
    return builder.shl(v, splat(to)) if to else v


def _lanes(index) -> ir.Constant:
    """A shuffle mask: result lane i takes source lane ``index[i]``."""
    index = list(index)
    return ir.Constant(_vec(_I32, len(index)), index)


def q5_0_bytes(builder, blk, if_set: int, if_clear: int) -> ir.Value:
    """The 32 values of the Q5_0 block at ``blk`` (float16 scale, 32 high bits, 16 bytes of low
    nibbles; value j = nibble | high bit j << 4) as bytes: each nibble or'ed with ``if_set`` where
    its high bit is set, ``if_clear`` where not (0, -16: the value - 16 as an int8; 16, 0: the
    value as an unsigned byte). qh's bytes are spread over 32 lanes and each lane tests its bit."""
    def i8(v):
        return ir.Constant(_vec(_I8, 32), [v] * 32)

    qh = builder.load(builder.bitcast(builder.gep(blk, [_c64(2)], inbounds=True), _vec(_I8, 4).as_pointer()), align=1)
    spread = builder.shuffle_vector(qh, qh, _lanes([j // 8 for j in range(32)]))
    bit = builder.and_(spread, ir.Constant(_vec(_I8, 32), [1 << (j % 8) for j in range(32)]))
    high = builder.select(builder.icmp_unsigned("!=", bit, i8(0)), i8(if_set), i8(if_clear))
    return builder.or_(nibble_bytes(builder, blk, 6), high)


def nibble_bytes(builder, base, start: int) -> ir.Value:
    """The 16 bytes at ``base[start:]`` as 32 nibbles (``<32 x i8>``): the low ones, then the high
    ones (a GGML block's value order)."""
    b = _load_vec(builder, base, _c64(start), _vec(_I8, 16))
    low, four = ir.Constant(_vec(_I8, 16), [15] * 16), ir.Constant(_vec(_I8, 16), [4] * 16)
    return builder.shuffle_vector(builder.and_(b, low), builder.lshr(b, four), _lanes(range(32)))


def byte_dots(builder, dot, acc: dict, wrows: list, xrows: list, base, chunks: int, x_unsigned: bool) -> dict:
    """``acc[i, j]`` (int32 x 8) after ``vpdpbusd`` (``dot``) of weight row ``i`` and activation row
    ``j`` over the ``chunks`` 32-byte chunks from ``base``: each chunk's rows loaded once for the
    tile. ``x_unsigned``: the activations are the unsigned operand (else the weights)."""
    acc = dict(acc)
    for c in range(chunks):
        off = builder.add(base, _c64(32 * c))
        ws = [builder.bitcast(_load_vec(builder, w, off, _vec(_I8, 32)), _vec(_I32, 8)) for w in wrows]
        xs = [builder.bitcast(_load_vec(builder, x, off, _vec(_I8, 32)), _vec(_I32, 8)) for x in xrows]
        for j in range(len(xrows)):
            for i in range(len(wrows)):
                pair = (xs[j], ws[i]) if x_unsigned else (ws[i], xs[j])
                acc[i, j] = builder.call(dot, [acc[i, j], *pair])
    return acc


def _splat(builder, x, n):
    v = builder.insert_element(ir.Constant(_vec(x.type, n), ir.Undefined), x, ir.Constant(_I32, 0))
    return builder.shuffle_vector(v, v, ir.Constant(_vec(_I32, n), [0] * n))


# Float arithmetic here is exactly as written, whatever the calling kernel's ``fastmath``: numba's
# fastmath pass flags only instructions without flags, so ours carry "nsz" (which permits neither
# reassociation nor contraction), and the accumulation is an explicit FMA. Otherwise LLVM may
# contract and reorder each tile shape its own way, and a row's result would depend on which
# rows it was computed with.
_EXACT = ("nsz",)


def _fma(builder, a, b, c):
    """``a * b + c`` rounded once (``llvm.fma``), on float vectors."""
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(a.type, [a.type] * 3),
                                        f"llvm.fma.v{a.type.count}f32")
    return builder.call(fn, [a, b, c])


def _hsum(builder, v):
    """Sum of the lanes of a float vector (once per output value, so a plain chain)."""
    total = builder.extract_element(v, ir.Constant(_I32, 0))
    for lane in range(1, v.type.count):
        total = builder.fadd(total, builder.extract_element(v, ir.Constant(_I32, lane)), flags=_EXACT)
    return total


def _pmadd(builder):
    """``llvm.x86.avx2.pmadd.wd``: 16 x int16 * int16, adjacent pairs summed into 8 x int32."""
    return cgutils.get_or_insert_function(
        builder.module, ir.FunctionType(_vec(_I32, 8), [_vec(_I16, 16), _vec(_I16, 16)]),
        "llvm.x86.avx2.pmadd.wd")


def _open_loop(builder, name: str):
    """Blocks of a counted loop; leaves the builder in its header. Returns (entry, head, body,
    done): phis take their first value from entry, the body branches back to head."""
    entry = builder.block
    head = builder.function.append_basic_block(f"{name}.head")
    body = builder.function.append_basic_block(f"{name}.body")
    done = builder.function.append_basic_block(f"{name}.done")
    builder.branch(head)
    builder.position_at_end(head)
    return entry, head, body, done


GGML_BLOCK = {"q8_0": 34, "q5_0": 22}  # bytes per 32 values: f16 scale, [4 bytes high bits], values
# bytes ahead the row kernel prefetches weights (on into the next rows of the thread's range: the
# hardware prefetcher stops at each 4 KiB page). Measured on a Q8_0 matrix of Gemma 3 270M's LM head
# shape (262,144 x 640) on two AVX2 threads: 19.1 GB/s without, 20.7 / 22.5 / 23.1 / 22.8 at 1 / 2 / 4 / 8 KiB
ROWS_PREFETCH = 4096


def _rows_dot_codegen(group: int, nrows: int, ntok: int, fmt: str):
    """IR for ``out[t0 + j, r0 + i] = dot(row r0 + i, x[t0 + j])``, ``i < nrows``, ``j < ntok``,
    over groups of ``group`` values.

    Per group and (row, token): exact int32 sums of weight * int16 activation with ``vpmaddwd``,
    converted once to float32 and scaled by the token's ``xd[t, g]`` (int4 and GGML blocks: times
    the group's float16 weight scale, both over eight lanes) into eight float32 lanes (one FMA),
    summed at the end. A group's weights are loaded and widened to int16 once for the ``ntok``
    tokens, and each token's activations once for the ``nrows`` rows: a batch of sequences costs
    little more compute than one. The float work of every (row, token) is the same sequence
    whatever the tile (integer sums are exact in any order), so each output is bit for bit its
    1 x 1 result.
    ``fmt`` "int4" (arguments ``(packed, scales, xq, xd, r0, t0, out)``), "int8" (``(q, xq, xd,
    r0, t0, out)``), or GGML rows of raw blocks of 32 values (``(raw, xq, xd, r0, t0, out)``):
    "q8_0" (float16 scale, 32 int8) or "q5_0" (float16 scale, 32 high bits, 16 bytes of low
    nibbles; value j = nibble | high bit << 4, minus 16; j and j + 16 share a byte).
    ``xq`` int16 ``[T, in]``, ``xd`` float32 ``[T, in // group]``, ``out`` float32 ``[T, out]``.
    """
    int4 = fmt == "int4"

    def codegen(builder, wa, *rest):
        if int4:
            sa, xqa, xda, r0, t0, oa = rest
            ng = sa.shape[1]
        else:
            xqa, xda, r0, t0, oa = rest
            ng = builder.udiv(wa.shape[1], ir.Constant(_I64, GGML_BLOCK.get(fmt, group)))
        pmadd = _pmadd(builder)
        rows, toks = _span(builder, r0, nrows), _span(builder, t0, ntok)
        wrow, xrow, drow = wa.rows(builder, rows), xqa.rows(builder, toks), xda.rows(builder, toks)
        if int4:
            srow = sa.rows(builder, rows)
        entry, head, body, done = _open_loop(builder, "rowsdot")
        g = builder.phi(_I64)
        g.add_incoming(_c64(0), entry)
        accs = {}
        for i in range(nrows):
            for j in range(ntok):
                accs[i, j] = builder.phi(_vec(_F32, 8))
                accs[i, j].add_incoming(ir.Constant(_vec(_F32, 8), [0.0] * 8), entry)
        builder.cbranch(builder.icmp_signed("<", g, ng), body, done)

        builder.position_at_end(body)
        xbase = builder.mul(g, _c64(group))
        xs = [[_load_vec(builder, x, builder.add(xbase, _c64(16 * c)), _vec(_I16, 16)) for c in range(group // 16)]
              for x in xrow]
        xdg = [builder.load(builder.gep(d, [g], inbounds=True)) for d in drow]
        if ROWS_PREFETCH:  # one hint per group and row (a cache line holds 2-4 groups: cheap, and no branch)
            step = group // 2 if int4 else GGML_BLOCK.get(fmt, group)
            for w in wrow:
                prefetch_ir(builder, builder.gep(w, [builder.add(builder.mul(g, _c64(step)), _c64(ROWS_PREFETCH))]))

        def int8_chunks(ptr, start):
            """The group's int8 weights from ``ptr[start:]``, widened: (int16 x 16, x chunk) pairs."""
            return [(builder.sext(_load_vec(builder, ptr, builder.add(start, _c64(16 * c)), _vec(_I8, 16)),
                                  _vec(_I16, 16)), c) for c in range(group // 16)]

        for i in range(nrows):
            scale = None  # the group's float16 weight scale (int4, GGML), as float32
            if int4:  # byte j of a group: value j (low nibble) and value j + group/2 (high)
                ws = []
                for c in range(group // 32):
                    b = _load_vec(builder, wrow[i], builder.add(builder.mul(g, _c64(group // 2)), _c64(16 * c)),
                                  _vec(_I8, 16))
                    w = builder.bitcast(builder.zext(b, _vec(_I16, 16)), _vec(_I32, 8))  # `_word_bits`
                    ws += [(builder.bitcast(_word_bits(builder, w, 0, 15), _vec(_I16, 16)), c),
                           (builder.bitcast(_word_bits(builder, w, 4, 15), _vec(_I16, 16)), c + group // 32)]
                scale = half_to_f32_ir(builder, builder.load(builder.gep(srow[i], [g], inbounds=True)), 8)
            elif fmt == "int8":
                ws = int8_chunks(wrow[i], xbase)
            else:  # GGML block: float16 scale first
                blk = builder.gep(wrow[i], [builder.mul(g, _c64(GGML_BLOCK[fmt]))], inbounds=True)
                scale = half_to_f32_ir(builder, builder.load(builder.bitcast(blk, _I16.as_pointer()), align=1), 8)
                if fmt == "q8_0":
                    ws = int8_chunks(blk, _c64(2))
                else:
                    val = q5_0_bytes(builder, blk, 0, -16)  # value - 16 as an int8
                    ws = [(builder.sext(builder.shuffle_vector(val, val, _lanes(range(16 * c, 16 * c + 16))),
                                        _vec(_I16, 16)), c) for c in range(2)]
            for j in range(ntok):
                isum = None
                for w, c in ws:
                    s = builder.call(pmadd, [w, xs[j][c]])
                    isum = s if isum is None else builder.add(isum, s)
                d = _splat(builder, xdg[j], 8)
                d = d if scale is None else builder.fmul(scale, d, flags=_EXACT)
                accs[i, j].add_incoming(_fma(builder, builder.sitofp(isum, _vec(_F32, 8)), d, accs[i, j]), body)
        g.add_incoming(builder.add(g, _c64(1)), body)
        builder.branch(head)

        builder.position_at_end(done)
        for (i, j), acc in accs.items():
            at = builder.add(builder.mul(toks[j], oa.shape[1]), rows[i])
            builder.store(_hsum(builder, acc), builder.gep(oa.data, [at], inbounds=True))

    return codegen


TILE_BLOCK = 256  # activation values per int16 scale in the matrix-matrix (prefill) kernel
# bytes ahead a one-row tile of `_tile_dot_codegen` (the int8 decode rows) prefetches its weights, on into
# the thread's next rows. Two AVX2 threads (Zen 3), E2B int8 shapes from memory, in one process against
# none: 12288 x 1536 27.8 -> 33.5 GB/s, 2048 x 1536 29.9 -> 34.2, 1536 x 256 21.8 -> 24.9 (1024 and 4096
# less). Four-row tiles (the 12288-wide down projections) go without: 35.5 GB/s, 28.9 with. On VNNI CPUs
# none either: on Zen 4 (AVX-512 VNNI) E2B int8 decode steps took 0.85x the time without it (0.78-0.95,
# 16 rounds alternating with the prefetching kernel, a 4 KiB distance 0.95x; scripts/paired_decode.py's
# workers), where its int4 kernel's prefetch still pays (1.09x slower without) and the GGML rows' is neutral.
TILE_PREFETCH = 2048
# Independent multiply-add chains per block of a tile with fewer than 4 (row, token) sums. On VNNI
# targets LLVM fuses each vpmaddwd and its add into one vpdpwssd, which a 1 x 1 decode tile then ran as
# one dependent chain of 16 per block, bound by the instruction's latency (one thread, a 0.4-6 MB matrix
# in cache: 22 GB/s, 30-32 with four chains written out as vpdpwssd calls). The int32 sums are exact in
# any order, so every result is the same to the bit.
TILE_CHAINS = 4
U8_BLOCK = 256  # activation values per int8 scale in the VNNI prefill kernel (128 measured no closer)


def _tile_dot_codegen(rt: int, tt: int):
    """IR for an ``rt`` rows x ``tt`` tokens tile of ``out = x @ q.T`` (before the row scale).

    Per block of TILE_BLOCK values: ``rt * tt`` exact int32 sums with ``vpmaddwd`` (``vpdpwssd``
    on VNNI targets, in TILE_CHAINS chains; 16 products each; <= 16 * 2 * 127 * 32767 per lane, no
    overflow), converted once to float32 and scaled
    by the token's block scale into eight float32 lanes; at the end the lanes of every (row,
    token) pair are folded by one transposing tree (`_lane_sums`, the same order for every
    pair). Each weight chunk is loaded once for the tile's ``tt`` tokens and each activation
    chunk once for its ``rt`` rows: ``rt * tt`` multiply-adds per ``rt + tt`` loads, which is
    what lets this beat a float32 BLAS product on dequantized weights (16-bit multiply-add
    does twice the work of a float32 FMA per instruction with VNNI).
    Arguments ``(q [n, k] int8, xq [T, k] int16, xd [T, k // TILE_BLOCK] float32, r0, t0,
    out [T, n] float32)``; the tile's outputs are stored, not accumulated.
    """
    def codegen(builder, qa, xa, da, r0, t0, oa):
        n, k = qa.shape
        nkb = da.shape[1]
        pmadd = _pmadd(builder)
        dpwssd = _vpdpwssd(builder) if target_has_vnni() else None
        rows, toks = _span(builder, r0, rt), _span(builder, t0, tt)
        wrow, xrow, drow = qa.rows(builder, rows), xa.rows(builder, toks, k), da.rows(builder, toks)
        entry, head, body, done = _open_loop(builder, "tile")
        kb = builder.phi(_I64)
        kb.add_incoming(_c64(0), entry)
        facc = {}
        for i in range(rt):
            for j in range(tt):
                facc[i, j] = builder.phi(_vec(_F32, 8))
                facc[i, j].add_incoming(ir.Constant(_vec(_F32, 8), [0.0] * 8), entry)
        builder.cbranch(builder.icmp_signed("<", kb, nkb), body, done)

        builder.position_at_end(body)
        base = builder.mul(kb, _c64(TILE_BLOCK))
        if rt == 1 and TILE_PREFETCH and not dpwssd:  # the block's cache lines TILE_PREFETCH bytes ahead
            for line in range(0, TILE_BLOCK, 64):
                prefetch_ir(builder, builder.gep(wrow[0], [builder.add(base, _c64(TILE_PREFETCH + line))]))
        acc = {}  # (row, token, chain): int32 x 8; without VNNI one chain of vpmaddwd + vpaddd (1-cycle adds)
        chains = max(1, TILE_CHAINS // (rt * tt)) if dpwssd else 1
        for c in range(TILE_BLOCK // 16):
            off = builder.add(base, _c64(16 * c))
            ws = [builder.sext(_load_vec(builder, w, off, _vec(_I8, 16)), _vec(_I16, 16)) for w in wrow]
            xs = [_load_vec(builder, x, off, _vec(_I16, 16)) for x in xrow]
            for i in range(rt):
                for j in range(tt):
                    key = (i, j, c % chains)
                    if dpwssd:
                        a = acc.get(key, ir.Constant(_vec(_I32, 8), [0] * 8))
                        pair = [builder.bitcast(v, _vec(_I32, 8)) for v in (ws[i], xs[j])]
                        acc[key] = builder.call(dpwssd, [a, *pair])
                    else:
                        s = builder.call(pmadd, [ws[i], xs[j]])
                        acc[key] = s if c < chains else builder.add(acc[key], s)
        for i in range(rt):  # integer sums: exact in any order, so the chains change no bit
            for j in range(tt):
                for h in range(1, chains):
                    acc[i, j, 0] = builder.add(acc[i, j, 0], acc[i, j, h])
                acc[i, j] = acc[i, j, 0]
        for j in range(tt):
            d = _splat(builder, builder.load(builder.gep(drow[j], [kb], inbounds=True)), 8)
            for i in range(rt):
                facc[i, j].add_incoming(_fma(builder, builder.sitofp(acc[i, j], _vec(_F32, 8)), d, facc[i, j]), body)
        kb.add_incoming(builder.add(kb, _c64(1)), body)
        builder.branch(head)

        builder.position_at_end(done)  # pairs p = j * rt + i: a token's rt sums are adjacent lanes
        sums = _lane_sums(builder, [facc[p % rt, p // rt] for p in range(rt * tt)])
        for j in range(tt):
            v, lane = divmod(j * rt, 8)
            part = builder.shuffle_vector(sums[v], sums[v], ir.Constant(_vec(_I32, rt), list(range(lane, lane + rt))))
            dst = builder.gep(oa.data, [builder.add(builder.mul(toks[j], n), r0)], inbounds=True)
            builder.store(part, builder.bitcast(dst, _vec(_F32, rt).as_pointer()), align=4)

    return codegen


def _vpdpwssd(builder):
    """``llvm.x86.avx512.vpdpwssd.256``: acc + sums of two int16 products per int32 lane (what LLVM
    fuses ``vpmaddwd`` and an add into on VNNI CPUs), as the ``<8 x i32>`` operand form."""
    v = _vec(_I32, 8)
    return cgutils.get_or_insert_function(builder.module, ir.FunctionType(v, [v, v, v]),
                                          "llvm.x86.avx512.vpdpwssd.256")


def _vpdpbusd(builder):
    """``llvm.x86.avx512.vpdpbusd.256``: acc + sums of four u8 * s8 products per int32 lane (32
    multiply-adds per instruction; AVX-512 VNNI + VL or AVX-VNNI). The ``<8 x i32>`` operand form
    every LLVM since 9 accepts (newer ones upgrade it to their ``<32 x i8>`` form)."""
    v = _vec(_I32, 8)
    return cgutils.get_or_insert_function(builder.module, ir.FunctionType(v, [v, v, v]),
                                          "llvm.x86.avx512.vpdpbusd.256")


def _lane_sums(builder, vecs):
    """Eight-lane float (or int32) vectors ``v_0 .. v_{m-1}`` -> ``ceil(m / 8)`` vectors whose lane
    ``p`` holds the sum of the lanes of ``v_{8i + p}`` (a transposing tree: 7 adds for 8 sums
    instead of 56). Every vector's lanes are summed in the same order, ``((0+1)+(2+3))+((4+5)+(6+7))``,
    whatever vectors it is grouped with, so a tile's shape never changes a result."""
    is_int = isinstance(vecs[0].type.element, ir.IntType)
    zero = ir.Constant(vecs[0].type, [0 if is_int else 0.0] * 8)

    def add(a, b):
        return builder.add(a, b) if is_int else builder.fadd(a, b, flags=_EXACT)

    vecs = vecs + [zero] * (-len(vecs) % 8)
    out = []
    for k in range(0, len(vecs), 8):
        level = vecs[k:k + 8]
        for width in (1, 2, 4):  # pair up: lanes in runs of `width` from a, then from b
            lo = [p for base in range(0, 8, 2 * width) for p in (*range(base, base + width),
                                                                    *range(8 + base, 8 + base + width))]
            hi = [p + width for p in lo]
            level = [add(builder.shuffle_vector(a, b, ir.Constant(_vec(_I32, 8), lo)),
                         builder.shuffle_vector(a, b, ir.Constant(_vec(_I32, 8), hi)))
                     for a, b in zip(level[0::2], level[1::2])]
        out.append(level[0])
    return out


def _spread(builder, ptr, count: int, lane_of, nvec: int, ety):
    """Load ``count`` consecutive values from ``ptr`` and lay them out over ``nvec`` eight-lane
    vectors: lane ``p`` of vector ``v`` gets value ``lane_of(8v + p)`` (any one where it is None)."""
    vals = builder.load(builder.bitcast(ptr, _vec(ety, count).as_pointer()), align=1)
    return [builder.shuffle_vector(vals, vals, ir.Constant(_vec(_I32, 8), [
        (lane_of(8 * v + p) if lane_of(8 * v + p) is not None else 0) for p in range(8)]))
        for v in range(nvec)]


def _round_u8_codegen(builder, xa, ua, da, t):
    """IR of `round_u8`: per block, the max of |x| over eight-lane vectors, then ``x / d`` rounded
    to nearest even (``cvtps2dq``, like ``np.rint``), +128, narrowed to bytes. (numba leaves a
    float max reduction scalar: 2 values per ns against ~16 here.)"""
    k = xa.shape[1]
    nkb, t_all = da.shape
    f8 = _vec(_F32, 8)
    cvt = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_vec(_I32, 8), [f8]),
                                         "llvm.x86.avx.cvt.ps2dq.256")
    fmax = cgutils.get_or_insert_function(builder.module, ir.FunctionType(f8, [f8, f8]), "llvm.maxnum.v8f32")
    fabs = cgutils.get_or_insert_function(builder.module, ir.FunctionType(f8, [f8]), "llvm.fabs.v8f32")
    (xrow,), (urow,) = xa.rows(builder, [t]), ua.rows(builder, [t], k)
    entry, head, body, done = _open_loop(builder, "roundu8")
    kb = builder.phi(_I64)
    kb.add_incoming(_c64(0), entry)
    builder.cbranch(builder.icmp_signed("<", kb, nkb), body, done)

    builder.position_at_end(body)
    base = builder.mul(kb, _c64(U8_BLOCK))
    xs = [_load_vec(builder, xrow, builder.add(base, _c64(8 * c)), f8) for c in range(U8_BLOCK // 8)]
    m = [builder.call(fabs, [v]) for v in xs]
    while len(m) > 1:
        m = [builder.call(fmax, [a, b]) for a, b in zip(m[0::2], m[1::2])]
    m = m[0]
    for width in (4, 2, 1):
        m = builder.call(fmax, [m, builder.shuffle_vector(m, m, ir.Constant(_vec(_I32, 8), [
            (p + width) % 8 for p in range(8)]))])
    amax = builder.extract_element(m, ir.Constant(_I32, 0))
    d = builder.fdiv(amax, ir.Constant(_F32, 127.0))
    builder.store(d, builder.gep(da.data, [builder.add(builder.mul(kb, t_all), t)], inbounds=True))
    pos = builder.fcmp_ordered(">", d, ir.Constant(_F32, 0.0))
    inv = _splat(builder, builder.select(pos, builder.fdiv(ir.Constant(_F32, 1.0), d), ir.Constant(_F32, 0.0)), 8)
    off = ir.Constant(_vec(_I32, 8), [128] * 8)
    for c, v in enumerate(xs):
        q = builder.add(builder.call(cvt, [builder.fmul(v, inv)]), off)
        dst = builder.gep(urow, [builder.add(base, _c64(8 * c))], inbounds=True)
        builder.store(builder.trunc(q, _vec(_I8, 8)), builder.bitcast(dst, _vec(_I8, 8).as_pointer()), align=1)
    kb.add_incoming(builder.add(kb, _c64(1)), body)
    builder.branch(head)
    builder.position_at_end(done)


@intrinsic
def round_u8(typingctx, x, xu, xd, t):
    """Row ``t`` of the activations ``x [T, k]`` float32 -> int8 per block of U8_BLOCK values
    (scale ``xd[b, t]`` = max|x| / 127, round to nearest even, values in [-127, 127]) stored
    offset by +128 in ``xu [T, k]`` uint8: the unsigned operand of ``vpdpbusd``
    (`u8_tile_dot` takes the offset back out with the weights' block sums). ``xd [k // B, T]``
    float32 (transposed: a tile reads its tokens' scales together). Rounding error <= xd / 2."""
    return types.void(x, xu, xd, t), _codegen(_round_u8_codegen, 4)


def _u8_tile_codegen(rt: int, tt: int, split: bool):
    """IR for an ``rt`` rows x ``tt`` tokens tile of ``out = scale * (x @ q.T)`` with int8
    activations: ``vpdpbusd`` of the uint8 ``x + 128`` against the int8 weights. With ``split``
    the activations are int16, ``x = 256 * hi + lo``, as two byte planes (``xh`` = hi + 128,
    ``xl`` = lo, unsigned): per block the hi plane's products (offset taken out as below), the
    sums shifted left by 8 bits, then the lo plane's products added: the exact int16 x int8 dot
    product with 32 multiply-adds per instruction on the weights as stored (``vpdpwssd`` needs
    them widened to 16 bits first). A lane stays below 2**31: 256 * 32 * 128 * 127 + 32 * 255 * 127.

    Per (row, token) pair, an int32 accumulator of eight lanes per block of U8_BLOCK values
    (each weight chunk of 32 bytes loaded once for the ``tt`` tokens, each activation chunk once
    for the ``rt`` rows) that starts from the lane's share of the offset term, ``-128 * sum(q)``
    over the weights that lane multiplies (``lc``, `u8_lane_corr`), so every lane holds its exact
    signed integer dot product (never the inflated offset sum, whose cancellation in float32
    would cost precision); the lanes are converted and added times the token's block scale into
    eight float32 lanes (one FMA each). Only at the end does a transposing tree fold each pair's
    lanes (`_lane_sums`), then the rows' scales are applied and each token's ``rt`` results
    stored: per block one conversion and one FMA a pair, no shuffles.
    Arguments ``(q [n, k] int8, lc [k // B, R, 8] int32 (rows r0 .. r0 + rt - 1 as 0 .. rt - 1,
    rt <= R), xu [T, k] uint8 (split: lo), xh [T, k] uint8 (split: hi + 128; else None),
    xd [k // B, T] float32, r0, t0, out [T, n] float32, scale [n] float32)``."""
    npair = rt * tt
    nvec = (npair + 7) // 8

    def codegen(builder, qa, la, xa, ha, da, r0, t0, oa, sa):
        n, k = qa.shape
        nkb, t_all = da.shape
        dot = _vpdpbusd(builder)
        v8, f8 = _vec(_I32, 8), _vec(_F32, 8)
        lrows = la.shape[1]
        wrow = [builder.gep(qa.data, [builder.mul(builder.add(r0, _c64(i)), k)], inbounds=True) for i in range(rt)]
        xrow = [builder.gep(xa.data, [builder.mul(builder.add(t0, _c64(j)), k)], inbounds=True) for j in range(tt)]
        hrow = [builder.gep(ha.data, [builder.mul(builder.add(t0, _c64(j)), k)], inbounds=True)
                for j in range(tt)] if split else []
        entry, head, body, done = _open_loop(builder, "u8tile")
        kb = builder.phi(_I64)
        kb.add_incoming(_c64(0), entry)
        facc = {}
        for p in range(npair):
            facc[p] = builder.phi(f8)
            facc[p].add_incoming(ir.Constant(f8, [0.0] * 8), entry)
        builder.cbranch(builder.icmp_signed("<", kb, nkb), body, done)

        builder.position_at_end(body)
        base = builder.mul(kb, _c64(U8_BLOCK))
        lptr = builder.gep(la.data, [builder.mul(builder.mul(kb, lrows), _c64(8))], inbounds=True)
        start = [_load_vec(builder, lptr, _c64(8 * i), v8) for i in range(rt)]
        acc = {(i, j): start[i] for i in range(rt) for j in range(tt)}
        planes = [hrow, xrow] if split else [xrow]
        for plane, rows in enumerate(planes):
            if plane:  # the hi plane's sums times 256, before the lo plane's products
                acc = {key: builder.shl(a, ir.Constant(v8, [8] * 8)) for key, a in acc.items()}
            acc = byte_dots(builder, dot, acc, wrow, rows, base, U8_BLOCK // 32, True)
        dptr = builder.gep(da.data, [builder.add(builder.mul(kb, t_all), t0)], inbounds=True)
        for j in range(tt):
            d = _splat(builder, builder.load(builder.gep(dptr, [_c64(j)], inbounds=True)), 8)
            for i in range(rt):
                p = j * rt + i
                facc[p].add_incoming(_fma(builder, builder.sitofp(acc[i, j], f8), d, facc[p]), body)
        kb.add_incoming(builder.add(kb, _c64(1)), body)
        builder.branch(head)

        builder.position_at_end(done)  # pairs p = j * rt + i: a token's rt results are adjacent lanes
        sums = _lane_sums(builder, [facc[p] for p in range(npair)])
        scale = _spread(builder, builder.gep(sa.data, [r0], inbounds=True), rt,
                        lambda p: p % rt if p < npair else None, nvec, _F32)
        res = [builder.fmul(f, s, flags=_EXACT) for f, s in zip(sums, scale)]
        for j in range(tt):
            v, lane = divmod(j * rt, 8)
            part = builder.shuffle_vector(res[v], res[v], ir.Constant(_vec(_I32, rt), list(range(lane, lane + rt))))
            dst = builder.gep(oa.data, [builder.add(builder.mul(builder.add(t0, _c64(j)), n), r0)], inbounds=True)
            builder.store(part, builder.bitcast(dst, _vec(_F32, rt).as_pointer()), align=4)

    return codegen


def _u8_lane_corr_codegen(rt: int):
    """IR of `u8_lane_corr`: ``vpdpbusd`` of 128 (unsigned) against each row's weights, negated."""
    def codegen(builder, qa, r0, la):
        k = qa.shape[1]
        nkb = builder.sdiv(k, _c64(U8_BLOCK))
        lrows = la.shape[1]
        dot = _vpdpbusd(builder)
        v8 = _vec(_I32, 8)
        half = builder.bitcast(ir.Constant(_vec(_I8, 32), [128] * 32), v8)
        wrow = [builder.gep(qa.data, [builder.mul(builder.add(r0, _c64(i)), k)], inbounds=True) for i in range(rt)]
        entry, head, body, done = _open_loop(builder, "lanecorr")
        kb = builder.phi(_I64)
        kb.add_incoming(_c64(0), entry)
        builder.cbranch(builder.icmp_signed("<", kb, nkb), body, done)
        builder.position_at_end(body)
        base = builder.mul(kb, _c64(U8_BLOCK))
        lptr = builder.gep(la.data, [builder.mul(builder.mul(kb, lrows), _c64(8))], inbounds=True)
        for i, w in enumerate(wrow):
            acc = ir.Constant(v8, [0] * 8)
            for c in range(U8_BLOCK // 32):
                wv = builder.bitcast(_load_vec(builder, w, builder.add(base, _c64(32 * c)), _vec(_I8, 32)), v8)
                acc = builder.call(dot, [acc, half, wv])
            dst = builder.bitcast(builder.gep(lptr, [_c64(8 * i)], inbounds=True), v8.as_pointer())
            builder.store(builder.sub(ir.Constant(v8, [0] * 8), acc), dst, align=4)
        kb.add_incoming(builder.add(kb, _c64(1)), body)
        builder.branch(head)
        builder.position_at_end(done)

    return codegen


def _literal(t, allowed) -> bool:
    return isinstance(t, types.IntegerLiteral) and t.literal_value in allowed


@intrinsic
def int4_rows_dot(typingctx, packed, scales, xq, xd, r0, t0, out, group, nrows, ntok):
    """``out[t, r] = sum_g f16(scales[r, g]) * xd[t, g] * sum_i n[r, g, i] * xq[t, g*G + i]`` for
    the ``nrows`` rows ``r0 ..`` of an int4 matrix and the ``ntok`` tokens ``t0 ..`` (no ``mins``
    term).

    ``packed`` uint8 ``[out, in//2]`` (gemmalite.weights.quant nibble order), ``scales`` uint16 float16
    bits ``[out, in//G]``, ``xq`` int16 ``[T, in]``, ``xd`` float32 ``[T, in//G]``, ``out`` float32
    ``[T, out]``; all C-contiguous. ``group`` (32 or 64), ``nrows`` and ``ntok`` must be
    compile-time literals (the unrolling depends on them). A group's products are summed exactly
    in int32 (15 * 32767 * 64 < 2**31), then scaled in float32.
    """
    if not (_literal(group, (32, 64)) and _literal(nrows, range(1, 9)) and _literal(ntok, range(1, 9))):
        return None
    inner = _rows_dot_codegen(group.literal_value, nrows.literal_value, ntok.literal_value, "int4")
    return types.void(packed, scales, xq, xd, r0, t0, out, group, nrows, ntok), _codegen(inner, 7)


@intrinsic
def int8_rows_dot(typingctx, q, xq, xd, r0, t0, out, nrows, ntok):
    """``out[t, r] = sum_g xd[t, g] * sum_i q[r, 32g + i] * xq[t, 32g + i]`` for rows ``r0 ..
    r0 + nrows - 1`` of an int8 matrix ``q [out, in]`` (in a multiple of 32; the caller applies
    the row scale) and tokens ``t0 .. t0 + ntok - 1``. ``xq`` int16 ``[T, in]``, ``xd`` float32
    ``[T, in//32]``, ``out`` float32 ``[T, out]``; ``nrows``, ``ntok`` literals.
    A group's products are summed exactly in int32 (127 * 32767 * 32 < 2**31)."""
    if not (_literal(nrows, range(1, 9)) and _literal(ntok, range(1, 9))):
        return None
    inner = _rows_dot_codegen(32, nrows.literal_value, ntok.literal_value, "int8")
    return types.void(q, xq, xd, r0, t0, out, nrows, ntok), _codegen(inner, 6)


@intrinsic
def int8_tile_dot(typingctx, q, xq, xd, r0, t0, out, rt, tt):
    """``out[t, r] = sum_b xd[t, b] * sum_i q[r, bB + i] * xq[t, bB + i]`` (B = TILE_BLOCK) for
    rows ``r0 .. r0 + rt - 1`` and tokens ``t0 .. t0 + tt - 1``; ``rt``, ``tt`` literals (1-4).
    All arrays C-contiguous, ``k`` a multiple of TILE_BLOCK."""
    if not (_literal(rt, (1, 2, 4, 8)) and _literal(tt, range(1, 5))):
        return None
    inner = _tile_dot_codegen(rt.literal_value, tt.literal_value)
    return types.void(q, xq, xd, r0, t0, out, rt, tt), _codegen(inner, 6)


@intrinsic
def u8_lane_corr(typingctx, q, r0, lc, rt):
    """``lc[b, i, l] = -128 * sum(q[r0 + i, bB + 32c + 4l + m] for c, m)`` (B = U8_BLOCK,
    ``c < B / 32``, ``m < 4``): the offset term of the +128 activations that lane ``l`` of a
    `u8_tile_dot` accumulator meets in block ``b`` of row ``r0 + i``, ``i < rt`` (a literal in 1,
    2, 4, 8; ``lc`` int32 ``[k // B, R, 8]``, R >= rt). Once per strip of rows: it does not
    depend on the tokens."""
    if not _literal(rt, (1, 2, 4, 8)):
        return None
    return types.void(q, r0, lc, rt), _codegen(_u8_lane_corr_codegen(rt.literal_value), 3)


@intrinsic
def u8_tile_dot(typingctx, q, lc, xu, xh, xd, r0, t0, out, scale, rt, tt):
    """``out[t, r] = scale[r] * sum_b xd[b, t] * sum_i q[r, bB + i] * a[t, bB + i]`` (B = U8_BLOCK)
    for rows ``r0 .. r0 + rt - 1`` and tokens ``t0 .. t0 + tt - 1``, the activations ``a`` int8
    (``xu`` = a + 128, ``xh`` None) or int16 (``xu`` = a & 255, ``xh`` = (a >> 8) + 128, uint8
    planes); ``lc``: `u8_lane_corr` of these rows, which takes the +128 back out exactly. ``rt``
    a literal in 1, 2, 4, 8 and ``tt`` in 1-4. Needs VNNI (`kernels.common.HAVE_VNNI`). All arrays
    C-contiguous, ``k`` a multiple of B."""
    if not (_literal(rt, (1, 2, 4, 8)) and _literal(tt, range(1, 5))):
        return None
    inner = _u8_tile_codegen(rt.literal_value, tt.literal_value, not isinstance(xh, types.NoneType))
    return types.void(q, lc, xu, xh, xd, r0, t0, out, scale, rt, tt), _codegen(inner, 9)


@intrinsic
def block_row_dot(typingctx, raw, xq, xd, r0, t0, out, bits, ntok):
    """``out[t, r] = sum_g f16(d[r, g]) * xd[t, g] * sum_i w[r, g, i] * xq[t, 32g + i]`` for row
    ``r0`` of a GGML matrix stored as raw blocks of 32 values (``raw`` uint8 ``[rows, in // 32 *
    block]``) and tokens ``t0 .. t0 + ntok - 1``: ``bits`` 8 for Q8_0, 5 for Q5_0 (literals, as
    ``ntok``). ``xq`` int16 ``[T, in]``, ``xd`` float32 ``[T, in // 32]``, ``out`` ``[T, rows]``."""
    if not (_literal(bits, (5, 8)) and _literal(ntok, range(1, 9))):
        return None
    inner = _rows_dot_codegen(32, 1, ntok.literal_value, "q8_0" if bits.literal_value == 8 else "q5_0")
    return types.void(raw, xq, xd, r0, t0, out, bits, ntok), _codegen(inner, 6)
