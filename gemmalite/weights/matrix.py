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

import numpy as np

from ..kernels import common
from ..kernels.numba_ops import bf16_matmul_small, f32_matmul_small

try:  # bfloat16 is only a storage format here; math is float32
    import ml_dtypes

    BF16 = np.dtype(ml_dtypes.bfloat16)
except ImportError:  # pragma: no cover - ml_dtypes is a dependency
    BF16 = None

ROW_BLOCK = 4096  # rows converted per block when a half-precision table is multiplied


class Matrix:
    """Base class: a 2-D weight of shape ``(rows, cols)`` = ``(out, in)``."""

    shape: tuple[int, int]
    uses_blas = True  # do products of many rows (prefill) call BLAS? (see DecoderGraph)

    @property
    def nbytes(self) -> int:  # bytes of weight data read by one full matmul
        raise NotImplementedError

    def rows(self, ids: np.ndarray) -> np.ndarray:
        raise NotImplementedError

    def matmul(self, x: np.ndarray) -> np.ndarray:
        raise NotImplementedError

    def matmul_each(self, x: np.ndarray) -> np.ndarray:
        """``matmul`` of each row of ``x`` on its own: row ``i`` of the result equals
        ``matmul(x[i:i+1])`` exactly (the rounding of a one-token decode step), for a batch of
        sequences decoding together. Formats whose one-row kernel serves several rows read the
        weights once per call; this fallback reads them once per row."""
        return np.concatenate([self.matmul(x[i : i + 1]) for i in range(x.shape[0])])

    def _each_in_chunks(self, x: np.ndarray, rows: int) -> np.ndarray:
        """``matmul_each`` for formats whose few-row kernel computes each row as it computes one."""
        return np.concatenate([self.matmul(x[i : i + rows]) for i in range(0, x.shape[0], rows)])

    def dense(self) -> np.ndarray:
        """The whole matrix in float32 (tests and conversion only)."""
        return self.rows(np.arange(self.shape[0]))


class F32Matrix(Matrix):
    """A float32 matrix in memory: BLAS does the products, numba the few-row (decode) ones."""

    def __init__(self, w: np.ndarray):
        assert w.ndim == 2
        self.w = np.ascontiguousarray(w, dtype=np.float32)
        self.shape = self.w.shape

    @property
    def nbytes(self) -> int:
        return self.w.nbytes

    def rows(self, ids: np.ndarray) -> np.ndarray:
        return self.w[np.asarray(ids, dtype=np.int64)]

    def matmul(self, x: np.ndarray) -> np.ndarray:
        x = np.ascontiguousarray(x, dtype=np.float32)
        if x.ndim == 2 and x.shape[0] <= common.FEW_ROWS and x.shape[1] == self.shape[1]:
            out = np.empty((x.shape[0], self.shape[0]), dtype=np.float32)
            f32_matmul_small(x, self.w, out)
            return out
        return x @ self.w.T

    def matmul_each(self, x: np.ndarray) -> np.ndarray:
        return self._each_in_chunks(x, common.FEW_ROWS)


class HalfMatrix(Matrix):
    """A bfloat16 / float16 matrix left in its stored dtype (typically memory-mapped).

    Rows are converted to float32 only when asked for; a product converts blocks of rows,
    so no float32 copy of the whole table is ever made.
    """

    def __init__(self, w: np.ndarray):
        assert w.ndim == 2 and w.dtype in (np.float16, BF16), w.dtype
        self.w = w
        self.shape = w.shape

    @property
    def nbytes(self) -> int:
        return self.w.nbytes

    def rows(self, ids: np.ndarray) -> np.ndarray:
        return self.w[np.asarray(ids, dtype=np.int64)].astype(np.float32)

    def matmul(self, x: np.ndarray) -> np.ndarray:
        x = np.ascontiguousarray(x, dtype=np.float32)
        out = np.empty((x.shape[0], self.shape[0]), dtype=np.float32)
        if self.w.dtype == BF16 and x.shape[0] <= common.FEW_ROWS:
            bf16_matmul_small(x, self.w.view(np.uint16), out)
            return out
        for r0 in range(0, self.shape[0], ROW_BLOCK):
            blk = self.w[r0 : r0 + ROW_BLOCK].astype(np.float32)
            out[:, r0 : r0 + blk.shape[0]] = x @ blk.T
        return out

    def matmul_each(self, x: np.ndarray) -> np.ndarray:
        return self._each_in_chunks(x, common.FEW_ROWS) if self.w.dtype == BF16 else super().matmul_each(x)


def as_matrix(w: np.ndarray, *, keep_half: bool = False) -> Matrix:
    """Wrap a stored 2-D tensor: half-precision stays as stored if ``keep_half``, else float32."""
    if keep_half and w.dtype in (np.float16, BF16):
        return HalfMatrix(w)
    return F32Matrix(w)
