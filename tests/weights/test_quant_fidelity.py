"""How far int8 / int4 weights move a whole model's logits from float32 (transformers-made checkpoint).

A broken kernel (wrong scale, nibble order, row order) gives unrelated logits: top-1
agreement near 1/vocab and an error as large as the logits themselves. Measured on this
checkpoint: int8 agrees on ~98% of positions with a mean error ~2.2% of the logit spread,
int4 (symmetric, 4.5 bits) on ~84% with ~22%; the bounds leave room for float noise, not for a bug.
"""
from __future__ import annotations

import numpy as np
import pytest

from conftest import random_ids
from hf_oracle import make_gemma4_checkpoint

VOCAB = 1024
BOUNDS = {"int8": (0.93, 0.05), "int4": (0.70, 0.35)}  # (min top-1 agreement, max mean |Δ| / std)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("fidelity")
    make_gemma4_checkpoint(path, seed=1, hidden_size=128, intermediate_size=256, head_dim=32, global_head_dim=64,
                           vocab_size=VOCAB, vocab_size_per_layer_input=VOCAB)
    return path


@pytest.mark.parametrize("quant", ["int8", "int4"])
def test_quantized_logits_stay_close(gl, checkpoint, quant):
    ids = random_ids(64, VOCAB, seed=0)
    ref = gl.load(checkpoint).logits(ids)
    model = gl.load(checkpoint, quant=quant)
    got = model.logits(ids)
    top1 = (got.argmax(-1) == ref.argmax(-1)).mean()
    err = np.abs(got - ref).mean() / ref.std()
    min_top1, max_err = BOUNDS[quant]
    assert top1 >= min_top1 and err <= max_err, f"{quant}: top-1 agreement {top1:.3f}, mean |Δ|/std {err:.4f}"
    assert type(model.engine.graph.layers[0].gate).__name__ == ("Int8Matrix" if quant == "int8" else "Int4Matrix")
    assert type(model.engine.lm_head).__name__ == ("Int8Matrix" if quant == "int8" else "Int4Matrix")
    if quant == "int4":  # the 4.5-bit symmetric format (W4A8 decode kernel)
        assert model.engine.lm_head.symmetric and model.engine.graph.layers[0].gate.symmetric


@pytest.mark.parametrize("quant", ["int8", "int4"])
def test_converted_checkpoint_equals_on_the_fly(gl, checkpoint, tmp_path, quant):
    from gemmalite.tools.convert import convert

    out = convert(checkpoint, tmp_path / quant, quant, progress=False)
    ids = random_ids(20, VOCAB, seed=2)
    np.testing.assert_array_equal(gl.load(out).logits(ids), gl.load(checkpoint, quant=quant).logits(ids))
    with pytest.raises(gl.CheckpointError, match="already quantized"):
        convert(out, tmp_path / "again", quant, progress=False)
