"""One loaded `Model` serves several threads, and several interleaved streams, at once: each
call owns its state, so every result equals the same call run alone (greedy and seeded); and
the compute thread count changes no number."""
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


@pytest.mark.parametrize("quant", [None, "int8", "int4"])
def test_the_thread_count_changes_no_number(folder, gl, quant):
    """A prompt past SHORT_ROWS (float32 products through BLAS, whose own sums depend on its
    thread count) gives the same logits on 1 and 2 compute threads, bit for bit."""
    ids = random_ids(150, VOCAB, seed=7)
    one = gl.load(folder, quant=quant, threads=1).logits(ids)
    np.testing.assert_array_equal(gl.load(folder, quant=quant, threads=2).logits(ids), one)


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


def _in_turn(*streams) -> list[str]:
    """The texts of ``streams``, consumed one piece of each in turn (in this thread)."""
    texts, live = ["" for _ in streams], list(range(len(streams)))
    while live:
        for i in list(live):
            piece = next(streams[i], None)
            if piece is None:
                live.remove(i)
            else:
                texts[i] += piece
    return texts


@pytest.mark.parametrize("on", ["default", "session"])
def test_second_reply_while_the_first_streams_in_one_thread(model, on):
    """Two replies of one session consumed in turn in one thread (once a deadlock on the
    session's lock): the second runs on a state of its own and both equal their solo replies."""
    solo = [model.session().chat(c, max_new_tokens=8, temperature=0.0) for c in CHATS[:2]]
    model.reset_chat()
    session = model.session()
    chat = model.chat if on == "default" else session.chat
    first, second = (chat(c, max_new_tokens=8, temperature=0.0, stream=True) for c in CHATS[:2])
    assert _in_turn(first, second) == solo
    assert first.stats.new_tokens > 0 and second.stats.new_tokens > 0
    assert second.stats.cached_tokens == 0  # a fresh state, not the conversation's
    held = (model._default_session if on == "default" else session).state  # the first kept the conversation's
    ids = model.tokenizer.chat_ids(CHATS[0], add_generation_prompt=True)
    assert held.tokens[: len(ids)] == ids
    # the conversation's state is free again: the follow-up turn runs on it
    turn = [*CHATS[0], {"role": "assistant", "content": solo[0]}, FOLLOW_UP]
    chat(turn, max_new_tokens=4, temperature=0.0)
    ids = model.tokenizer.chat_ids(turn, add_generation_prompt=True)
    assert (model._default_session if on == "default" else session).state.tokens[: len(ids)] == ids


def test_reset_while_a_reply_streams(model):
    """`ChatSession.reset` during a reply (once a deadlock in the same thread): the reply goes on
    with its state, the session's next reply starts from nothing."""
    session = model.session()
    solo = model.session().chat(CHATS[0], max_new_tokens=8, temperature=0.0)
    stream = session.chat(CHATS[0], max_new_tokens=8, temperature=0.0, stream=True)
    text = next(stream)
    session.reset()
    assert session.state.length == 0
    assert text + "".join(stream) == solo
    again = session.chat(CHATS[0], max_new_tokens=8, temperature=0.0, stream=True)
    assert "".join(again) == solo and again.stats.cached_tokens == 0


def test_second_reply_while_the_first_streams_in_another_thread(model):
    """A thread's reply while another thread's stream holds the session, unconsumed, runs at once
    on its own state (it does not wait for the open stream, which may never be consumed)."""
    solo = [model.session().chat(c, max_new_tokens=8, temperature=0.0) for c in CHATS[:2]]
    session = model.session()
    first = session.chat(CHATS[0], max_new_tokens=8, temperature=0.0, stream=True)
    head = next(first)  # holds the session's state from here until its last piece
    with ThreadPoolExecutor(1) as pool:
        # a hang shows as this wait running out; the reply itself takes well under a second
        second = pool.submit(session.chat, CHATS[1], max_new_tokens=8, temperature=0.0).result(timeout=600)
    assert second == solo[1]
    assert head + "".join(first) == solo[0]
