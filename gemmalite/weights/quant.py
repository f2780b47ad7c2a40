"""Weight-only quantized matrices: int8 per output row, int4 in groups along the input.

Both classes implement :class:`gemmalite.weights.matrix.Matrix`. Activations stay 16/32-bit: the math
is float32, so ``matmul(x)`` agrees with ``x @ dense().T`` to float32 rounding, except decode
rows (T <= FEW_ROWS, AVX2: a decode step or a prompt-lookup verification step; each row
computed bit for bit as alone), which round ``x`` to int16 per group (the int4 grid's groups; for int8 TILE_BLOCK = 256
values, or 32 where the width is not a multiple of 256; step ``max|x| / 32767``: W8A16 / W4A16,
as NPUs run them) so that the products are
exact 16-bit integer multiply-adds (:mod:`gemmalite.kernels.simd`); that rounding is ~100 times
smaller than the int8 weight error and ~1e4 times smaller than the int4 one. int8 prefill
(T > FEW_ROWS, AVX2) rounds ``x`` too: to int16 per TILE_BLOCK values, or on VNNI to int8
(W8A8, step ``max|x| / 127``: an error of the same order as the int8 weights' own).

Formats (what ``tensors()`` returns and ``from_tensors()`` reads; the converter stores them in
safetensors under ``<name>.<key>``):

``Int8Matrix``   ``q`` int8 ``[out, in]``, ``scale`` float32 ``[out]``.
                 ``W[r, k] = scale[r] * q[r, k]``, symmetric, ``q`` in ``[-127, 127]``.

``Int4Matrix``   symmetric (what ``quantize(w, "int4")`` and ``convert --quant int4`` make):
                 ``packed`` uint8 ``[out, in // 2]``, ``scales`` float16 ``[out, in // 32]``;
                 ``W[r, 32g + i] = scales[r, g] * (n - 8)``, ``n`` in ``0..15``: 4.5 bits per
                 weight, Q4_0's size, with a searched scale (`gemmalite.kernels.int4s`).
                 asymmetric (checkpoints converted before; ``quantize(..., symmetric=False)``):
                 also ``mins`` float16 ``[out, in // group]``;
                 ``W[r, g*G + i] = scales[r, g] * n + mins[r, g]``: 5 bits per weight.
                 The group size is implied by the shapes: ``G = in // scales.shape[1]``; a
                 converted folder of either kind loads (``mins`` present or not).

Int4 layout: within each group of ``G`` values (``G // 2`` bytes), byte ``j`` holds value ``j``
in its low nibble and value ``j + G//2`` in its high nibble (the llama.cpp Q4_0/Q4_1 order).
Unpacking one contiguous run of bytes with ``b & 15`` and ``b >> 4`` thus yields two
*contiguous* runs of values that line up with two contiguous slices of ``x``, so the inner loop
is plain unit-stride SIMD (load bytes, mask/shift, widen, convert, FMA) with no shuffles.

The asymmetric int4 (scale + min, "Q4_1"-like): on Gaussian, Laplace and
Student-t weights the fitted asymmetric grid has 12-25 % lower RMS error than a symmetric one
(with the same scale search), for 2 extra bytes per 32 weights (20 vs 18 bytes, +11 % bytes
read). The kernel cost is the same inner loop: ``sum_g(d_g * sum(n*x) + m_g * sum_g(x))``,
where the group sums of ``x`` are computed once per call. The scale and min are fitted per
group by a weighted least-squares search (llama.cpp ``make_qkx2_quants`` style), which may clip
a few outliers when that lowers the weighted error; the stored values are then used to
re-round, so dequantization error is at most ``scale/2`` for every weight inside the grid.

The symmetric int4 trades some of that for speed: its decode kernel rounds x to int8 per 32 values
(W4A8, as llama.cpp's Q4_0 x Q8_0 products) and takes 8-bit dot products (``vpdpbusd`` on VNNI,
``vpmaddubsw`` on AVX2: the same integers), about half the instructions per byte of the W4A16 one;
on real Gemma 3 270M its logit error is 13 % below Q4_0's on the same weights, 37 % above the
asymmetric format's (``python scripts/int4_error.py gemma3``).

Kernels (numba, in `gemmalite.kernels.quant`): ``matmul`` with ``T <= FEW_ROWS`` runs fused numba kernels (``prange`` over output
rows, weights read once for all T columns). Larger T (prefill): int8 runs integer tiles; with
VNNI (``common.HAVE_VNNI``) the activations are rounded to int8 per TILE_BLOCK values (W8A8:
step ``max|x| / 127``, about the weights' own error) and tiles of 4 rows x 3 tokens take 8-bit
dot products (``simd.u8_tile_dot``); otherwise tiles of 4 rows x 3 tokens with int16
activations (``simd.int8_tile_dot``, 2-3x the float32 BLAS path; on VNNI `matmul_alike`'s int16
activations go through the 8-bit tiles as two byte planes instead); all keep per-lane float sums
and fold a pair's lanes once, at the end;
symmetric int4 runs W4A8 tiles (``kernels.int4s``); asymmetric int4 and CPUs without AVX2
dequantize tiles of rows into a reused float32 buffer per thread and multiply them with
single-threaded BLAS (``kernels.blas``: the same numbers on any thread count). All kernels are cached on disk. On this 2-core
machine both int8 and int4 decode run near memory bandwidth (the portable float int4 kernel
is bound by nibble unpacking at ~6 GB/s). Thread pools: numba's OpenMP workers and
OpenBLAS's workers each spin after a call; the engine keeps them from overlapping (no BLAS
call in a decode step; ``OPENBLAS_THREAD_TIMEOUT=4``).
"""
from __future__ import annotations

import numpy as np

from ..kernels import common
from ..kernels.int4s import (LANE_GROUP, activation_pairs, i4s_fit, i4s_mm_lanes, i4s_mm_w4a8, i4s_pack, round_i8_lanes,
                              token_groups)
from ..kernels.quant import (
    group_sums,
    i4_dequant_ids,
    i4_dequant_range,
    i4_mv1,
    i4_mv4,
    i4_pack,
    i4_quantize,
    i8_dequant_ids,
    i8_dequant_range,
    i8_mm_vnni,
    i8_mm_w8a16,
    i8_mv1,
    i8_mv4,
    i8_quantize,
    round_i16_planes,
    round_int16_rows,
    round_u8_rows,
)
from ..kernels.simd import TILE_BLOCK, U8_BLOCK
from .matrix import Matrix, Prepared
from .operands import Int4aOp, Int4RowsOp, Int4sOp, Int8Op, Int8RowsOp, run_product

__all__ = ["Int8Matrix", "Int4Matrix", "quantize"]

# int16 activations on VNNI go through the 8-bit tiles as two byte planes (`Int8Matrix._planes`):
# the planes keep the int16 rounding's scale per block, so the two block sizes must be one
assert TILE_BLOCK == U8_BLOCK

TOKEN_CHUNK = 128       # int8 prefill: tokens per pass over the weights (x chunk: 128 * k * 2 bytes)
QUANT_BLOCK = 4096      # rows converted to float32 at a time when quantizing
LONG_ROW_SIMD = 8192  # same for the int16-activation kernels (measured: only the 12288-wide down projections
# gain while the weight stream bounds the step). Several activation rows (a batch of sequences) go in
# tiles of up to 4 of them per weight row, which widen each weight once and sum each row's groups on
# independent chains.
# int4 inputs of up to this many rows (a short query) take the decode kernel, which reads each
# weight once for all rows, instead of dequantizing every row block for BLAS: 18 rows x 2048 x 512
# 0.56 vs 2.2 ms; even at 64 rows (the two break even there).
INT4_SHORT_ROWS = 32


def _token_chunks(t: int) -> list[tuple[int, int]]:
    """The int8 tiles' passes over the weights: at most TOKEN_CHUNK tokens each, as even as the
    3-token tiles allow (272 tokens: 93, 93, 86, not 128, 128, 16, whose last pass reads the whole
    matrix for 16 tokens). Each (row, token) pair is computed the same way in any chunk."""
    if t <= 0:
        return []
    per = -(-t // -(-t // TOKEN_CHUNK))      # the passes' even share
    per = min(TOKEN_CHUNK, -(-per // 3) * 3)  # in whole 3-token tiles
    return [(t0, min(t, t0 + per)) for t0 in range(0, t, per)]


def _as_f32_block(w: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(w, dtype=np.float32)


def _ids(ids) -> np.ndarray:
    return np.ascontiguousarray(np.asarray(ids, dtype=np.int64).reshape(-1))


def _round_tiles(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """x as the prefill tiles take it: int16 values and a scale per TILE_BLOCK values."""
    t, k = x.shape
    xq = common.aligned_empty((t, k), np.int16)
    xd = np.empty((t, k // TILE_BLOCK), dtype=np.float32)
    round_int16_rows(x, TILE_BLOCK, xq, xd)
    return xq, xd


def _round_u8(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """x as the VNNI prefill tiles take it: int8 values + 128 and a scale per U8_BLOCK values
    (``xd`` token-minor, ``[k // U8_BLOCK, T]``)."""
    t, k = x.shape
    xu = common.aligned_empty((t, k), np.uint8)
    xd = np.empty((k // U8_BLOCK, t), dtype=np.float32)
    round_u8_rows(x, xu, xd)
    return xu, xd


def _round_planes(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """x as the VNNI tiles take int16 activations: the same integers as `_round_tiles` (a scale
    per TILE_BLOCK = U8_BLOCK values) as a low and a high byte plane, ``xd [k // U8_BLOCK, T]``."""
    t, k = x.shape
    xl = common.aligned_empty((t, k), np.uint8)
    xh = common.aligned_empty((t, k), np.uint8)
    xd = np.empty((k // U8_BLOCK, t), dtype=np.float32)
    round_i16_planes(x, xl, xh, xd)
    return xl, xh, xd


def _round_w4a8(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """x as the int4 prefill tiles take it: rows padded with zeros to a multiple of 4, int8 per 32
    values (`int4s.round_i8_pairs`), the block terms per group of 4 rows (`int4s.token_groups`)."""
    t, k = x.shape
    if t % 4:
        x = np.concatenate([x, np.zeros((-t % 4, k), np.float32)])
    xq, xc, xd = activation_pairs(x)
    return (xq, *token_groups(xc, xd))


def _round_w4a8_lanes(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """x as the block-lane int4 tiles take it (`int4s.round_i8_lanes`: the same integers as
    `_round_w4a8`, each value where its block's int32 lane meets it)."""
    t, k = x.shape
    xs = common.aligned_empty((t, k), np.int8)
    xc = np.empty((t, k // LANE_GROUP, 8), np.int32)
    xd = np.empty((t, k // LANE_GROUP, 8), np.float32)
    round_i8_lanes(x, xs, xc, xd, 8)
    return xs, xc, xd


class _Quantized(Matrix):
    def _dequant_ids(self, ids: np.ndarray, out: np.ndarray) -> None:
        """Rows ``ids`` (in range) in float32 into ``out``."""
        raise NotImplementedError

    def rows(self, ids) -> np.ndarray:
        ids = _ids(ids)
        out = np.empty((ids.size, self.shape[1]), dtype=np.float32)
        if ids.size:
            if ids.min() < -self.shape[0] or ids.max() >= self.shape[0]:
                raise IndexError("row id out of range")
            self._dequant_ids(ids % self.shape[0], out)
        return out


class Int8Matrix(_Quantized):
    """Symmetric int8 weights, one float32 scale per output row: ``W = scale[:, None] * q``."""

    def __init__(self, q: np.ndarray, scale: np.ndarray):
        q = np.asarray(q)
        scale = np.asarray(scale)
        if q.ndim != 2 or q.dtype != np.int8:
            raise ValueError(f"q must be a 2-D int8 array, got {q.dtype} {q.shape}")
        if scale.dtype != np.float32 or scale.shape != (q.shape[0],):
            raise ValueError(f"scale must be float32 [{q.shape[0]}], got {scale.dtype} {scale.shape}")
        self.q = np.ascontiguousarray(q)  # no copy when already contiguous (memory-mapped)
        self.scale = np.ascontiguousarray(scale)
        self.shape = q.shape

    @property
    def uses_blas(self) -> bool:
        """Prefill takes the integer tiles where they apply, else dequantize + BLAS."""
        return not (common.HAVE_AVX2 and self.shape[1] % TILE_BLOCK == 0)

    @property
    def independent_rows(self) -> bool:
        """The integer tiles round and sum each row of x on its own."""
        return not self.uses_blas

    @classmethod
    def quantize(cls, w: np.ndarray) -> "Int8Matrix":
        """Quantize a float32/bfloat16/float16 ``[out, in]`` array, QUANT_BLOCK rows at a time."""
        if w.ndim != 2:
            raise ValueError("w must be 2-D")
        n, k = w.shape
        q = common.aligned_empty((n, k), np.int8)
        scale = np.empty(n, dtype=np.float32)
        for r0 in range(0, n, QUANT_BLOCK):
            r1 = min(n, r0 + QUANT_BLOCK)
            i8_quantize(_as_f32_block(w[r0:r1]), q[r0:r1], scale[r0:r1])
        return cls(q, scale)

    def tensors(self) -> dict[str, np.ndarray]:
        return {"q": self.q, "scale": self.scale}

    @classmethod
    def from_tensors(cls, d: dict) -> "Int8Matrix":
        return cls(d["q"], d["scale"])

    @property
    def nbytes(self) -> int:
        return self.q.nbytes + self.scale.nbytes

    def _dequant_ids(self, ids, out):
        i8_dequant_ids(self.q, self.scale, ids, out)

    def _dequant_range(self, r0, out):
        i8_dequant_range(self.q, self.scale, r0, out)

    def matmul(self, x: np.ndarray) -> np.ndarray:
        x = self._check(x)
        t = x.shape[0]
        if t > common.FEW_ROWS:
            if self.uses_blas:
                return self._matmul_blocked(x)
            return self._matmul_w8a8(x) if common.HAVE_VNNI else self._matmul_w8a16(x)
        if self._int16_rows():
            return run_product(self.operand(), x)
        out = np.empty((t, self.shape[0]), dtype=np.float32)
        if t == 1:
            i8_mv1(self.q, self.scale, x, out)
        elif t > 1:
            i8_mv4(self.q, self.scale, x, out)
        return out

    def matmul_alike(self, x: np.ndarray) -> np.ndarray:
        """The int16-activation prefill tiles for any row count where the width takes them (each
        row rounded and summed on its own), else `matmul_each`. Never W8A8, even on VNNI: on real
        Gemma 3 270M (the proxy for EmbeddingGemma 2), mean-pooled final hidden states have
        1 - cos to float 7.25e-4 with int8 weights, 7.24e-4 with int16 activations per 256 added,
        1.16e-3 with int8 ones (``scripts/activation_rounding_error.py --pooled``): only the int16
        rounding stays within the int8 weights' own error."""
        x = self._check(x)
        if self.uses_blas:
            return self.matmul_each(x)
        return self._matmul_w8a16(x)

    def prepare_alike(self, x: np.ndarray) -> "np.ndarray | Prepared":
        """`matmul_alike`'s input rounded once (on VNNI: the int16 byte planes) for every matrix it
        multiplies."""
        x = self._check(x)
        if self.uses_blas or not self._planes():
            return x
        return Prepared(x, "int16-planes", _round_planes(x))

    def matmul_alike_prepared(self, p: "np.ndarray | Prepared") -> np.ndarray:
        if (isinstance(p, Prepared) and p.kind == "int16-planes" and p.x.shape[1] == self.shape[1]
                and not self.uses_blas and self._planes()):
            return self._matmul_w8a16(p.x, planes=p.data)
        return super().matmul_alike_prepared(p)

    @staticmethod
    def _planes() -> bool:
        """Do int16 activations go as two byte planes through the 8-bit tiles (VNNI)?"""
        return common.HAVE_VNNI

    def _int16_rows(self) -> bool:
        return common.HAVE_AVX2 and self.shape[1] % 32 == 0

    def _make_operand(self) -> Int8Op | Int8RowsOp:
        """Decode rows (`run_product`): with AVX2, x in int16 per TILE_BLOCK values where the width
        allows (the prefill tiles' `int8_tile_dot`: one float conversion per 256 products instead of
        per 32, which a batch of sequences, bound by the multiply-adds, feels: E2B steps of 8 rows
        10-20 % faster), else per 32 (`int8_rows_dot`), weights read once for all rows (W8A16); the
        rounding error is negligible either way (~1e-3 of the int8 weights' own logit error on
        Gemma 3 270M). Without AVX2, the portable float kernel row by row."""
        k = self.shape[1]
        if self._int16_rows():
            return Int8Op(self.q, self.scale, TILE_BLOCK if k % TILE_BLOCK == 0 else 32, k >= LONG_ROW_SIMD)
        return Int8RowsOp(self.q, self.scale)

    def prepare(self, x: np.ndarray) -> "np.ndarray | Prepared":
        """Prefill input: rounded once (int8 on VNNI, else int16) for every matrix it multiplies
        (q/k/v, gate/up)."""
        x = self._check(x)
        if x.shape[0] <= common.FEW_ROWS or self.uses_blas:
            return x
        if common.HAVE_VNNI:
            return Prepared(x, "w8a8", _round_u8(x))
        return Prepared(x, "int16-tiles", _round_tiles(x))

    def matmul_prepared(self, p: "np.ndarray | Prepared") -> np.ndarray:
        if isinstance(p, Prepared) and p.x.shape[1] == self.shape[1] and not self.uses_blas:
            if p.kind == "w8a8" and common.HAVE_VNNI:
                return self._matmul_w8a8(p.x, p.data)
            if p.kind == "int16-tiles":
                return self._matmul_w8a16(p.x, p.data)
        return super().matmul_prepared(p)

    def _matmul_w8a16(self, x: np.ndarray, rounded: tuple[np.ndarray, np.ndarray] | None = None,
                      planes: tuple | None = None) -> np.ndarray:
        """Prefill: x rounded to int16 per TILE_BLOCK values (``rounded``: already, as
        `_round_tiles` gives it), integer tiles, TOKEN_CHUNK tokens at a time (so that a chunk of
        x stays in L2 while every weight strip passes by). On VNNI (unless already rounded) the
        same integers go as two byte planes through the 8-bit tiles (`simd.u8_tile_dot`), which
        read the weights as stored instead of widening them to 16 bits (``planes``: already, as
        `_round_planes` gives them)."""
        t, k = x.shape
        out = np.empty((t, self.shape[0]), dtype=np.float32)
        if rounded is None and self._planes():
            xl, xh, xd8 = planes if planes is not None else _round_planes(x)
            for t0, t1 in _token_chunks(t):
                i8_mm_vnni(self.q, self.scale, xl, xh, xd8, t0, t1, out)
            return out
        xq, xd = rounded if rounded is not None else _round_tiles(x)
        for t0, t1 in _token_chunks(t):
            i8_mm_w8a16(self.q, self.scale, xq[t0:t1], xd[t0:t1], out[t0:t1])
        return out

    def _matmul_w8a8(self, x: np.ndarray, rounded: tuple[np.ndarray, np.ndarray] | None = None) -> np.ndarray:
        """Prefill on VNNI: x rounded to int8 per U8_BLOCK values (W8A8; the activation error is
        about the weights' own; ``rounded``: already), 8-bit dot products, TOKEN_CHUNK tokens at
        a time."""
        t, k = x.shape
        xu, xd = rounded if rounded is not None else _round_u8(x)
        out = np.empty((t, self.shape[0]), dtype=np.float32)
        for t0, t1 in _token_chunks(t):
            i8_mm_vnni(self.q, self.scale, xu, None, xd, t0, t1, out)
        return out

    def __repr__(self):
        return f"Int8Matrix{self.shape}"


class Int4Matrix(_Quantized):
    """Grouped int4: asymmetric ``W[r, g*G+i] = scales[r, g] * n + mins[r, g]``, or symmetric
    (``mins`` None, G = 32) ``W[r, 32g+i] = scales[r, g] * (n - 8)``; n in 0..15.

    ``packed`` uint8 ``[out, in//2]`` (see the module docstring for the nibble order),
    ``scales`` (and ``mins``) float16 ``[out, in//group]``. The symmetric format
    (`gemmalite.kernels.int4s`) is what ``quantize(w, "int4")`` and ``convert --quant int4`` make;
    asymmetric checkpoints converted before it still load and run.
    """

    GROUPS = (32, 64)

    def __init__(self, packed: np.ndarray, scales: np.ndarray, mins: np.ndarray | None,
                 shape: tuple[int, int] | None = None, group: int | None = None):
        packed = np.asarray(packed)
        scales = np.asarray(scales)
        self.symmetric = mins is None
        mins = scales if mins is None else np.asarray(mins)  # (symmetric: a stand-in the kernels never read)
        if packed.ndim != 2 or packed.dtype != np.uint8:
            raise ValueError(f"packed must be 2-D uint8, got {packed.dtype} {packed.shape}")
        n, k = packed.shape[0], packed.shape[1] * 2
        if shape is not None and tuple(shape) != (n, k):
            raise ValueError(f"shape {tuple(shape)} does not match packed {packed.shape}")
        if scales.ndim != 2 or scales.shape[0] != n or scales.shape[1] == 0:
            raise ValueError(f"scales must be [{n}, in//group], got {scales.shape}")
        g = k // scales.shape[1]
        if group is not None and group != g:
            raise ValueError(f"group {group} does not match the shapes (implied {g})")
        _check_group(k, g)
        if self.symmetric and g != 32:
            raise ValueError(f"symmetric int4 takes groups of 32 values, got {g}")
        if scales.dtype != np.float16 or mins.dtype != np.float16 or mins.shape != scales.shape:
            raise ValueError("scales and mins must be float16 arrays of the same shape")
        self.packed = np.ascontiguousarray(packed)
        self.scales = np.ascontiguousarray(scales)
        self.mins = None if self.symmetric else np.ascontiguousarray(mins)
        self._s16 = self.scales.view(np.uint16)
        self._m16 = self._s16 if self.symmetric else self.mins.view(np.uint16)
        self.group = g
        self.shape = (n, k)

    @classmethod
    def quantize(cls, w: np.ndarray, group: int = 32, search: bool = True,
                 symmetric: bool = False) -> "Int4Matrix":
        """Quantize a float32/bfloat16/float16 ``[out, in]`` array, QUANT_BLOCK rows at a time.

        ``search`` fits each group's scale/min by weighted least squares (slower, more
        accurate); otherwise the grid spans the group's [min, max] exactly. ``symmetric``: the
        4.5-bit format (groups of 32; ``search`` off is llama.cpp Q4_0's rounding).
        """
        if w.ndim != 2:
            raise ValueError("w must be 2-D")
        n, k = w.shape
        _check_group(k, group)
        if symmetric:
            return cls._quantize_symmetric(w, group, search)
        ng = k // group
        packed = np.empty((n, k // 2), dtype=np.uint8)
        scales = np.empty((n, ng), dtype=np.float16)
        mins = np.empty((n, ng), dtype=np.float16)
        for r0 in range(0, n, QUANT_BLOCK):
            r1 = min(n, r0 + QUANT_BLOCK)
            wb = _as_f32_block(w[r0:r1])
            d = np.empty((r1 - r0, ng), dtype=np.float32)
            m = np.empty((r1 - r0, ng), dtype=np.float32)
            i4_quantize(wb, group, search, d, m)
            with np.errstate(over="ignore"):
                d16 = d.astype(np.float16)
                m16 = m.astype(np.float16)
            scales[r0:r1] = d16
            mins[r0:r1] = m16
            i4_pack(wb, group, d16.astype(np.float32), m16.astype(np.float32), packed[r0:r1])
        return cls(packed, scales, mins)

    @classmethod
    def _quantize_symmetric(cls, w: np.ndarray, group: int, search: bool) -> "Int4Matrix":
        if group != 32:
            raise ValueError(f"symmetric int4 takes groups of 32 values, got {group}")
        n, k = w.shape
        packed = np.empty((n, k // 2), dtype=np.uint8)
        scales = np.empty((n, k // 32), dtype=np.float16)
        for r0 in range(0, n, QUANT_BLOCK):
            r1 = min(n, r0 + QUANT_BLOCK)
            wb = _as_f32_block(w[r0:r1])
            d = np.empty((r1 - r0, k // 32), dtype=np.float32)
            i4s_fit(wb, search, d)
            with np.errstate(over="ignore"):
                scales[r0:r1] = d.astype(np.float16)
            i4s_pack(wb, scales[r0:r1].astype(np.float32), packed[r0:r1])
        return cls(packed, scales, None)

    def tensors(self) -> dict[str, np.ndarray]:
        if self.symmetric:
            return {"packed": self.packed, "scales": self.scales}
        return {"packed": self.packed, "scales": self.scales, "mins": self.mins}

    @classmethod
    def from_tensors(cls, d: dict) -> "Int4Matrix":
        return cls(d["packed"], d["scales"], d.get("mins"))

    @property
    def nbytes(self) -> int:
        return self.packed.nbytes + self.scales.nbytes + (0 if self.symmetric else self.mins.nbytes)

    def _dequant_ids(self, ids, out):
        i4_dequant_ids(self.packed, self._s16, self._m16, ids, self.group, out, self.symmetric)

    def _dequant_range(self, r0, out):
        i4_dequant_range(self.packed, self._s16, self._m16, r0, self.group, out, self.symmetric)

    @property
    def _tiles(self) -> bool:
        """Does prefill (T > FEW_ROWS) take the W4A8 integer tiles (symmetric, AVX2, an even number
        of blocks per row), which compute each row on its own?"""
        return self.symmetric and common.HAVE_AVX2 and self.shape[1] % 64 == 0

    @property
    def _lanes(self) -> bool:
        """Do the tiles take the block-lane layout (`int4s.i4s_mm_lanes`: VNNI, rows a multiple of
        LANE_GROUP wide), one conversion per 256 products instead of per 64?"""
        return self._tiles and common.HAVE_VNNI and self.shape[1] % LANE_GROUP == 0

    @property
    def uses_blas(self) -> bool:
        """Prefill takes the W4A8 tiles where they apply (then no product of this matrix calls
        BLAS), else dequantize + BLAS."""
        return not self._tiles

    @property
    def independent_rows(self) -> bool:
        return self._tiles

    def uses_blas_for(self, rows: int) -> bool:
        return self.uses_blas and rows > (INT4_SHORT_ROWS if common.HAVE_AVX2 else common.FEW_ROWS)

    def matmul(self, x: np.ndarray) -> np.ndarray:
        x = self._check(x)
        t = x.shape[0]
        if t > common.FEW_ROWS and self._tiles:
            return self._matmul_w4a8(x)
        if self.uses_blas_for(t):
            return self._matmul_blocked(x)
        if common.HAVE_AVX2:
            return run_product(self.operand(), x)
        out = np.empty((t, self.shape[0]), dtype=np.float32)
        if t == 0:
            return out
        xs = np.empty((t, self.shape[1] // self.group), dtype=np.float32)
        group_sums(x, self.group, xs)
        if t == 1:
            i4_mv1(self.packed, self._s16, self._m16, x, xs, self.group, out, self.symmetric)
        else:
            i4_mv4(self.packed, self._s16, self._m16, x, xs, self.group, out, self.symmetric)
        return out

    def prepare(self, x: np.ndarray) -> "np.ndarray | Prepared":
        """Prefill input: rounded once for every matrix it multiplies (q/k/v, gate/up)."""
        x = self._check(x)
        if x.shape[0] <= common.FEW_ROWS or not self._tiles:
            return x
        if self._lanes:
            return Prepared(x, "w4a8-lanes", _round_w4a8_lanes(x))
        return Prepared(x, "w4a8-tiles", _round_w4a8(x))

    def matmul_prepared(self, p: "np.ndarray | Prepared") -> np.ndarray:
        if isinstance(p, Prepared) and p.x.shape[1] == self.shape[1] and (
                (p.kind == "w4a8-tiles" and self._tiles) or (p.kind == "w4a8-lanes" and self._lanes)):
            return self._matmul_w4a8(p.x, p.data)
        return super().matmul_prepared(p)

    def _matmul_w4a8(self, x: np.ndarray, rounded: tuple | None = None) -> np.ndarray:
        """Prefill: x in int8 per 32 values as in decode (``rounded``: already), integer tiles
        TOKEN_CHUNK tokens at a time: on VNNI with rows a multiple of LANE_GROUP wide 4 weight rows x
        3 tokens in block-lane order (`kernels.int4s.i4s_mm_lanes`), else 4 x 4 with folded block
        sums (`kernels.int4s.int4s_tile_dot`)."""
        t = x.shape[0]
        if self._lanes:
            xs, xc, xd = rounded if rounded is not None else _round_w4a8_lanes(x)
            out = np.empty((t, self.shape[0]), dtype=np.float32)
            for t0, t1 in _token_chunks(t):
                i4s_mm_lanes(self.packed.view(np.uint32), self._s16, xs, xc, xd, t0, t1, out)
            return out
        xq, xc4, xd4 = rounded if rounded is not None else _round_w4a8(x)
        out = np.empty((xq.shape[0], self.shape[0]), dtype=np.float32)
        for t0 in range(0, xq.shape[0], TOKEN_CHUNK):
            i4s_mm_w4a8(self.packed, self._s16, xq, xc4, xd4, t0 // 4, min(xq.shape[0], t0 + TOKEN_CHUNK) // 4,
                        common.HAVE_VNNI, out)
        return out[:t]

    def _make_operand(self) -> Int4sOp | Int4aOp | Int4RowsOp:
        """Decode rows (`run_product`), each computed as alone, weights read once: with AVX2 the
        symmetric kernel with x in int8 per 32 values (W4A8; 8-bit dot products on VNNI, else AVX2's
        8-bit multiply-add; tiles of 4 weight rows only for many activation rows: long rows stream
        faster one at a time here) or the asymmetric one with x in int16 per group (W4A16); without
        AVX2, the portable float kernel row by row."""
        if not common.HAVE_AVX2:
            return Int4RowsOp(self.packed, self._s16, self._m16, self.group, self.symmetric)
        if self.symmetric:
            return Int4sOp(self.packed, self._s16, common.HAVE_VNNI)
        return Int4aOp(self.packed, self._s16, self._m16, self.group, self.shape[1] >= LONG_ROW_SIMD)

    def __repr__(self):
        return f"Int4Matrix{self.shape}({'symmetric' if self.symmetric else f'group={self.group}'})"


def _check_group(k: int, group: int) -> None:
    if group not in Int4Matrix.GROUPS:
        raise ValueError(f"int4 group size must be one of {Int4Matrix.GROUPS}, got {group}")
    if k % group:
        raise ValueError(f"in features ({k}) must be divisible by the group size ({group})")


def quantize(w: np.ndarray, kind: str) -> "Int8Matrix | Int4Matrix":
    """``kind`` "int8" or "int4"; int4 falls back to int8 for a matrix whose input width is not a
    multiple of the group (only toy shapes: real Gemma widths are multiples of 256)."""
    if kind == "int4" and w.shape[1] % Int4Matrix.GROUPS[0] == 0:
        return Int4Matrix.quantize(w, symmetric=True)
    if kind not in ("int8", "int4"):
        raise ValueError(f"unknown quantization {kind!r}")
    return Int8Matrix.quantize(w)
