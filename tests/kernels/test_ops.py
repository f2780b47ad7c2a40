"""The numba attention path against the batched numpy (BLAS) path it stands in for."""
import numpy as np
import pytest

from gemmalite.kernels import common
from gemmalite.kernels import ops as kernels


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("t", [1, 3, 24])
def test_numba_attention_matches_batched(t, window, monkeypatch):
    rng = np.random.default_rng(t)
    nq, kv, d, n = 8, 2, 16, 24
    q = rng.standard_normal((t, nq, d)).astype(np.float32)
    k = rng.standard_normal((n, kv, d)).astype(np.float32)
    v = rng.standard_normal((n, kv, d)).astype(np.float32)
    k_pos = rng.permutation(n).astype(np.int64)  # a ring: slot order is not position order
    k_pos[[2, 7]] = -1  # empty slots
    q_pos = np.arange(n - t, n, dtype=np.int64)
    fast = kernels.attention(q, k, v, q_pos, k_pos, window, 0.25)
    monkeypatch.setattr(common, "FEW_ROWS", 0)
    ref = kernels.attention(q, k, v, q_pos, k_pos, window, 0.25, blas_free=False)
    np.testing.assert_allclose(fast, ref, rtol=2e-5, atol=2e-6)
    # a query that sees nothing but masked slots still gives finite numbers
    monkeypatch.setattr(common, "FEW_ROWS", 4)
    assert np.isfinite(kernels.attention(q[:1], k, v, np.array([-5]), k_pos, window, 0.25)).all()


@pytest.mark.parametrize("shape", [(18, 4, 256), (1, 8, 512), (37, 3, 64)])
def test_apply_rope_is_the_rotate_half_expression_to_the_bit(shape):
    from gemmalite.kernels.ops import apply_rope, rope_tables

    rng = np.random.default_rng(1)
    x = rng.standard_normal(shape).astype(np.float32)
    inv = (1.0 / 10000 ** (np.arange(shape[2] // 2) * 2 / shape[2])).astype(np.float32)
    cos, sin = rope_tables(inv, np.arange(3, 3 + shape[0]))
    half = shape[2] // 2

    def reference(x):
        x1, x2 = x[..., :half], x[..., half:]
        c, s = cos[:, None, :], sin[:, None, :]
        return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)

    assert np.array_equal(apply_rope(x, cos, sin), reference(x))
    wide = np.concatenate([x, x], axis=-1)[..., : shape[2]]  # a strided view, as the vision tower passes
    assert np.array_equal(apply_rope(wide, cos, sin), reference(wide))
