"""GGML block formats: decoding is bit-exact against gguf-py's reference dequantizers, products
are float32 math on those weights, and every code path (gather, fused kernel, BLAS slabs) agrees."""
from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf import quants

from gemmalite.kernels import common
from gemmalite.kernels import ggml as ggml_kernels
from gemmalite.kernels.common import HAVE_AVX2
from gemmalite.kernels.ggml import block_info
from gemmalite.weights import ggml
from gemmalite.weights.ggml import GGMLMatrix, dequantize

QUANT = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"]
FLOAT = ["F32", "F16", "BF16"]
ROWS, COLS = 40, 512


def make_raw(name: str, rows: int = ROWS, cols: int = COLS, seed: int = 0) -> np.ndarray:
    """[rows, row_bytes] uint8: quantized by gguf-py where it can, else random bytes with sane
    float16 scales (the K-quant decoders take any bit pattern for the quants)."""
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((rows, cols)) * rng.uniform(0.01, 3.0, size=(rows, 1))).astype(np.float32)
    try:
        return np.ascontiguousarray(quants.quantize(w, Q[name])).view(np.uint8).reshape(rows, -1)
    except NotImplementedError:
        bs, ts = block_info(name)
        raw = rng.integers(0, 256, size=(rows, cols // bs, ts), dtype=np.uint8)
        d = rng.uniform(1e-4, 0.05, size=(rows, cols // bs, 2)).astype(np.float16).view(np.uint8)
        if name in ("Q4_K", "Q5_K"):  # d, dmin at bytes 0..3
            raw[..., 0:4] = d.reshape(rows, cols // bs, 4)
        else:  # Q6_K: d at the end
            raw[..., 208:210] = d[..., :2]
        return raw.reshape(rows, -1)


def reference(raw: np.ndarray, name: str) -> np.ndarray:
    return quants.dequantize(raw, Q[name]).reshape(raw.shape[0], -1).astype(np.float32)


W8A16 = ("Q8_0", "Q5_0", "Q4_K", "Q5_K", "Q6_K")  # decode rows (AVX2) against int16 activations per 32 values


def close_to_f64(y: np.ndarray, x: np.ndarray, w: np.ndarray, name: str = "") -> None:
    """float32 accumulation error bound: |y - x@w.T| <= 1e-5 * (|x| @ |w|.T) (+ denormal slack),
    plus, where decode rounds x to int16 per 32 values (W8A16: up to FEW_ROWS rows, AVX2), half a
    rounding step per value: |w| @ (max|x| per 32 / 32767 / 2)."""
    x64, w64 = x.astype(np.float64), w.astype(np.float64)
    ref = x64 @ w64.T
    bound = 1e-5 * (np.abs(x64) @ np.abs(w64).T) + 1e-30
    if name in W8A16 and x.shape[0] <= common.FEW_ROWS and common.HAVE_AVX2:
        step = np.repeat(np.abs(x64.reshape(x.shape[0], -1, 32)).max(2) / 32767 / 2, 32, axis=1)
        bound += step @ np.abs(w64).T
    assert np.all(np.abs(y - ref) <= bound), float(np.max(np.abs(y - ref) / bound))


@pytest.mark.parametrize("name", QUANT + FLOAT)
def test_dequantize_matches_gguf_reference_bit_for_bit(name):
    raw = make_raw(name)
    ref = reference(raw, name)
    assert np.array_equal(dequantize(raw, name, (ROWS, COLS)), ref)
    ids = np.array([7, 0, ROWS - 1, 7, 3])
    assert np.array_equal(GGMLMatrix(raw, name, (ROWS, COLS)).rows(ids), ref[ids])


@pytest.mark.parametrize("name", QUANT + FLOAT)
@pytest.mark.parametrize("t", [1, 3, 37, ggml.FUSED_MAX_T, ggml.FUSED_MAX_T + 1])
def test_matmul_is_float32_math_on_dequantized_weights(name, t):
    """(Q8_0 / Q5_0 decode: with the int16 activation rounding of the W8A16 kernel.)"""
    raw = make_raw(name, seed=1)
    w = reference(raw, name)
    x = np.random.default_rng(t).standard_normal((t, COLS)).astype(np.float32)
    y = GGMLMatrix(raw, name, (ROWS, COLS)).matmul(x)
    assert y.shape == (t, ROWS) and y.dtype == np.float32
    close_to_f64(y, x, w, name)


@pytest.mark.skipif(not HAVE_AVX2, reason="no AVX2 on this CPU")
@pytest.mark.parametrize("name", W8A16)
def test_w8a16_decode_is_exact_math_on_rounded_activations(name):
    """Decode rows (W8A16) are float64 math on the reference dequantizer's weights and the
    activations as rounded (int16 per 32 values, `simd.int16_activation_rows`) to float32
    accumulation error: the integer block / sub-block sums are exact, whatever their scales and
    mins. Several rows at once (a batch, up to 9) give each row bit for bit its one-row result."""
    from gemmalite.kernels.simd import int16_activation_rows

    raw = make_raw(name, seed=6)
    w = reference(raw, name).astype(np.float64)
    m = GGMLMatrix(raw, name, (ROWS, COLS))
    x = (np.random.default_rng(8).standard_normal((9, COLS)) * 3).astype(np.float32)
    xq, xd = int16_activation_rows(x, 32)
    xr = (xq.astype(np.float64).reshape(9, -1, 32) * xd.astype(np.float64)[:, :, None]).reshape(9, COLS)
    y = m.matmul_each(x)
    bound = 1e-5 * (np.abs(xr) @ np.abs(w).T) + 1e-30
    assert np.all(np.abs(y - xr @ w.T) <= bound), float(np.max(np.abs(y - xr @ w.T) / bound))
    for t in range(9):
        assert np.array_equal(m.matmul(x[t : t + 1]), y[t : t + 1])
    assert np.array_equal(m.matmul(x[:4]), y[:4])


@pytest.mark.parametrize("name", QUANT)
def test_parallel_fused_kernel(name, monkeypatch):
    """Small matrices stay on the calling thread; force the thread-pool kernel (ragged last chunk)."""
    monkeypatch.setattr(ggml, "PARALLEL_MIN", 0)
    raw = make_raw(name, rows=ggml_kernels.ROW_CHUNK * 3 + 5, seed=5)
    w = reference(raw, name)
    for t in (1, 6):
        x = np.random.default_rng(t).standard_normal((t, COLS)).astype(np.float32)
        close_to_f64(GGMLMatrix(raw, name, (raw.shape[0], COLS)).matmul(x), x, w, name)


def rounded_i8(x: np.ndarray) -> np.ndarray:
    """x rounded to int8 per 32 values as the int8 prefill rounds it (step max|x| / 127 in float32,
    round to nearest of x times its float32 inverse), back in float64."""
    xb = x.reshape(x.shape[0], -1, 32)
    d = np.abs(xb).max(2) / np.float32(127)
    inv = np.divide(np.float32(1), d, out=np.zeros_like(d), where=d > 0)
    return (np.rint(xb * inv[:, :, None]).astype(np.float64) * d[:, :, None]).reshape(x.shape)


@pytest.mark.skipif(not common.HAVE_VNNI, reason="no VNNI on this CPU")
@pytest.mark.parametrize("name", sorted(ggml_kernels.LANE_OFFSET))
@pytest.mark.parametrize("cols", [COLS, 640])  # 640: the last group of 256 half empty (Gemma 3 270M's width)
def test_int8_prefill_is_exact_math_on_rounded_activations(name, cols):
    """With ``int8_prefill`` (`load(..., gguf_prefill="int8")`), prefill rows of Q4_0 / Q5_0 / Q8_0
    on VNNI (block lanes, `ggml.block_mm_lanes`) are float64
    math on the reference dequantizer's weights and the activations rounded to int8 per 32 values,
    to float32 accumulation error (the block sums are exact integers); a token's row is the same
    bit for bit whatever the tokens beside it (tiles of 3, a ragged strip of rows, passes of
    TOKEN_CHUNK tokens)."""
    rows = 42
    raw = make_raw(name, rows=rows, cols=cols, seed=9)
    w = reference(raw, name).astype(np.float64)
    m = GGMLMatrix(raw, name, (rows, cols))
    x = (np.random.default_rng(10).standard_normal((131, cols)) * np.linspace(0.1, 30, cols)).astype(np.float32)
    x[3, :32] = 0  # an all-zero block
    close_to_f64(m.matmul(x), x, reference(raw, name), name)  # off by default: float32 math
    m.int8_prefill = True
    y = m.matmul(x)
    xr = rounded_i8(x)
    bound = 1e-5 * (np.abs(xr) @ np.abs(w).T) + 1e-30
    assert np.all(np.abs(y - xr @ w.T) <= bound), float(np.max(np.abs(y - xr @ w.T) / bound))
    for lo, hi in ((0, 5), (5, 12), (125, 131)):
        assert np.array_equal(m.matmul(x[lo:hi]), y[lo:hi])
    assert m.row_slice(8, 20).int8_prefill and np.array_equal(m.row_slice(8, 20).matmul(x), y[:, 8:20])


def test_blas_path_in_several_tiles(monkeypatch):
    """BLAS tiles smaller than the matrix, with a ragged last one, give the products."""
    from gemmalite.kernels import blas

    raw = make_raw("Q4_K", rows=200, seed=2)
    w = reference(raw, "Q4_K")
    monkeypatch.setattr(blas, "TILE_BYTES", 64 * COLS * 4)
    x = np.random.default_rng(3).standard_normal((ggml.FUSED_MAX_T + 5, COLS)).astype(np.float32)
    close_to_f64(GGMLMatrix(raw, "Q4_K", (200, COLS)).matmul(x), x, w)


def test_one_dimensional_input_and_type_ids():
    raw = make_raw("Q8_0")
    m = GGMLMatrix(raw.reshape(-1), Q.Q8_0, (ROWS, COLS))  # flat bytes, gguf enum
    x = np.random.default_rng(4).standard_normal(COLS).astype(np.float32)
    y = m.matmul(x)
    assert y.shape == (ROWS,)
    np.testing.assert_array_equal(y, m.matmul(x[None])[0])
    assert m.nbytes == raw.nbytes and m.shape == (ROWS, COLS) and m.qtype == "Q8_0"


def test_row_slice_shares_bytes():
    raw = make_raw("Q6_K")
    m = GGMLMatrix(raw, "Q6_K", (ROWS, COLS))
    part = m.row_slice(5, 12)
    assert part.shape == (7, COLS) and np.shares_memory(part.raw, m.raw)
    np.testing.assert_array_equal(part.dense(), m.dense()[5:12])


def test_bad_inputs_raise_value_errors():
    raw = make_raw("Q4_0")
    with pytest.raises(ValueError, match="bytes"):
        GGMLMatrix(raw[:-1], "Q4_0", (ROWS, COLS))
    with pytest.raises(ValueError, match="multiple of 32"):
        GGMLMatrix(raw, "Q4_0", (ROWS * 2, COLS // 2 + 16))
    with pytest.raises(ValueError, match="unsupported"):
        GGMLMatrix(raw, "Q2_K", (ROWS, COLS))
    m = GGMLMatrix(raw, "Q4_0", (ROWS, COLS))
    with pytest.raises(ValueError, match="needs"):
        m.matmul(np.zeros((2, COLS + 1), np.float32))
    with pytest.raises(IndexError):
        m.rows(np.array([ROWS]))


@pytest.mark.parametrize("avx2", [True, False])
def test_q5_0_as_q8_0_is_the_same_matrix(avx2, monkeypatch):
    """`GGMLMatrix.as_q8_0` (`load(..., gguf_q5_0=...)`): Q8_0 blocks that gguf-py's reference
    dequantizer reads as exactly the Q5_0 weights, whose every product is the Q5_0 matrix's bit for
    bit: decode rows (with AVX2 one kernel for both, the values in the same lanes; without it the
    fused float kernel on the same decoded rows), a few rows, and a prompt through BLAS slabs."""
    if avx2 and not HAVE_AVX2:
        pytest.skip("no AVX2 on this CPU")
    monkeypatch.setattr(common, "HAVE_AVX2", avx2)
    raw = make_raw("Q5_0", rows=70, cols=COLS, seed=3)
    src = raw.copy()
    q5 = GGMLMatrix(raw, "Q5_0", (70, COLS))
    q8 = q5.as_q8_0()
    assert q8.qtype == "Q8_0" and q8.shape == q5.shape and q8.nbytes == q5.nbytes // 22 * 34
    np.testing.assert_array_equal(reference(q8.raw, "Q8_0"), reference(raw, "Q5_0"))
    np.testing.assert_array_equal(raw, src)  # the source untouched
    rng = np.random.default_rng(4)
    for t in (1, 3, common.FEW_ROWS + 1, ggml.FUSED_MAX_T + 36):
        x = (rng.standard_normal((t, COLS)) * rng.uniform(0.1, 10, size=(t, 1))).astype(np.float32)
        np.testing.assert_array_equal(q8.matmul(x), q5.matmul(x), err_msg=f"T={t}")
        if t <= common.FEW_ROWS:
            np.testing.assert_array_equal(q8.matmul_each(x), q5.matmul_each(x), err_msg=f"each, T={t}")
    with pytest.raises(ValueError, match="takes a Q5_0 matrix"):
        GGMLMatrix(make_raw("Q8_0"), "Q8_0", (ROWS, COLS)).as_q8_0()
