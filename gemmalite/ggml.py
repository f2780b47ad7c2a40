"""GGML block formats (llama.cpp's weight storage) behind the `Matrix` interface.

A GGUF tensor stays as its raw memory-mapped blocks; only what a call needs is decoded:

* ``rows(ids)``  decodes just those rows (embedding lookups into a 262k-row table).
* ``matmul(x)``  for a few tokens (decode, ``T <= DECODE_MAX_T``) runs a numba kernel that
  decodes one row at a time into a per-thread buffer and dots it with each ``x`` row in
  float32, parallel over output rows: the weights cross the memory bus once, still compressed.
  For longer inputs (prefill) it decodes ``ROW_BLOCK``-sized slabs of rows to float32 and lets
  BLAS multiply them, so the float32 copy never exceeds one slab.

Numerics: every decoder reproduces the float32 operations of the reference dequantizers in
``gguf.quants`` (llama.cpp's ``dequantize_row_*``) bit for bit, e.g. Q4_K computes
``(d*sc)*q - (dmin*m)``. Products then use exactly those weights and float32 ``x``; there is
no activation quantization (llama.cpp quantizes ``x`` to Q8 for its dot products, we do not),
so the result equals float32 math on the dequantized matrix up to summation order.
Decoders are compiled with ``fastmath=False`` (no FMA contraction, no reassociation), so the
decoded weights are exact; only the float32 dot product (`_dot`) allows reassociation, which
lets LLVM vectorise the sum.
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from .matrix import BF16, Matrix

QK_K = 256
DECODE_MAX_T = 4  # inputs with at most this many rows use the fused decode kernel
SLAB_BYTES = 4 << 20  # float32 bytes per dequantized slab in the prefill path
ROW_CHUNK = 16  # output rows per parallel work item in the decode kernel

# GGML type id -> (name, elements per block, bytes per block); ids from ggml.h
GGML_TYPES: dict[int, tuple[str, int, int]] = {
    0: ("F32", 1, 4),
    1: ("F16", 1, 2),
    2: ("Q4_0", 32, 18),
    3: ("Q4_1", 32, 20),
    6: ("Q5_0", 32, 22),
    7: ("Q5_1", 32, 24),
    8: ("Q8_0", 32, 34),
    12: ("Q4_K", QK_K, 144),
    13: ("Q5_K", QK_K, 176),
    14: ("Q6_K", QK_K, 210),
    30: ("BF16", 1, 2),
}
_BY_NAME = {v[0]: k for k, v in GGML_TYPES.items()}
FLOAT_TYPES = ("F32", "F16", "BF16")

# float16 bit pattern -> float32 (exact), the same table trick as ggml's ggml_table_f32_f16
_F16 = np.arange(1 << 16, dtype=np.uint16).view(np.float16).astype(np.float32)


def type_name(qtype) -> str:
    """Normalise a GGML type given as id, name or ``gguf.GGMLQuantizationType``."""
    if isinstance(qtype, str):
        name = qtype.upper()
        if name not in _BY_NAME:
            raise ValueError(f"unsupported GGML type {qtype!r}")
        return name
    tid = int(qtype)
    if tid not in GGML_TYPES:
        raise ValueError(f"unsupported GGML type id {tid} ({getattr(qtype, 'name', '?')})")
    return GGML_TYPES[tid][0]


def block_info(qtype) -> tuple[int, int]:
    """(elements per block, bytes per block) of a type."""
    _, bs, ts = GGML_TYPES[_BY_NAME[type_name(qtype)]]
    return bs, ts


def row_bytes(qtype, cols: int) -> int:
    bs, ts = block_info(qtype)
    if cols % bs:
        raise ValueError(f"{type_name(qtype)} rows need a multiple of {bs} columns, got {cols}")
    return cols // bs * ts


# ---------------------------------------------------------------------------------------------
# Block decoders: dec(row, b, dst, o, tab) writes block b of the byte row into dst[o:o+bs].
# `tab` is the float16 -> float32 table. All arithmetic is float32, in the reference order.
# ---------------------------------------------------------------------------------------------


@njit(inline="always", cache=True)
def _half(row, o, tab):
    return tab[np.int64(row[o]) | (np.int64(row[o + 1]) << 8)]


@njit(inline="always", cache=True)
def _u32(row, o):
    return (np.int64(row[o]) | (np.int64(row[o + 1]) << 8)
            | (np.int64(row[o + 2]) << 16) | (np.int64(row[o + 3]) << 24))


@njit(inline="always", cache=True)
def _legacy32(row, o, dst, do, tab, has_min, has_high):
    """Q4_0 / Q4_1 / Q5_0 / Q5_1: element j is the low nibble of qs[j], j+16 the high one;
    the 5-bit types take bit j of the 32-bit ``qh`` as bit 4. Without a min: d*(q - offset)."""
    d = _half(row, o, tab)
    p = o + 2
    m = np.float32(0.0)
    if has_min:
        m = _half(row, p, tab)
        p += 2
    qh = 0
    if has_high:
        qh = _u32(row, p)
        p += 4
    off = 16 if has_high else 8
    for j in range(16):
        v = np.int64(row[p + j])
        q0 = v & 15
        q1 = v >> 4
        if has_high:
            q0 |= ((qh >> j) & 1) << 4
            q1 |= ((qh >> (j + 16)) & 1) << 4
        if has_min:
            dst[do + j] = d * np.float32(q0) + m
            dst[do + j + 16] = d * np.float32(q1) + m
        else:
            dst[do + j] = d * np.float32(q0 - off)
            dst[do + j + 16] = d * np.float32(q1 - off)


@njit(inline="always", cache=True)
def dec_q4_0(row, b, dst, do, tab):
    _legacy32(row, b * 18, dst, do, tab, False, False)


@njit(inline="always", cache=True)
def dec_q4_1(row, b, dst, do, tab):
    _legacy32(row, b * 20, dst, do, tab, True, False)


@njit(inline="always", cache=True)
def dec_q5_0(row, b, dst, do, tab):
    _legacy32(row, b * 22, dst, do, tab, False, True)


@njit(inline="always", cache=True)
def dec_q5_1(row, b, dst, do, tab):
    _legacy32(row, b * 24, dst, do, tab, True, True)


@njit(inline="always", cache=True)
def dec_q8_0(row, b, dst, do, tab):
    o = b * 34
    d = _half(row, o, tab)
    for i in range(32):
        dst[do + i] = np.float32(np.int8(row[o + 2 + i])) * d


@njit(inline="always", cache=True)
def _scale_min_k4(row, s, j):
    """6-bit scale and min of sub-block j from the 12 packed bytes at row[s:] (get_scale_min_k4)."""
    if j < 4:
        return np.int64(row[s + j]) & 63, np.int64(row[s + j + 4]) & 63
    sc = (np.int64(row[s + j + 4]) & 15) | ((np.int64(row[s + j - 4]) >> 6) << 4)
    mn = (np.int64(row[s + j + 4]) >> 4) | ((np.int64(row[s + j]) >> 6) << 4)
    return sc, mn


@njit(inline="always", cache=True)
def _k4(row, o, dst, do, tab, has_high):
    """Q4_K / Q5_K: 8 sub-blocks of 32, value (d*sc)*q - (dmin*m). Bytes 32c..32c+31 of qs hold
    sub-block 2c in the low nibbles, 2c+1 in the high ones; Q5_K's qh bit j is bit 4 of sub-block j."""
    d = _half(row, o, tab)
    dmin = _half(row, o + 2, tab)
    s = o + 4
    qh = o + 16
    qs = o + 48 if has_high else o + 16
    for c in range(4):
        sc0, m0 = _scale_min_k4(row, s, 2 * c)
        sc1, m1 = _scale_min_k4(row, s, 2 * c + 1)
        d0 = d * np.float32(sc0)
        dm0 = dmin * np.float32(m0)
        d1 = d * np.float32(sc1)
        dm1 = dmin * np.float32(m1)
        base = do + 64 * c
        for l in range(32):
            v = np.int64(row[qs + 32 * c + l])
            q0 = v & 15
            q1 = v >> 4
            if has_high:
                h = np.int64(row[qh + l])
                q0 |= ((h >> (2 * c)) & 1) << 4
                q1 |= ((h >> (2 * c + 1)) & 1) << 4
            dst[base + l] = d0 * np.float32(q0) - dm0
            dst[base + 32 + l] = d1 * np.float32(q1) - dm1


@njit(inline="always", cache=True)
def dec_q4_k(row, b, dst, do, tab):
    _k4(row, b * 144, dst, do, tab, False)


@njit(inline="always", cache=True)
def dec_q5_k(row, b, dst, do, tab):
    _k4(row, b * 176, dst, do, tab, True)


@njit(inline="always", cache=True)
def dec_q6_k(row, b, dst, do, tab):
    """Q6_K: two halves of 128; in half h, element 32*j + l (j < 4) takes its low 4 bits from
    ql[64h + 32*(j%2) + l] (nibble j//2), its top 2 bits from qh[32h + l] >> 2j; value
    (d*scale[e//16]) * (q - 32)."""
    o = b * 210
    ql = o
    qh = o + 128
    sc = o + 192
    d = _half(row, o + 208, tab)
    for h in range(2):
        for j in range(4):
            ds0 = d * np.float32(np.int8(row[sc + 8 * h + 2 * j]))
            ds1 = d * np.float32(np.int8(row[sc + 8 * h + 2 * j + 1]))
            lo = ql + 64 * h + 32 * (j & 1)
            shift = 4 * (j >> 1)
            base = do + 128 * h + 32 * j
            for l in range(32):
                q = ((np.int64(row[lo + l]) >> shift) & 15) | (((np.int64(row[qh + 32 * h + l]) >> (2 * j)) & 3) << 4)
                dsl = ds0 if l < 16 else ds1
                dst[base + l] = dsl * np.float32(q - 32)


# Kernels take the block type as a small integer and branch per block (a well-predicted
# branch): passing decoder functions as arguments would defeat numba's on-disk cache.
_KINDS = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K")


@njit(inline="always", cache=True)
def _decode(kind, row, b, dst, do, tab):
    if kind == 0:
        dec_q4_0(row, b, dst, do, tab)
    elif kind == 1:
        dec_q4_1(row, b, dst, do, tab)
    elif kind == 2:
        dec_q5_0(row, b, dst, do, tab)
    elif kind == 3:
        dec_q5_1(row, b, dst, do, tab)
    elif kind == 4:
        dec_q8_0(row, b, dst, do, tab)
    elif kind == 5:
        dec_q4_k(row, b, dst, do, tab)
    elif kind == 6:
        dec_q5_k(row, b, dst, do, tab)
    else:
        dec_q6_k(row, b, dst, do, tab)


# ---------------------------------------------------------------------------------------------
# Drivers, shared by every block type.
# ---------------------------------------------------------------------------------------------


@njit(cache=True, fastmath={"reassoc"})
def _dot(a, b):
    """float32 dot product. Only reassociation is allowed (no FMA contraction, no other
    fast-math): it lets LLVM keep vector partial sums, i.e. float32 accumulation in a
    different order, while the decoded weights stay exact (they are computed elsewhere)."""
    s = np.float32(0.0)
    for i in range(a.shape[0]):
        s += a[i] * b[i]
    return s


@njit(parallel=True, cache=True)
def _dequant_rows(raw, ids, out, kind, bs, tab):
    nb = out.shape[1] // bs
    for i in prange(ids.shape[0]):
        row = raw[ids[i]]
        dst = out[i]
        for b in range(nb):
            _decode(kind, row, b, dst, b * bs, tab)


@njit(parallel=True, cache=True)
def _matvec(raw, x, out, kind, bs, tab):
    """out[t, r] = w[r] . x[t] for a few rows of x: each row is decoded once into a per-thread
    buffer (L1/L2 resident) and dotted with every x row; parallel over chunks of rows."""
    n_rows = raw.shape[0]
    n_t, cols = x.shape
    nb = cols // bs
    n_chunks = (n_rows + ROW_CHUNK - 1) // ROW_CHUNK
    for c in prange(n_chunks):
        buf = np.empty(cols, np.float32)
        for r in range(c * ROW_CHUNK, min(n_rows, (c + 1) * ROW_CHUNK)):
            row = raw[r]
            for b in range(nb):
                _decode(kind, row, b, buf, b * bs, tab)
            for t in range(n_t):
                out[t, r] = _dot(buf, x[t])


# ---------------------------------------------------------------------------------------------
# Float formats: plain numpy views of the stored bytes.
# ---------------------------------------------------------------------------------------------


def _float_rows(raw: np.ndarray, name: str, cols: int) -> np.ndarray:
    """The raw [rows, bytes] array viewed as [rows, cols] of its stored float dtype."""
    dt = {"F32": np.dtype("<f4"), "F16": np.dtype("<f2"), "BF16": BF16}[name]
    return raw.view(dt).reshape(raw.shape[0], cols)


def _to_f32(w: np.ndarray) -> np.ndarray:
    return np.asarray(w, dtype=np.float32)


# ---------------------------------------------------------------------------------------------


class GGMLMatrix(Matrix):
    """A weight ``[rows, cols]`` kept as GGML blocks (e.g. a memory-mapped GGUF tensor).

    ``raw`` is uint8 with ``rows * row_bytes`` bytes (any shape; it is viewed as
    ``[rows, row_bytes]`` without copying). Float types (F32/F16/BF16) are served by numpy.
    """

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
        if self.qtype in FLOAT_TYPES:
            self._w = _float_rows(self.raw, self.qtype, cols)
            self._kind = -1
        else:
            self._w = None
            self._kind = _KINDS.index(self.qtype)

    def __repr__(self) -> str:
        return f"GGMLMatrix({self.qtype}, {self.shape})"

    @property
    def nbytes(self) -> int:
        return self.raw.nbytes

    def rows(self, ids: np.ndarray) -> np.ndarray:
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        if ids.size and (ids.min() < 0 or ids.max() >= self.shape[0]):
            raise IndexError(f"row ids out of range for {self!r}")
        if self._w is not None:
            return _to_f32(self._w[ids])
        out = np.empty((ids.size, self.shape[1]), dtype=np.float32)
        if ids.size:
            _dequant_rows(self.raw, ids, out, self._kind, self.block_size, _F16)
        return out

    def _slab(self, r0: int, r1: int) -> np.ndarray:
        if self._w is not None:
            return _to_f32(self._w[r0:r1])
        return self.rows(np.arange(r0, r1))

    def matmul(self, x: np.ndarray) -> np.ndarray:
        x = np.ascontiguousarray(x, dtype=np.float32)
        squeeze = x.ndim == 1
        x2 = x.reshape(1, -1) if squeeze else x
        if x2.shape[1] != self.shape[1]:
            raise ValueError(f"matmul: x has {x2.shape[1]} columns, {self!r} needs {self.shape[1]}")
        n_t = x2.shape[0]
        if self.qtype == "F32":
            out = x2 @ self._w.T
        elif self._kind >= 0 and 0 < n_t <= DECODE_MAX_T:
            out = np.empty((n_t, self.shape[0]), dtype=np.float32)
            _matvec(self.raw, x2, out, self._kind, self.block_size, _F16)
        else:
            out = np.empty((n_t, self.shape[0]), dtype=np.float32)
            step = max(64, SLAB_BYTES // (4 * self.shape[1]))
            for r0 in range(0, self.shape[0], step):
                r1 = min(self.shape[0], r0 + step)
                out[:, r0:r1] = x2 @ self._slab(r0, r1).T
        return out[0] if squeeze else out


def dequantize(raw: np.ndarray, qtype, shape: tuple[int, ...]) -> np.ndarray:
    """The whole tensor in float32 (tests and conversion); ``shape`` is row-major, last = cols."""
    shape = tuple(int(s) for s in shape)
    cols = shape[-1]
    rows = int(np.prod(shape[:-1])) if len(shape) > 1 else 1
    return GGMLMatrix(raw, qtype, (rows, cols)).dense().reshape(shape)


def quantized_nbytes(qtype, shape: tuple[int, ...]) -> int:
    """Bytes a tensor of this type and (row-major) shape occupies."""
    rows = int(np.prod(shape[:-1])) if len(shape) > 1 else 1
    return rows * row_bytes(qtype, int(shape[-1]))
