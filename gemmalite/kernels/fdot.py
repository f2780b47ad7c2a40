"""Float sums in an order written out in the IR: dot products (`dot_tile`), sums (`lane_sum`) and
float64 sums of squares (`sum_squares64`).

Why: numba compiles a parallel kernel's loop body (and any function a kernel calls) twice: once
on its own and once more inside the caller's library, linked in and optimised again with it. A
process that compiles the kernel runs the first copy; one that loads it from numba's on-disk cache
runs the second, the only one the cache holds. Under fastmath's ``reassoc`` LLVM is free to order
a float sum differently in the two copies, and it did (`attention_blocked`: 2,222 of 16,384
outputs of one call 1 ulp apart), so a text's embedding depended on whether its process had
compiled the kernels. The kernels therefore take fastmath without ``reassoc`` (`common.FAST`);
the sums that need SIMD to be fast are these intrinsics, whose order is fixed before LLVM sees
them: ``L`` partial sums (element ``c`` into lane ``c % L``) over the first ``n - n % L``
elements, the lanes added by halves (lane ``l`` + lane ``l + L/2``, down to one), plus the sum of
the tail elements taken one by one. Every optimisation of this IR gives the same bits.
``L`` is LANES (one AVX-512 register), except in a `dot_tile` of fewer than four sums, which
takes ``LANES * (4 // sums)`` (64 for one: four sums in flight, as the tiles keep; one chain of
FMAs would wait on each other). So a pair's sum is the same in every tile of three sums or more
(the kernels' tiles of 4 x 4, 4 x 3, 4 x 1, 1 x 4), and in every tile of its own size.
Products are fused into their sums where the CPU has FMA (``contract``: fixed per CPU, never a
reordering).
"""
from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from .common import _FEATURES

__all__ = ["CHUNK", "LANES", "dot_tile", "lane_sum", "sum_squares64", "weighted_rows"]

LANES = 16  # float32 lanes per sum: one AVX-512 register, two AVX2 ones
_F32, _F64, _I32, _I64 = ir.FloatType(), ir.DoubleType(), ir.IntType(32), ir.IntType(64)
# Flags of every float operation here: numba's fastmath pass adds the kernel's flags only to
# operations that have none, so these keep their own (fusion allowed, no reassociation).
_CONTRACT = ("contract",)


def _c64(v: int) -> ir.Constant:
    return ir.Constant(_I64, v)


def _halves(builder, v):
    """The lanes of ``v`` added by halves: ``v[l] + v[l + n/2]`` until one is left."""
    n = v.type.count
    while n > 1:
        n //= 2
        lo = builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(_I32, n), list(range(n))))
        hi = builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(_I32, n), list(range(n, 2 * n))))
        v = builder.fadd(lo, hi, flags=_CONTRACT)
    return builder.extract_element(v, ir.Constant(_I32, 0))


def _loop(builder, name: str, start, stop, step: int, inits: list, body) -> list:
    """``for i in range(start, stop, step)`` carrying ``inits``; ``body(i, values)`` returns the
    next values. Leaves the builder after the loop and returns the final values."""
    entry = builder.block
    head = builder.append_basic_block(f"{name}.head")
    loop = builder.append_basic_block(f"{name}.body")
    done = builder.append_basic_block(f"{name}.done")
    builder.branch(head)
    builder.position_at_end(head)
    i = builder.phi(_I64)
    i.add_incoming(start, entry)
    phis = []
    for v in inits:
        phis.append(builder.phi(v.type))
        phis[-1].add_incoming(v, entry)
    builder.cbranch(builder.icmp_signed("<", i, stop), loop, done)
    builder.position_at_end(loop)
    nxt = body(i, phis)
    i.add_incoming(builder.add(i, _c64(step)), builder.block)
    for p, v in zip(phis, nxt):
        p.add_incoming(v, builder.block)
    builder.branch(head)
    builder.position_at_end(done)
    return phis


def _arrays(context, builder, arr_type, values) -> tuple[list, ir.Value]:
    """(data pointer, element IR type) of 1-D arrays of type ``arr_type``, and the first one's length."""
    arrs = [context.make_array(arr_type)(context, builder, v) for v in values]
    ety = context.get_data_type(arr_type.dtype)
    return [(a.data, ety) for a in arrs], cgutils.unpack_tuple(builder, arrs[0].shape)[0]


def _tuple(builder, tup_type, tup) -> list:
    return [builder.extract_value(tup, i) for i in range(tup_type.count)]


def _sums(builder, rows: list, n, terms, count: int, wide: bool, width: int = LANES) -> list:
    """``count`` sums in the module's order over ``width`` lanes, of ``terms(loads) -> [addend] * count``
    (loads: one float32 value per row of ``rows``, ``(pointer, element type)``: a vector of ``width``
    in the main loop, a scalar in the tail; int8 elements converted exactly); float64 lanes if ``wide``."""
    fty = _F64 if wide else _F32

    def load(row, c, lanes):
        p, ety = row
        at = builder.gep(p, [c], inbounds=True)
        if lanes:
            v = builder.load(builder.bitcast(at, ir.VectorType(ety, width).as_pointer()), align=1)
        else:
            v = builder.load(at)
        return v if ety == _F32 else builder.sitofp(v, ir.VectorType(_F32, width) if lanes else _F32)

    def step(lanes):
        def body(c, accs):
            loads = [load(r, c, lanes) for r in rows]
            return [builder.fadd(a, t, flags=_CONTRACT) for a, t in zip(accs, terms(loads))]
        return body

    end = builder.mul(builder.sdiv(n, _c64(width)), _c64(width))
    zeros = ir.Constant(ir.VectorType(fty, width), [0.0] * width)
    lanes = _loop(builder, "fsum.lanes", _c64(0), end, width, [zeros] * count, step(True))
    heads = [_halves(builder, a) for a in lanes]
    tails = _loop(builder, "fsum.tail", end, n, 1, [ir.Constant(fty, 0.0)] * count, step(False))
    return [builder.fadd(h, t, flags=_CONTRACT) for h, t in zip(heads, tails)]


def _rows_of(t, dtypes) -> bool:
    return (isinstance(t, types.UniTuple) and isinstance(t.dtype, types.Array) and t.dtype.ndim == 1
            and t.dtype.dtype in dtypes and t.dtype.layout == "C" and 1 <= t.count <= 4)


@intrinsic
def dot_tile(typingctx, xs, ws):
    """``(x_i . w_j for i in xs for j in ws)`` of 1-D contiguous arrays, 1-4 in each tuple, all as
    long as ``xs[0]``: ``xs`` float32, ``ws`` float32 or int8 (an int8 weight row, each value
    converted exactly). The tile's products share each load of their rows; lanes per sum as the
    module says (LANES, more in tiles of fewer than three sums)."""
    if not (_rows_of(xs, (types.float32,)) and _rows_of(ws, (types.float32, types.int8))):
        return None
    nx, nw = xs.count, ws.count

    def codegen(context, builder, signature, args):
        px, n = _arrays(context, builder, xs.dtype, _tuple(builder, xs, args[0]))
        pw, _ = _arrays(context, builder, ws.dtype, _tuple(builder, ws, args[1]))
        mul = lambda a, b: builder.fmul(a, b, flags=_CONTRACT)  # noqa: E731
        terms = lambda v: [mul(v[i], v[nx + j]) for i in range(nx) for j in range(nw)]  # noqa: E731
        sums = _sums(builder, px + pw, n, terms, nx * nw, False, LANES * max(1, 4 // (nx * nw)))
        return context.make_tuple(builder, signature.return_type, sums)

    return types.UniTuple(types.float32, nx * nw)(xs, ws), codegen


def _one_row(x) -> bool:
    return isinstance(x, types.Array) and x.ndim == 1 and x.dtype == types.float32 and x.layout == "C"


@intrinsic
def lane_sum(typingctx, x):
    """``sum(x)`` of a 1-D contiguous float32 array, in float32."""
    if not _one_row(x):
        return None

    def codegen(context, builder, signature, args):
        rows, n = _arrays(context, builder, x, args)
        return _sums(builder, rows, n, lambda v: [v[0]], 1, False)[0]

    return types.float32(x), codegen


@intrinsic
def sum_squares64(typingctx, x):
    """``sum(float64(x) ** 2)`` of a 1-D contiguous float32 array (float64 lanes: RMSNorm's mean of
    squares, exact to far below float32's rounding)."""
    if not _one_row(x):
        return None

    def codegen(context, builder, signature, args):
        rows, n = _arrays(context, builder, x, args)

        def square(v):
            w = builder.fpext(v[0], ir.VectorType(_F64, LANES) if isinstance(v[0].type, ir.VectorType) else _F64)
            return [builder.fmul(w, w, flags=_CONTRACT)]

        return _sums(builder, rows, n, square, 1, True)[0]

    return types.float64(x), codegen


# accumulator tile of `weighted_rows`: 4 rows x CHUNK floats in registers (16 of AVX-512's 32 zmm,
# 8 of AVX2's 16 ymm), V loaded once per key for the 4 rows
_AVX512 = "+avx512f" in _FEATURES
_VEC = 16 if _AVX512 else 8
CHUNK = 4 * _VEC if _AVX512 else 2 * _VEC


@intrinsic
def weighted_rows(typingctx, p, r0, v, j0, kh, jlo, jhi, acc):
    """``acc[r0 + i, :] += sum_j p[r0 + i, j] * v[j0 + j, kh, :]`` for ``i < 4`` and ``j`` from
    ``jlo`` to ``jhi - 1`` (attention's probabilities times V): ``p`` float32 ``[R, KB]``, ``v``
    float32 ``[N, kv, D]``, ``acc`` float32 ``[R, D]``, all C-contiguous. Each element of ``acc``
    takes its terms one by one in key order (a product fused into its sum where the CPU has FMA),
    the same chain whatever the rows and however D is tiled: the accumulators stay in registers
    over the keys, a CHUNK of D at a time."""
    f2 = types.Array(types.float32, 2, "C")
    if not (p == f2 and acc == f2 and v == types.Array(types.float32, 3, "C")):
        return None

    def codegen(context, builder, signature, args):
        pa, r0v, va, j0v, khv, lo, hi, aa = args
        pp = context.make_array(p)(context, builder, pa)
        vv = context.make_array(v)(context, builder, va)
        ac = context.make_array(acc)(context, builder, aa)
        kb = cgutils.unpack_tuple(builder, pp.shape)[1]
        nkv, d = cgutils.unpack_tuple(builder, vv.shape)[1:]
        prow = [builder.gep(pp.data, [builder.mul(builder.add(r0v, _c64(i)), kb)], inbounds=True) for i in range(4)]
        arow = [builder.gep(ac.data, [builder.mul(builder.add(r0v, _c64(i)), d)], inbounds=True) for i in range(4)]

        def vrow(j):  # pointer to v[j0 + j, kh, 0]
            return builder.gep(vv.data, [builder.mul(builder.add(builder.mul(builder.add(j0v, j), nkv), khv), d)],
                               inbounds=True)

        def tile(width: int, nvec: int):
            """The loop over D in chunks of ``nvec`` vectors of ``width`` lanes (1: scalars), from
            where the previous one stopped; returns where it stopped."""
            def load(ptr, at):
                q = builder.gep(ptr, [at], inbounds=True)
                if width == 1:
                    return builder.load(q)
                return builder.load(builder.bitcast(q, ir.VectorType(_F32, width).as_pointer()), align=4)

            def store(val, ptr, at):
                q = builder.gep(ptr, [at], inbounds=True)
                if width > 1:
                    q = builder.bitcast(q, ir.VectorType(_F32, width).as_pointer())
                builder.store(val, q, align=4)

            def splat(x):
                if width == 1:
                    return x
                u = builder.insert_element(ir.Constant(ir.VectorType(_F32, width), ir.Undefined), x, ir.Constant(_I32, 0))
                return builder.shuffle_vector(u, u, ir.Constant(ir.VectorType(_I32, width), [0] * width))

            step = width * nvec

            def chunk(c, _):
                offs = [builder.add(c, _c64(width * u)) for u in range(nvec)]
                accs = [load(arow[i], o) for i in range(4) for o in offs]

                def key(j, accs):
                    vr = vrow(j)
                    vs = [load(vr, o) for o in offs]
                    ps = [splat(builder.load(builder.gep(prow[i], [j], inbounds=True))) for i in range(4)]
                    return [builder.fadd(accs[i * nvec + u], builder.fmul(ps[i], vs[u], flags=_CONTRACT),
                                         flags=_CONTRACT) for i in range(4) for u in range(nvec)]

                accs = _loop(builder, "wrows.key", lo, hi, 1, accs, key)
                for i in range(4):
                    for u, o in enumerate(offs):
                        store(accs[i * nvec + u], arow[i], o)
                return []

            start = tile.at
            stop = builder.add(start, builder.mul(builder.sdiv(builder.sub(d, start), _c64(step)), _c64(step)))
            _loop(builder, f"wrows.d{width}", start, stop, step, [], chunk)
            tile.at = stop

        tile.at = _c64(0)
        tile(_VEC, CHUNK // _VEC)
        tile(1, 1)
        return context.get_dummy_value()

    return types.void(p, r0, v, j0, kh, jlo, jhi, acc), codegen
