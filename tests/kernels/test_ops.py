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
