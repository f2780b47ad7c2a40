"""Long prompts: chunked prefill and the blocked numba attention inside the engine, against
transformers (float32, eager) on a prompt of many sliding windows, and against one-call prefill."""
from __future__ import annotations

import numpy as np
import pytest

import hf_oracle as H
from conftest import random_ids
from gemmalite.kernels import ops
from gemmalite.runtime import engine as engine_mod

VOCAB = 512
# E2B-like: multimodal layout, KV sharing, k_eq_v full layers, window 8 (the prompt spans 18 windows)
CONFIG = dict(layout="conditional", seed=15, sliding_window=8, num_kv_shared_layers=2, attention_k_eq_v=True,
              num_global_key_value_heads=1)
PROMPT = random_ids(150, VOCAB, seed=7)
LOGITS_ATOL = 2e-4


@pytest.fixture(scope="module")
def pair(tmp_path_factory, gl):
    path = tmp_path_factory.mktemp("long_ckpt")
    hf = H.make_gemma4_checkpoint(path, **CONFIG)
    return hf, gl.load(path)


@pytest.fixture(scope="module")
def hf_ref(pair):
    return H.hf_logits(pair[0], PROMPT)


@pytest.mark.parametrize("chunk", [16, 37, 1000])
def test_long_prompt_logits_match_transformers(pair, hf_ref, chunk, monkeypatch):
    """Every position's logits, prefilled in chunks (and in one call), through the blocked numba
    attention: never the batched BLAS one, although this float model's products of more than
    SHORT_ROWS rows (the one-call prefill) do use BLAS (on the real Gemma 3 270M, 4,096 tokens, the
    prompt took 1.4x as long with BLAS attention)."""
    _, model = pair
    monkeypatch.setattr(engine_mod, "PREFILL_CHUNK", chunk)
    assert model.engine.graph.layers[0].q.uses_blas_for(len(PROMPT))  # the one-call prefill's products

    def no_blas_attention(*a, **k):
        raise AssertionError("a prompt's attention took the batched BLAS path")

    monkeypatch.setattr(ops, "_attention_blas", no_blas_attention)
    got = model.logits(PROMPT)
    assert got.shape == hf_ref.shape
    np.testing.assert_allclose(got, hf_ref, atol=LOGITS_ATOL, rtol=0)


def test_chunked_prefill_then_decode_equals_transformers_greedy(pair, monkeypatch):
    hf, model = pair
    monkeypatch.setattr(engine_mod, "PREFILL_CHUNK", 23)
    assert model.generate_tokens(PROMPT, max_new_tokens=12, temperature=0.0) == H.hf_greedy(hf, PROMPT, 12)


def test_decode_after_a_long_prefill_matches_transformers_logits(pair, monkeypatch):
    """Decode steps after a chunked prefill, teacher-forced past 2 x DECODE_BLOCK positions (the
    decode attention's key blocks; the sliding rings wrap every few steps): each step's logits
    against transformers' full forward over the same tokens."""
    from gemmalite.kernels.numba_ops import DECODE_BLOCK

    hf, model = pair
    monkeypatch.setattr(engine_mod, "PREFILL_CHUNK", 37)
    cont = random_ids(2 * DECODE_BLOCK + 20 - len(PROMPT), VOCAB, seed=8)
    ref = H.hf_logits(hf, PROMPT + cont)
    eng = model.engine
    state = eng.new_state()
    got = [eng.logits(eng.prefill(state, np.array(PROMPT)))[0]]
    got += [eng.decode_step(state, t) for t in cont]
    np.testing.assert_allclose(np.array(got), ref[len(PROMPT) - 1 :], atol=LOGITS_ATOL, rtol=0)


def test_chunked_prefill_keeps_rows_in_order(pair, monkeypatch):
    """``keep`` rows in any order, repeated, negative, in chunks that keep none of them."""
    _, model = pair
    eng = model.engine
    keep = np.array([149, 3, 3, -1, 70, 0])
    ref = eng.forward(eng.new_state(), np.array(PROMPT), keep=keep)
    monkeypatch.setattr(engine_mod, "PREFILL_CHUNK", 20)
    state = eng.new_state()
    got = eng.forward(state, np.array(PROMPT), keep=keep)
    np.testing.assert_allclose(got, ref, atol=1e-5, rtol=0)
    assert state.length == len(PROMPT) and state.tokens == PROMPT


def test_chunked_prefill_checks_the_context_first(pair, gl, monkeypatch, tmp_path):
    """A prompt over the context fails before any chunk runs: the state is left as it was."""
    _, model = pair
    monkeypatch.setattr(engine_mod, "PREFILL_CHUNK", 16)
    eng = model.engine
    state = eng.new_state()
    eng.prefill(state, np.array(PROMPT[:10]))
    state.context = 100
    with pytest.raises(gl.ContextError):
        eng.prefill(state, np.array(PROMPT[10:]))
    assert state.length == 10 and state.tokens == PROMPT[:10]


def test_kept_rows_skip_the_work_no_layer_reads(pair, monkeypatch):
    """With ``keep``, the last layer that owns K/V computes every row's K/V but its queries, MLP
    and PLE only for the kept rows, as the KV-shared layers after it: the kept rows' outputs and
    the cache (the decode steps after) are those of a pass with every layer on every row."""
    _, model = pair
    eng = model.engine
    graph = eng.graph
    last_owner = graph.layers[graph.cfg.first_shared_layer - 1]
    rows_seen = []
    down = last_owner.down
    monkeypatch.setattr(last_owner, "down", _Spy(down, rows_seen))
    keep = np.array([149, 3, -1, 70])
    full_state, state = eng.new_state(), eng.new_state()
    ref = eng.forward(full_state, np.array(PROMPT))[keep]
    assert rows_seen == [len(PROMPT)]
    got = eng.forward(state, np.array(PROMPT), keep=keep)
    assert rows_seen[1:] == [len(keep)]
    np.testing.assert_allclose(got, ref, atol=1e-5, rtol=0)
    cont = random_ids(5, VOCAB, seed=9)
    np.testing.assert_allclose([eng.decode_step(state, t) for t in cont],
                               [eng.decode_step(full_state, t) for t in cont], atol=1e-5, rtol=0)


class _Spy:
    """A matrix that records the rows of each product it is asked for."""

    def __init__(self, m, seen):
        self._m, self._seen = m, seen

    def __getattr__(self, name):
        return getattr(self._m, name)

    def matmul(self, x):
        self._seen.append(x.shape[0])
        return self._m.matmul(x)
