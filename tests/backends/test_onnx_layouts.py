"""gemmalite's int8 / int4 storage as ONNX operators (`gemmalite.backends.onnx.layouts`).

Oracle: ONNX Runtime itself. One projection is exported through the exporter's own builder (as
``MatMulNBits`` or ``DequantizeLinear`` + ``MatMul``) and run at ``accuracy_level`` 0 (float32
activations), so its product is ``x @ W'.T`` for the weights ``W'`` ONNX Runtime decodes from
the encoding; it must equal ``x @ m.dense().T`` computed in float64 within float32 summation
rounding, which only holds when ``W' == W`` value for value (a nibble order, zero point, padding
or scale broadcast off by anything moves it by a weight step, ~1e-2 of the product here).
"""
from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("onnxruntime")

import onnx  # noqa: E402
import onnxruntime as ort  # noqa: E402
from onnx import TensorProto, helper  # noqa: E402

from gemmalite.backends.onnx.export import _Builder, _Store  # noqa: E402
from gemmalite.backends.onnx.layouts import dequantized, weight_kind  # noqa: E402
from gemmalite.errors import ConfigError  # noqa: E402
from gemmalite.weights.ggml import GGMLMatrix  # noqa: E402
from gemmalite.weights.matrix import BF16, F32Matrix, HalfMatrix  # noqa: E402
from gemmalite.weights.quant import Int4Matrix, Int8Matrix  # noqa: E402

# [out, in]: widths a multiple of the int8 block (128), under it (padded to a power of two), over
# it but no multiple (padded with zero blocks); int4 widths are multiples of 32
SHAPES8 = [(24, 256), (7, 96), (5, 200)]
SHAPES4 = [(24, 256), (7, 96), (6, 32)]


def _product(m, fmt: str, x: np.ndarray, tmp_path) -> np.ndarray:
    """``x @ W.T`` by ONNX Runtime on the exporter's encoding of ``m`` (float32 activations)."""
    store = _Store(tmp_path / "w.data")
    b = _Builder(store, "t", fmt, accuracy_level=0)
    b.matmul("x", m, "w")
    store.close()
    b.nodes[-1].output[0] = "y"
    model = b.model("one", [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(x.shape))],
                    [helper.make_tensor_value_info("y", TensorProto.FLOAT, [x.shape[0], m.shape[0]])], {})
    onnx.save_model(model, str(tmp_path / "one.onnx"))
    onnx.checker.check_model(str(tmp_path / "one.onnx"), full_check=True)
    opts = ort.SessionOptions()
    opts.add_session_config_entry("session.qdq_matmulnbits_accuracy_level", "0")
    sess = ort.InferenceSession(str(tmp_path / "one.onnx"), opts, providers=["CPUExecutionProvider"])
    return sess.run(None, {"x": x})[0]


def _check(m, fmt: str, tmp_path) -> None:
    rng = np.random.default_rng(1)
    x = rng.standard_normal((3, m.shape[1])).astype(np.float32)
    want = x.astype(np.float64) @ m.dense().astype(np.float64).T
    got = _product(m, fmt, x, tmp_path)
    # float32 sums of k products: |error| <= k * eps * sum |x w| (a weight step would be ~1e-2 |want|)
    bound = m.shape[1] * np.finfo(np.float32).eps * (np.abs(x) @ np.abs(m.dense()).T)
    assert np.all(np.abs(got - want) <= bound), f"{type(m).__name__}{m.shape} {fmt}: max |d| {np.abs(got - want).max()}"
    np.testing.assert_array_equal(dequantized(m, fmt), m.dense())


@pytest.mark.parametrize("fmt", ["matmulnbits", "qdq"])
@pytest.mark.parametrize("shape", SHAPES8)
def test_int8_exact(shape, fmt, tmp_path):
    w = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    _check(Int8Matrix.quantize(w), fmt, tmp_path)


@pytest.mark.parametrize("fmt", ["matmulnbits", "qdq"])
@pytest.mark.parametrize("shape", SHAPES4)
def test_int4_exact(shape, fmt, tmp_path):
    w = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    m = Int4Matrix.quantize(w, symmetric=True)
    assert {int(v) for v in np.unique(np.concatenate([m.packed & 15, m.packed >> 4]))} >= {0, 15}  # the whole grid
    _check(m, fmt, tmp_path)


def test_float_weights(tmp_path):
    w = np.random.default_rng(0).standard_normal((9, 40)).astype(np.float32)
    _check_float = lambda m: np.testing.assert_allclose(  # noqa: E731
        _product(m, "matmulnbits", np.ones((2, 40), np.float32), tmp_path), np.ones((2, 40)) @ m.dense().T.astype(np.float64),
        rtol=1e-5, atol=1e-5)
    _check_float(F32Matrix(w))
    _check_float(HalfMatrix(w.astype(BF16)))
    assert weight_kind(F32Matrix(w), "w") == "float" and weight_kind(Int8Matrix.quantize(w), "w") == "int8"


def test_refused_by_name():
    w = np.random.default_rng(0).standard_normal((4, 64)).astype(np.float32)
    with pytest.raises(ConfigError, match="layers.3.gate is asymmetric int4"):
        weight_kind(Int4Matrix.quantize(w, symmetric=False), "layers.3.gate")
    with pytest.raises(ConfigError, match="layers.0.q is GGMLMatrix"):
        weight_kind(GGMLMatrix(w.astype(np.float16).view(np.uint8), "F16", w.shape), "layers.0.q")
