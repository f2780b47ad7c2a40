"""Prompt-lookup decoding: the same tokens as plain decoding (greedy, seeded sampling, repetition
penalty, stops, chat sessions), drafts that are used, and the draft finder itself."""
from __future__ import annotations

import numpy as np
import pytest

import hf_oracle as H
from conftest import random_ids
from gemmalite.kernels import common
from gemmalite.runtime.generate import lookup_drafts

VOCAB = 512
# E2B-like (KV sharing, k_eq_v), window 8: drafts are verified on wrapped sliding rings
CONFIG = dict(layout="conditional", seed=15, sliding_window=8, num_kv_shared_layers=2, attention_k_eq_v=True,
              num_global_key_value_heads=1)
# a prompt that repeats itself, so drafts are found (and often right) in the reply
BASE = random_ids(12, VOCAB, seed=3)
PROMPT = BASE + random_ids(5, VOCAB, seed=4) + BASE + BASE[:6]


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def model(request, tmp_path_factory, gl):
    path = tmp_path_factory.mktemp(f"pl_{request.param}")
    H.make_gemma4_checkpoint(path, tokenizer=True, dtype=request.param, **CONFIG)
    return gl.load(path, context=80)


@pytest.mark.parametrize("opts", [dict(temperature=0.0), dict(temperature=0.0, repetition_penalty=1.3),
                                  dict(temperature=0.8, top_k=20, seed=3)])
def test_same_tokens_as_plain_decoding(model, opts):
    plain = model.generate_tokens(PROMPT, max_new_tokens=24, **opts)
    for k in (True, 1):
        s = model.generate_tokens(PROMPT, max_new_tokens=24, stream=True, prompt_lookup=k, **opts)
        assert list(s) == plain, k
        assert s.stats.new_tokens == len(plain) and s.stats.accepted_tokens <= s.stats.draft_tokens
        if opts == dict(temperature=0.0):
            assert s.stats.draft_tokens > 0


def test_greedy_reply_up_to_the_context_end(model):
    """A greedy reply running up to the end of the context (drafts are cut to what still fits).
    Kept drafts are checked on the real Gemma 3 270M (tests/models), whose replies quote."""
    plain = model.generate_tokens(PROMPT, max_new_tokens=80 - len(PROMPT), temperature=0.0)
    s = model.generate_tokens(PROMPT, max_new_tokens=80 - len(PROMPT), temperature=0.0, stream=True, prompt_lookup=3)
    assert list(s) == plain and s.stats.draft_tokens > 0 and s.stats.new_tokens == 80 - len(PROMPT)


def test_reply_cut_by_the_context_like_plain_decoding(tmp_path, gl):
    """A reply that runs into the end of the context (max_new_tokens beyond it) ends where plain
    decoding's does: a step's later rows still fit when its first ones are kept (it once ended up
    to three tokens early, judging by the length of the state with the drafts in it)."""
    H.make_gemma4_checkpoint(tmp_path, tokenizer=True, **CONFIG)
    drafted = 0
    for ctx in range(42, 50):
        m = gl.load(tmp_path, context=ctx)
        plain = m.generate_tokens(PROMPT, max_new_tokens=200, temperature=0.0)
        s = m.generate_tokens(PROMPT, max_new_tokens=200, temperature=0.0, stream=True, prompt_lookup=3)
        assert list(s) == plain and len(plain) == ctx - len(PROMPT) + 1, ctx  # the last one never runs
        drafted += s.stats.draft_tokens
    assert drafted > 0


def test_stops_and_chat_sessions_match(model):
    plain = model.generate_tokens(PROMPT, max_new_tokens=30, temperature=0.0)
    stop = plain[9]
    cut = plain[: plain.index(stop)]
    assert model.generate_tokens(PROMPT, max_new_tokens=30, temperature=0.0, stop=[stop], prompt_lookup=True) == cut
    msgs = [{"role": "user", "content": "one two three one two three one two"}]
    a, b = model.session(), model.session()
    for _ in range(2):
        ra = a.chat(msgs, max_new_tokens=12, temperature=0.0, truncate=True)  # the tiny context: keep the end
        rb = b.chat(msgs, max_new_tokens=12, temperature=0.0, truncate=True, prompt_lookup=True)
        assert ra == rb
        msgs = msgs + [{"role": "assistant", "content": ra}, {"role": "user", "content": "one two three again"}]


@pytest.fixture(scope="module")
def quantized(tmp_path_factory, gl):
    path = tmp_path_factory.mktemp("pl_quant")
    H.make_gemma4_checkpoint(path, tokenizer=True, **CONFIG)
    return {q: gl.load(path, context=80, quant=q) for q in ("int8", "int4")}


@pytest.mark.parametrize("avx2", [True, False], ids=["avx2", "portable"])
@pytest.mark.parametrize("kind", ["float32", "int8", "int4"])
def test_decode_rows_equal_one_token_steps(model, quantized, kind, avx2, monkeypatch):
    """`Engine.decode_rows` (a verification step) gives every row bit for bit the logits of
    one-token steps, on every kernel path: the int16 decode kernels, and without AVX2 the
    portable float ones (whose 2-4-row kernels sum differently: rows then go one at a time)."""
    if avx2 and not common.HAVE_AVX2:
        pytest.skip("the host has no AVX2")
    monkeypatch.setattr(common, "HAVE_AVX2", avx2)
    eng = (model if kind == "float32" else quantized[kind]).engine
    head, toks = np.array(PROMPT[:-4]), PROMPT[-4:]
    a, b = eng.new_state(), eng.new_state()
    eng.prefill(a, head)
    eng.prefill(b, head)
    rows = eng.decode_rows(a, toks)
    steps = np.stack([eng.decode_step(b, t) for t in toks])
    np.testing.assert_array_equal(rows, steps)
    assert a.tokens == b.tokens and a.length == b.length


def test_lookup_drafts():
    h = [5, 6, 7, 8, 9, 1, 6, 7, 2, 6, 7]
    assert lookup_drafts(h, 3) == [2, 6, 7]  # latest earlier "6 7" (no "2 6 7" before)
    assert lookup_drafts([1, 2, 3, 9, 1, 2, 3], 2) == [9, 1]  # the trigram
    assert lookup_drafts([1, 2, 3, 4], 3) == []  # nothing repeats
    assert lookup_drafts([4, 5, 4], 5) == [5, 4]  # unigram, cut at the end of the history
    assert lookup_drafts([4], 3) == [] and lookup_drafts([], 3) == []
    assert lookup_drafts(list(np.arange(10)) + [3], 2) == [4, 5]
    # a predicted reply is searched after the history, for each n-gram length
    assert lookup_drafts([1, 2, 3], 3, source=[9, 2, 3, 4, 5, 6]) == [4, 5, 6]
    assert lookup_drafts([1, 2, 3, 1, 2, 3], 2, source=[2, 3, 7]) == [1, 2]  # the history's trigram first
    assert lookup_drafts([5, 2, 3], 2, source=[1, 2, 3, 8]) == [8]  # the source's bigram before a unigram
    assert lookup_drafts([1, 2, 3], 3, source=[2, 3]) == []  # nothing follows it there
