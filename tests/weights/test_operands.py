"""The decode operands' fused regions (`operands.fusable`): which products share one, and that
sharing one changes no bit."""
import numpy as np
import pytest

from gemmalite.kernels import common
from gemmalite.weights import operands
from gemmalite.weights.matrix import F32Matrix, matmul_each_all
from gemmalite.weights.quant import Int4Matrix, Int8Matrix


def _mats(fmt: str, rows: tuple, cols: int) -> list:
    rng = np.random.default_rng(7)
    ws = [(0.02 * rng.standard_normal((r, cols))).astype(np.float32) for r in rows]
    if fmt == "int8":
        return [Int8Matrix.quantize(w) for w in ws]
    return [Int4Matrix.quantize(w, symmetric=True) for w in ws]


@pytest.mark.parametrize("fmt", ["int8", "int4s"])
def test_products_fuse_up_to_the_byte_limit_and_give_the_same_bits_either_way(fmt, monkeypatch):
    """Small products of one input share a parallel region, big ones run one after the other
    (FUSE_MAX_BYTES); every output is the bits of the separate product whichever way it ran, for
    one row and for several (a decode batch)."""
    if not common.HAVE_AVX2:
        pytest.skip("no AVX2 on this CPU: the portable path has no fused regions")
    mats = _mats(fmt, (96, 32, 32), 256)
    ops = [m.operand() for m in mats]
    total = sum(operands.weight_bytes(op) for op in ops)
    assert total == sum(m.nbytes for m in mats) > 0  # the matrices' own count of the bytes a product reads
    assert operands.fusable(ops) and operands.fusable(ops[:2])
    monkeypatch.setattr(operands, "FUSE_MAX_BYTES", total - 1)
    assert not operands.fusable(ops) and operands.fusable(ops[:2])
    x = np.random.default_rng(8).standard_normal((5, 256)).astype(np.float32)
    for t in (1, 5):
        apart = matmul_each_all(mats, x[:t])
        monkeypatch.setattr(operands, "FUSE_MAX_BYTES", total)
        fused = matmul_each_all(mats, x[:t])
        monkeypatch.setattr(operands, "FUSE_MAX_BYTES", total - 1)
        for a, f, m in zip(apart, fused, mats):
            np.testing.assert_array_equal(f, a)
            np.testing.assert_array_equal(a, m.matmul_each(x[:t]))


def test_only_kernels_made_of_tasks_fuse():
    """A float32 operand (a kernel with no tasks) never shares a region, however small."""
    w = np.random.default_rng(9).standard_normal((16, 64)).astype(np.float32)
    f32 = F32Matrix(w).operand()
    i8 = Int8Matrix.quantize(w).operand()
    assert f32 is not None and not operands.fusable([f32, i8]) and not operands.fusable([i8])
