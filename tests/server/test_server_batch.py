"""The batched decode step (several sequences, one token each, each weight read once) gives
every sequence exactly the logits of its own one-token decode step."""
from __future__ import annotations

import numpy as np
import pytest

from conftest import random_ids


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    from gemmalite.tools.synth import synth

    return synth("tiny", tmp_path_factory.mktemp("tiny"), progress=False)


@pytest.fixture(scope="module", params=["stored", "int8"])
def model(request, tiny_dir, tmp_path_factory, gl):
    if request.param == "stored":
        return gl.load(tiny_dir, context=64)
    from gemmalite.tools.convert import convert

    out = convert(tiny_dir, tmp_path_factory.mktemp(request.param), request.param, progress=False)
    return gl.load(out, context=64)


def test_decode_batch_equals_decode_step(model):
    eng = model.engine
    vocab = model.config.vocab_size
    # five sequences at different lengths (one past the 16-token sliding window), so each row
    # attends to its own cache; five rows also crosses the 4-row fused-kernel chunk
    prompts = [random_ids(n, vocab, seed=n) for n in (1, 3, 7, 20, 11)]
    solo, batch = [eng.new_state() for _ in prompts], [eng.new_state() for _ in prompts]
    for p, a, b in zip(prompts, solo, batch):
        eng.prefill(a, np.array(p))
        eng.prefill(b, np.array(p))
    rng = np.random.default_rng(0)
    for step in range(3):
        toks = [int(t) for t in rng.integers(5, vocab, size=len(prompts))]
        want = np.stack([eng.decode_step(s, t) for s, t in zip(solo, toks)])
        got = eng.decode_batch(batch, toks)
        assert got.shape == (len(prompts), vocab)
        np.testing.assert_array_equal(got, want)
    for a, b in zip(solo, batch):
        assert a.tokens == b.tokens and a.length == b.length


@pytest.mark.parametrize("cols", [256, 8192])  # 8192: the kernels' four-rows-per-task variant
def test_matmul_each_equals_one_row_products(cols):
    """Every weight format's batched product equals its one-row product, row by row, bit for bit."""
    from gemmalite.weights.matrix import BF16, F32Matrix, HalfMatrix
    from gemmalite.weights.quant import Int4Matrix, Int8Matrix

    rng = np.random.default_rng(cols)
    w = rng.standard_normal((37, cols)).astype(np.float32)
    x = rng.standard_normal((9, cols)).astype(np.float32)
    mats = [F32Matrix(w), HalfMatrix(w.astype(BF16)), HalfMatrix(w.astype(np.float16)), Int8Matrix.quantize(w),
            Int4Matrix.quantize(w, 32, search=False), Int4Matrix.quantize(w, 64, search=False)]
    for m in mats:
        np.testing.assert_array_equal(m.matmul_each(x), np.concatenate([m.matmul(r[None]) for r in x]), err_msg=repr(m))


def test_decode_batch_context_full(gl, tiny_dir):
    m = gl.load(tiny_dir, context=8)
    eng = m.engine
    s = eng.new_state()
    eng.prefill(s, np.arange(5, 13))
    with pytest.raises(gl.ContextError):
        eng.decode_batch([s], [5])
