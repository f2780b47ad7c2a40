"""GGML block formats (llama.cpp's weight storage) behind the `Matrix` interface.

A GGUF tensor stays as its raw memory-mapped blocks; only what a call needs is decoded:

* ``rows(ids)``  decodes just those rows (embedding lookups into a 262k-row table).
* ``matmul(x)``  for a few input rows (decode, short prompts: see ``FUSED_MAX_T``) runs a numba
  kernel that decodes one weight row at a time into a per-thread buffer and dots it with every
  ``x`` row in float32, parallel over output rows for big matrices (``PARALLEL_MIN``): the
  weights cross the memory bus once, still compressed. Q8_0 / Q5_0 short prompts (more
  than FEW_ROWS rows) take `kernels.half`'s tiles instead, each weight widened to float32 in
  registers (the real Gemma 3 270M's Q8_0 matrices, 16-64 rows: 86-98 GFLOP/s against 38-90 for
  the row kernel and 21-98 for BLAS on decoded tiles; BLAS wins from ~96 rows on). Longer
  inputs (prefill) decode tiles of rows to float32 and let single-threaded BLAS multiply them,
  the compute threads taking the tiles (`kernels.blas`: the same numbers on any thread count), so
  the float32 copy never exceeds a tile per thread. OpenBLAS's own pool never runs (its spinning
  workers fought numba's regions between the calls: measured 10x slower on 2 cores), so a
  prompt's numba attention runs between the products' BLAS calls at full speed.

Numerics: the decoders (`gemmalite.kernels.ggml`) reproduce llama.cpp's dequantizers bit for
bit, so products equal float32 math on the dequantized matrix up to summation order. Where a
user asks for it (``int8_prefill``), prefill on Q4_0 / Q5_0 / Q8_0 rounds x to int8 per 32
values (llama.cpp's trade: on the real Gemma 3 270M, prompt logits 0.54 off the exact math,
where float32 stays within 1e-3 and even int16 activations give 0.002). One other exception: decode rows (T <= FEW_ROWS) on Q8_0, Q5_0 and K-quant (Q4_K, Q5_K, Q6_K) blocks with
AVX2 round ``x`` to int16 per block of 32 (step ``max|x| / 32767``, as gemmalite's own int8
decode; llama.cpp rounds it to 8 bits) and sum each block or sub-block exactly with 16-bit SIMD
multiply-adds (``simd.block_row_dot``, ``ggml.kquant_row_dot``); float types compute as
`F32Matrix` / `HalfMatrix` do.
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np

from ..kernels import common
from ..kernels.ggml import (FLOAT_TYPES, KERNELS, KQ_KINDS, LANE_OFFSET, W, block_info, block_mm_lanes,
                            q5_0_to_q8_0, row_bytes, type_name)
from ..kernels.half import KIND_Q5_0, KIND_Q8_0, half_matmul
from ..kernels.half import ROWS as HALF_ROWS
from ..kernels.int4s import LANE_GROUP, round_i8_lanes
from . import bf16
from .matrix import Matrix, Prepared, as_matrix
from .operands import GGML_OPS, BlockOp, KQuantOp, run_product
from .quant import _token_chunks

# The fused kernel is used for T <= FEW_ROWS input rows always, and up to FUSED_MAX_T rows while
# x (T x cols float32) stays cache-resident; beyond that BLAS on decoded slabs is faster.
FUSED_MAX_T = 64
FUSED_MAX_X = 128 * 1024  # T * cols values (512 KiB of x)
# Below this much work (weights x max(1, T/4)) the fused kernel stays on the calling thread:
# waking the thread pool costs more than it saves. Since a decode step makes no BLAS call (so
# numba's pool is the only one awake), even Gemma 3 270M's 256 x 640 matrices gain from both
# cores: decode 24.6 -> 35 tok/s with 1 << 16 instead of 1 << 22.
PARALLEL_MIN = 1 << 16
TILE_KINDS = {"Q8_0": KIND_Q8_0, "Q5_0": KIND_Q5_0}  # short prompts on `half_matmul`'s tiles


# ---------------------------------------------------------------------------------------------
# Float formats: plain numpy views of the stored bytes.
# ---------------------------------------------------------------------------------------------


def _float_rows(raw: np.ndarray, name: str, cols: int) -> np.ndarray:
    """The raw [rows, bytes] array viewed as [rows, cols] of its stored float dtype."""
    dt = bf16.dtype() if name == "BF16" else {"F32": np.dtype("<f4"), "F16": np.dtype("<f2")}[name]
    return raw.view(dt).reshape(raw.shape[0], cols)


# ---------------------------------------------------------------------------------------------


class GGMLMatrix(Matrix):
    """A weight ``[rows, cols]`` kept as GGML blocks (e.g. a memory-mapped GGUF tensor).

    ``raw`` is uint8 with ``rows * row_bytes`` bytes (any shape; it is viewed as
    ``[rows, row_bytes]`` without copying). Float types (F32/F16/BF16) take the products of the
    `Matrix` a checkpoint folder's tensor of that dtype becomes (`as_matrix`: `F32Matrix`,
    `HalfMatrix`) on a view of the same bytes, so a GGUF converted from a folder computes the
    folder's numbers bit for bit, whatever the number of rows.

    ``int8_prefill`` (`gemmalite.load(..., gguf_prefill="int8")`): Q4_0 / Q5_0 / Q8_0 products of
    more than FEW_ROWS rows round x to int8 per 32 values on VNNI CPUs (`_matmul_lanes`), as
    llama.cpp does, instead of float32 math on the decoded weights.
    """

    int8_prefill = False

    def __init__(self, raw: np.ndarray, qtype, shape: tuple[int, int]):
        self.qtype = type_name(qtype)
        rows, cols = int(shape[0]), int(shape[1])
        self.shape = (rows, cols)
        rb = row_bytes(self.qtype, cols)
        raw = np.asarray(raw)
        if raw.dtype != np.uint8:
            raw = raw.view(np.uint8)
        if raw.size != rows * rb:
            raise ValueError(f"{self.qtype} {self.shape} needs {rows * rb} bytes, got {raw.size}")
        self.raw = raw.reshape(rows, rb)
        self.raw.flags.writeable = False  # one compiled specialisation (GGUF memmaps are read-only)
        self.block_size = block_info(self.qtype)[0]
        self._float: Matrix | None = None
        if self.qtype in FLOAT_TYPES:
            self._w = _float_rows(self.raw, self.qtype, cols)
            self._k = None
            self._float = as_matrix(self._w, keep_half=True)
        else:
            self._w = None
            self._k = KERNELS[self.qtype]

    def __repr__(self) -> str:
        return f"GGMLMatrix({self.qtype}, {self.shape})"

    def as_q8_0(self) -> "GGMLMatrix":
        """This Q5_0 matrix as Q8_0 blocks of the same values (`kernels.ggml.q5_0_to_q8_0`: exact), in
        memory of its own (34 bytes a block of 32 instead of 22). With AVX2 both formats take one
        decode kernel, whose Q8_0 blocks stream from memory where Q5_0's unpacking is compute-bound;
        every product is bit for bit the Q5_0 one's (the same values in the same lanes; short
        prompts' tiles widen both to the same float32 weights, longer prompts decode both to them)."""
        if self.qtype != "Q5_0":
            raise ValueError(f"as_q8_0 takes a Q5_0 matrix, not {self.qtype}")
        out = np.empty((self.shape[0], row_bytes("Q8_0", self.shape[1])), np.uint8)
        q5_0_to_q8_0(self.raw, out)
        m = GGMLMatrix(out, "Q8_0", self.shape)
        m.int8_prefill = self.int8_prefill
        return m

    def row_slice(self, r0: int, r1: int) -> "GGMLMatrix":
        """Rows r0..r1 as a new matrix sharing the same bytes (splits a fused QKV weight)."""
        m = GGMLMatrix(self.raw[r0:r1], self.qtype, (r1 - r0, self.shape[1]))
        m.int8_prefill = self.int8_prefill
        return m

    @property
    def nbytes(self) -> int:
        return self.raw.nbytes

    @property
    def uses_blas(self) -> bool:  # type: ignore[override]
        return self._float.uses_blas if self._float is not None else True

    @property
    def independent_rows(self) -> bool:  # type: ignore[override]
        return self._float.independent_rows if self._float is not None else False

    def uses_blas_for(self, rows: int) -> bool:
        return self._float.uses_blas_for(rows) if self._float is not None else super().uses_blas_for(rows)

    def rows(self, ids: np.ndarray) -> np.ndarray:
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        if ids.size and (ids.min() < 0 or ids.max() >= self.shape[0]):
            raise IndexError(f"row ids out of range for {self!r}")
        if self._w is not None:
            return self._w[ids].astype(np.float32)
        out = np.empty((ids.size, self.shape[1]), dtype=np.float32)
        if ids.size:
            self._k.gather(self.raw, ids, out, W)
        return out

    def matmul(self, x: np.ndarray) -> np.ndarray:
        x = np.ascontiguousarray(x, dtype=np.float32)
        squeeze = x.ndim == 1
        x2 = x.reshape(1, -1) if squeeze else x
        if x2.ndim != 2 or x2.shape[1] != self.shape[1]:
            raise ValueError(f"matmul: x has shape {x.shape}, {self!r} needs [T, {self.shape[1]}]")
        n_t = x2.shape[0]
        if self._float is not None:
            out = self._float.matmul(x2)
        elif 1 <= n_t <= common.FEW_ROWS:  # decode rows: the operand's product (as `matmul_each`)
            out = run_product(self.operand(), x2)
        elif self.int8_prefill and self.qtype in LANE_OFFSET and common.HAVE_VNNI:
            out = self._matmul_lanes(x2)
        elif self._fused(n_t):
            out = np.empty((n_t, self.shape[0]), dtype=np.float32)
            if self.qtype in TILE_KINDS:  # widened in registers, tiles of 4 rows x 3 tokens
                half_matmul(x2, self.raw, TILE_KINDS[self.qtype], HALF_ROWS, out)
            else:
                big = self.shape[0] * self.shape[1] * max(1, n_t // 4) >= PARALLEL_MIN
                (self._k.matvec if big else self._k.matvec_serial)(self.raw, x2, out, W)
        else:
            out = self._matmul_blocked(x2)
        return out[0] if squeeze else out

    def _make_operand(self) -> Any:
        """Decode rows (`Matrix.matmul_each`, the compiled step): float types as `F32Matrix` /
        `HalfMatrix` take them; with AVX2, Q8_0 / Q5_0 and the K-quants (Q4_K, Q5_K, Q6_K) against int16
        activations per 32 values (W8A16: exact integer sums per block or sub-block); other blocks
        (and every block without AVX2) decoded a row at a time by the fused kernel, FEW_ROWS rows of x
        per call."""
        if self._float is not None:
            return self._float.operand()
        if self._int16_rows():
            return BlockOp(self.raw, self.qtype == "Q5_0")
        if self.qtype in KQ_KINDS and common.HAVE_AVX2:
            return KQuantOp(self.raw, KQ_KINDS[self.qtype])
        return GGML_OPS[self.qtype](self.raw, self.shape[0] * self.shape[1] >= PARALLEL_MIN)

    def matmul_alike(self, x: np.ndarray) -> np.ndarray:
        return self._float.matmul_alike(x) if self._float is not None else super().matmul_alike(x)

    def prepare(self, x: np.ndarray) -> np.ndarray | Prepared:
        return self._float.prepare(x) if self._float is not None else super().prepare(x)

    def matmul_prepared(self, p: np.ndarray | Prepared) -> np.ndarray:
        return self._float.matmul_prepared(p) if self._float is not None else super().matmul_prepared(p)

    def _int16_rows(self) -> bool:
        return self.qtype in ("Q8_0", "Q5_0") and common.HAVE_AVX2

    def _fused(self, n_t: int) -> bool:
        return 0 < n_t and (n_t <= common.FEW_ROWS or (n_t <= FUSED_MAX_T and n_t * self.shape[1] <= FUSED_MAX_X))

    def _matmul_lanes(self, x: np.ndarray) -> np.ndarray:
        """Prefill of Q4_0 / Q5_0 / Q8_0 on VNNI: x rounded to int8 per block of 32 (as the int4
        prefill rounds it: `int4s.round_i8_lanes`, rows padded with zero blocks to a multiple of
        LANE_GROUP), 4 weight rows x 3 tokens of exact integer block sums (`ggml.block_mm_lanes`),
        TOKEN_CHUNK tokens a pass."""
        t, k = x.shape
        kp = -(-k // LANE_GROUP) * LANE_GROUP
        xs = common.aligned_empty((t, kp), np.int8)
        xs[:] = 0
        xc = np.zeros((t, kp // LANE_GROUP, 8), np.int32)
        xd = np.zeros((t, kp // LANE_GROUP, 8), np.float32)
        round_i8_lanes(x, xs, xc, xd, LANE_OFFSET[self.qtype])
        out = np.empty((t, self.shape[0]), dtype=np.float32)
        kind = int(self.qtype[1])  # the kernel's literal: 4, 5, 8 bits
        for t0, t1 in _token_chunks(t):
            block_mm_lanes(self.raw, kind, xs, xc, xd, t0, t1, out)
        return out

    def _dequant_range(self, r0: int, out: np.ndarray) -> None:
        """Rows ``r0 ..`` decoded (serial, nogil) for the BLAS tiles of other block types' prompts
        (`Matrix._matmul_blocked`)."""
        self._k.gather(self.raw, np.arange(r0, r0 + out.shape[0]), out, W)


def dequantize(raw: np.ndarray, qtype, shape: tuple[int, ...]) -> np.ndarray:
    """The whole tensor in float32 (tests and conversion); ``shape`` is row-major, last = cols."""
    shape = tuple(int(s) for s in shape)
    return GGMLMatrix(raw, qtype, (math.prod(shape[:-1]), shape[-1])).dense().reshape(shape)


def quantized_nbytes(qtype, shape: tuple[int, ...]) -> int:
    """Bytes a tensor of this type and (row-major) shape occupies."""
    return math.prod(shape[:-1]) * row_bytes(qtype, int(shape[-1]))
