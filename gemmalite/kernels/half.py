"""Products with weights read in place and widened to float32 in registers, as LLVM IR:
bfloat16 / float16 (2 bytes per weight), and GGML's Q8_0 / Q5_0 blocks in short prompts.

Two tile kernels (``numba.extending.intrinsic``), both for ``rows x tokens`` tiles of
``out = x @ w.T`` over the first ``ncols`` columns (a multiple of CHUNK; the callers add the
rest), each (row, token) summed in vector lanes and reduced once at the end:

* `half_rows_dot`: float32 activations, each weight widened to float32 in registers as it
  is loaded (bfloat16: a 16-bit shift; float16: ``vcvtph2ps``; Q8_0 / Q5_0: the integer
  value converted and multiplied by its block's float16 scale, a product float32 holds exactly,
  so the weight is the dequantized one to the bit, and a Q5_0 matrix and its Q8_0 expansion
  give the same bits), one FMA per value. Plain vector IR, no target intrinsic: it runs on every CPU
  LLVM targets. Decode (memory-bound) and the portable prefill path of half weights; GGUF
  prompts of FEW_ROWS to FUSED_MAX_T rows (`weights.ggml`).
* `bf16_dot_tile`: ``vdpbf16ps`` (AVX-512 BF16: 32 bfloat16 products summed pairwise into
  16 float32 lanes per instruction, twice a float32 FMA's work) against activations rounded
  to bfloat16 (relative error <= 2^-9 per value: the size of the weights' own rounding).
  Prefill, where the CPU has it and the user asks for it (`common.BF16_DOT`). (Activations as
  ``hi + lo`` bfloat16 pairs were as exact as float32 and no faster than `half_rows_dot`.)

Float arithmetic is as written (the ``nsz`` flags of `simd`: no reassociation, no
contraction) and each (row, token) takes the same sequence of operations whatever the tile
shape, so a row's result never depends on the rows computed with it.
"""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic, overload

from .common import EXACT, FAST, among, bf2f, either, h2f, literal_ladder
from .simd import GGML_BLOCK, _EXACT, _c64, _codegen, _fma, _hsum, _literal, _load_vec, _open_loop, _span, _splat, _vec

CHUNK = 32  # values per step of the column loop (two 16-lane float vectors; one vdpbf16ps; a Q8_0 block)
# the weights' kinds (`half_rows_dot`, `half_matmul`): half bits, GGML blocks of 32 values
KIND_F16, KIND_BF16, KIND_Q8_0, KIND_Q5_0 = 0, 1, 2, 3

_I16, _I32, _I64, _F32 = ir.IntType(16), ir.IntType(32), ir.IntType(64), ir.FloatType()


def _widen(builder, bits, bf16: bool):
    """``<16 x i16>`` half bits -> ``<16 x float>``: bfloat16 is the high half of a float32."""
    if bf16:
        wide = builder.shl(builder.zext(bits, _vec(_I32, 16)), ir.Constant(_vec(_I32, 16), [16] * 16))
        return builder.bitcast(wide, _vec(_F32, 16))
    return builder.fpext(builder.bitcast(bits, _vec(ir.HalfType(), 16)), _vec(_F32, 16))  # vcvtph2ps with F16C


def _dpbf16(builder):
    """``llvm.x86.avx512bf16.dpbf16ps.512``: acc + pairwise sums of 32 bfloat16 products into 16
    float32 lanes. Declared in its ``<16 x i32>`` operand form (LLVM 9-16), which newer LLVMs
    upgrade to their ``<32 x bfloat>`` one when they parse the module."""
    f16x, i16x = _vec(_F32, 16), _vec(_I32, 16)
    return cgutils.get_or_insert_function(builder.module, ir.FunctionType(f16x, [f16x, i16x, i16x]),
                                          "llvm.x86.avx512bf16.dpbf16ps.512")


def _ints(v: int):
    """``<16 x i32>`` of ``v``."""
    return ir.Constant(_vec(_I32, 16), [v] * 16)


def _block_widen(builder, w, c, h: int, mode: str):
    """Values ``c + 16 h .. + 15`` of a GGML row as float32, ``float32(d) * q``: exact (an 11-bit
    scale times an 8- or 5-bit integer), so the very weights the reference dequantizer gives.
    Each block of 32 starts with its float16 scale; then Q8_0: 32 int8 values; Q5_0: 4 bytes of
    fifth bits (bit ``j`` for value ``j``) and 16 bytes of nibbles (value ``j`` low, ``j + 16``
    high), values ``n - 16``. (Q4_0's nibbles the same way ran slower than its row kernel.)"""
    i32x16 = _vec(_I32, 16)
    at = builder.mul(builder.lshr(c, _c64(5)), _c64(GGML_BLOCK[mode]))
    d = builder.load(builder.bitcast(builder.gep(w, [at], inbounds=True), ir.HalfType().as_pointer()), align=1)
    if mode == "q8_0":
        q = builder.sext(_load_vec(builder, w, builder.add(at, _c64(2 + 16 * h)), _vec(ir.IntType(8), 16)), i32x16)
    else:
        qh = builder.load(builder.bitcast(builder.gep(w, [builder.add(at, _c64(2))], inbounds=True),
                                          _I32.as_pointer()), align=1)
        qs = builder.zext(_load_vec(builder, w, builder.add(at, _c64(6)), _vec(ir.IntType(8), 16)), i32x16)
        low = builder.and_(qs, _ints(15)) if h == 0 else builder.lshr(qs, _ints(4))
        fifth = builder.lshr(_splat(builder, qh, 16), ir.Constant(i32x16, list(range(16 * h, 16 * h + 16))))
        q = builder.sub(builder.or_(low, builder.shl(builder.and_(fifth, _ints(1)), _ints(4))), _ints(16))
    return builder.fmul(builder.sitofp(q, _vec(_F32, 16)), _splat(builder, builder.fpext(d, _F32), 16), flags=_EXACT)


def _tile_codegen(nrows: int, ntok: int, mode: str):
    """IR of one tile. ``mode`` "bf16" / "f16": arguments ``(w uint16 [R, C], x float32 [T, C],
    r0, t0, out float32 [T, R], ncols)``; "q8_0" / "q5_0": the same with ``w`` uint8 GGML rows; "dp":
    ``(w, xb uint16 [T, C], r0, t0, out, ncols)``. Stores ``out[t0 + j, r0 + i]``."""
    dp = mode == "dp"

    def codegen(builder, wa, xa, r0, t0, oa, ncols):
        n = wa.shape[0]
        rows, toks = _span(builder, r0, nrows), _span(builder, t0, ntok)
        wrow, xrow = wa.rows(builder, rows), xa.rows(builder, toks)
        nacc = 1 if dp else 2  # float32 mode: the two 16-lane halves of a chunk in lanes of their own
        entry, head, body, done = _open_loop(builder, "halftile")
        c = builder.phi(_I64)
        c.add_incoming(_c64(0), entry)
        accs = {}
        for key in [(i, j, h) for i in range(nrows) for j in range(ntok) for h in range(nacc)]:
            accs[key] = builder.phi(_vec(_F32, 16))
            accs[key].add_incoming(ir.Constant(_vec(_F32, 16), [0.0] * 16), entry)
        builder.cbranch(builder.icmp_signed("<", c, ncols), body, done)

        builder.position_at_end(body)
        new = {}
        if dp:
            dot = _dpbf16(builder)
            ws = [builder.bitcast(_load_vec(builder, w, c, _vec(_I16, 32)), _vec(_I32, 16)) for w in wrow]
            xs = [builder.bitcast(_load_vec(builder, x, c, _vec(_I16, 32)), _vec(_I32, 16)) for x in xrow]
            for j in range(ntok):
                for i in range(nrows):
                    new[i, j, 0] = builder.call(dot, [accs[i, j, 0], xs[j], ws[i]])
        else:
            for h in range(2):
                off = builder.add(c, _c64(16 * h))
                if mode in GGML_BLOCK:
                    ws = [_block_widen(builder, w, c, h, mode) for w in wrow]
                else:
                    ws = [_widen(builder, _load_vec(builder, w, off, _vec(_I16, 16)), mode == "bf16") for w in wrow]
                xs = [_load_vec(builder, x, off, _vec(_F32, 16)) for x in xrow]
                for j in range(ntok):
                    for i in range(nrows):
                        new[i, j, h] = _fma(builder, ws[i], xs[j], accs[i, j, h])
        for key, v in new.items():
            accs[key].add_incoming(v, body)
        c.add_incoming(builder.add(c, _c64(CHUNK)), body)
        builder.branch(head)

        builder.position_at_end(done)
        for i in range(nrows):
            for j in range(ntok):
                lanes = accs[i, j, 0] if dp else builder.fadd(accs[i, j, 0], accs[i, j, 1], flags=_EXACT)
                at = builder.add(builder.mul(toks[j], n), rows[i])
                builder.store(_hsum(builder, lanes), builder.gep(oa.data, [at], inbounds=True))

    return codegen


@intrinsic
def half_rows_dot(typingctx, w, x, r0, t0, out, ncols, kind, nrows, ntok):
    """``out[t, r] = sum_{c < ncols} x[t, c] * float32(w[r, c])`` for rows ``r0 .. r0 + nrows - 1``
    and tokens ``t0 .. t0 + ntok - 1``: ``w`` uint16 bits of float16 (``kind`` KIND_F16), bfloat16
    (KIND_BF16), or uint8 GGML Q8_0 / Q5_0 rows (KIND_Q8_0 / KIND_Q5_0), ``x`` float32, ``out``
    float32 ``[T, R]``, all C-contiguous; ``ncols`` a multiple of CHUNK; ``kind``, ``nrows`` (1-8)
    and ``ntok`` (1-8) literals."""
    kinds = (KIND_F16, KIND_BF16, KIND_Q8_0, KIND_Q5_0)
    if not (_literal(kind, kinds) and _literal(nrows, range(1, 9)) and _literal(ntok, range(1, 9))):
        return None
    mode = dict(zip(kinds, ("f16", "bf16", "q8_0", "q5_0")))[kind.literal_value]
    inner = _tile_codegen(nrows.literal_value, ntok.literal_value, mode)
    return types.void(w, x, r0, t0, out, ncols, kind, nrows, ntok), _codegen(inner, 6)


@intrinsic
def bf16_dot_tile(typingctx, w, xb, r0, t0, out, ncols, nrows, ntok):
    """``out[t, r] = sum_{c < ncols} xb[t, c] * w[r, c]`` with ``vdpbf16ps``: ``w``, ``xb`` uint16
    bfloat16 bits, ``out`` float32 ``[T, R]``, all C-contiguous; ``ncols`` a multiple of CHUNK;
    ``nrows``, ``ntok`` (1-8) literals. Needs AVX-512 BF16 (`common.HAVE_BF16`)."""
    if not (_literal(nrows, range(1, 9)) and _literal(ntok, range(1, 9))):
        return None
    inner = _tile_codegen(nrows.literal_value, ntok.literal_value, "dp")
    return types.void(w, xb, r0, t0, out, ncols, nrows, ntok), _codegen(inner, 6)


# ---------------------------------------------------------------------------- kernels

ROWS = 4  # weight rows per task: a strip against every token of a block
# Decode rows (T <= FEW_ROWS) of weight rows this short go one row per task: measured on E2B's
# matrices (A/B in one process) 29-38 GB/s against 22-24 for 4-row strips on rows of 1536-2048
# values; 4-row strips win on rows of 6144-12288 (28-30 against 22-24).
ONE_ROW_COLS = 4096
F32_TOKENS = 3  # tokens per float32 tile (4 x 3 x 2 accumulators: 24 of the 32 vector registers)
DP_TOKENS = 6  # tokens per vdpbf16ps tile (4 x 6 accumulators)
TOKEN_BLOCK = 144  # at most this many tokens per pass over the weights (their activations stay in L2)


@njit(inline="always", **EXACT)
def _block(t_all):  # pragma: no cover - compiled
    """Tokens per block: as even as TOKEN_BLOCK allows (128 tokens: one pass, not 126 + 2)."""
    nb = (t_all + TOKEN_BLOCK - 1) // TOKEN_BLOCK
    return (t_all + nb - 1) // max(nb, 1)


@njit(inline="always", **EXACT)
def _tile_len(left, full):  # pragma: no cover - compiled
    """Tokens of the next tile: ``full`` ones, but the last two tiles share what is left evenly
    (8 tokens of 6-token tiles: 4 + 4, not 6 + 2)."""
    if left <= full:
        return left
    if left % full == 0 or left > 2 * full:
        return full
    return (left + 1) // 2


@njit(**EXACT)
def _tail(x, w, t, r, c0, bf16):  # pragma: no cover - compiled
    """``sum_{c >= c0} x[t, c] * w[r, c]`` (the columns past the last CHUNK): no fastmath (stated:
    left unset, numba would take the calling kernel's), so the same roundings wherever it runs."""
    s = np.float32(0.0)
    for c in range(c0, w.shape[1]):
        s += x[t, c] * (bf2f(w[r, c]) if bf16 else h2f(w[r, c]))
    return s


# `half_rows_dot` for rows ``r ..`` (4 if ``four``, else 1) x ``nt`` (1-3) tokens: the intrinsic wants
# literal sizes. One ladder per weight dtype (`_f32_tile` picks it while typing), so that a kernel
# compiles only its own kinds' tiles.
_TILE = ("_{N}(w, x, r, t0, nt, out, ncols, kind, four)", "half_rows_dot(w, x, r, t0, out, ncols, {K}, {R}, {T})")
_SIZES = dict(R=either("four", 4, 1), T=among("nt", 3, 2, 1))
_half_tile = literal_ladder(_TILE[0].format(N="half_tile"), _TILE[1], dict(half_rows_dot=half_rows_dot),
                            K=among("kind", KIND_BF16, KIND_F16), **_SIZES)
_ggml_tile = literal_ladder(_TILE[0].format(N="ggml_tile"), _TILE[1], dict(half_rows_dot=half_rows_dot),
                            K=among("kind", KIND_Q8_0, KIND_Q5_0), **_SIZES)


def _f32_tile(w, x, r, t0, nt, out, ncols, kind, four):  # pragma: no cover - replaced by the overload
    raise NotImplementedError


@overload(_f32_tile)
def _f32_tile_impl(w, x, r, t0, nt, out, ncols, kind, four):
    """`_half_tile` for uint16 weights (half bits), `_ggml_tile` for uint8 ones (GGML rows)."""
    tile = _ggml_tile if w.dtype == types.uint8 else _half_tile
    return lambda w, x, r, t0, nt, out, ncols, kind, four: tile(w, x, r, t0, nt, out, ncols, kind, four)


@njit(parallel=True, **FAST)
def half_matmul(x, w, kind, rows, out):  # pragma: no cover - compiled
    """``out = x @ float32(w).T`` for float32 ``x [T, C]`` and ``w`` half bits ``[R, C]`` (``kind``
    KIND_BF16 or KIND_F16) or uint8 GGML rows (KIND_Q8_0 / KIND_Q5_0, C a multiple of 32): every
    token count, decode to prefill. Tiles of 4 rows x 3 tokens, a task per 4-row strip (``rows``
    4; 1: a task per row, see ONE_ROW_COLS) (its weights stay in L1 while the tokens pass),
    tokens by blocks of TOKEN_BLOCK (their activations stay in L2; the weights are read once per
    block). Each (row, token) takes the same operations whatever the tile: a row's result is bit
    for bit its one-row product."""
    R = w.shape[0]
    T, C = x.shape
    main = C - C % CHUNK
    step = _block(T)
    for tb in range(0, T, step):
        te = min(T, tb + step)
        for b in prange((R + rows - 1) // rows):
            r = b * rows
            four = rows == ROWS and r + ROWS <= R
            t0 = tb
            while t0 < te:
                nt = _tile_len(te - t0, F32_TOKENS)
                if four:
                    _f32_tile(w, x, r, t0, nt, out, main, kind, True)
                else:
                    for i in range(r, min(R, r + rows)):
                        _f32_tile(w, x, i, t0, nt, out, main, kind, False)
                t0 += nt
            if main < C:  # (half weights only: GGML rows are whole blocks of 32)
                for t in range(tb, te):
                    for i in range(r, min(R, r + rows)):
                        out[t, i] += _tail(x, w, t, i, main, kind == KIND_BF16)


@njit(inline="always", **FAST)
def _dp_tile(w, xb, r, t0, nt, out, ncols, four):  # pragma: no cover - compiled
    """`bf16_dot_tile` for rows ``r .. r + 3`` (``four``) x ``nt`` (1-6) tokens, or row ``r``."""
    if not four:
        for t in range(t0, t0 + nt):
            bf16_dot_tile(w, xb, r, t, out, ncols, 1, 1)
    elif nt == 6:
        bf16_dot_tile(w, xb, r, t0, out, ncols, 4, 6)
    elif nt == 5:
        bf16_dot_tile(w, xb, r, t0, out, ncols, 4, 5)
    elif nt == 4:
        bf16_dot_tile(w, xb, r, t0, out, ncols, 4, 4)
    elif nt == 3:
        bf16_dot_tile(w, xb, r, t0, out, ncols, 4, 3)
    elif nt == 2:
        bf16_dot_tile(w, xb, r, t0, out, ncols, 4, 2)
    else:
        bf16_dot_tile(w, xb, r, t0, out, ncols, 4, 1)


@njit(parallel=True, **FAST)
def bf16_matmul(xb, w, out):  # pragma: no cover - compiled
    """``out = x @ w.T`` with ``vdpbf16ps`` (`bf16_dot_tile`): ``x`` as bfloat16 bits ``xb``, ``w``
    bfloat16 bits; `half_matmul`'s strips and token blocks, tiles of 4 rows x 6 tokens. A row's
    result does not depend on the other rows of the call."""
    R, C = w.shape
    T = xb.shape[0]
    main = C - C % CHUNK
    step = _block(T)
    for tb in range(0, T, step):
        te = min(T, tb + step)
        for b in prange((R + ROWS - 1) // ROWS):
            r = b * ROWS
            four = r + ROWS <= R
            t0 = tb
            while t0 < te:
                nt = _tile_len(te - t0, DP_TOKENS)
                if four:
                    _dp_tile(w, xb, r, t0, nt, out, main, True)
                else:
                    for i in range(r, R):
                        _dp_tile(w, xb, i, t0, nt, out, main, False)
                t0 += nt
            if main < C:
                for t in range(tb, te):
                    for i in range(r, min(R, r + ROWS)):
                        s = np.float32(0.0)
                        for c in range(main, C):
                            s += bf2f(xb[t, c]) * bf2f(w[i, c])
                        out[t, i] += s


@njit(parallel=True, **EXACT)
def round_bf16(xbits, out):  # pragma: no cover - compiled
    """float32 values (their uint32 bits) -> bfloat16 bits, rounded to nearest even (NaN stays NaN)."""
    for t in prange(xbits.shape[0]):
        for c in range(xbits.shape[1]):
            u = np.uint32(xbits[t, c])
            if (u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000):
                out[t, c] = np.uint16((u >> np.uint32(16)) | np.uint32(0x40))
            else:
                out[t, c] = np.uint16((u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16))
