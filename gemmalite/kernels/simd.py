"""Integer SIMD dot products for numba kernels, written as LLVM IR (``numba.extending.intrinsic``).

numba types every integer operation as int64, so a plain loop of ``nibble * int16`` never
becomes the 16-bit multiply-add instructions the CPU has (``vpmaddwd``; ``vpdpwssd`` with
AVX-512 VNNI, which LLVM fuses in by itself). The intrinsics here emit them directly: they
turn int4 decode from compute-bound (float nibble unpacking, ~6 GB/s of weights per two
cores) into memory-bound (~28 GB/s from L3 on this machine), and lift int8 decode from
~21 to ~27 GB/s on E2B's matrices (half the instructions per weight of int8 -> float32 FMA).

Only x86 with AVX2 has ``llvm.x86.avx2.pmadd.wd``; ``kernels.common.HAVE_AVX2`` says whether the
host has it, and callers keep a plain-numba path for other CPUs.
"""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from .common import half_to_f32_ir

__all__ = ["int16_activation_rows", "round_int16", "int4_rows_dot", "int8_rows_dot", "int8_tile_dot",
           "block_rows_dot", "TILE_BLOCK", "TOKENS"]

_I8, _I16, _I32, _I64, _F32 = (ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64),
                               ir.FloatType())


@njit(cache=True, error_model="numpy", boundscheck=False, fastmath=True)
def round_int16(x, group, xq, xd, xs):  # pragma: no cover - compiled
    """One activation row -> int16 per group of ``group`` (scale ``xd`` = max|x| / 32767, round to
    nearest) plus the exact float32 group sums ``xs``. Rounding error <= xd / 2 per value.
    This is the activation format every dot product below takes."""
    for g in range(x.shape[0] // group):
        amax = np.float32(0.0)
        s = np.float32(0.0)
        for j in range(g * group, g * group + group):
            amax = max(amax, abs(x[j]))
            s += x[j]
        xs[g] = s
        d = amax / np.float32(32767.0)
        xd[g] = d
        inv = np.float32(1.0) / d if d > 0 else np.float32(0.0)
        for j in range(g * group, g * group + group):
            xq[j] = np.int16(np.rint(x[j] * inv))


def int16_activation_rows(x: np.ndarray, group: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Each row of ``x`` ``[T, k]`` as int16 per group (``round_int16``): values ``[T, k]``, scales
    and sums ``[T, k//group]``; the input of the decode kernels, each row rounded on its own."""
    t, k = x.shape
    xq = np.empty((t, k), dtype=np.int16)
    xd = np.empty((t, k // group), dtype=np.float32)
    xs = np.empty((t, k // group), dtype=np.float32)
    for i in range(t):
        round_int16(x[i], group, xq[i], xd[i], xs[i])
    return xq, xd, xs


def _vec(t: ir.Type, n: int) -> ir.VectorType:
    return ir.VectorType(t, n)


def _data(context, builder, ty, val):
    return context.make_array(ty)(context, builder, val).data


def _load_vec(builder, base, index, vty):
    """Load ``vty`` (unaligned) starting at element ``index`` of the array pointer ``base``."""
    p = builder.bitcast(builder.gep(base, [index], inbounds=True), vty.as_pointer())
    return builder.load(p, align=1)


def _splat(builder, x, n):
    v = builder.insert_element(ir.Constant(_vec(x.type, n), ir.Undefined), x, ir.Constant(_I32, 0))
    return builder.shuffle_vector(v, v, ir.Constant(_vec(_I32, n), [0] * n))


def _hsum(builder, v):
    """Sum of the lanes of a float vector (once per output value, so a plain chain)."""
    total = builder.extract_element(v, ir.Constant(_I32, 0))
    for lane in range(1, v.type.count):
        total = builder.fadd(total, builder.extract_element(v, ir.Constant(_I32, lane)))
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


def _rows_dot_codegen(group: int, nrows: int, fmt: str, ntok: int):
    """IR for ``out[t0 + j, r0 + i] = dot(weight row r0 + i, x row t0 + j)``, ``i < nrows``,
    ``j < ntok``, over groups of ``group`` values.

    Per group: exact int32 sums of weight * int16 activation with ``vpmaddwd``, converted once
    to float32 and scaled by ``xd[t, g]`` (int4, GGML: also by the group's float16 weight scale)
    into eight float32 lanes per (row, token), summed at the end. Each weight chunk is loaded
    (and widened) once for the ``ntok`` tokens and each x chunk once for the ``nrows`` rows; a
    (row, token) pair goes through the same operations in the same order whatever ``nrows`` and
    ``ntok`` are, so every output is bit for bit its one-row, one-token value.
    ``fmt`` "int4" (arguments ``(packed, scales, xq, xd, r0, t0, out)``), "int8" (``(q, xq, xd,
    r0, t0, out)``), or GGML rows of raw blocks of 32 values (``(raw, xq, xd, r0, t0, out)``):
    "q8_0" (float16 scale, 32 int8) or "q5_0" (float16 scale, 32 high bits, 16 bytes of low
    nibbles; value j = nibble | high bit << 4, minus 16; j and j + 16 share a byte).
    ``xq`` int16 ``[T, in]``, ``xd`` float32 ``[T, in // group]``, ``out`` float32 ``[T, rows]``.
    """
    int4 = fmt == "int4"

    def codegen(context, builder, signature, args):
        if int4:
            pty, sty, qty, dty, _, _, oty = signature.args
            wa = context.make_array(pty)(context, builder, args[0])
            sa = context.make_array(sty)(context, builder, args[1])
            ng = cgutils.unpack_tuple(builder, sa.shape)[1]
            args = [args[0], *args[2:]]
        else:
            pty, qty, dty, _, _, oty = signature.args
            wa = context.make_array(pty)(context, builder, args[0])
            ng = builder.udiv(cgutils.unpack_tuple(builder, wa.shape)[1],
                              ir.Constant(_I64, GGML_BLOCK.get(fmt, group)))
        xa = context.make_array(qty)(context, builder, args[1])
        da = context.make_array(dty)(context, builder, args[2])
        oa = context.make_array(oty)(context, builder, args[5])
        r0, t0 = args[3], args[4]
        c64 = lambda v: ir.Constant(_I64, v)  # noqa: E731
        k = cgutils.unpack_tuple(builder, xa.shape)[1]
        nxd = cgutils.unpack_tuple(builder, da.shape)[1]
        nout = cgutils.unpack_tuple(builder, oa.shape)[1]
        toks = [builder.add(t0, c64(j)) for j in range(ntok)]
        xq = [builder.gep(xa.data, [builder.mul(t, k)], inbounds=True) for t in toks]
        xd = [builder.gep(da.data, [builder.mul(t, nxd)], inbounds=True) for t in toks]
        out = [builder.gep(oa.data, [builder.mul(t, nout)], inbounds=True) for t in toks]
        row_len = cgutils.unpack_tuple(builder, wa.shape)[1]
        pmadd = _pmadd(builder)
        rows = [builder.add(r0, c64(i)) for i in range(nrows)]
        wrow = [builder.gep(wa.data, [builder.mul(r, row_len)], inbounds=True) for r in rows]
        if int4:
            srow = [builder.gep(sa.data, [builder.mul(r, ng)], inbounds=True) for r in rows]
        entry, head, body, done = _open_loop(builder, "rowsdot")
        g = builder.phi(_I64)
        g.add_incoming(c64(0), entry)
        accs = {}
        for i in range(nrows):
            for j in range(ntok):
                accs[i, j] = builder.phi(_vec(_F32, 8))
                accs[i, j].add_incoming(ir.Constant(_vec(_F32, 8), [0.0] * 8), entry)
        builder.cbranch(builder.icmp_signed("<", g, ng), body, done)

        builder.position_at_end(body)
        xbase = builder.mul(g, c64(group))
        xs = [[_load_vec(builder, xq[j], builder.add(xbase, c64(16 * c)), _vec(_I16, 16))
               for c in range(group // 16)] for j in range(ntok)]
        xdg = [builder.load(builder.gep(xd[j], [g], inbounds=True)) for j in range(ntok)]

        def sums(chunks):
            """Per token: the int32 lane sums of the weight chunks (int16 vectors, one per x chunk)."""
            out_ = []
            for j in range(ntok):
                isum = None
                for c, w in enumerate(chunks):
                    s = builder.call(pmadd, [w, xs[j][c]])
                    isum = s if isum is None else builder.add(isum, s)
                out_.append(isum)
            return out_

        def int8_chunks(ptr, start):
            return [builder.sext(_load_vec(builder, ptr, builder.add(start, c64(16 * c)), _vec(_I8, 16)),
                                 _vec(_I16, 16)) for c in range(group // 16)]

        for i in range(nrows):
            wscale = None
            if int4:  # byte j of a group: value j (low nibble) and value j + group/2 (high)
                lo, hi = [], []
                for c in range(group // 32):
                    b = _load_vec(builder, wrow[i], builder.add(builder.mul(g, c64(group // 2)), c64(16 * c)),
                                  _vec(_I8, 16))
                    w = builder.zext(b, _vec(_I16, 16))
                    lo.append(builder.and_(w, ir.Constant(_vec(_I16, 16), [15] * 16)))
                    hi.append(builder.lshr(w, ir.Constant(_vec(_I16, 16), [4] * 16)))
                # the sum order of the one-token kernel: (lo c0 + hi c0) + (lo c1 + hi c1) ...
                isums = []
                for j in range(ntok):
                    isum = None
                    for c in range(group // 32):
                        s = builder.add(builder.call(pmadd, [lo[c], xs[j][c]]),
                                        builder.call(pmadd, [hi[c], xs[j][c + group // 32]]))
                        isum = s if isum is None else builder.add(isum, s)
                    isums.append(isum)
                wscale = half_to_f32_ir(builder, builder.load(builder.gep(srow[i], [g], inbounds=True)))
            elif fmt == "int8":
                isums = sums(int8_chunks(wrow[i], xbase))
            else:  # GGML block: float16 scale first
                blk = builder.gep(wrow[i], [builder.mul(g, c64(GGML_BLOCK[fmt]))], inbounds=True)
                half = builder.load(builder.bitcast(blk, _I16.as_pointer()), align=1)
                wscale = half_to_f32_ir(builder, half)
                if fmt == "q8_0":
                    isums = sums(int8_chunks(blk, c64(2)))
                else:
                    qh = builder.load(builder.bitcast(builder.gep(blk, [c64(2)], inbounds=True),
                                                      _I32.as_pointer()), align=1)
                    qh = _splat(builder, qh, 16)
                    w = builder.zext(_load_vec(builder, blk, c64(6), _vec(_I8, 16)), _vec(_I16, 16))
                    nib = (builder.and_(w, ir.Constant(_vec(_I16, 16), [15] * 16)),
                           builder.lshr(w, ir.Constant(_vec(_I16, 16), [4] * 16)))
                    chunks = []
                    for c in range(2):
                        bit = builder.and_(builder.lshr(qh, ir.Constant(_vec(_I32, 16), list(range(16 * c, 16 * c + 16)))),
                                           ir.Constant(_vec(_I32, 16), [1] * 16))
                        hi = builder.shl(builder.trunc(bit, _vec(_I16, 16)), ir.Constant(_vec(_I16, 16), [4] * 16))
                        chunks.append(builder.sub(builder.or_(nib[c], hi), ir.Constant(_vec(_I16, 16), [16] * 16)))
                    isums = sums(chunks)
            for j in range(ntok):
                d = xdg[j] if wscale is None else builder.fmul(wscale, xdg[j])
                accs[i, j].add_incoming(
                    builder.fadd(accs[i, j], builder.fmul(builder.sitofp(isums[j], _vec(_F32, 8)), _splat(builder, d, 8))),
                    body)
        g.add_incoming(builder.add(g, c64(1)), body)
        builder.branch(head)

        builder.position_at_end(done)
        for (i, j), acc in accs.items():
            builder.store(_hsum(builder, acc), builder.gep(out[j], [rows[i]], inbounds=True))
        return context.get_dummy_value()

    return codegen


TILE_BLOCK = 256  # activation values per int16 scale in the matrix-matrix (prefill) kernel


def _tile_dot_codegen(rt: int, tt: int):
    """IR for an ``rt`` rows x ``tt`` tokens tile of ``out = x @ q.T`` (before the row scale).

    Per block of TILE_BLOCK values: ``rt * tt`` exact int32 sums with ``vpmaddwd`` (16 products
    each; <= 16 * 2 * 127 * 32767 per lane, no overflow), converted once to float32 and scaled
    by the token's block scale into eight float32 lanes; one horizontal sum per (row, token) at
    the end. Each weight chunk is loaded once for the tile's ``tt`` tokens and each activation
    chunk once for its ``rt`` rows: ``rt * tt`` multiply-adds per ``rt + tt`` loads, which is
    what lets this beat a float32 BLAS product on dequantized weights (16-bit multiply-add
    does twice the work of a float32 FMA per instruction with VNNI).
    Arguments ``(q [n, k] int8, xq [T, k] int16, xd [T, k // TILE_BLOCK] float32, r0, t0,
    out [T, n] float32)``; the tile's outputs are stored, not accumulated.
    """
    def codegen(context, builder, signature, args):
        qty, xqty, xdty, _, _, oty = signature.args
        qa = context.make_array(qty)(context, builder, args[0])
        xa = context.make_array(xqty)(context, builder, args[1])
        da = context.make_array(xdty)(context, builder, args[2])
        oa = context.make_array(oty)(context, builder, args[5])
        r0, t0 = args[3], args[4]
        n, k = cgutils.unpack_tuple(builder, qa.shape)
        nkb = cgutils.unpack_tuple(builder, da.shape)[1]
        c64 = lambda v: ir.Constant(_I64, v)  # noqa: E731
        pmadd = _pmadd(builder)
        rows = [builder.add(r0, c64(i)) for i in range(rt)]
        toks = [builder.add(t0, c64(j)) for j in range(tt)]
        wrow = [builder.gep(qa.data, [builder.mul(r, k)], inbounds=True) for r in rows]
        xrow = [builder.gep(xa.data, [builder.mul(t, k)], inbounds=True) for t in toks]
        drow = [builder.gep(da.data, [builder.mul(t, nkb)], inbounds=True) for t in toks]
        entry, head, body, done = _open_loop(builder, "tile")
        kb = builder.phi(_I64)
        kb.add_incoming(c64(0), entry)
        facc = {}
        for i in range(rt):
            for j in range(tt):
                facc[i, j] = builder.phi(_vec(_F32, 8))
                facc[i, j].add_incoming(ir.Constant(_vec(_F32, 8), [0.0] * 8), entry)
        builder.cbranch(builder.icmp_signed("<", kb, nkb), body, done)

        builder.position_at_end(body)
        base = builder.mul(kb, c64(TILE_BLOCK))
        acc = {}
        for c in range(TILE_BLOCK // 16):
            off = builder.add(base, c64(16 * c))
            ws = [builder.sext(_load_vec(builder, w, off, _vec(_I8, 16)), _vec(_I16, 16)) for w in wrow]
            xs = [_load_vec(builder, x, off, _vec(_I16, 16)) for x in xrow]
            for i in range(rt):
                for j in range(tt):
                    s = builder.call(pmadd, [ws[i], xs[j]])
                    acc[i, j] = s if c == 0 else builder.add(acc[i, j], s)
        for j in range(tt):
            d = _splat(builder, builder.load(builder.gep(drow[j], [kb], inbounds=True)), 8)
            for i in range(rt):
                facc[i, j].add_incoming(
                    builder.fadd(facc[i, j], builder.fmul(builder.sitofp(acc[i, j], _vec(_F32, 8)), d)), body)
        kb.add_incoming(builder.add(kb, c64(1)), body)
        builder.branch(head)

        builder.position_at_end(done)
        for (i, j), lanes in facc.items():
            builder.store(_hsum(builder, lanes),
                          builder.gep(oa.data, [builder.add(builder.mul(toks[j], n), rows[i])], inbounds=True))
        return context.get_dummy_value()

    return codegen


def _literal(t, allowed) -> bool:
    return isinstance(t, types.IntegerLiteral) and t.literal_value in allowed


def _first_args(inner, n: int):
    """Codegen that hands ``inner`` only the first ``n`` arguments (the rest are literals)."""
    def codegen(context, builder, signature, args):
        return inner(context, builder, types.void(*signature.args[:n]), args[:n])

    return codegen


TOKENS = (4, 2, 1)  # activation rows per call of the few-row intrinsics (``ntok`` literals)


@intrinsic
def int4_rows_dot(typingctx, packed, scales, xq, xd, r0, t0, out, group, nrows, ntok):
    """``out[t, r] = sum_g f16(scales[r, g]) * xd[t, g] * sum_i n[r, g, i] * xq[t, g*G + i]`` for the
    ``nrows`` rows ``r0 ..`` of an int4 matrix and the ``ntok`` activation rows ``t0 ..`` (no
    ``mins`` term).

    ``packed`` uint8 ``[out, in//2]`` (gemmalite.weights.quant nibble order), ``scales`` uint16 float16
    bits ``[out, in//G]``, ``xq`` int16 ``[T, in]``, ``xd`` float32 ``[T, in//G]``, ``out`` float32
    ``[T, out]``; all C-contiguous. ``group`` (32 or 64), ``nrows`` and ``ntok`` must be
    compile-time literals (the unrolling depends on them). A group's products are summed exactly
    in int32 (15 * 32767 * 64 < 2**31), then scaled in float32.
    """
    if not (_literal(group, (32, 64)) and _literal(nrows, range(1, 9)) and _literal(ntok, TOKENS)):
        return None
    inner = _rows_dot_codegen(group.literal_value, nrows.literal_value, "int4", ntok.literal_value)
    return types.void(packed, scales, xq, xd, r0, t0, out, group, nrows, ntok), _first_args(inner, 7)


@intrinsic
def int8_rows_dot(typingctx, q, xq, xd, r0, t0, out, nrows, ntok):
    """``out[t, r] = sum_g xd[t, g] * sum_i q[r, 32g + i] * xq[t, 32g + i]`` for rows ``r0 ..
    r0 + nrows - 1`` of an int8 matrix ``q [out, in]`` (in a multiple of 32; the caller applies
    the row scale) and activation rows ``t0 .. t0 + ntok - 1``. ``xq`` int16 ``[T, in]``, ``xd``
    float32 ``[T, in//32]``, ``out`` ``[T, out]``; ``nrows``, ``ntok`` literals. A group's
    products are summed exactly in int32 (127 * 32767 * 32 < 2**31)."""
    if not (_literal(nrows, range(1, 9)) and _literal(ntok, TOKENS)):
        return None
    inner = _rows_dot_codegen(32, nrows.literal_value, "int8", ntok.literal_value)
    return types.void(q, xq, xd, r0, t0, out, nrows, ntok), _first_args(inner, 6)


@intrinsic
def int8_tile_dot(typingctx, q, xq, xd, r0, t0, out, rt, tt):
    """``out[t, r] = sum_b xd[t, b] * sum_i q[r, bB + i] * xq[t, bB + i]`` (B = TILE_BLOCK) for
    rows ``r0 .. r0 + rt - 1`` and tokens ``t0 .. t0 + tt - 1``; ``rt``, ``tt`` literals (1-4).
    All arrays C-contiguous, ``k`` a multiple of TILE_BLOCK."""
    if not (_literal(rt, range(1, 5)) and _literal(tt, range(1, 5))):
        return None
    inner = _tile_dot_codegen(rt.literal_value, tt.literal_value)
    return types.void(q, xq, xd, r0, t0, out, rt, tt), _first_args(inner, 6)


@intrinsic
def block_rows_dot(typingctx, raw, xq, xd, r0, t0, out, bits, ntok):
    """``out[t, r0] = sum_g f16(d[r0, g]) * xd[t, g] * sum_i w[r0, g, i] * xq[t, 32g + i]`` for row
    ``r0`` of a GGML matrix stored as raw blocks of 32 values (``raw`` uint8 ``[rows, in // 32 *
    block]``) and activation rows ``t0 .. t0 + ntok - 1``: ``bits`` 8 for Q8_0, 5 for Q5_0 (a
    literal). ``xq`` int16 ``[T, in]``, ``xd`` float32 ``[T, in // 32]``, ``out`` ``[T, rows]``."""
    if not (_literal(bits, (5, 8)) and _literal(ntok, TOKENS)):
        return None
    inner = _rows_dot_codegen(32, 1, "q8_0" if bits.literal_value == 8 else "q5_0", ntok.literal_value)
    return types.void(raw, xq, xd, r0, t0, out, bits, ntok), _first_args(inner, 6)
