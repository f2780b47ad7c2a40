"""Integer SIMD dot products for numba kernels, written as LLVM IR (``numba.extending.intrinsic``).

numba types every integer operation as int64, so a plain loop of ``nibble * int16`` never
becomes the 16-bit multiply-add instructions the CPU has (``vpmaddwd``; ``vpdpwssd`` with
AVX-512 VNNI, which LLVM fuses in by itself). The intrinsic here emits them directly: it is
what turns int4 decode from compute-bound (float nibble unpacking, ~6 GB/s of weights per
two cores) into memory-bound (~28 GB/s from L3 on this machine).

Only x86 with AVX2 has ``llvm.x86.avx2.pmadd.wd``; :data:`HAVE_AVX2` says whether the host has
it, and callers keep a plain-numba path for other CPUs.
"""
from __future__ import annotations

from llvmlite import binding as llvm
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

__all__ = ["HAVE_AVX2", "int4_rows_dot"]

HAVE_AVX2 = "+avx2" in llvm.get_host_cpu_features().flatten().split(",")

_I8, _I16, _I32, _I64, _F32 = (ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64),
                               ir.FloatType())


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


def _int4_rows_dot_codegen(group: int, nrows: int):
    """IR for ``out[r0 + i] = dot(row r0 + i)``, i < nrows: the rows share each load of x
    (with rows of 6144+ values, x no longer sits in L1 and re-reading it per row costs
    bandwidth; several rows also keep more memory streams in flight)."""
    chunks = group // 32  # 16-byte chunks per half-group

    def codegen(context, builder, signature, args):
        pty, sty, qty, dty, _, oty = signature.args
        pa = context.make_array(pty)(context, builder, args[0])
        sa = context.make_array(sty)(context, builder, args[1])
        xq = _data(context, builder, qty, args[2])
        xd = _data(context, builder, dty, args[3])
        r0 = args[4]
        out = _data(context, builder, oty, args[5])
        row_bytes = cgutils.unpack_tuple(builder, pa.shape)[1]
        ng = cgutils.unpack_tuple(builder, sa.shape)[1]
        pmadd = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(_vec(_I32, 8), [_vec(_I16, 16), _vec(_I16, 16)]),
            "llvm.x86.avx2.pmadd.wd")
        c64 = lambda v: ir.Constant(_I64, v)  # noqa: E731
        rows = [builder.add(r0, c64(i)) for i in range(nrows)]
        prow = [builder.gep(pa.data, [builder.mul(r, row_bytes)], inbounds=True) for r in rows]
        srow = [builder.gep(sa.data, [builder.mul(r, ng)], inbounds=True) for r in rows]
        entry = builder.block
        head = builder.function.append_basic_block("i4dot.head")
        body = builder.function.append_basic_block("i4dot.body")
        done = builder.function.append_basic_block("i4dot.done")
        builder.branch(head)

        builder.position_at_end(head)
        g = builder.phi(_I64)
        g.add_incoming(c64(0), entry)
        accs = []
        for _ in range(nrows):
            acc = builder.phi(_vec(_F32, 8))
            acc.add_incoming(ir.Constant(_vec(_F32, 8), [0.0] * 8), entry)
            accs.append(acc)
        builder.cbranch(builder.icmp_signed("<", g, ng), body, done)

        builder.position_at_end(body)
        xs = []
        for c in range(chunks):
            x0 = builder.add(builder.mul(g, c64(group)), c64(16 * c))
            xs.append((_load_vec(builder, xq, x0, _vec(_I16, 16)),
                       _load_vec(builder, xq, builder.add(x0, c64(group // 2)), _vec(_I16, 16))))
        xdg = builder.load(builder.gep(xd, [g], inbounds=True))
        for i in range(nrows):
            isum = None
            for c, (xa, xb) in enumerate(xs):
                b = _load_vec(builder, prow[i], builder.add(builder.mul(g, c64(group // 2)), c64(16 * c)),
                              _vec(_I8, 16))
                w = builder.zext(b, _vec(_I16, 16))
                lo = builder.and_(w, ir.Constant(_vec(_I16, 16), [15] * 16))
                hi = builder.lshr(w, ir.Constant(_vec(_I16, 16), [4] * 16))
                s = builder.add(builder.call(pmadd, [lo, xa]), builder.call(pmadd, [hi, xb]))
                isum = s if isum is None else builder.add(isum, s)
            half = builder.load(builder.gep(srow[i], [g], inbounds=True))
            d = builder.fmul(builder.fpext(builder.bitcast(half, ir.HalfType()), _F32), xdg)
            accs[i].add_incoming(
                builder.fadd(accs[i], builder.fmul(builder.sitofp(isum, _vec(_F32, 8)), _splat(builder, d, 8))),
                body)
        g.add_incoming(builder.add(g, c64(1)), body)
        builder.branch(head)

        builder.position_at_end(done)
        for r, acc in zip(rows, accs):
            total = builder.extract_element(acc, ir.Constant(_I32, 0))
            for i in range(1, 8):
                total = builder.fadd(total, builder.extract_element(acc, ir.Constant(_I32, i)))
            builder.store(total, builder.gep(out, [r], inbounds=True))
        return context.get_dummy_value()

    return codegen


@intrinsic
def int4_rows_dot(typingctx, packed, scales, xq, xd, r0, out, group, nrows):
    """``out[r] = sum_g f16(scales[r, g]) * xd[g] * sum_i n[r, g, i] * xq[g*G + i]`` for the
    ``nrows`` rows ``r0 .. r0 + nrows - 1`` of an int4 matrix (no ``mins`` term).

    ``packed`` uint8 ``[out, in//2]`` (gemmalite.quant nibble order), ``scales`` uint16 float16
    bits ``[out, in//G]``, ``xq`` int16 ``[in]``, ``xd`` float32 ``[in//G]``, ``out`` float32
    ``[out]``; all C-contiguous. ``group`` (32 or 64) and ``nrows`` must be compile-time
    literals (the unrolling depends on them). A group's products are summed exactly in int32
    (15 * 32767 * 64 < 2**31), then scaled in float32.
    """
    if not (isinstance(group, types.IntegerLiteral) and group.literal_value in (32, 64)
            and isinstance(nrows, types.IntegerLiteral) and 1 <= nrows.literal_value <= 8):
        return None
    sig = types.void(packed, scales, xq, xd, r0, out, group, nrows)
    inner = _int4_rows_dot_codegen(group.literal_value, nrows.literal_value)

    def codegen(context, builder, signature, args):
        return inner(context, builder, types.void(*signature.args[:6]), args[:6])

    return sig, codegen
