"""gemmalite's weight storage mapped onto ONNX's weight-only quantized operators, value for value.

Two encodings of one quantized matrix ``W [out, in]`` (``y = x @ W.T``):

* ``matmulnbits``: ONNX Runtime's ``com.microsoft.MatMulNBits`` (CPU and GPU providers): ``B``
  uint8 ``[out, in / block, block * bits / 8]``, float32 ``scales [out * in / block]``, no
  zero-point input (the default, ``2^(bits-1)``): ``W[r, k] = (B[r, k] - 2^(bits-1)) * scale``.
  4-bit blocks hold value ``2j`` in byte ``j``'s low nibble and ``2j + 1`` in its high one.
* ``qdq``: ``DequantizeLinear`` on signed integers ``[in, out]`` feeding ``MatMul`` (the QDQ
  form NPU toolchains take): int8 with a float32 scale per output column (``axis=1``), or int4
  (opset 21) with a scale per 32 inputs of each column (``axis=0, block_size=32``).

Where they match (exactly: the dequantized float32 weights are ours, bit for bit):

* `Int8Matrix` (symmetric int8, a float32 scale per output row, ``q`` in -127..127): 8 bits,
  ``B = q + 128``, the row's scale repeated over its ``in / block`` blocks (``INT8_BLOCK``
  values each; a row whose width is no multiple of it is padded with zeros, which add nothing).
* `Int4Matrix`, symmetric (a float16 scale per 32 values, ``W = scale * (n - 8)``, ``n`` 0..15):
  4 bits, blocks of 32, the nibbles re-paired (ours pair value ``j`` with ``j + 16``), the
  scales widened to float32 (exact).

Where they do not: the asymmetric int4 of checkpoints converted before the symmetric format
(``W = scale * n + min``, a float16 ``min`` per group) has no integer zero point, and GGML's
block formats (GGUF files) are not mapped; both are refused by name (`weight_kind`).
"""
from __future__ import annotations

import numpy as np
from onnx import TensorProto

from ...errors import ConfigError
from ...weights.matrix import F32Matrix, HalfMatrix, Matrix
from ...weights.quant import Int4Matrix, Int8Matrix

QUANT_FORMATS = ("matmulnbits", "qdq")
INT8_BLOCK = 128  # int8 values per MatMulNBits block (its activations are rounded per block at accuracy_level 4)
INT4_BLOCK = 32


def weight_kind(m: Matrix, where: str) -> str:
    """``"float"``, ``"int8"`` or ``"int4"``; `ConfigError` naming ``where`` for storage with no exact form."""
    if isinstance(m, (F32Matrix, HalfMatrix)):
        return "float"
    if isinstance(m, Int8Matrix):
        return "int8"
    if isinstance(m, Int4Matrix):
        if not m.symmetric:
            raise ConfigError(f"ONNX export: {where} is asymmetric int4 (a float min per group of {m.group}); "
                              "ONNX's int4 operators take an integer zero point, so it has no exact form: convert "
                              "the original checkpoint again with gemmalite convert --quant int4 (symmetric)")
        return "int4"
    raise ConfigError(f"ONNX export takes float, int8 or symmetric int4 weights; {where} is "
                      f"{type(m).__name__} (GGUF blocks are not mapped: export the Hugging Face checkpoint)")


def int4_values(m: Int4Matrix) -> np.ndarray:
    """The stored 4-bit codes ``n`` (0..15) of a symmetric `Int4Matrix`, uint8 ``[out, in]`` in order."""
    n, k = m.shape
    p = m.packed.reshape(n, k // INT4_BLOCK, INT4_BLOCK // 2)
    return np.concatenate([p & 15, p >> 4], axis=2).reshape(n, k)


def _int8_block(k: int) -> int:
    return INT8_BLOCK if k >= INT8_BLOCK else max(16, 1 << (k - 1).bit_length())


def nbits_attrs(m: Int8Matrix | Int4Matrix) -> dict:
    """MatMulNBits' attributes for ``m``."""
    n, k = m.shape
    if isinstance(m, Int8Matrix):
        return {"K": k, "N": n, "bits": 8, "block_size": _int8_block(k)}
    return {"K": k, "N": n, "bits": 4, "block_size": INT4_BLOCK}


def nbits_tensors(m: Int8Matrix | Int4Matrix) -> tuple[np.ndarray, np.ndarray]:
    """MatMulNBits' ``B`` (uint8 ``[out, blocks, block * bits / 8]``) and ``scales`` (float32 ``[out * blocks]``)."""
    n, k = m.shape
    block = nbits_attrs(m)["block_size"]
    blocks = -(-k // block)
    if isinstance(m, Int8Matrix):
        b = np.full((n, blocks * block), 128, np.uint8)
        b[:, :k] = m.q.view(np.uint8) ^ 0x80  # two's complement q + 128
        return b.reshape(n, blocks, block), np.repeat(m.scale, blocks).astype(np.float32)
    v = int4_values(m).reshape(n, blocks, block)
    return (v[..., 0::2] | (v[..., 1::2] << 4)).astype(np.uint8), m.scales.astype(np.float32).reshape(-1)


def qdq_attrs(m: Int8Matrix | Int4Matrix) -> dict:
    """DequantizeLinear's attributes for ``m`` (its weight is ``[in, out]``)."""
    return {"axis": 1} if isinstance(m, Int8Matrix) else {"axis": 0, "block_size": INT4_BLOCK}


def qdq_tensors(m: Int8Matrix | Int4Matrix) -> tuple[np.ndarray, int, list[int], np.ndarray]:
    """DequantizeLinear's weight (raw bytes, its ONNX type, its dims ``[in, out]``) and float32 scale."""
    n, k = m.shape
    if isinstance(m, Int8Matrix):
        return np.ascontiguousarray(m.q.T), TensorProto.INT8, [k, n], m.scale.astype(np.float32)
    v = (int4_values(m).T.astype(np.int8) - 8).reshape(-1).view(np.uint8) & 15  # signed int4, two's complement
    if v.size % 2:
        v = np.append(v, np.uint8(0))
    packed = (v[0::2] | (v[1::2] << 4)).astype(np.uint8)  # element 2i in the low nibble (ONNX's INT4 packing)
    scale = np.ascontiguousarray(m.scales.T).astype(np.float32)  # [in / 32, out]
    return packed, TensorProto.INT4, [k, n], scale


def dequantized(m: Int8Matrix | Int4Matrix, fmt: str) -> np.ndarray:
    """``W [out, in]`` float32 as the ONNX encoding defines it (tests: equal to ``m.dense()``)."""
    n, k = m.shape
    if fmt == "matmulnbits":
        a = nbits_attrs(m)
        b, s = nbits_tensors(m)
        if a["bits"] == 4:
            v = np.empty((n, b.shape[1], a["block_size"]), np.uint8)
            v[..., 0::2], v[..., 1::2] = b & 15, b >> 4
        else:
            v = b
        w = (v.astype(np.float32) - 2 ** (a["bits"] - 1)) * s.reshape(n, -1, 1)
        return w.reshape(n, -1)[:, :k]
    q, dtype, dims, scale = qdq_tensors(m)
    if dtype == TensorProto.INT8:
        return (q.astype(np.float32) * scale).T
    v = np.empty(q.size * 2, np.uint8)
    v[0::2], v[1::2] = q & 15, q >> 4
    s = v[:k * n].astype(np.int8)
    s = np.where(s > 7, s - 16, s).astype(np.float32).reshape(k, n)
    return (s * np.repeat(scale, INT4_BLOCK, axis=0)[:k]).T
