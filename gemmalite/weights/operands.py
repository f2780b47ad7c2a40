"""Weight matrices as numba values: the decode products, one compiled call each.

`Matrix.operand` gives each matrix as a small named tuple of its arrays and the choices its
decode kernel takes (a class per kernel family), holding the address of its own `run_product`
(``addr`` / ``sig``, as a `kernels.calls.Kernel`). `run_product(op, x)` runs exactly what `Matrix.matmul_each` runs (each row of
``x`` computed as alone: a decode step's rounding; the weights read once for all rows); it is what
`Matrix.matmul_each`, the few-row `Matrix.matmul` and a compiled decode step (by address:
`models.gemma.compiled`) all call, so each product is one piece of machine code for all of them.

`run_products2` / `run_products3` do the products of one input (q/k/v, gate/up) in one parallel
region where they are small (`FUSE_MAX_BYTES`) and every operand's kernel is built of tasks
(`TASKED`: the integer-SIMD decode kernels; each task the same inlined function the kernel's own
loop calls, exact integer sums scaled by explicit float operations, so every output is the bits
of the separate product); `products_each` is that from Python.

Every kernel gets the argument types a call from Python gives it (no literal constants: numba
would compile another specialisation).
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np
from numba import njit, prange, typeof
from numba.extending import overload

from ..kernels import common
from ..kernels.calls import F32_2D, Kernel, kernel
from ..kernels.ggml import (_KINDS, KERNELS, W, block_mvn_w8a16, block_w8a16_task, group_isums, kquant_mvn_w8a16,
                            kquant_w8a16_task)
from ..kernels.half import ROWS as HALF_ROWS
from ..kernels.half import KIND_BF16, KIND_F16, half_matmul
from ..kernels.int4s import ROW_BLOCK, activation_pairs, i4s_mvn_w4a8, i4s_task
from ..kernels.numba_ops import f32_matmul_small
from ..kernels.quant import group_sums, i4_mv1, i4_mvn_w4a16, i8_mv1, i8_mvn_w8a16, i8_w8a16_task
from ..kernels.simd import int16_activation_rows

FEW = common.FEW_ROWS
FOUR_ROW_TILES = 8  # from this many activation rows on, the integer decode kernels take tiles of 4 weight rows
# (the 16-bit multiply-adds bound the step, not the weight stream). Measured on E2B, decode_batch step ms with
# 4-row tiles from 2 rows on / from 4 / never: B=2 152/102/105, B=4 167/175/145, B=8 285/287/297.


class F32Op(NamedTuple):
    """float32 weights: `f32_matmul_small` on FEW_ROWS rows at a time."""

    w: np.ndarray
    addr: int = 0  # run_product's Kernel for this operand (`with_kernel`): a compiled step calls it
    sig: int = 0


class HalfOp(NamedTuple):
    """bfloat16 / float16 bits used in place: `half_matmul`; ``short`` rows (at most
    `half.ONE_ROW_COLS` values) take a task per weight row for decode rows."""

    w: np.ndarray
    bf16: bool
    short: bool
    addr: int = 0  # run_product's Kernel for this operand (`with_kernel`): a compiled step calls it
    sig: int = 0


class Int8Op(NamedTuple):
    """int8, int16 activations per ``group`` (TILE_BLOCK or 32): `i8_mvn_w8a16`; ``long`` rows
    (`quant.LONG_ROW_SIMD`) take tiles of 4 weight rows."""

    q: np.ndarray
    scale: np.ndarray
    group: int
    long: bool
    addr: int = 0  # run_product's Kernel for this operand (`with_kernel`): a compiled step calls it
    sig: int = 0


class Int8RowsOp(NamedTuple):
    """int8 without AVX2: the portable float kernel (`i8_mv1`) on each row."""

    q: np.ndarray
    scale: np.ndarray
    addr: int = 0  # run_product's Kernel for this operand (`with_kernel`): a compiled step calls it
    sig: int = 0


class Int4sOp(NamedTuple):
    """Symmetric int4 against int8 activations: `i4s_mvn_w4a8` (``vnni``: 8-bit dot products)."""

    packed: np.ndarray
    scales: np.ndarray
    vnni: bool
    addr: int = 0  # run_product's Kernel for this operand (`with_kernel`): a compiled step calls it
    sig: int = 0


class Int4aOp(NamedTuple):
    """Asymmetric int4 against int16 activations per group: `i4_mvn_w4a16`."""

    packed: np.ndarray
    scales: np.ndarray
    mins: np.ndarray
    group: int
    long: bool
    addr: int = 0  # run_product's Kernel for this operand (`with_kernel`): a compiled step calls it
    sig: int = 0


class Int4RowsOp(NamedTuple):
    """int4 without AVX2: the portable float kernel on each row."""

    packed: np.ndarray
    scales: np.ndarray
    mins: np.ndarray
    group: int
    sym: bool
    addr: int = 0  # run_product's Kernel for this operand (`with_kernel`): a compiled step calls it
    sig: int = 0


class BlockOp(NamedTuple):
    """GGML Q8_0 / Q5_0 (``q5``) blocks against int16 activations per 32: `block_mvn_w8a16`."""

    raw: np.ndarray
    q5: bool
    addr: int = 0  # run_product's Kernel for this operand (`with_kernel`): a compiled step calls it
    sig: int = 0


class KQuantOp(NamedTuple):
    """GGML Q4_K / Q5_K / Q6_K blocks (``kind`` 4 / 5 / 6) against int16 activations per 32:
    `kquant_mvn_w8a16`."""

    raw: np.ndarray
    kind: int
    addr: int = 0
    sig: int = 0


def _ggml_op(kind: str) -> type:
    """The operand class of GGML block type ``kind`` (decoded row by row, `ggml.make_kernels`):
    a class per type, so that typing picks that type's kernels; ``big``: parallel over rows."""
    cls = NamedTuple(f"GGML_{kind}", [("raw", np.ndarray), ("big", bool), ("addr", int), ("sig", int)])
    cls.__new__.__defaults__ = (0, 0)
    cls.__module__ = __name__
    cls.__doc__ = f"GGML {kind} blocks decoded a row at a time: `ggml.KERNELS[{kind!r}]`."
    return cls


GGML_OPS = {kind: _ggml_op(kind) for kind in _KINDS}
globals().update({cls.__name__: cls for cls in GGML_OPS.values()})  # importable by name (numba's cache pickles types)
_GGML_KERNELS = {cls: KERNELS[kind] for kind, cls in GGML_OPS.items()}

TASKED = (Int8Op, Int4sOp, BlockOp, KQuantOp)  # decode kernels made of tasks (`products` fuses them)


def _class(op) -> type | None:
    return getattr(op, "instance_class", None)


def product(op, x):  # pragma: no cover - replaced by the overload in compiled code
    """``x @ W.T`` with each row of ``x`` computed as alone, inside numba code."""
    raise NotImplementedError


@overload(product)
def _product(op, x):
    c = _class(op)
    if c is F32Op:
        def f32(op, x):
            t = x.shape[0]
            out = np.empty((t, op.w.shape[0]), np.float32)
            for t0 in range(0, t, FEW):
                f32_matmul_small(x[t0 : t0 + FEW], op.w, out[t0 : t0 + FEW])
            return out
        return f32
    if c is HalfOp:
        def half(op, x):
            t = x.shape[0]
            out = np.empty((t, op.w.shape[0]), np.float32)
            half_matmul(x, op.w, KIND_BF16 if op.bf16 else KIND_F16, 1 if t <= FEW and op.short else HALF_ROWS, out)
            return out
        return half
    if c is Int8Op:
        def int8(op, x):
            t = x.shape[0]
            xq, xd = int16_activation_rows(x, op.group)
            out = np.empty((t, op.q.shape[0]), np.float32)
            i8_mvn_w8a16(op.q, op.scale, xq, xd, 4 if t >= FOUR_ROW_TILES or op.long else 1, out)
            return out
        return int8
    if c is Int8RowsOp:
        def int8_rows(op, x):
            out = np.empty((x.shape[0], op.q.shape[0]), np.float32)
            for t in range(x.shape[0]):
                i8_mv1(op.q, op.scale, x[t : t + 1], out[t : t + 1])
            return out
        return int8_rows
    if c is Int4sOp:
        def int4s(op, x):
            xq, xc, xd = activation_pairs(x)
            out = np.empty((x.shape[0], op.packed.shape[0]), np.float32)
            i4s_mvn_w4a8(op.packed, op.scales, xq, xc, xd, 4 if x.shape[0] >= FOUR_ROW_TILES else 1, op.vnni, out)
            return out
        return int4s
    if c is Int4aOp:
        def int4a(op, x):
            t = x.shape[0]
            xq, xd = int16_activation_rows(x, op.group)
            xs = np.empty((t, x.shape[1] // op.group), np.float32)
            group_sums(x, op.group, xs)
            out = np.empty((t, op.packed.shape[0]), np.float32)
            i4_mvn_w4a16(op.packed, op.scales, op.mins, xq, xd, xs, op.group,
                         4 if t >= FOUR_ROW_TILES or op.long else 1, out)
            return out
        return int4a
    if c is Int4RowsOp:
        def int4_rows(op, x):
            k = x.shape[1]
            out = np.empty((x.shape[0], op.packed.shape[0]), np.float32)
            for t in range(x.shape[0]):
                xs = np.empty((1, k // op.group), np.float32)
                group_sums(x[t : t + 1], op.group, xs)
                i4_mv1(op.packed, op.scales, op.mins, x[t : t + 1], xs, op.group, out[t : t + 1], op.sym)
            return out
        return int4_rows
    if c is BlockOp:
        def block(op, x):
            xq, xd = int16_activation_rows(x, np.int64(32))
            out = np.empty((x.shape[0], op.raw.shape[0]), np.float32)
            block_mvn_w8a16(op.raw, xq, xd, op.q5, out)
            return out
        return block
    if c is KQuantOp:
        def kquant(op, x):
            xq, xd = int16_activation_rows(x, np.int64(32))
            out = np.empty((x.shape[0], op.raw.shape[0]), np.float32)
            kquant_mvn_w8a16(op.raw, xq, xd, group_isums(xq), op.kind, out)
            return out
        return kquant
    if c in _GGML_KERNELS:
        matvec, matvec_serial = _GGML_KERNELS[c].matvec, _GGML_KERNELS[c].matvec_serial

        def ggml(op, x):
            t = x.shape[0]
            out = np.empty((t, op.raw.shape[0]), np.float32)
            for t0 in range(0, t, FEW):
                if op.big:
                    matvec(op.raw, x[t0 : t0 + FEW], out[t0 : t0 + FEW], np.int64(W))
                else:
                    matvec_serial(op.raw, x[t0 : t0 + FEW], out[t0 : t0 + FEW], np.int64(W))
            return out
        return ggml
    return None


def _prepare(op, x):  # pragma: no cover - replaced by the overload
    raise NotImplementedError


def _tasks(op, p):  # pragma: no cover - replaced by the overload
    raise NotImplementedError


def _task(op, p, b, out):  # pragma: no cover - replaced by the overload
    raise NotImplementedError


@overload(_prepare)
def _prepare_impl(op, x):
    """A TASKED operand's activations (rounded as its kernel takes them) and tile height."""
    c = _class(op)
    if c is Int8Op:
        def int8(op, x):
            xq, xd = int16_activation_rows(x, op.group)
            return xq, xd, 4 if x.shape[0] >= FOUR_ROW_TILES or op.long else 1
        return int8
    if c is Int4sOp:
        def int4s(op, x):
            xq, xc, xd = activation_pairs(x)
            return xq, xc, xd, 4 if x.shape[0] >= FOUR_ROW_TILES else 1
        return int4s
    if c is BlockOp:
        def block(op, x):
            xq, xd = int16_activation_rows(x, np.int64(32))
            return xq, xd
        return block
    if c is KQuantOp:
        def kquant(op, x):
            xq, xd = int16_activation_rows(x, np.int64(32))
            return xq, xd, group_isums(xq)
        return kquant
    return None


@overload(_tasks)
def _tasks_impl(op, p):
    c = _class(op)
    if c is Int8Op:
        return lambda op, p: (op.q.shape[0] + p[2] - 1) // p[2]
    if c is Int4sOp:
        return lambda op, p: (op.packed.shape[0] + ROW_BLOCK - 1) // ROW_BLOCK
    if c in (BlockOp, KQuantOp):
        return lambda op, p: op.raw.shape[0]
    return None


@overload(_task, inline="always")
def _task_impl(op, p, b, out):
    """Task ``b``: the same inlined function the operand's own kernel calls for its task ``b``."""
    c = _class(op)
    if c is Int8Op:
        return lambda op, p, b, out: i8_w8a16_task(op.q, op.scale, p[0], p[1], p[2], b, out)
    if c is Int4sOp:
        return lambda op, p, b, out: i4s_task(op.packed, op.scales, p[0], p[1], p[2], p[3], op.vnni, b, out)
    if c is BlockOp:
        return lambda op, p, b, out: block_w8a16_task(op.raw, p[0], p[1], op.q5, b, out)
    if c is KQuantOp:
        return lambda op, p, b, out: kquant_w8a16_task(op.raw, p[0], p[1], p[2], op.kind, b, out)
    return None


# the kernels' own options (`common.FAST`: the tasks are inlined, so they compile under these flags
# exactly as inside the uncompiled step's kernels; no ``reassoc``, so the bits are the same in any process)
_TASKS = dict(common.FAST)


@njit(**_TASKS)
def _task_range(op, p, lo, hi, out):  # pragma: no cover - compiled
    """Tasks ``lo .. hi - 1`` of a TASKED operand: one compiled function per operand class, which
    every fused region calls (not inlined into each: a region of three int4 products compiled 3x
    the code, and as slowly)."""
    for b in range(lo, hi):
        _task(op, p, b, out)


def _chunk(op, p):  # pragma: no cover - replaced by the overload
    raise NotImplementedError


@overload(_chunk)
def _chunk_impl(op, p):
    """Tasks per parallel work item: about 16 weight rows (a task is 1, 4 or ROW_BLOCK rows)."""
    c = _class(op)
    if c is Int8Op:
        return lambda op, p: 16 // p[2]
    if c is Int4sOp:
        return lambda op, p: 1
    if c in (BlockOp, KQuantOp):
        return lambda op, p: 16
    return None


@njit(**_TASKS)
def _items(op, p):  # pragma: no cover - compiled
    return (_tasks(op, p) + _chunk(op, p) - 1) // _chunk(op, p)


@njit(**_TASKS)
def _item(op, p, i, out):  # pragma: no cover - compiled
    n = _chunk(op, p)
    _task_range(op, p, i * n, min(_tasks(op, p), (i + 1) * n), out)


_REGION = dict(_TASKS, parallel=True)


@njit(**_REGION)
def _fused2(a, pa, oa, b, pb, ob):  # pragma: no cover - compiled
    na = _items(a, pa)
    for i in prange(na + _items(b, pb)):
        if i < na:
            _item(a, pa, i, oa)
        else:
            _item(b, pb, i - na, ob)


@njit(**_REGION)
def _fused3(a, pa, oa, b, pb, ob, c, pc, oc):  # pragma: no cover - compiled
    na = _items(a, pa)
    nb = na + _items(b, pb)
    for i in prange(nb + _items(c, pc)):
        if i < na:
            _item(a, pa, i, oa)
        elif i < nb:
            _item(b, pb, i - na, ob)
        else:
            _item(c, pc, i - nb, oc)


def _width(op):  # pragma: no cover - replaced by the overload
    raise NotImplementedError


@overload(_width)
def _width_impl(op):
    """A TASKED operand's output width (its weight rows)."""
    c = _class(op)
    if c is Int8Op:
        return lambda op: op.q.shape[0]
    if c is Int4sOp:
        return lambda op: op.packed.shape[0]
    if c in (BlockOp, KQuantOp):
        return lambda op: op.raw.shape[0]
    return None


@njit(cache=True, fastmath=False, error_model="python", boundscheck=False)
def run_product(op, x):  # pragma: no cover - compiled
    """`product` as one compiled call (from Python, or by address from a compiled step)."""
    return product(op, x)


@njit(cache=True, fastmath=False, error_model="python", boundscheck=False)
def run_products2(a, b, x):  # pragma: no cover - compiled
    """The products of two TASKED operands with one input, in one parallel region."""
    oa = np.empty((x.shape[0], _width(a)), np.float32)
    ob = np.empty((x.shape[0], _width(b)), np.float32)
    _fused2(a, _prepare(a, x), oa, b, _prepare(b, x), ob)
    return oa, ob


@njit(cache=True, fastmath=False, error_model="python", boundscheck=False)
def run_products3(a, b, c, x):  # pragma: no cover - compiled
    """The products of three TASKED operands with one input, in one parallel region."""
    oa = np.empty((x.shape[0], _width(a)), np.float32)
    ob = np.empty((x.shape[0], _width(b)), np.float32)
    oc = np.empty((x.shape[0], _width(c)), np.float32)
    _fused3(a, _prepare(a, x), oa, b, _prepare(b, x), ob, c, _prepare(c, x), oc)
    return oa, ob, oc


def with_kernel(op):
    """``op`` holding the `Kernel` of its own `run_product` (``addr`` / ``sig``: the entry a compiled
    step calls, ``call1(op, (op, x))``)."""
    k = kernel(run_product, (typeof(op), F32_2D))
    return op._replace(addr=k.addr, sig=k.sig)


# Fused products up to this many weight bytes in all. One region saves a fork and a join, which
# pays for small products (the real Gemma 3 270M's q / k / v, 1 MB: 47 against 56 us; its gate / up,
# 2.8 MB: 100 against 108); E2B's gate / up (17-30 MB) ran 2-4 % slower fused than one after the
# other (two AVX2 threads, weights from memory, alternating in one process),
# whichever way the tasks were ordered.
FUSE_MAX_BYTES = 8 << 20


def weight_bytes(op) -> int:
    """The bytes of an operand's arrays (its weights, scales and the like)."""
    return sum(a.nbytes for a in op if isinstance(a, np.ndarray))


def fusable(ops: list) -> bool:
    """Do these operands' products of one input run as one parallel region (`products_kernel`)?
    Kernels made of tasks, FUSE_MAX_BYTES of weights at most."""
    return (len(ops) in (2, 3) and all(type(op) in TASKED for op in ops)
            and sum(weight_bytes(op) for op in ops) <= FUSE_MAX_BYTES)


def products_kernel(ops: list) -> Kernel:
    """The `Kernel` of `run_products2` / `run_products3` for these (`fusable`) operands."""
    run = run_products2 if len(ops) == 2 else run_products3
    return kernel(run, tuple(typeof(op) for op in ops) + (F32_2D,))


def products_each(ops: list, x: np.ndarray) -> list[np.ndarray]:
    """Each operand's product of ``x`` (rows as alone, `run_product`), the `fusable` ones in one
    parallel region: what the compiled step computes for q/k/v and gate/up."""
    if fusable(ops):
        return list((run_products2 if len(ops) == 2 else run_products3)(*ops, x))
    return [run_product(op, x) for op in ops]
