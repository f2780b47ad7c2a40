"""The towers' clipped projection against transformers' Gemma4ClippableLinear."""
from __future__ import annotations

import types

import numpy as np
import pytest

from gemmalite.weights.clipped import Linear
from gemmalite.weights.matrix import as_matrix

torch = pytest.importorskip("torch")


@pytest.mark.parametrize("bounds", [(-0.5, 0.7, -0.3, 0.4), (-np.inf, np.inf, -np.inf, np.inf), (-2.0, 2.0, -np.inf, 0.1)])
def test_matches_gemma4_clippable_linear(bounds):
    from transformers.models.gemma4.modeling_gemma4 import Gemma4ClippableLinear

    rng = np.random.default_rng(0)
    w = rng.standard_normal((6, 5)).astype(np.float32)
    x = rng.standard_normal((4, 5)).astype(np.float32)
    ref = Gemma4ClippableLinear(types.SimpleNamespace(use_clipped_linears=True), 5, 6)
    with torch.no_grad():
        ref.linear.weight.copy_(torch.from_numpy(w))
        for name, b in zip(("input_min", "input_max", "output_min", "output_max"), bounds):
            getattr(ref, name).fill_(float(b))
        want = ref(torch.from_numpy(x)).numpy()
    lin = Linear(as_matrix(w), bounds)
    assert (lin.clip is None) == all(np.isinf(bounds))
    np.testing.assert_allclose(lin(x), want, rtol=1e-6, atol=1e-6)
    if lin.clip is not None:
        assert not np.allclose(Linear(as_matrix(w))(x), want)  # the bounds bind
