"""Speculative decoding with a model drafter: the same tokens as plain decoding (greedy, and
transformers' target-only generate; seeded sampling), whatever the drafts -- a replaying
drafter injects wrong ones to exercise every count of kept drafts, rollbacks across the
sliding window's edge, stops inside drafts, max_new_tokens and the end of the context --
and the policy that turns drafting off where it does not pay."""
from __future__ import annotations

import numpy as np
import pytest

import assistant_oracle as A
import hf_oracle as H
from conftest import random_ids
from gemmalite.runtime.drafting import DraftPolicy, ReplayDrafter
from gemmalite.runtime.generate import GenerationStats, generate_ids
from gemmalite.runtime.sampling import SamplingParams

VOCAB = 512
PROMPT = random_ids(7, VOCAB, seed=2)  # the sliding window is 8: replies cross its edge at once


class Always(DraftPolicy):
    """Three drafts every step (what fits), so the replayed counts are the kept counts."""

    def choose(self, room: int) -> int:
        return min(room, 3)


@pytest.fixture(scope="module")
def setup(tmp_path_factory, gl):
    root = tmp_path_factory.mktemp("mtp")
    hf = H.make_gemma4_checkpoint(root / "target", seed=4, **A.TARGET)
    A.make_assistant(root / "drafter", seed=6)
    return hf, root, gl.load(root / "target", context=64), gl.load(root / "target", context=64,
                                                                   drafter=root / "drafter")


def run(model, ids, n, drafter=None, policy=None, temperature=0.0, seed=None, stop=(), context_state=None):
    stats = GenerationStats()
    out = list(generate_ids(model.engine, model.engine.new_state(), np.array(ids), max_new_tokens=n,
                            params=SamplingParams(temperature=temperature, top_k=40 if temperature else None,
                                                  seed=seed), stop_ids=set(stop), stats=stats,
                            drafter=drafter, policy=policy))
    return out, stats


def test_greedy_equals_plain_and_transformers(setup):
    hf, _, plain_model, mtp_model = setup
    plain, _ = run(plain_model, PROMPT, 40)
    assert plain == H.hf_greedy(hf, PROMPT, 40, eos_token_id=[])
    full = PROMPT + plain
    for accept in ([0, 1, 2, 3], [3], [0], [2, 0, 3, 1, 1]):
        out, st = run(plain_model, PROMPT, 40, ReplayDrafter(full, accept, VOCAB), Always())
        assert out == plain, accept
        assert st.draft_tokens > 0
        if accept == [3]:  # all kept but those past the last token
            assert st.accepted_tokens >= st.draft_tokens - 3
        if accept == [0]:
            assert st.accepted_tokens == 0
    # the real (random) drafter, and its policy
    assert run(mtp_model, PROMPT, 40, mtp_model.drafter)[0] == plain
    assert mtp_model.generate_tokens(PROMPT, max_new_tokens=40, temperature=0.0) == plain


@pytest.mark.parametrize("accept", [0.0, 0.5, 0.9])
def test_seeded_sampling_equals_plain(setup, accept):
    _, _, model, _ = setup
    plain, _ = run(model, PROMPT, 40, temperature=0.9, seed=11)
    out, st = run(model, PROMPT, 40, ReplayDrafter(PROMPT + plain, accept, VOCAB, seed=1), Always(),
                  temperature=0.9, seed=11)
    assert out == plain and st.draft_tokens > 0
    assert (st.accepted_tokens > 0) == (accept > 0)


def test_prompts_straddling_the_window_edge(setup):
    _, _, model, _ = setup
    for n in range(3, 12):
        ids = random_ids(n, VOCAB, seed=30 + n)
        plain, _ = run(model, ids, 14)
        out, _ = run(model, ids, 14, ReplayDrafter(ids + plain, [1, 3, 0, 2], VOCAB), Always())
        assert out == plain, n


def test_stops_inside_drafts_and_max_new_tokens(setup):
    _, _, model, _ = setup
    plain, _ = run(model, PROMPT, 30)
    full = PROMPT + plain
    for j in range(1, 12):  # a stop token met at every row of a step
        stop = plain[j]
        if stop in plain[:j]:
            continue
        out, st = run(model, PROMPT, 30, ReplayDrafter(full, [3], VOCAB), Always(), stop=[stop])
        assert out == plain[:j] and st.finish_reason == "stop", j
    for n in range(1, 9):
        out, st = run(model, PROMPT, n, ReplayDrafter(full, [3], VOCAB), Always())
        assert out == plain[:n] and st.new_tokens == n and st.finish_reason == "length", n


def test_end_of_the_context(setup, gl):
    _, root, _, _ = setup
    for ctx in range(20, 26):
        m = gl.load(root / "target", context=ctx, drafter=root / "drafter")
        plain, _ = run(m, PROMPT, 200)
        assert len(plain) == ctx - len(PROMPT) + 1
        for accept in ([3], [1, 2]):
            out, _ = run(m, PROMPT, 200, ReplayDrafter(PROMPT + plain, accept, VOCAB), Always())
            assert out == plain, (ctx, accept)
        assert run(m, PROMPT, 200, m.drafter)[0] == plain


def test_policy_turns_drafting_off_and_back_on():
    p = DraftPolicy()
    assert p.choose(3) == 0  # the first step is plain: its time is what drafting is judged against
    p.update(0, 0, 1.0, 0.0)
    assert p.choose(3) >= 2  # the prior: half the drafts kept
    drafted = 0
    for _ in range(400):  # nothing kept, every step as long as a one-row step (+8 % a row)
        k = p.choose(3)
        drafted += k > 0
        p.update(k, 0, 1.0 + 0.08 * k, 0.02 * k)
    assert p.choose(3) == 0 and drafted <= 12
    for _ in range(200):  # drafts kept again: probes see it, drafting resumes
        k = p.choose(3)
        p.update(k, k, 1.0 + 0.08 * k, 0.02 * k)
    assert p.choose(3) == 3
    assert p.choose(1) == 1 and p.choose(0) == 0
