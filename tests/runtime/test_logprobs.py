"""logprobs: each new token's log-probability (and the top ones) equal log_softmax of
`Model.logits` of the text so far (a fresh prefill: an independent computation of the same
logits), the greedy token ranked first; prompt-lookup rows included; bad options refused."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import hf_oracle as H
from conftest import random_ids
from gemmalite.errors import InputError
from gemmalite.kernels.numba_ops import top_ids
from gemmalite.runtime.logprobs import token_logprob

BASE = random_ids(12, 512, seed=3)
REPEATING = BASE + random_ids(5, 512, seed=4) + BASE + BASE[:6]  # prompt lookup finds drafts in its reply


@pytest.fixture(scope="module")
def model(tmp_path_factory, gl):
    from gemmalite.tools.synth import synth

    return gl.load(synth("tiny", tmp_path_factory.mktemp("tiny"), progress=False), context=256)


@pytest.fixture(scope="module")
def small(tmp_path_factory, gl):
    """A transformers-made random checkpoint with a 512-token vocabulary (replies repeat their prompt)."""
    path = tmp_path_factory.mktemp("lp_small")
    H.make_gemma4_checkpoint(path, tokenizer=True, layout="conditional", seed=15, sliding_window=8,
                             num_kv_shared_layers=2, attention_k_eq_v=True, num_global_key_value_heads=1)
    return gl.load(path, context=80)


def _log_softmax(z):
    z = z.astype(np.float64)
    return z - (z.max() + np.log(np.exp(z - z.max()).sum()))


POINT = {"type": "object", "properties": {"x": {"type": "integer", "minimum": -9, "maximum": 9}, "y": {"type": "boolean"}},
         "required": ["x", "y"], "additionalProperties": False}


@pytest.mark.parametrize("lookup,temp,schema", [(0, 0.0, None), (3, 0.0, None), (0, 1.0, None), (0, 0.0, POINT)])
def test_logprobs_equal_log_softmax_of_logits(model, small, lookup, temp, schema):
    if schema is None:
        model, ids = small, REPEATING
    else:
        ids = model.tokenizer.encode("one two three")
    c = model.generate_tokens(ids, max_new_tokens=12, temperature=temp, seed=7, logprobs=5, prompt_lookup=lookup,
                              json_schema=schema)
    assert len(c.logprobs) == len(c.output) > 0
    if lookup:
        assert c.stats.draft_tokens > 0
    if schema:  # forced tokens rode as drafts: their rows are a multi-row step's
        assert c.stats.accepted_tokens > 0
    ref = model.logits(ids + c.output)[len(ids) - 1 : -1]
    for row, lp, tok in zip(ref, c.logprobs, c.output):
        want = _log_softmax(row)
        assert lp.token == tok
        assert abs(lp.logprob - want[tok]) < 1e-5
        order = np.argsort(-want, kind="stable")[:5]
        assert [t for t, _ in lp.top] == order.tolist()
        assert np.allclose([v for _, v in lp.top], want[order], atol=1e-5, rtol=0)
        if temp == 0 and schema is None:
            assert lp.top[0][0] == tok  # the greedy token ranks first


def test_logprobs_in_text_calls(model):
    c = model.generate("Hello", max_new_tokens=4, temperature=0, logprobs=True)
    assert isinstance(c.output, str) and len(c.logprobs) == 4 and all(lp.top == [] for lp in c.logprobs)
    s = model.chat([{"role": "user", "content": "Hi"}], max_new_tokens=3, temperature=0, logprobs=2, stream=True)
    text = "".join(s)
    assert len(s.stats.logprobs) == s.stats.new_tokens and text == model.chat(
        [{"role": "user", "content": "Hi"}], max_new_tokens=3, temperature=0)
    assert model.generate("Hello", max_new_tokens=4, temperature=0) == c.output  # no logprobs: text as before


@pytest.mark.parametrize("v", [21, -1, 1.5, "3"])
def test_bad_logprobs(model, v):
    with pytest.raises(InputError, match="logprobs"):
        model.generate("Hi", logprobs=v)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(-3, 3), min_size=1, max_size=60), st.integers(0, 20), st.data())
def test_token_logprob_is_float64_log_softmax_ties_by_lower_id(values, top, data):
    """Few distinct values (ties everywhere): the top ids are a stable argsort of -z cut at top."""
    z = np.array(values, np.float32) * np.float32(0.75)
    tok = data.draw(st.integers(0, len(values) - 1))
    lp = token_logprob(z, tok, top)
    want = _log_softmax(z)
    order = np.argsort(-want, kind="stable")[:top]
    assert lp.token == tok and [t for t, _ in lp.top] == order.tolist()
    np.testing.assert_allclose([lp.logprob] + [v for _, v in lp.top], np.r_[want[tok], want[order]], rtol=0, atol=1e-12)


def test_top_ids_over_a_whole_vocabulary():
    z = np.random.default_rng(9).standard_normal(262_144).astype(np.float32)
    z[[7, 70_000, 262_143]] = z.max()  # a three-way tie at the top
    assert top_ids(z, 20).tolist() == np.argsort(-z, kind="stable")[:20].tolist()
    assert top_ids(z[:5], 20).tolist() == np.argsort(-z[:5], kind="stable").tolist()
