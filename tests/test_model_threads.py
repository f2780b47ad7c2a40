"""One loaded `Model` serves several threads, and several interleaved streams, at once: each
call owns its state, so every result equals the same call run alone (greedy and seeded)."""
from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

import hf_oracle as H
from conftest import random_ids

VOCAB = 512
N = 4
PROMPTS = [random_ids(18 + 5 * i, VOCAB, seed=100 + i) for i in range(N)]
TEXTS = ["Once upon a time", "The little model said", "In the beginning there was", "A cat sat"]
CHATS = [[{"role": "user", "content": t}] for t in TEXTS]
FOLLOW_UP = {"role": "user", "content": "and then?"}


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("threads_ckpt")
    H.make_gemma4_checkpoint(path, tokenizer=True, layout="conditional", seed=15, sliding_window=8,
                             num_kv_shared_layers=2, attention_k_eq_v=True, num_global_key_value_heads=1)
    return path


@pytest.fixture(scope="module", params=[None, "int8"])
def model(request, folder, gl):
    return gl.load(folder, quant=request.param)


def in_threads(fn, items):
    """``fn`` on every item, each in its own thread, all started together."""
    start = threading.Barrier(len(items))

    def run(item):
        start.wait()
        return fn(item)

    with ThreadPoolExecutor(len(items)) as pool:
        return list(pool.map(run, items))


def test_generate_tokens_in_threads(model):
    solo = [model.generate_tokens(p, max_new_tokens=12, temperature=0.0) for p in PROMPTS]
    assert len({tuple(s) for s in solo}) == N  # different prompts, different continuations
    assert in_threads(lambda p: model.generate_tokens(p, max_new_tokens=12, temperature=0.0), PROMPTS) == solo


def test_seeded_sampling_in_threads(model):
    def sample(i):
        return model.generate_tokens(PROMPTS[i], max_new_tokens=10, temperature=1.0, top_k=40, seed=i)

    solo = [sample(i) for i in range(N)]
    assert in_threads(sample, list(range(N))) == solo


def test_logits_in_threads(model):
    solo = [model.logits(p) for p in PROMPTS]
    for a, b in zip(in_threads(model.logits, PROMPTS), solo):
        np.testing.assert_array_equal(a, b)


def test_generate_text_in_threads(model):
    solo = [model.generate(t, max_new_tokens=10, temperature=0.0) for t in TEXTS]
    assert in_threads(lambda t: model.generate(t, max_new_tokens=10, temperature=0.0), TEXTS) == solo


def test_interleaved_streams_in_one_thread(model):
    solo = [model.generate_tokens(p, max_new_tokens=8, temperature=0.0) for p in PROMPTS]
    streams = [model.generate_tokens(p, max_new_tokens=8, temperature=0.0, stream=True) for p in PROMPTS]
    got = [[] for _ in PROMPTS]
    for _ in range(8):  # one token of each stream in turn
        for out, s in zip(got, streams):
            out.append(next(s))
    assert got == solo
    assert all(s.stats.new_tokens == 8 and s.stats.prompt_tokens == len(p) for s, p in zip(streams, PROMPTS))


def _two_turns(session, chat):
    first = session.chat(chat, max_new_tokens=8, temperature=0.0)
    second = session.chat([*chat, {"role": "assistant", "content": first}, FOLLOW_UP], max_new_tokens=8,
                          temperature=0.0)
    return first, second


def test_chat_sessions_in_threads(model):
    solo = [_two_turns(model.session(), c) for c in CHATS]
    sessions = [model.session() for _ in CHATS]
    assert in_threads(lambda i: _two_turns(sessions[i], CHATS[i]), list(range(N))) == solo
    # each session kept its own conversation: the follow-up turn reused its cached prefix
    fresh = model.session()
    ids = model.tokenizer.chat_ids([*CHATS[0], {"role": "assistant", "content": solo[0][0]}, FOLLOW_UP],
                                   add_generation_prompt=True)
    assert sessions[0].state.tokens[: len(ids) - 1] == ids[:-1]
    assert fresh.state.length == 0


def test_default_chat_matches_a_session(model):
    model.reset_chat()
    assert model.chat(CHATS[1], max_new_tokens=8, temperature=0.0) == model.session().chat(
        CHATS[1], max_new_tokens=8, temperature=0.0)
