"""Gemma 4's MTP drafter against transformers' `Gemma4AssistantForCausalLM` (float64 reference,
the float32 one's own error as the yardstick): the same target state (a prefill in both, below
and past the sliding window, a long full-attention context), the same candidate set and
argmax, logits and next hidden state within 1e-4, over several chained steps; the centroid
head and the dense head; states rolled back by verification equal to a clean prefill."""
from __future__ import annotations

import json

import numpy as np
import pytest

import assistant_oracle as A
import hf_oracle as H
from conftest import random_ids
from gemmalite.errors import CheckpointError, ConfigError, InputError

VOCAB = 512


@pytest.fixture(scope="module", params=[True, False], ids=["centroids", "dense"])
def pair(request, tmp_path_factory, gl):
    """(gemmalite model with the drafter, transformers target, assistant) in float32, and both in float64."""
    root = tmp_path_factory.mktemp("asst")
    target = H.make_gemma4_checkpoint(root / "target", seed=3, **A.TARGET)
    assistant = A.make_assistant(root / "drafter", ordered=request.param, seed=5)
    model = gl.load(root / "target", drafter=root / "drafter", context=400)
    t64, a64 = H.make_gemma4_checkpoint(root / "t64", seed=3, **A.TARGET).double(), \
        A.make_assistant(None, ordered=request.param, seed=5).double()
    return model, (target, assistant), (t64, a64), root


def _candidates(logits: np.ndarray) -> set[int]:
    return set(np.flatnonzero(logits > logits.min()).tolist())


@pytest.mark.parametrize("n", [5, 20, 300], ids=["below-window", "past-window", "long-context"])
def test_chained_steps_match_transformers(pair, n):
    model, (t32, a32), (t64, a64), _ = pair
    ids = random_ids(n, VOCAB, seed=n)
    token, steps = 11, 4
    ref64 = A.draft_steps(t64, a64, ids, token, steps)
    ref32 = A.draft_steps(t32, a32, ids, token, steps)
    state = model.engine.new_state()
    h = model.engine.prefill(state, np.array(ids))[0]
    tokens = []
    tok = token
    for (l64, h64), (l32, h32) in zip(ref64, ref32):
        logits, h = model.drafter.step(state, tok, h)
        own = max(np.abs(l32 - l64).max(), np.abs(h32 - h64).max())  # transformers' float32 error
        bound = min(1e-4, max(8 * own, 2e-5))
        assert np.abs(logits - l64).max() <= bound and np.abs(h - h64).max() <= bound, (own, bound)
        assert int(logits.argmax()) == int(l64.argmax())
        if model.drafter.assistant.cfg.ordered:
            assert _candidates(logits) == _candidates(l64)
            assert len(_candidates(logits)) == 4 * VOCAB // 16
        tok = int(logits.argmax())
        tokens.append(tok)
    assert len(state.tokens) == n  # a step leaves the target state as it was
    h0 = model.engine.prefill(model.engine.new_state(), np.array(ids))[0]
    assert model.drafter.draft(state, token, h0, steps) == tokens


def test_step_after_rollbacks_equals_clean_state(pair):
    """Verification steps write drafts' K/V and roll them back across the window's edge: the
    drafter then reads what a clean prefill of the kept tokens gives."""
    model, *_ = pair
    eng = model.engine
    ids = random_ids(6, VOCAB, seed=1)
    state = eng.new_state()
    eng.prefill(state, np.array(ids))
    rng = np.random.default_rng(0)
    for _ in range(8):
        eng.decode_rows(state, rng.integers(3, VOCAB, 4).tolist())
        assert state.truncate(state.length - int(rng.integers(0, 4)))
    clean = eng.new_state()
    h = eng.prefill(clean, np.array(state.tokens))[0]
    a, ha = model.drafter.step(state, 9, h)
    b, hb = model.drafter.step(clean, 9, h)
    np.testing.assert_allclose(a, b, atol=1e-5)
    np.testing.assert_allclose(ha, hb, atol=1e-5)


def test_bad_input_and_mismatched_drafters(pair, gl, tmp_path):
    model, _, _, root = pair
    state = model.engine.new_state()
    h = np.zeros(64, np.float32)
    with pytest.raises(InputError):
        model.drafter.step(state, 3, h)  # an empty state
    model.engine.prefill(state, np.array([2, 5, 6]))
    for bad in ((VOCAB, h), (3, h[:10])):
        with pytest.raises(InputError):
            model.drafter.step(state, *bad)
    with pytest.raises(CheckpointError, match="gemma4_assistant"):
        gl.load(root / "target", drafter=root / "target")  # a target is no drafter
    A.make_assistant(tmp_path / "wide", backbone=48)
    with pytest.raises(ConfigError, match="backbone_hidden_size"):
        gl.load(root / "target", drafter=tmp_path / "wide")
    cfg = json.loads((root / "drafter" / "config.json").read_text())
    cfg["text_config"]["sliding_window"] = 9
    (tmp_path / "win").mkdir()
    (tmp_path / "win" / "config.json").write_text(json.dumps(cfg))
    (tmp_path / "win" / "model.safetensors").symlink_to(root / "drafter" / "model.safetensors")
    with pytest.raises(ConfigError, match="sliding_window"):
        gl.load(root / "target", drafter=tmp_path / "win")
