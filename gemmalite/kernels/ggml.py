"""numba kernels of the GGML block formats (`gemmalite.weights.ggml`): the block type table,
one decoder per block type, row gathers and fused few-row products.

Numerics: every decoder reproduces the float32 operations of the reference dequantizers in
``gguf.quants`` (llama.cpp's ``dequantize_row_*``) bit for bit, e.g. Q4_K computes
``(d*sc)*q - (dmin*m)``. Decoders are compiled with ``fastmath=False`` (no FMA contraction, no
reassociation), so the decoded weights are exact; the float32 dot product (`_dot`) sums in
vector lanes in `fdot`'s written-out order.
"""
from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np
from llvmlite import ir
from numba import literally, njit, prange, types
from numba.extending import intrinsic, overload

from .common import EXACT, FAST, TOKEN_TILE, among, either, h2f, half_to_f32_ir, literal_ladder, nibbles
from .fdot import _loop, dot_tile
from .int4s import LANE_GROUP, lane_strip_tiles
from .simd import (_EXACT, _F32, _I8, _I16, _I32, _I64, _c64, _codegen, _fma, _hsum, _lane_sums, _lanes, _literal,
                   _load_vec, _open_loop, _pmadd, _span, _vec, _word_bits, block_row_dot, nibble_bytes, q5_0_bytes)

QK_K = 256
ROW_CHUNK = 16  # output rows per parallel work item in the fused kernel

# GGML type id -> (name, elements per block, bytes per block); ids from ggml.h
GGML_TYPES: dict[int, tuple[str, int, int]] = {
    0: ("F32", 1, 4),
    1: ("F16", 1, 2),
    2: ("Q4_0", 32, 18),
    3: ("Q4_1", 32, 20),
    6: ("Q5_0", 32, 22),
    7: ("Q5_1", 32, 24),
    8: ("Q8_0", 32, 34),
    12: ("Q4_K", QK_K, 144),
    13: ("Q5_K", QK_K, 176),
    14: ("Q6_K", QK_K, 210),
    30: ("BF16", 1, 2),
}
_BY_NAME = {v[0]: k for k, v in GGML_TYPES.items()}
FLOAT_TYPES = ("F32", "F16", "BF16")

def type_name(qtype) -> str:
    """Normalise a GGML type given as id, name or ``gguf.GGMLQuantizationType``."""
    if isinstance(qtype, str):
        name = qtype.upper()
        if name not in _BY_NAME:
            raise ValueError(f"unsupported GGML type {qtype!r}")
        return name
    tid = int(qtype)
    if tid not in GGML_TYPES:
        raise ValueError(f"unsupported GGML type id {tid} ({getattr(qtype, 'name', '?')})")
    return GGML_TYPES[tid][0]


def block_info(qtype) -> tuple[int, int]:
    """(elements per block, bytes per block) of a type."""
    _, bs, ts = GGML_TYPES[_BY_NAME[type_name(qtype)]]
    return bs, ts


def row_bytes(qtype, cols: int) -> int:
    bs, ts = block_info(qtype)
    if cols % bs:
        raise ValueError(f"{type_name(qtype)} rows need a multiple of {bs} columns, got {cols}")
    return cols // bs * ts


# ---------------------------------------------------------------------------------------------
# Block decoders: dec(row, b, dst, o, n) writes block b of the byte row into dst[o:o+bs].
# All arithmetic is float32, in the reference order.
# `n` is always 32 (= W). It is passed in at run time on purpose: with a constant trip count
# LLVM fully unrolls the inner loops and then cannot vectorise them (it cannot prove that `dst`
# and `row` do not overlap); with an opaque one it vectorises them behind a runtime overlap
# check, which is 3-4x faster.
# ---------------------------------------------------------------------------------------------

W = 32


@njit(inline="always", **EXACT)
def _half(row, o):
    return h2f(np.uint16(np.int64(row[o]) | (np.int64(row[o + 1]) << 8)))


@njit(inline="always", **EXACT)
def _u32(row, o):
    return (np.int64(row[o]) | (np.int64(row[o + 1]) << 8)
            | (np.int64(row[o + 2]) << 16) | (np.int64(row[o + 3]) << 24))


@njit(inline="always", **EXACT)
def _legacy32(row, o, dst, do, n, has_min, has_high):
    """Q4_0 / Q4_1 / Q5_0 / Q5_1: element j is the low nibble of qs[j], j+16 the high one;
    the 5-bit types take bit j of the 32-bit ``qh`` as bit 4. Without a min: d*(q - offset)."""
    d = _half(row, o)
    p = o + 2
    m = np.float32(0.0)
    if has_min:
        m = _half(row, p)
        p += 2
    qh = 0
    if has_high:
        qh = _u32(row, p)
        p += 4
    off = np.float32(16.0 if has_high else 8.0)
    half = n // 2
    for j in range(half):
        if has_high:
            v = np.int64(row[p + j])
            q0 = np.float32((v & 15) | (((qh >> j) & 1) << 4))
            q1 = np.float32((v >> 4) | (((qh >> (j + half)) & 1) << 4))
        else:
            q0, q1 = nibbles(row[p + j])
        if has_min:
            dst[do + j] = d * q0 + m
            dst[do + half + j] = d * q1 + m
        else:  # q - offset is exact in float32, as in the reference's int8 arithmetic
            dst[do + j] = d * (q0 - off)
            dst[do + half + j] = d * (q1 - off)


@njit(inline="always", **EXACT)
def dec_q4_0(row, b, dst, do, n):
    _legacy32(row, b * 18, dst, do, n, False, False)


@njit(inline="always", **EXACT)
def dec_q4_1(row, b, dst, do, n):
    _legacy32(row, b * 20, dst, do, n, True, False)


@njit(inline="always", **EXACT)
def dec_q5_0(row, b, dst, do, n):
    _legacy32(row, b * 22, dst, do, n, False, True)


@njit(inline="always", **EXACT)
def dec_q5_1(row, b, dst, do, n):
    _legacy32(row, b * 24, dst, do, n, True, True)


@njit(inline="always", **EXACT)
def dec_q8_0(row, b, dst, do, n):
    o = b * 34
    d = _half(row, o)
    for i in range(n):
        dst[do + i] = np.float32(np.int8(row[o + 2 + i])) * d


@njit(inline="always", **EXACT)
def _scale_min_k4(row, s, j):
    """6-bit scale and min of sub-block j from the 12 packed bytes at row[s:] (get_scale_min_k4)."""
    if j < 4:
        return np.int64(row[s + j]) & 63, np.int64(row[s + j + 4]) & 63
    sc = (np.int64(row[s + j + 4]) & 15) | ((np.int64(row[s + j - 4]) >> 6) << 4)
    mn = (np.int64(row[s + j + 4]) >> 4) | ((np.int64(row[s + j]) >> 6) << 4)
    return sc, mn


@njit(inline="always", **EXACT)
def _k4(row, o, dst, do, n, has_high):
    """Q4_K / Q5_K: 8 sub-blocks of 32, value (d*sc)*q - (dmin*m). Bytes 32c..32c+31 of qs hold
    sub-block 2c in the low nibbles, 2c+1 in the high ones; Q5_K's qh bit j is bit 4 of sub-block j."""
    d = _half(row, o)
    dmin = _half(row, o + 2)
    s = o + 4
    qh = o + 16
    qs = o + 48 if has_high else o + 16
    for c in range(4):
        sc0, m0 = _scale_min_k4(row, s, 2 * c)
        sc1, m1 = _scale_min_k4(row, s, 2 * c + 1)
        d0 = d * np.float32(sc0)
        dm0 = dmin * np.float32(m0)
        d1 = d * np.float32(sc1)
        dm1 = dmin * np.float32(m1)
        base = do + 64 * c
        for l in range(n):
            if has_high:
                v = np.int64(row[qs + 32 * c + l])
                h = np.int64(row[qh + l])
                q0 = np.float32((v & 15) | (((h >> (2 * c)) & 1) << 4))
                q1 = np.float32((v >> 4) | (((h >> (2 * c + 1)) & 1) << 4))
            else:
                q0, q1 = nibbles(row[qs + 32 * c + l])
            dst[base + l] = d0 * q0 - dm0
            dst[base + 32 + l] = d1 * q1 - dm1


@njit(inline="always", **EXACT)
def dec_q4_k(row, b, dst, do, n):
    _k4(row, b * 144, dst, do, n, False)


@njit(inline="always", **EXACT)
def dec_q5_k(row, b, dst, do, n):
    _k4(row, b * 176, dst, do, n, True)


@njit(inline="always", **EXACT)
def _crumbs(byte):
    """The four 2-bit fields of a byte (bits 0-1, 2-3, 4-5, 6-7) as exact float32s."""
    v = np.float32(byte)
    t1 = np.floor(v * np.float32(0.25))
    t2 = np.floor(t1 * np.float32(0.25))
    c3 = np.floor(t2 * np.float32(0.25))
    return v - np.float32(4.0) * t1, t1 - np.float32(4.0) * t2, t2 - np.float32(4.0) * c3, c3


@njit(inline="always", **EXACT)
def dec_q6_k(row, b, dst, do, n):
    """Q6_K (dequantize_row_q6_K): two halves of 128. In half h, with a = ql[64h + l],
    b = ql[64h + 32 + l], c = qh[32h + l] (l < 32), elements l, l+32, l+64, l+96 take their low
    4 bits from a&15, b&15, a>>4, b>>4 and their top 2 bits from c's bit pairs 0-1 ... 6-7;
    value (d*scale[e//16]) * (q - 32), one int8 scale per 16 elements."""
    o = b * 210
    sc = o + 192
    d = _half(row, o + 208)
    half = n // 2
    f16, f32 = np.float32(16.0), np.float32(32.0)
    for h in range(2):
        ql = o + 64 * h
        qh = o + 128 + 32 * h
        base = do + 128 * h
        for k in range(2):  # elements 0-15 / 16-31 of each group of 32 have their own scale
            s0 = sc + 8 * h + k
            d0 = d * np.float32(np.int8(row[s0]))
            d1 = d * np.float32(np.int8(row[s0 + 2]))
            d2 = d * np.float32(np.int8(row[s0 + 4]))
            d3 = d * np.float32(np.int8(row[s0 + 6]))
            for l in range(half * k, half * (k + 1)):
                a0, a1 = nibbles(row[ql + l])
                b0, b1 = nibbles(row[ql + 32 + l])
                c0, c1, c2, c3 = _crumbs(row[qh + l])
                dst[base + l] = d0 * (a0 + f16 * c0 - f32)
                dst[base + 32 + l] = d1 * (b0 + f16 * c1 - f32)
                dst[base + 64 + l] = d2 * (a1 + f16 * c2 - f32)
                dst[base + 96 + l] = d3 * (b1 + f16 * c3 - f32)


_KINDS = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K")  # `kind` numbers


_DECODERS = (dec_q4_0, dec_q4_1, dec_q5_0, dec_q5_1, dec_q8_0, dec_q4_k, dec_q5_k, dec_q6_k)  # by `kind`


@njit(**EXACT)
def _decode_row(kind, row, dst, bs, n):
    """Decode a whole row. ``kind`` is made a literal, so numba compiles one specialisation per
    block type, holding only that type's decoder (one compiled function that the gathers and
    products of that type all call)."""
    literally(kind)
    _decode_blocks(kind, row, dst, bs, n)


def _decode_blocks(kind, row, dst, bs, n):  # pragma: no cover - only ever compiled, see the overload
    raise NotImplementedError


@overload(_decode_blocks)
def _decode_blocks_impl(kind, row, dst, bs, n):
    """The loop over a row's blocks with the one decoder of block type ``kind`` (inlined, so its
    loops vectorise). Typing one `if kind == ...` chain of all eight decoders instead, even with
    the dead branches pruned afterwards, cost ~2.5 s of compilation per block type used."""
    if not isinstance(kind, types.IntegerLiteral):
        return None
    dec = _DECODERS[kind.literal_value]

    def impl(kind, row, dst, bs, n):
        for b in range(dst.shape[0] // bs):
            dec(row, b, dst, b * bs, n)

    return impl


@njit(inline="always", **EXACT)
def _dot(a, b):
    """float32 dot product in `fdot`'s fixed order (vector partial sums written out, not left to
    ``reassoc``); the decoded weights stay exact (they are computed elsewhere)."""
    return dot_tile((a,), (b,))[0]


@njit(inline="always", **EXACT)
def _matvec_rows(kind, raw, x, out, n, bs, r0, r1, buf):
    """Rows r0..r1 of out = x @ W.T: each weight row is decoded once into ``buf`` (L1/L2
    resident) and dotted with every x row."""
    for r in range(r0, r1):
        _decode_row(kind, raw[r], buf, bs, n)
        for t in range(x.shape[0]):
            out[t, r] = _dot(buf, x[t])


class _Kernels(NamedTuple):
    gather: Any  # (raw, ids, out, n): out[i] = row ids[i], on the calling thread
    matvec: Any  # (raw, x, out, n): out = x @ W.T, parallel over chunks of rows
    matvec_serial: Any  # the same on the calling thread, for small matrices


def make_kernels(name: str) -> _Kernels:
    """Drivers for one block type. ``kind`` is a closure constant that `_decode_row` turns into
    a literal, so each type runs its own decoder with tight loops (a run-time switch between
    decoders inside the row loop stops LLVM from vectorising them: 3x slower). The closure
    holds plain ints, which numba's disk cache can key on (a captured dispatcher pickles
    differently in every process, so kernels closing over one are never found in the cache).
    """
    kind = _KINDS.index(name)
    bs = block_info(name)[0]

    @njit(nogil=True, **EXACT)
    def gather(raw, ids, out, n):
        """Serial on purpose (lookups are a few rows), without the GIL: the BLAS tiles of a
        prefill decode their rows on several threads at once (`kernels.blas`)."""
        for i in range(ids.shape[0]):
            _decode_row(kind, raw[ids[i]], out[i], bs, n)

    @njit(parallel=True, **EXACT)
    def matvec(raw, x, out, n):
        n_rows = raw.shape[0]
        for c in prange((n_rows + ROW_CHUNK - 1) // ROW_CHUNK):
            buf = np.empty(x.shape[1], np.float32)
            _matvec_rows(kind, raw, x, out, n, bs, c * ROW_CHUNK, min(n_rows, (c + 1) * ROW_CHUNK), buf)

    @njit(**EXACT)
    def matvec_serial(raw, x, out, n):
        _matvec_rows(kind, raw, x, out, n, bs, 0, raw.shape[0], np.empty(x.shape[1], np.float32))

    return _Kernels(gather, matvec, matvec_serial)


KERNELS = {name: make_kernels(name) for name in _KINDS}


# `block_row_dot` on row ``r``, tokens ``t0 .. t0+nt-1`` (``nt`` 1..TOKEN_TILE): the intrinsic wants literal
# sizes.
_block_rows = literal_ladder(
    "_block_rows(raw, xq, xd, r, t0, nt, out, q5)", "block_row_dot(raw, xq, xd, r, t0, out, {B}, {T})",
    dict(block_row_dot=block_row_dot),
    B=either("q5", 5, 8), T=among("nt", 4, 3, 2, 1))


@njit(inline="always", **FAST)
def block_w8a16_task(raw, xq, xd, q5, r, out):  # pragma: no cover - compiled
    """Task ``r`` of `block_mvn_w8a16`: weight row ``r`` against every row of x (a compiled decode
    step runs the same tasks inside its fused products, `weights.operands`)."""
    t_all = xq.shape[0]
    for t0 in range(0, t_all, TOKEN_TILE):
        _block_rows(raw, xq, xd, r, t0, min(TOKEN_TILE, t_all - t0), out, q5)


@njit(parallel=True, **FAST)
def block_mvn_w8a16(raw, xq, xd, q5, out):  # pragma: no cover - compiled
    """Rows of x (``xq``/``xd``/``out`` ``[T, .]``: a decode step, a prompt-lookup step, a batch of
    sequences) on Q8_0 (``q5`` False) or Q5_0 blocks with int16 activations (W8A16, as gemmalite's
    own int8): exact int32 block sums with 16-bit SIMD multiply-add; a weight row is read once for
    all T rows and each of its chunks widened once per TOKEN_TILE of them (the tiles of the int8
    and int4 decode kernels), each row's result bit for bit its T=1 result."""
    for r in prange(raw.shape[0]):
        block_w8a16_task(raw, xq, xd, q5, r, out)


@njit(parallel=True, **EXACT)
def q5_0_to_q8_0(raw, out):  # pragma: no cover - compiled
    """Q5_0 rows ``raw [rows, n * 22]`` as Q8_0 rows ``out [rows, n * 34]`` (uint8 both): each block's
    float16 scale copied, value j = ``nibble | high bit j << 4`` minus 16 as an int8. Exact."""
    for r in prange(raw.shape[0]):
        for b in range(raw.shape[1] // 22):
            i, o = 22 * b, 34 * b
            out[r, o] = raw[r, i]
            out[r, o + 1] = raw[r, i + 1]
            qh = _u32(raw[r], i + 2)
            for j in range(16):
                q = raw[r, i + 6 + j]
                lo = np.int32(q & 15) | np.int32(((qh >> j) & 1) << 4)
                hi = np.int32(q >> 4) | np.int32(((qh >> (j + 16)) & 1) << 4)
                out[r, o + 2 + j] = np.uint8((lo - 16) & 255)
                out[r, o + 18 + j] = np.uint8((hi - 16) & 255)


# ---------------------------------------------------------------------------------------------
# K-quant blocks against int16 activations (W8A16), as the Q8_0 / Q5_0 decode kernel above.
# ---------------------------------------------------------------------------------------------

KQ_KINDS = {"Q4_K": 4, "Q5_K": 5, "Q6_K": 6}  # the `kind` literal of `kquant_row_dot`
_KQ_BYTES = {4: 144, 5: 176, 6: 210}  # bytes per super-block of 256 values


def _kquant_codegen(kind: int, ntok: int):
    """IR for ``out[t, r] = sum_g xd[t, g] * (scale_g * sum_i q_i * xq[t, 32g + i] - min_g * xs[t, g])``
    for row ``r`` of a Q4_K / Q5_K / Q6_K matrix (raw blocks) and tokens ``t0 .. t0 + ntok - 1``.

    Per super-block of 256 values: each sub-block's quants (Q4_K / Q5_K: 8 of 32, 4 or 5 bits, a
    6-bit scale and min each; Q6_K: 16 of 16, 6 bits minus 32, an int8 scale each) are unpacked in
    16-lane vectors and summed against the int16 activations exactly in int32 (``vpmaddwd``); a
    transposing tree (`_lane_sums`) folds the eight sub-block sums of a super-block into one vector,
    a lane each, exact integers (below 2^24, so exact in float32 too, but Q5_K's). The scales
    unpack into vectors as well (``d * sc``, ``dmin * m``: the reference dequantizer's own
    roundings), times the token's activation steps, so a super-block costs each token two FMAs
    into eight float32 lanes (Q6_K: its two halves of each 32), not one per sub-block plus the
    scalar work of its scales; the min term (exact integer activation sums ``xs``) rides in the
    same accumulator. One horizontal sum per token at the end. Each token's operations are the
    same whatever the tile, so every output is bit for bit its one-token result. ``xq`` int16
    ``[T, in]``, ``xd`` float32 and ``xs`` int32 ``[T, in // 32]``, ``out`` float32 ``[T, rows]``."""
    bs = _KQ_BYTES[kind]
    v16, f8, i32x8 = _vec(_I16, 16), _vec(_F32, 8), _vec(_I32, 8)

    def i16(v):
        return ir.Constant(v16, [v] * 16)

    def i32(vals):
        return ir.Constant(i32x8, list(vals))

    def codegen(builder, wa, xqa, xda, xsa, r, t0, oa):
        nsb = builder.udiv(wa.shape[1], _c64(bs))
        pmadd = _pmadd(builder)
        toks = _span(builder, t0, ntok)
        wrow = wa.rows(builder, [r])[0]
        xrow, drow, srow = xqa.rows(builder, toks), xda.rows(builder, toks), xsa.rows(builder, toks)
        entry, head, body, done = _open_loop(builder, "kq")
        b = builder.phi(_I64)
        b.add_incoming(_c64(0), entry)
        accs = [builder.phi(f8) for _ in range(ntok)]
        for a in accs:
            a.add_incoming(ir.Constant(f8, [0.0] * 8), entry)
        builder.cbranch(builder.icmp_signed("<", b, nsb), body, done)

        builder.position_at_end(body)
        blk = builder.gep(wrow, [builder.mul(b, _c64(bs))], inbounds=True)
        g0 = builder.mul(b, _c64(8))  # the super-block's first group of 32 activations

        def half(off):  # a float16 over eight lanes (`half_to_f32_ir`: no false dependency)
            p = builder.bitcast(builder.gep(blk, [_c64(off)], inbounds=True), _I16.as_pointer())
            return half_to_f32_ir(builder, builder.load(p, align=1), 8)

        def quants(off):  # 16 bytes as 16-bit lanes, seen as eight 32-bit ones (`_word_bits`)
            return builder.bitcast(builder.zext(_load_vec(builder, blk, _c64(off), _vec(_I8, 16)), v16), i32x8)

        def bits(w, shift, mask, to=0):
            return _word_bits(builder, w, shift, mask, to)

        def dot(q, t, g, off):  # 16 quants against token t's activations 32g + off ..
            x = _load_vec(builder, xrow[t], builder.add(builder.mul(builder.add(g0, _c64(g)), _c64(32)), _c64(off)), v16)
            return builder.call(pmadd, [q, x])

        def eight(t, arr):  # token t's eight values of the super-block's groups (xd or xs)
            p = builder.bitcast(builder.gep(arr[t], [g0], inbounds=True), _vec(arr[t].type.pointee, 8).as_pointer())
            return builder.load(p, align=1)

        new_accs = list(accs)
        if kind in (4, 5):
            d, dmin = half(0), half(2)
            s = _load_vec(builder, blk, _c64(4), _vec(_I8, 16))  # the 12 bytes of 6-bit scales and mins

            def pick(idx):  # lanes j of those bytes (16: zero) as int32
                return builder.zext(builder.shuffle_vector(s, ir.Constant(_vec(_I8, 16), [0] * 16), _lanes(idx)), i32x8)

            six, four, low = i32([6] * 8), i32([4] * 8), i32([63] * 4 + [15] * 4)
            # get_scale_min_k4 for j = 0..7: j < 4 the low 6 bits of s[j] / s[j + 4]; else a nibble of
            # s[j + 4] and the top two bits of s[j - 4] / s[j]
            sc = builder.or_(builder.and_(pick([0, 1, 2, 3, 8, 9, 10, 11]), low),
                             builder.shl(builder.lshr(pick([16] * 4 + [0, 1, 2, 3]), six), four))
            mn = builder.or_(builder.and_(builder.lshr(pick([4, 5, 6, 7, 8, 9, 10, 11]), i32([0] * 4 + [4] * 4)), low),
                             builder.shl(builder.lshr(pick([16] * 4 + [4, 5, 6, 7]), six), four))
            scale = builder.fmul(d, builder.uitofp(sc, f8), flags=_EXACT)
            mins = builder.fmul(dmin, builder.uitofp(mn, f8), flags=_EXACT)
            qs = 48 if kind == 5 else 16
            hbits = [quants(16), quants(32)] if kind == 5 else None
            isums = [[None] * 8 for _ in range(ntok)]
            for c in range(4):
                for h in range(2):
                    w = quants(qs + 32 * c + 16 * h)
                    ql, qh = bits(w, 0, 15), bits(w, 4, 15)
                    if kind == 5:  # bit j of qh[l]: bit 4 of sub-block j's value l
                        ql = builder.or_(ql, bits(hbits[h], 2 * c, 1, 4))
                        qh = builder.or_(qh, bits(hbits[h], 2 * c + 1, 1, 4))
                    ql, qh = builder.bitcast(ql, v16), builder.bitcast(qh, v16)
                    for t in range(ntok):
                        for j, q in ((2 * c, ql), (2 * c + 1, qh)):
                            p = dot(q, t, j, 16 * h)
                            isums[t][j] = p if isums[t][j] is None else builder.add(isums[t][j], p)
            for t in range(ntok):
                xd = eight(t, drow)
                total = builder.sitofp(_lane_sums(builder, isums[t])[0], f8)
                acc = _fma(builder, total, builder.fmul(scale, xd, flags=_EXACT), new_accs[t])
                xs = builder.sitofp(eight(t, srow), f8)
                new_accs[t] = _fma(builder, builder.fneg(builder.fmul(mins, xd, flags=_EXACT)), xs, acc)
        else:  # Q6_K: group g of 32 activations holds sub-blocks 2g (scale A) and 2g + 1 (scale B)
            d = half(208)
            sc = builder.sext(_load_vec(builder, blk, _c64(192), _vec(_I8, 16)), _vec(_I32, 16))
            scales = [builder.fmul(d, builder.sitofp(builder.shuffle_vector(sc, sc, _lanes(range(k, 16, 2))), f8),
                                   flags=_EXACT) for k in range(2)]
            isums = [[[None] * 8 for _ in range(2)] for _ in range(ntok)]
            for h in range(2):
                for k in range(2):
                    a, bq, cq = quants(64 * h + 16 * k), quants(64 * h + 32 + 16 * k), quants(128 + 32 * h + 16 * k)
                    qv = [builder.or_(bits(a, 0, 15), bits(cq, 0, 3, 4)), builder.or_(bits(bq, 0, 15), bits(cq, 2, 3, 4)),
                          builder.or_(bits(a, 4, 15), bits(cq, 4, 3, 4)), builder.or_(bits(bq, 4, 15), bits(cq, 6, 3, 4))]
                    for i in range(4):
                        q = builder.sub(builder.bitcast(qv[i], v16), i16(32))
                        for t in range(ntok):
                            isums[t][k][4 * h + i] = dot(q, t, 4 * h + i, 16 * k)
            for t in range(ntok):
                xd = eight(t, drow)
                acc = new_accs[t]
                for k in range(2):
                    total = builder.sitofp(_lane_sums(builder, isums[t][k])[0], f8)
                    acc = _fma(builder, total, builder.fmul(scales[k], xd, flags=_EXACT), acc)
                new_accs[t] = acc
        for t in range(ntok):
            accs[t].add_incoming(new_accs[t], body)
        b.add_incoming(builder.add(b, _c64(1)), body)
        builder.branch(head)

        builder.position_at_end(done)
        for t in range(ntok):
            at = builder.add(builder.mul(toks[t], oa.shape[1]), r)
            builder.store(_hsum(builder, accs[t]), builder.gep(oa.data, [at], inbounds=True))

    return codegen


@intrinsic
def kquant_row_dot(typingctx, raw, xq, xd, xs, r, t0, out, kind, ntok):
    """`_kquant_codegen` for row ``r``, tokens ``t0 ..``: ``kind`` 4, 5, 6 (Q4_K, Q5_K, Q6_K) and
    ``ntok`` (1-4) literals. Needs AVX2 (`common.HAVE_AVX2`)."""
    if not (_literal(kind, (4, 5, 6)) and _literal(ntok, range(1, 5))):
        return None
    inner = _kquant_codegen(kind.literal_value, ntok.literal_value)
    return types.void(raw, xq, xd, xs, r, t0, out, kind, ntok), _codegen(inner, 7)


_kq_rows = literal_ladder(
    "_kq_rows(raw, xq, xd, xs, r, t0, nt, out, kind)", "kquant_row_dot(raw, xq, xd, xs, r, t0, out, {K}, {T})",
    dict(kquant_row_dot=kquant_row_dot), K=among("kind", 4, 5, 6), T=among("nt", 4, 3, 2, 1))


@njit(inline="always", **FAST)
def kquant_w8a16_task(raw, xq, xd, xs, kind, r, out):  # pragma: no cover - compiled
    """Task ``r`` of `kquant_mvn_w8a16`: weight row ``r`` against every row of x."""
    t_all = xq.shape[0]
    for t0 in range(0, t_all, TOKEN_TILE):
        _kq_rows(raw, xq, xd, xs, r, t0, min(TOKEN_TILE, t_all - t0), out, kind)


@njit(parallel=True, **FAST)
def kquant_mvn_w8a16(raw, xq, xd, xs, kind, out):  # pragma: no cover - compiled
    """Rows of x (``xq`` / ``xd`` from `simd.int16_activation_rows` per 32 values, ``xs`` their
    integer sums per 32: `group_isums`) on Q4_K / Q5_K / Q6_K blocks (``kind`` 4 / 5 / 6): exact
    integer sub-block sums, a weight row read once for all rows, each row's result bit for bit its
    T=1 result (W8A16, as `block_mvn_w8a16`)."""
    for r in prange(raw.shape[0]):
        kquant_w8a16_task(raw, xq, xd, xs, kind, r, out)


@njit(**EXACT)
def group_isums(xq):  # pragma: no cover - compiled
    """``xs[t, g] = sum of xq[t, 32g .. 32g + 31]`` (int32, exact): the K-quants' min terms."""
    t, k = xq.shape
    xs = np.empty((t, k // 32), np.int32)
    for i in range(t):
        for g in range(k // 32):
            s = 0
            for j in range(32):
                s += np.int32(xq[i, 32 * g + j])
            xs[i, g] = s
    return xs


# ---------------------------------------------------------------------------------------------
# Prefill on VNNI: Q4_0 / Q5_0 / Q8_0 strips in block-lane order against int8 activations.
# ---------------------------------------------------------------------------------------------

LANE_OFFSET = {"Q4_0": 8, "Q5_0": 16, "Q8_0": 128}  # the blocks' values go in as value + offset, unsigned


def _unpack_blocks_codegen(kind: int, nrows: int):
    """IR of `unpack_block_lanes`: per row and block, its 32 values + offset as unsigned bytes (Q8_0:
    the int8 values xor 0x80; Q5_0: `simd.q5_0_bytes`; Q4_0: the nibbles, low ones first), stored
    as eight 32-bit words, word ``w`` of block ``b`` at lane ``b % 8`` of vector ``w`` of group ``b // 8``."""
    bpb = 2 + 4 * kind  # a block: its float16 scale, 32 values of ``kind`` bits

    def codegen(builder, ra, r0, wa):
        nblk = builder.udiv(ra.shape[1], _c64(bpb))
        src = ra.rows(builder, _span(builder, r0, nrows))
        dst = [builder.bitcast(d, _I32.as_pointer()) for d in wa.rows(builder, [_c64(i) for i in range(nrows)])]

        def block(b, _):
            at = builder.add(builder.mul(builder.lshr(b, _c64(3)), _c64(64)), builder.and_(b, _c64(7)))
            for i in range(nrows):
                blk = builder.gep(src[i], [builder.mul(b, _c64(bpb))], inbounds=True)
                if kind == 8:
                    v = builder.xor(_load_vec(builder, blk, _c64(2), _vec(_I8, 32)), ir.Constant(_vec(_I8, 32), [-128] * 32))
                elif kind == 5:
                    v = q5_0_bytes(builder, blk, 16, 0)
                else:
                    v = nibble_bytes(builder, blk, 2)
                words = builder.bitcast(v, _vec(_I32, 8))
                for w in range(8):
                    ptr = builder.gep(dst[i], [builder.add(at, _c64(8 * w))], inbounds=True)
                    builder.store(builder.extract_element(words, ir.Constant(_I32, w)), ptr)
            return []

        _loop(builder, "ggml.unpack", _c64(0), nblk, 1, [], block)

    return codegen


@intrinsic
def unpack_block_lanes(typingctx, raw, r0, wb, kind, nrows):
    """Rows ``r0 .. r0 + nrows - 1`` of a Q4_0 / Q5_0 / Q8_0 matrix (``kind`` 4 / 5 / 8) into ``wb``
    uint8 ``[4, K]`` in block-lane order (`int4s.lane_strip_tiles`), each value + LANE_OFFSET.
    ``kind`` and ``nrows`` (1-4) literals."""
    if not (_literal(kind, (4, 5, 8)) and _literal(nrows, range(1, 5))):
        return None
    inner = _unpack_blocks_codegen(kind.literal_value, nrows.literal_value)
    return types.void(raw, r0, wb, kind, nrows), _codegen(inner, 3)


# `unpack_block_lanes` with the run-time kind and row count as the literals it wants
_unpack_rows = literal_ladder(
    "_unpack_rows(raw, r, wb, kind, nrows)", "unpack_block_lanes(raw, r, wb, {K}, {N})",
    dict(unpack_block_lanes=unpack_block_lanes), K=among("kind", 4, 5, 8), N=among("nrows", 4, 1))


@njit(inline="always", **EXACT)
def _block_lane_scales(raw, r, nrows, bpb, ws):  # pragma: no cover - compiled
    """The blocks' float16 scales of rows ``r ..`` as float32 into ``ws [4, K // 256, 8]`` (block
    ``8g + b`` at ``[., g, b]``); the lanes past the last block are left as they are."""
    for i in range(nrows):
        for b in range(raw.shape[1] // bpb):
            ws[i, b >> 3, b & 7] = _half(raw[r + i], b * bpb)


@njit(parallel=True, **FAST)
def block_mm_lanes(raw, kind, xs, xc, xd, t_lo, t_hi, out):  # pragma: no cover - compiled
    """Prefill of Q4_0 / Q5_0 / Q8_0 rows (``kind`` 4 / 5 / 8) on VNNI against int8 activations per
    block of 32 (`int4s.round_i8_lanes` with the kind's LANE_OFFSET, rows padded to a multiple of
    LANE_GROUP): each task one strip of 4 weight rows unpacked in L1, then the int4 prefill's tiles
    (`int4s.lane_strip_tiles`): exact integer block sums, one conversion and FMA per 256 products."""
    n, kp = raw.shape[0], xs.shape[1]
    bpb = 2 + 4 * kind  # a block: its float16 scale, 32 values of ``kind`` bits
    for s in prange((n + 3) // 4):
        r = 4 * s
        wb = np.empty((4, kp), np.uint8)
        ws = np.zeros((4, kp // LANE_GROUP, 8), np.float32)
        if r + 4 <= n:
            _unpack_rows(raw, r, wb, kind, 4)
            _block_lane_scales(raw, r, 4, bpb, ws)
            lane_strip_tiles(wb, ws, xs, xc, xd, t_lo, t_hi, out, r, True)
        else:
            for i in range(r, n):
                _unpack_rows(raw, i, wb, kind, 1)
                _block_lane_scales(raw, i, 1, bpb, ws)
                lane_strip_tiles(wb, ws, xs, xc, xd, t_lo, t_hi, out, i, False)
