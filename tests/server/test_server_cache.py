"""The server's prefix cache across the turns of conversations, with the real `openai` client
against a live server: the tiny random Gemma 4 (sliding window 16), two tool-calling
conversations interleaved (one thinking), each turn served from its conversation's cached
state at least up to where the re-rendered history leaves the previous prompt, within the
cache's byte budget. The oracle of every reply is a fresh `Model.session().chat`, computed
before serving."""
from __future__ import annotations

import json

import numpy as np
import pytest
from live_server import KEY, LiveServer
from tool_loop import CONVERSATIONS, TURNS, fresh_turns, options

from gemmalite.runtime.generate import common_prefix

MODEL_ID = "tiny-gemma"


@pytest.fixture(scope="module")
def model(tmp_path_factory, gl):
    from gemmalite.tools.synth import synth

    return gl.load(synth("tiny", tmp_path_factory.mktemp("tiny"), progress=False), context=512)


@pytest.fixture(scope="module")
def oracle(model):
    """Each conversation's turns: (messages, prompt ids, the fresh session's reply)."""
    return fresh_turns(model)


def state_bound(model) -> int:
    """The most bytes one conversation's state can hold: its rings, full, and its checkpoints."""
    state = model.new_state()
    return state.nbytes + state.checkpoint_budget


@pytest.fixture(scope="module")
def live(model, oracle):
    from gemmalite.server import build_app

    s = LiveServer(build_app(model, model_id=MODEL_ID, api_key=KEY, max_concurrency=2,
                             prefix_cache=2 * state_bound(model)))
    yield s
    s.stop()


def request(client, messages, turn: int, thinking: bool):
    o = options(turn, thinking)
    return client.chat.completions.create(
        model=MODEL_ID, messages=messages, tools=o["tools"], tool_choice=o["tool_choice"],
        max_tokens=o["max_new_tokens"], temperature=o["temperature"],
        extra_body={"chat_template_kwargs": {"enable_thinking": thinking}})


def test_interleaved_conversations_hit_the_cache_within_its_budget(live, oracle, model):
    client = live.client()
    budget = live.srv.scheduler.cache.budget
    hits = live.metric("gemmalite_prefix_cache_hits_total")
    for turn in range(TURNS):
        for name, (_, thinking) in CONVERSATIONS.items():
            messages, ids, want = oracle[name][turn]
            r = request(client, messages, turn, thinking)
            msg = r.choices[0].message
            assert (msg.content or None) == (want.content or None)
            assert getattr(msg, "reasoning_content", None) == (want.reasoning or None)
            assert [(c.function.name, json.loads(c.function.arguments)) for c in msg.tool_calls or []] == \
                [(c.name, json.loads(c.arguments)) for c in want.tool_calls]
            assert r.choices[0].finish_reason == want.finish_reason
            assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ids), want.stats.new_tokens)
            cached = r.usage.prompt_tokens_details.cached_tokens
            if turn:  # all of the conversation's previous prompt that the new one keeps
                assert cached >= common_prefix(oracle[name][turn - 1][1], ids) > 0, (name, turn)
                hits += 1
            assert live.metric("gemmalite_prefix_cache_hits_total") == hits
            assert 0 < live.metric("gemmalite_prefix_cache_bytes") <= budget
    assert live.metric("gemmalite_cached_prompt_tokens_total") > 0


class _Engine:
    """What `PrefixCache` asks of an engine: new states (a sliding ring of 4 + 4 spare slots)."""

    def new_state(self):
        from gemmalite.runtime.cache import KVRing, KVState

        return KVState({0: KVRing(8, 1, 2, window=4), 1: KVRing(64, 1, 2, window=None)}, context=64)


def _filled(tokens, checkpoint_at=()):
    state = _Engine().new_state()
    for t in tokens:
        for r in state.rings.values():
            r.write(np.full((1, 1, 2), t, np.float32), np.zeros((1, 1, 2), np.float32), start=state.length)
        state.length += 1
        state.tokens.append(t)
        if state.length in checkpoint_at:
            state.checkpoint()
    return state


def test_prefix_cache_keeps_the_most_recently_used_states_within_its_budget():
    from gemmalite.server.metrics import Metrics
    from gemmalite.server.scheduler import PrefixCache

    a, b, c = (_filled(range(base, base + 20), checkpoint_at=(10,)) for base in (100, 200, 300))
    cache = PrefixCache(_Engine(), 2 * a.held_bytes, Metrics())
    for s in (a, b, c):
        cache.put(s)
    assert cache.states == [b, c] and cache.held <= cache.budget  # a, the least recently used, went
    state, reuse = cache.take(list(range(200, 213)) + [7])  # b's first 13 tokens: out of the ring's reach
    assert (state, reuse) == (b, 10) and b.length == 10 and cache.states == [c]  # its checkpoint
    cache.put(b)
    cache.put(a)
    assert cache.states == [b, a]  # c was used least recently
    state, reuse = cache.take([5, 6])
    assert reuse == 0 and state not in (a, b, c) and cache.states == [b, a]
    assert cache.metrics.value("gemmalite_prefix_cache_hits_total") == 1
    small = PrefixCache(_Engine(), c.held_bytes - 1)
    small.put(c)  # more than the whole budget: not kept
    assert small.states == [] and small.held == 0
