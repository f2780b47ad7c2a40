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

__all__ = ["HAVE_AVX2", "int4_row_dot"]

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


def _int4_row_dot_codegen(group: int):
    chunks = group // 32  # 16-byte chunks per half-group

    def codegen(context, builder, signature, args):
        pty, sty, qty, dty = signature.args
        packed = _data(context, builder, pty, args[0])
        scales = _data(context, builder, sty, args[1])
        xq = _data(context, builder, qty, args[2])
        xd = _data(context, builder, dty, args[3])
        ng = cgutils.unpack_tuple(builder, context.make_array(sty)(context, builder, args[1]).shape)[0]
        pmadd = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(_vec(_I32, 8), [_vec(_I16, 16), _vec(_I16, 16)]),
            "llvm.x86.avx2.pmadd.wd")
        c64 = lambda v: ir.Constant(_I64, v)  # noqa: E731
        entry = builder.block
        head = builder.function.append_basic_block("i4dot.head")
        body = builder.function.append_basic_block("i4dot.body")
        done = builder.function.append_basic_block("i4dot.done")
        builder.branch(head)

        builder.position_at_end(head)
        g = builder.phi(_I64)
        acc = builder.phi(_vec(_F32, 8))
        g.add_incoming(c64(0), entry)
        acc.add_incoming(ir.Constant(_vec(_F32, 8), [0.0] * 8), entry)
        builder.cbranch(builder.icmp_signed("<", g, ng), body, done)

        builder.position_at_end(body)
        isum = None
        for c in range(chunks):
            b = _load_vec(builder, packed, builder.add(builder.mul(g, c64(group // 2)), c64(16 * c)),
                          _vec(_I8, 16))
            w = builder.zext(b, _vec(_I16, 16))
            lo = builder.and_(w, ir.Constant(_vec(_I16, 16), [15] * 16))
            hi = builder.lshr(w, ir.Constant(_vec(_I16, 16), [4] * 16))
            x0 = builder.add(builder.mul(g, c64(group)), c64(16 * c))
            xa = _load_vec(builder, xq, x0, _vec(_I16, 16))
            xb = _load_vec(builder, xq, builder.add(x0, c64(group // 2)), _vec(_I16, 16))
            s = builder.add(builder.call(pmadd, [lo, xa]), builder.call(pmadd, [hi, xb]))
            isum = s if isum is None else builder.add(isum, s)
        half = builder.load(builder.gep(scales, [g], inbounds=True))
        d = builder.fpext(builder.bitcast(half, ir.HalfType()), _F32)
        d = builder.fmul(d, builder.load(builder.gep(xd, [g], inbounds=True)))
        dv = builder.insert_element(ir.Constant(_vec(_F32, 8), ir.Undefined), d, ir.Constant(_I32, 0))
        dv = builder.shuffle_vector(dv, dv, ir.Constant(_vec(_I32, 8), [0] * 8))
        acc_next = builder.fadd(acc, builder.fmul(builder.sitofp(isum, _vec(_F32, 8)), dv))
        g.add_incoming(builder.add(g, c64(1)), body)
        acc.add_incoming(acc_next, body)
        builder.branch(head)

        builder.position_at_end(done)
        total = builder.extract_element(acc, ir.Constant(_I32, 0))
        for i in range(1, 8):
            total = builder.fadd(total, builder.extract_element(acc, ir.Constant(_I32, i)))
        return total

    return codegen


@intrinsic
def int4_row_dot(typingctx, packed, scales, xq, xd, group):
    """``sum_g f16(scales[g]) * xd[g] * sum_i n[g, i] * xq[g*G + i]`` for one int4 row.

    ``packed`` uint8 ``[in//2]`` (gemmalite.quant nibble order), ``scales`` uint16 float16 bits
    ``[in//G]``, ``xq`` int16 ``[in]``, ``xd`` float32 ``[in//G]``; all C-contiguous. ``group``
    must be a compile-time literal (32 or 64): the unrolling depends on it. The products of a
    group are summed exactly in int32 (15 * 32767 * 64 < 2**31), then scaled in float32.
    """
    if not isinstance(group, types.IntegerLiteral) or group.literal_value not in (32, 64):
        return None
    sig = types.float32(packed, scales, xq, xd, group)
    inner = _int4_row_dot_codegen(group.literal_value)

    def codegen(context, builder, signature, args):
        return inner(context, builder, types.float32(*signature.args[:4]), args[:4])

    return sig, codegen
