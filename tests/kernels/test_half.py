"""Half-precision weight products (`kernels.half`): float32-activation tiles (every CPU) and
``vdpbf16ps`` tiles (AVX-512 BF16), against float64 math on the same values; every row of a
product bit for bit its one-row product."""
from __future__ import annotations

import numpy as np
import pytest
from conftest import haswell_env

from gemmalite.kernels import common, half
from gemmalite.weights.matrix import BF16, HalfMatrix

needs_bf16 = pytest.mark.skipif(not common.HAVE_BF16, reason="the host has no AVX-512 BF16")


def _case(rows, cols, t, dtype, seed):
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((rows, cols)).astype(np.float32)
    w[0, :3] = [0.0, -0.0, 1e-8]
    x = rng.standard_normal((t, cols)).astype(np.float32)
    return w.astype(dtype), x


@pytest.mark.parametrize("dtype", [BF16, np.float16], ids=["bf16", "f16"])
@pytest.mark.parametrize("cols", [64, 72, 1040])  # whole chunks; a tail of 8; 32 chunks + 16
@pytest.mark.parametrize("t", [1, 4, 7, half.TOKEN_BLOCK + 5, 2 * half.TOKEN_BLOCK + 1])
def test_float32_tiles_equal_float64(dtype, cols, t, monkeypatch):
    """Ragged strips (333 rows), ragged token tiles and blocks, column tails."""
    w, x = _case(333, cols, t, dtype, seed=cols + t)
    # float16 weights and decode rows never take vdpbf16ps, even when it is on
    monkeypatch.setattr(common, "BF16_DOT", dtype == np.float16 or t <= common.FEW_ROWS)
    got = HalfMatrix(w).matmul(x)
    ref = x.astype(np.float64) @ w.astype(np.float64).T
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=2e-5 * np.sqrt(cols / 64))


@pytest.mark.parametrize("dtype", [BF16, np.float16], ids=["bf16", "f16"])
@pytest.mark.parametrize("dot", [False, True], ids=["float32", "vdpbf16ps"])
@pytest.mark.parametrize("cols", [1040, half.ONE_ROW_COLS + 64])  # decode rows one per task / in 4-row strips
def test_each_row_is_its_own_product_to_the_bit(dtype, dot, cols, monkeypatch):
    """Any rows of a product, computed among any others, give the same bits: decode rows
    (`matmul_each`) as one-token steps, and with float32 activations also prefill rows (the
    rows of several sequences share one product: `Matrix.independent_rows`)."""
    if dot and not common.HAVE_BF16:
        pytest.skip("the host has no AVX-512 BF16")
    monkeypatch.setattr(common, "BF16_DOT", dot)
    w, x = _case(37, cols, 140, dtype, seed=1)
    m = HalfMatrix(w)
    alone = np.concatenate([m.matmul(r[None]) for r in x[:9]])
    np.testing.assert_array_equal(m.matmul_each(x[:9]), alone)
    for t in (2, 3, 4):
        np.testing.assert_array_equal(m.matmul(x[:t]), alone[:t])
    full = m.matmul(x)
    for part in (slice(0, 5), slice(3, 20), slice(7, 140), slice(130, 140)):
        np.testing.assert_array_equal(m.matmul(x[part]), full[part], err_msg=str(part))
    if not dot or dtype == np.float16:
        np.testing.assert_array_equal(full[:9], alone)


@needs_bf16
@pytest.mark.parametrize("cols", [64, 72, 1040])
@pytest.mark.parametrize("t", [5, 11, half.TOKEN_BLOCK + 7])
def test_vdpbf16ps_tiles_equal_float64_of_rounded_activations(cols, t, monkeypatch):
    """With BF16_DOT, the prefill product is exact float64 math on bfloat16-rounded activations,
    to float32 summation error."""
    monkeypatch.setattr(common, "BF16_DOT", True)
    w, x = _case(333, cols, t, BF16, seed=cols * t)
    got = HalfMatrix(w).matmul(x)
    ref = x.astype(BF16).astype(np.float64) @ w.astype(np.float64).T
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=2e-5 * np.sqrt(cols / 64))
    # and the rounding is what it costs: within bfloat16's half step of each activation
    exact = x.astype(np.float64) @ w.astype(np.float64).T
    bound = (np.abs(x).astype(np.float64) * 2.0 ** -8) @ np.abs(w.astype(np.float64)).T
    assert np.all(np.abs(got - exact) <= bound + 1e-4)


def test_round_bf16_is_round_to_nearest_even():
    rng = np.random.default_rng(0)
    x = np.concatenate([rng.standard_normal(5000).astype(np.float32) * 10.0 ** rng.integers(-40, 38, 5000),
                        np.array([0.0, -0.0, np.inf, -np.inf, 1e-45, 3.4e38, -3.4e38], np.float32),
                        # exact ties: bits ...8000 round to even
                        np.array([0x3F808000, 0x3F818000, 0x3F80C000, 0x7F7F8000], np.uint32).view(np.float32)])
    x = x.astype(np.float32)[None]
    out = np.empty(x.shape, np.uint16)
    half.round_bf16(x.view(np.uint32), out)
    np.testing.assert_array_equal(out, x.astype(BF16).view(np.uint16))
    nan = np.array([[np.nan, -np.nan]], np.float32)
    half.round_bf16(nan.view(np.uint32), out[:, :2])
    assert np.isnan(out[:, :2].view(BF16).astype(np.float32)).all()


def test_float32_tiles_compile_and_agree_for_an_avx2_cpu(tmp_path):
    """The portable path as a CPU without AVX-512 gets it: the tiles compiled for Haswell (AVX2,
    FMA, F16C; no zmm register in the code) give float64's results, half weights and GGML rows."""
    import subprocess
    import sys

    code = """
import numpy as np
from gguf import GGMLQuantizationType, quants
from gemmalite.kernels.half import KIND_BF16, KIND_F16, KIND_Q5_0, KIND_Q8_0, half_matmul
from gemmalite.weights.matrix import BF16, HalfMatrix
rng = np.random.default_rng(0)
for dt in (BF16, np.float16):
    w = rng.standard_normal((37, 1040)).astype(np.float32).astype(dt)
    for t in (1, 3, 9):
        x = rng.standard_normal((t, 1040)).astype(np.float32)
        ref = x.astype(np.float64) @ w.astype(np.float64).T
        np.testing.assert_allclose(HalfMatrix(w).matmul(x), ref, rtol=1e-5, atol=1e-4)
        out = np.empty((t, 37), np.float32)
        half_matmul(x, w.view(np.uint16), KIND_BF16 if dt == BF16 else KIND_F16, 4, out)
        np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-4)
for name, kind in (("Q8_0", KIND_Q8_0), ("Q5_0", KIND_Q5_0)):
    qt = GGMLQuantizationType[name]
    raw = np.ascontiguousarray(quants.quantize(rng.standard_normal((37, 1024)).astype(np.float32), qt))
    raw = raw.view(np.uint8).reshape(37, -1)
    x = rng.standard_normal((9, 1024)).astype(np.float32)
    out = np.empty((9, 37), np.float32)
    half_matmul(x, raw, kind, 4, out)
    ref = x.astype(np.float64) @ quants.dequantize(raw, qt).reshape(37, 1024).astype(np.float64).T
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-4)
asm = "".join(half_matmul.inspect_asm().values())
assert "vfmadd" in asm and "zmm" not in asm
print("ok")
"""
    env = {**haswell_env(tmp_path), "GEMMALITE_BF16_DOT": "0"}
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600, check=False)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-2000:]


@pytest.mark.parametrize("name", ["Q8_0", "Q5_0"])
@pytest.mark.parametrize("cols", [32, 64, 1056])  # one block; two; 33
@pytest.mark.parametrize("t", [1, 5, half.TOKEN_BLOCK + 5])
def test_ggml_tiles_are_float32_math_on_the_dequantized_weights(name, cols, t):
    """GGML Q8_0 / Q5_0 rows (``kind`` KIND_Q8_0 / KIND_Q5_0): each weight widened to ``float32(d) *
    q``, exactly gguf-py's dequantized value, so the products are float64 math on gguf-py's weights
    to float32 accumulation error; ragged strips (333 rows) and token tiles; a row's result does
    not depend on the rows computed beside it (a block of zeros: a zero scale)."""
    from gguf import GGMLQuantizationType, quants

    rng = np.random.default_rng(cols + t)
    w = (rng.standard_normal((333, cols)) * rng.uniform(0.01, 3.0, (333, 1))).astype(np.float32)
    w[5, :32] = 0.0
    qt = GGMLQuantizationType[name]
    raw = np.ascontiguousarray(quants.quantize(w, qt)).view(np.uint8).reshape(333, -1)
    ref_w = quants.dequantize(raw, qt).reshape(333, cols).astype(np.float64)
    x = rng.standard_normal((t, cols)).astype(np.float32)
    kind = {"Q8_0": half.KIND_Q8_0, "Q5_0": half.KIND_Q5_0}[name]

    def product(xs):
        out = np.full((xs.shape[0], 333), np.nan, np.float32)
        half.half_matmul(xs, raw, kind, half.ROWS, out)
        return out

    got = product(x)
    x64 = x.astype(np.float64)
    err, bound = np.abs(got - x64 @ ref_w.T), 1e-5 * (np.abs(x64) @ np.abs(ref_w).T) + 1e-30
    assert np.all(err <= bound), float(np.max(err / bound))
    for part in (slice(0, 1), slice(t // 2, t), slice(t - 1, t)):
        np.testing.assert_array_equal(product(x[part]), got[part], err_msg=str(part))
