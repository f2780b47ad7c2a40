"""What the kernels share: their numba options, the host's SIMD features, the few-rows threshold,
float16 decoding and nibble unpacking. Every kernel module reads these from here (tests patch them
here)."""
from __future__ import annotations

import os
import threading

import numpy as np
from numpy.typing import DTypeLike
from llvmlite import binding as llvm
from llvmlite import ir
from numba import get_num_threads, njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from ..settings import announce_first_compile

announce_first_compile()  # one stderr line when this process first compiles a kernel (not a cache hit)

# The numba options of every kernel, all stated: numba gives a function whose options leave one
# unset its caller's (fastmath, error model, bounds checks), and the dispatcher then keeps that code
# for later direct calls, so the code of a kernel would depend on which caller compiled it first.
# EXACT: float operations as written (no fused multiply-add, no reordering).
# FAST: fastmath without ``reassoc``. numba compiles a parallel kernel's body (and any function a
# kernel calls) twice, the second time linked into the kernel and optimised again; a process that
# compiled the kernel runs the first copy, one that loaded it from the disk cache the second.
# With ``reassoc`` LLVM ordered a sum differently in the two, so results depended on whether the
# process had compiled its kernels (see `fdot`, where the sums that need SIMD are written out).
# ``contract`` (fused multiply-add) stays, but an addition in a FAST kernel takes at most one product
# (``acc + a * b``, never ``a * b + c * d``): which of two products is fused is LLVM's choice, and
# it too differed between the copies (scripts/audit_kernel_cache.py finds such cases).
EXACT = dict(cache=True, error_model="numpy", boundscheck=False, fastmath=False)
FAST = dict(EXACT, fastmath={"nnan", "ninf", "nsz", "arcp", "contract", "afn"})

# Does the host have AVX2 (the 16-bit integer multiply-add the SIMD intrinsics emit)? Without
# it, products take portable float numba kernels. Read at call time, so tests can force False.
_FEATURES = llvm.get_host_cpu_features().flatten().split(",")
HAVE_AVX2 = "+avx2" in _FEATURES


def _vnni(features: list[str]) -> bool:
    """256-bit ``vpdpbusd`` / ``vpdpwssd``: AVX-512 VNNI with VL, or AVX-VNNI."""
    return ("+avx512vnni" in features and "+avx512vl" in features) or "+avxvnni" in features


# Does the host have 8-bit dot products (``vpdpbusd`` on 256-bit vectors: AVX-512 VNNI with VL, or
# AVX-VNNI)? Then int8 prefill rounds activations to int8 and takes 32 multiply-adds per
# instruction (`simd.int8_u8_tile_dot`) instead of 16. GEMMALITE_VNNI=0 forces the portable int16
# path; like HAVE_AVX2, read at call time, so tests run both paths on one machine.
HAVE_VNNI = HAVE_AVX2 and os.environ.get("GEMMALITE_VNNI", "1") != "0" and _vnni(_FEATURES)


def target_has_vnni() -> bool:
    """Does the CPU numba compiles for (``NUMBA_CPU_FEATURES`` where set, else the host) have
    ``vpdpwssd`` / ``vpdpbusd`` on 256-bit vectors? For code generation, which must not emit an
    instruction the target lacks (the tests compile for Haswell on any host); HAVE_VNNI says
    which path a call takes."""
    from numba.core import config

    return _vnni(config.CPU_FEATURES.split(",") if config.CPU_FEATURES is not None else _FEATURES)


# Does the host have AVX-512 BF16 (``vdpbf16ps``: 32 bfloat16 products per instruction, twice a
# float32 FMA's)? GEMMALITE_BF16_DOT=1 lets prefill products of bfloat16 weights round their
# activations to bfloat16 and use it (`kernels.half.bf16_matmul`): ~2x the float32 tiles, at
# the price of an activation rounding as large as the weights' own (off by default). Read at call
# time, like HAVE_AVX2.
HAVE_BF16 = "+avx512bf16" in _FEATURES
BF16_DOT = HAVE_BF16 and os.environ.get("GEMMALITE_BF16_DOT", "0") == "1"

# Products of at most this many activation rows (decode steps) run fused numba kernels that read
# each weight once for all rows, and attention for that many query rows runs in numba: a decode
# step then makes no BLAS call, so OpenBLAS's workers never spin against numba's.
FEW_ROWS = 4

# Activation rows per weight load in the few-row decode kernels (int8, int4, GGML Q8_0/Q5_0): a tile of
# weight rows x up to this many tokens; the tail takes a smaller tile.
TOKEN_TILE = 4
# float32 products of more rows, up to this many (a short query, a short prompt), run numba
# tiles (`numba_ops.matmul_tiles`) and make no BLAS call (measured 18 rows x 512-2048: ~100
# GFLOP/s on two cores against ~40 for BLAS on half weights converted to float32 blocks).
SHORT_ROWS = 64


# Arrays the SIMD tiles stream (weights, rounded activations) start on a cache line: numpy gives
# 16 bytes, a safetensors tensor 8, and then half the tiles' 32-byte loads straddle two lines
# (measured: the int8 prefill tiles 4-14 % faster on aligned operands). The checkpoint writer
# (`formats.safetensors.write_safetensors`) lays tensors out on the same boundary.
ALIGN = 64


def compute_threads() -> int:
    """The compute threads of the calling step: numba's thread count, which
    `runtime.threads.compute` sets per step (the BLAS tiles and the full-context attention's split
    take it)."""
    return get_num_threads()


_SCRATCH = threading.local()


def scratch(n: int, dtype: DTypeLike = np.float32) -> np.ndarray:
    """``n`` values of ``dtype`` the calling thread reuses (grown on demand, one buffer per dtype):
    per thread, so two requests computing at once never share one, and reused, so a hot path pays
    no page faults on fresh memory (the prefill's BLAS tiles, each token's log-probabilities)."""
    key = np.dtype(dtype).str
    buf = getattr(_SCRATCH, key, None)
    if buf is None or buf.size < n:
        buf = np.empty(n, dtype=dtype)
        setattr(_SCRATCH, key, buf)
    return buf[:n]


def aligned_empty(shape: int | tuple[int, ...], dtype) -> np.ndarray:
    """``np.empty(shape, dtype)`` whose data starts on an ALIGN-byte boundary."""
    shape = (shape,) if isinstance(shape, (int, np.integer)) else tuple(shape)
    dtype = np.dtype(dtype)
    n = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    raw = np.empty(n + ALIGN, dtype=np.uint8)
    a = -raw.ctypes.data % ALIGN
    return raw[a:a + n].view(dtype).reshape(shape)


def half_to_f32_ir(builder: ir.IRBuilder, bits: ir.Value, lanes: int = 0) -> ir.Value:
    """float16 bits (i16) -> float32, in LLVM IR (vcvtph2ps with F16C): the one float16 decoder.

    ``lanes`` > 0: that many copies in a vector, from a word broadcast (``vpbroadcastw``, which
    writes its whole register). Kernels that scale every block by a float16 take this: the scalar
    conversion's ``vpinsrw`` merges into a register LLVM may have just freed from a loop-carried
    accumulator, a false dependency that chained each block's scale on the previous block's FMA
    (the real Gemma 3 270M's Q8_0 LM head: 13.6 GB/s instead of 10.7 in L2, one thread, AVX2)."""
    half = builder.bitcast(bits, ir.HalfType())
    if not lanes:
        return builder.fpext(half, ir.FloatType())
    vec = ir.VectorType(ir.HalfType(), lanes)
    one = builder.insert_element(ir.Constant(vec, None), half, ir.Constant(ir.IntType(32), 0))
    splat = builder.shuffle_vector(one, one, ir.Constant(ir.VectorType(ir.IntType(32), lanes), [0] * lanes))
    return builder.fpext(splat, ir.VectorType(ir.FloatType(), lanes))


@intrinsic
def h2f(typingctx, h):
    """float16 bits (uint16) -> float32 inside numba kernels (numba has no CPU float16)."""
    sig = types.float32(types.uint16)

    def codegen(context, builder, signature, args):
        return half_to_f32_ir(builder, args[0])

    return sig, codegen


@intrinsic
def bf2f(typingctx, b):
    """bfloat16 bits (uint16) -> float32 inside numba kernels: the bits become the high half."""
    sig = types.float32(types.uint16)

    def codegen(context, builder, signature, args):
        wide = builder.shl(builder.zext(args[0], ir.IntType(32)), ir.Constant(ir.IntType(32), 16))
        return builder.bitcast(wide, ir.FloatType())

    return sig, codegen


@intrinsic
def bits_to_f32(typingctx, i):
    """The low 32 bits of an integer as the bits of a float32 (``2^n`` is ``(n + 127) << 23``)."""
    if not isinstance(i, types.Integer):
        return None
    sig = types.float32(i)

    def codegen(context, builder, signature, args):
        v = args[0]
        if v.type.width != 32:
            v = builder.trunc(v, ir.IntType(32)) if v.type.width > 32 else builder.sext(v, ir.IntType(32))
        return builder.bitcast(v, ir.FloatType())

    return sig, codegen


def prefetch_ir(builder: ir.IRBuilder, ptr: ir.Value) -> None:
    """``llvm.prefetch`` of the cache line at ``ptr`` (read, keep in all levels): no effect on
    results, and none on a line past the array's end (a hint never faults)."""
    i8p, i32 = ir.IntType(8).as_pointer(), ir.IntType(32)
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32]),
                                        "llvm.prefetch.p0")
    builder.call(fn, [builder.bitcast(ptr, i8p), ir.Constant(i32, 0), ir.Constant(i32, 3), ir.Constant(i32, 1)])


@intrinsic
def prefetch(typingctx, arr, index):
    """Hint the CPU to bring ``arr.flat[index]``'s cache line in (``llvm.prefetch``: read, keep
    in all levels); no effect on results. For weights streamed from memory at a pace the
    hardware prefetcher does not anticipate (a product's next rows while this row computes)."""
    sig = types.void(arr, index)

    def codegen(context, builder, signature, args):
        data = context.make_array(signature.args[0])(context, builder, args[0]).data
        prefetch_ir(builder, builder.gep(data, [args[1]]))
        return context.get_dummy_value()

    return sig, codegen


def either(test: str, if_true, if_false) -> tuple:
    """A `literal_ladder` axis: ``if_true`` where the expression ``test`` holds, else ``if_false``."""
    return ((test, if_true), (None, if_false))


def among(name: str, *values) -> tuple:
    """A `literal_ladder` axis: the run-time value of the integer ``name``, one of ``values`` (the last
    one also stands for any other value)."""
    return tuple((f"{name} == {v}", v) for v in values[:-1]) + ((None, values[-1]),)


def literal_ladder(signature: str, body: str, env: dict, **axes):
    """An inlined numba function ``signature`` (``"name(params)"``) that runs ``body`` with each
    ``{KEY}`` filled in with a literal, picked at run time by the axis ``KEY`` (`either`, `among`).

    The IR intrinsics take their tile sizes only as literals, so a kernel reaches them through an
    if/elif ladder with a case per combination (each case its own specialised code); this writes
    that ladder, outermost axis first, so that each kernel states only the call and the axes.
    ``env``: the names ``body`` calls."""
    lines = [f"def {signature}:"]

    def emit(todo, fill, depth):
        pad = "    " * depth
        if not todo:
            lines.extend(pad + line for line in body.format(**fill).splitlines())
            return
        (key, choices), rest = todo[0], todo[1:]
        for i, (test, value) in enumerate(choices):
            lines.append(pad + ("else:" if test is None else f"{'elif' if i else 'if'} {test}:"))
            emit(rest, {**fill, key: value}, depth + 1)

    emit(list(axes.items()), {}, 1)
    name = signature.split("(")[0]
    ns = dict(env)
    exec(compile("\n".join(lines) + "\n", f"<literal_ladder {name}>", "exec"), ns)
    return njit(inline="always", **dict(EXACT, cache=False))(ns[name])  # exec'd: no file to cache by


@njit(inline="always", **EXACT)
def nibbles(byte):
    """(low, high) nibble of a byte as exact float32s, in float arithmetic: it vectorises to
    16 lanes, where numba's int64 integer ops take 8 (~15% faster decoding)."""
    v = np.float32(byte)
    hi = np.floor(v * np.float32(0.0625))
    return v - np.float32(16.0) * hi, hi
