"""Weight matrices behind one small interface, whatever their storage.

Every projection, the token-embedding table (which is also the tied LM head) and the PLE
table are `Matrix` objects. The engine only ever asks a matrix for two things:

* ``rows(ids)``   -> float32 ``[n, cols]``: gather rows (embedding lookups). Only the rows
  asked for are read, so a memory-mapped table never comes into memory whole.
* ``matmul(x)``   -> float32 ``[T, rows]``: ``x @ W.T`` for float32 ``x`` of shape ``[T, cols]``
  (the PyTorch ``[out, in]`` convention: ``rows`` = out features, ``cols`` = in features).

Storage formats (float32, bfloat16/float16 memory-mapped, int8/int4, GGML blocks) each
implement this interface, so kernels and backends change without touching loading,
tokenization or sampling.
"""
from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from ..kernels import blas, common
from ..kernels.half import KIND_BF16, KIND_F16, ONE_ROW_COLS, ROWS, bf16_matmul, half_matmul, round_bf16
from ..kernels.numba_ops import matmul_tiles
from . import bf16
from .operands import F32Op, HalfOp, products_each, run_product, with_kernel


def __getattr__(name: str) -> Any:
    """``BF16``: numpy's bfloat16 dtype (`bf16.dtype`), imported on first use."""
    if name == "BF16":
        return bf16.dtype()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


FAULT_AROUND = 64 * 1024  # bytes the kernel maps around a faulting page of a cached file (its default)


def table_rows(w: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """``w[ids]`` (a copy). When ``w`` is a read-only file mapping (a checkpoint's embedding or
    PLE table), the pages the lookup brought into this process are dropped again afterwards:
    the kernel maps up to FAULT_AROUND bytes of cached file around every faulting page, so random
    token rows of E2B's 17.5 KiB PLE table added ~120 KiB of resident memory each, about 1 GiB
    over an 8,192-token prompt, none of it needed again (the file stays in the page cache; the
    next lookup maps what it needs again). Only the looked-up rows' aligned windows are dropped:
    the same mapping may be a product's weights (a tied LM head), whose pages must stay."""
    ids = np.asarray(ids, dtype=np.int64)
    out = w[ids]
    if ids.size and _read_only_mapping(w):
        _drop_rows(w, np.unique(ids % w.shape[0]))
    return out


def release_pages(a: np.ndarray) -> None:
    """Drop this process's pages of the C-contiguous ``a`` where it is a read-only file mapping
    that nothing reads again (a GGUF's Q5_0 tensor once the loader has expanded it): the resident
    set shrinks, the data stay as they are (a later read maps them back from the file). Anything
    else (a copy, no madvise) is left alone."""
    if a.size and _read_only_mapping(a):
        _drop_rows(a.reshape(1, -1), np.zeros(1, np.int64))  # one row: the whole array's pages


def _read_only_mapping(a: np.ndarray) -> bool:
    b: Any = a
    while b is not None:
        if isinstance(b, np.memmap):
            return b.mode == "r"
        b = getattr(b, "base", None)
    return False


def advise_random(a: np.ndarray, random: bool = True) -> None:
    """madvise(MADV_RANDOM) over the pages of ``a`` where it is a read-only file mapping: a table
    read a row at a time, never streamed (token embeddings that are no LM head, the PLE table). A
    fault on a page the page cache lacks then reads that page, not the disk's read-ahead window
    around it: 8 MiB on a cloud VM's virtio disk, where a cold row of E2B's PLE table took 6-12 ms
    (a tenth of a decode step) and takes 0.3-0.5 ms so advised. ``random`` False: the default
    again (MADV_NORMAL). A failure leaves the advice as it was."""
    if a.size and _read_only_mapping(a) and _madvise():
        base = a.ctypes.data
        first = base - base % _PAGE
        _MADVISE(first, base + a.nbytes - first, 1 if random else 0)  # MADV_RANDOM / MADV_NORMAL


def _madvise() -> Any:
    """libc's ``madvise`` (False where there is none)."""
    global _MADVISE
    if _MADVISE is None:
        import ctypes
        import sys

        libc = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None
        _MADVISE = libc.madvise if libc is not None else False
        if _MADVISE:
            _MADVISE.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return _MADVISE


def _drop_rows(a: np.ndarray, rows: np.ndarray) -> None:
    """madvise(MADV_DONTNEED) over the FAULT_AROUND-aligned windows that hold ``rows`` of the
    C-contiguous ``a`` (file-backed read-only: the pages read back from the file), clipped to
    ``a``'s own pages; adjacent windows are merged."""
    if not _madvise():
        return
    base, row = a.ctypes.data, a.strides[0]
    first, last = base - base % _PAGE, -(-(base + a.nbytes) // _PAGE) * _PAGE
    lo = np.maximum((base + rows * row) // FAULT_AROUND * FAULT_AROUND, first)
    hi = np.minimum(-(-(base + (rows + 1) * row) // FAULT_AROUND) * FAULT_AROUND, last)
    start, end = int(lo[0]), int(hi[0])
    for a0, a1 in zip(lo[1:].tolist(), hi[1:].tolist()):
        if a0 > end:
            _MADVISE(start, end - start, 4)  # MADV_DONTNEED; a failure only leaves them mapped
            start = a0
        end = max(end, a1)
    _MADVISE(start, end - start, 4)


_MADVISE: Any = None
_PAGE = __import__("mmap").PAGESIZE


class Prepared(NamedTuple):
    """An input converted once for several products (`Matrix.prepare`): ``kind`` names the
    conversion, ``data`` holds it; a matrix that cannot use it multiplies ``x``."""

    x: np.ndarray
    kind: str
    data: Any


class Matrix:
    """Base class: a 2-D weight of shape ``(rows, cols)`` = ``(out, in)``."""

    shape: tuple[int, int]
    uses_blas = True  # do products of many rows (prefill) call BLAS?
    # Does a product of more than FEW_ROWS rows compute each row as it would among any other
    # rows (so several sequences' prompts can share one product and get their own numbers)?
    # Not through BLAS, whose blocking may depend on the row count.
    independent_rows = False

    def uses_blas_for(self, rows: int) -> bool:
        """Does a product of ``rows`` activation rows call BLAS? (float formats: not up to SHORT_ROWS)"""
        return self.uses_blas and rows > common.FEW_ROWS

    @property
    def nbytes(self) -> int:  # bytes of weight data read by one full matmul
        raise NotImplementedError

    def rows(self, ids: np.ndarray) -> np.ndarray:
        raise NotImplementedError

    def lookup_only(self, only: bool = True) -> "Matrix":
        """Say that only `rows` reads this matrix (a table, never a product's weights): its
        file-mapped arrays get random-access advice (`advise_random`; ``only`` False takes it
        back). Returns the matrix."""
        for a in vars(self).values():
            if isinstance(a, np.ndarray):
                advise_random(a, only)
        return self

    def matmul(self, x: np.ndarray) -> np.ndarray:
        raise NotImplementedError

    def _check(self, x: np.ndarray) -> np.ndarray:
        """``x`` as C-contiguous float32 ``[T, cols]``; a ValueError naming both shapes otherwise."""
        x = np.ascontiguousarray(x, dtype=np.float32)
        if x.ndim != 2 or x.shape[1] != self.shape[1]:
            raise ValueError(f"x must be [T, {self.shape[1]}], got {x.shape}")
        return x

    def prepare(self, x: np.ndarray) -> np.ndarray | Prepared:
        """``x`` in the form this format's products take, for several matrices of the same input
        width and format (`matmul_all`); formats without a conversion return ``x``."""
        return x

    def matmul_prepared(self, p: np.ndarray | Prepared) -> np.ndarray:
        """``matmul`` of an input from `prepare` (of this matrix or a sibling)."""
        return self.matmul(p.x if isinstance(p, Prepared) else p)

    def matmul_each(self, x: np.ndarray) -> np.ndarray:
        """``matmul`` of each row of ``x`` on its own: row ``i`` of the result equals
        ``matmul(x[i:i+1])`` exactly (the rounding of a one-token decode step), for a batch of
        sequences decoding together. Formats with an `operand` run its product (the decode kernel,
        which reads the weights once for all rows; the one code a compiled decode step runs too);
        this fallback reads them once per row."""
        x = np.ascontiguousarray(x, dtype=np.float32)
        if x.ndim != 2 or x.shape[1] != self.shape[1]:
            raise ValueError(f"x must be [T, {self.shape[1]}], got {x.shape}")
        op = self.operand()
        if op is None:
            return np.concatenate([self.matmul(x[i : i + 1]) for i in range(x.shape[0])])
        return run_product(op, x) if x.shape[0] else np.empty((0, self.shape[0]), np.float32)

    def operand(self) -> Any:
        """This matrix as compiled code takes it (`weights.operands`: the arrays and the choices of
        its decode kernel, which depend on the CPU features `kernels.common` says, read now), or
        None for a format without one."""
        key = (common.HAVE_AVX2, common.HAVE_VNNI)
        cached = self.__dict__.get("_operand")
        if cached is None or cached[0] != key:
            op = self._make_operand()
            cached = self.__dict__["_operand"] = (key, None if op is None else with_kernel(op))
        return cached[1]

    def _make_operand(self) -> Any:
        return None

    def matmul_alike(self, x: np.ndarray) -> np.ndarray:
        """``matmul`` whose row ``i`` depends on ``x[i]`` alone -- not on the other rows, their
        number or the thread count -- for a graph whose rows must not depend on the batch they
        are packed into (the encoder: a text's vector is the same alone and among others).
        Formats whose many-row kernel computes rows independently take it for any row count;
        this fallback is `matmul_each`."""
        return self.matmul_each(x)

    def prepare_alike(self, x: np.ndarray) -> np.ndarray | Prepared:
        """`prepare` for `matmul_alike` (`matmul_alike_all`); formats without a conversion return ``x``."""
        return x

    def matmul_alike_prepared(self, p: np.ndarray | Prepared) -> np.ndarray:
        """`matmul_alike` of an input from `prepare_alike` (of this matrix or a sibling)."""
        return self.matmul_alike(p.x if isinstance(p, Prepared) else p)

    def dense(self) -> np.ndarray:
        """The whole matrix in float32 (tests and conversion only)."""
        return self.rows(np.arange(self.shape[0]))

    def _dequant_range(self, r0: int, out: np.ndarray) -> None:
        """Rows ``r0 .. r0 + len(out)`` in float32 into ``out`` (compressed storage only)."""
        raise NotImplementedError

    def _matmul_blocked(self, x: np.ndarray) -> np.ndarray:
        """Prefill of compressed storage through BLAS (`kernels.blas.products`): each tile of rows
        converted by a serial nogil kernel into its thread's scratch buffer, then multiplied; no
        float32 copy of the whole matrix."""
        k = self.shape[1]

        def tile(r0: int, r1: int) -> np.ndarray:
            blk = common.scratch((r1 - r0) * k).reshape(-1, k)
            self._dequant_range(r0, blk)
            return blk

        return blas.products(np.ascontiguousarray(x, dtype=np.float32), self.shape[0], tile)


class F32Matrix(Matrix):
    """A float32 matrix in memory: BLAS does the products of many rows, numba the few-row
    (decode) and short (``T <= SHORT_ROWS``: a query, a short prompt) ones."""

    def __init__(self, w: np.ndarray):
        assert w.ndim == 2
        self.w = np.ascontiguousarray(w, dtype=np.float32)
        self.shape = self.w.shape

    @property
    def nbytes(self) -> int:
        return self.w.nbytes

    def rows(self, ids: np.ndarray) -> np.ndarray:
        return table_rows(self.w, ids)

    def matmul(self, x: np.ndarray) -> np.ndarray:
        x = self._check(x)
        if x.shape[0] <= common.SHORT_ROWS:
            if x.shape[0] <= common.FEW_ROWS:
                return run_product(self.operand(), x)
            out = np.empty((x.shape[0], self.shape[0]), dtype=np.float32)
            matmul_tiles(x, self.w, out)
            return out
        return blas.products(x, self.shape[0], lambda r0, r1: self.w[r0:r1])

    def _make_operand(self) -> F32Op:
        return F32Op(self.w)

    def matmul_alike(self, x: np.ndarray) -> np.ndarray:
        """The numba tiles for any row count (each row summed on its own, never BLAS)."""
        x = self._check(x)
        out = np.empty((x.shape[0], self.shape[0]), dtype=np.float32)
        if x.shape[0]:
            matmul_tiles(x, self.w, out)
        return out

    def uses_blas_for(self, rows: int) -> bool:
        return rows > common.SHORT_ROWS


class HalfMatrix(Matrix):
    """A bfloat16 / float16 matrix used in place, in its stored dtype (typically memory-mapped
    from the checkpoint: loading copies nothing, memory holds 2 bytes per weight).

    Every product converts each weight in registers as it is read (`kernels.half.half_matmul`:
    float32 activations, one FMA per weight, 2 bytes read per weight; decode near memory
    bandwidth, prefill ~2x BLAS on blocks converted to float32), no BLAS call. Each row of a
    product is bit for bit its one-row product. With `common.BF16_DOT` (AVX-512 BF16, opted
    in), bfloat16 products of more than FEW_ROWS rows round the activations to bfloat16 and
    take ``vdpbf16ps`` (`kernels.half.bf16_matmul`, ~2x faster again). ``rows`` converts only
    the rows asked for.
    """

    uses_blas = False
    independent_rows = True

    def __init__(self, w: np.ndarray):
        assert w.ndim == 2 and (w.dtype == np.float16 or bf16.is_bf16(w.dtype)), w.dtype
        self.w = np.ascontiguousarray(w)  # no copy when contiguous (memory-mapped)
        self._bits = self.w.view(np.uint16)
        self._bf16 = bf16.is_bf16(w.dtype)
        self.shape = w.shape

    @property
    def nbytes(self) -> int:
        return self.w.nbytes

    def rows(self, ids: np.ndarray) -> np.ndarray:
        return table_rows(self.w, ids).astype(np.float32)

    def _dot(self, t: int) -> bool:
        """Does a product of ``t`` rows take bfloat16 activations (`common.BF16_DOT`)?"""
        return common.BF16_DOT and self._bf16 and t > common.FEW_ROWS

    def matmul(self, x: np.ndarray) -> np.ndarray:
        return self.matmul_prepared(self.prepare(x))

    def prepare(self, x: np.ndarray) -> np.ndarray | Prepared:
        x = self._check(x)
        if not self._dot(x.shape[0]):
            return x
        xb = np.empty(x.shape, dtype=np.uint16)
        round_bf16(x.view(np.uint32), xb)
        return Prepared(x, "bf16", xb)

    def matmul_prepared(self, p: np.ndarray | Prepared) -> np.ndarray:
        x = p.x if isinstance(p, Prepared) else self._check(p)
        if 0 < x.shape[0] <= common.FEW_ROWS:
            return run_product(self.operand(), x)
        out = np.empty((x.shape[0], self.shape[0]), dtype=np.float32)
        if isinstance(p, Prepared) and p.kind == "bf16" and self._dot(x.shape[0]):
            bf16_matmul(p.data, self._bits, out)
        else:
            half_matmul(x, self._bits, KIND_BF16 if self._bf16 else KIND_F16, self._rows_per_task(x.shape[0]), out)
        return out

    def _rows_per_task(self, t: int) -> int:
        return 1 if t <= common.FEW_ROWS and self.shape[1] <= ONE_ROW_COLS else ROWS

    def _make_operand(self) -> HalfOp:
        return HalfOp(self._bits, bool(self._bf16), self.shape[1] <= ONE_ROW_COLS)

    def __repr__(self):
        return f"HalfMatrix{self.shape}({'bfloat16' if self._bf16 else 'float16'})"


def matmul_all(mats: list[Matrix], x: np.ndarray) -> list[np.ndarray]:
    """``[m.matmul(x) for m in mats]`` with the input converted once (q/k/v, gate/up: int8's
    int16 rounding of a prefill input is then done once, not per matrix); one row (a decode
    step) as `matmul_each_all`."""
    if x.shape[0] == 1:
        return matmul_each_all(mats, x)
    if len(mats) == 1:
        return [mats[0].matmul(x)]
    p = mats[0].prepare(x)
    return [m.matmul_prepared(p) for m in mats]


def matmul_alike_all(mats: list[Matrix], x: np.ndarray) -> list[np.ndarray]:
    """``[m.matmul_alike(x) for m in mats]`` with the input converted once (the encoder's q/k/v,
    gate/up)."""
    if len(mats) == 1:
        return [mats[0].matmul_alike(x)]
    p = mats[0].prepare_alike(x)
    return [m.matmul_alike_prepared(p) for m in mats]


def matmul_each_all(mats: list[Matrix], x: np.ndarray) -> list[np.ndarray]:
    """``[m.matmul_each(x) for m in mats]``; products of the integer-SIMD formats in one parallel
    region (`operands.products_each`: what the compiled decode step runs)."""
    ops = [m.operand() for m in mats]
    if any(op is None for op in ops):
        return [m.matmul_each(x) for m in mats]
    return products_each(ops, np.ascontiguousarray(x, dtype=np.float32))


def as_matrix(w: np.ndarray, *, keep_half: bool = False) -> Matrix:
    """Wrap a stored 2-D tensor: half-precision stays as stored if ``keep_half``, else float32."""
    if keep_half and (w.dtype == np.float16 or bf16.is_bf16(w.dtype)):
        return HalfMatrix(w)
    return F32Matrix(w)
