"""MTP drafts in the server's batched step, beside prompt lookup and plain sequences: every text
and finish reason equals the plain solo run's, whatever the drafts (a replaying drafter with
wrong ones, the real random drafter), with greedy and seeded sampling and a reply that runs into
the end of the context."""
from __future__ import annotations

import queue

import pytest

import assistant_oracle as A
import hf_oracle as H
from conftest import random_ids
from gemmalite.runtime.drafting import ReplayDrafter
from gemmalite.runtime.sampling import SamplingParams
from gemmalite.server.scheduler import Finish, Scheduler, Sequence

VOCAB = 512


@pytest.fixture(scope="module")
def model(tmp_path_factory, gl):
    root = tmp_path_factory.mktemp("srv_mtp")
    H.make_gemma4_checkpoint(root / "target", seed=8, tokenizer=True, **A.TARGET)
    A.make_assistant(root / "drafter", seed=9)
    return gl.load(root / "target", context=48, drafter=root / "drafter")


def _serve(sch, seqs) -> list:
    sinks = []
    for seq in seqs:
        sinks.append(queue.Queue())
        seq.sink = sinks[-1].put
        sch.waiting.put_nowait(seq)
    sch.start()
    try:
        out = []
        for q in sinks:
            text = []
            while not isinstance(ev := q.get(timeout=60), Finish):
                text.append(ev.text)
            out.append(("".join(text), ev))
        return out
    finally:
        sch.close()


def test_drafts_in_a_batch_keep_every_text(model):
    base = random_ids(8, VOCAB, seed=1)
    prompts = [base + base, random_ids(9, VOCAB, seed=2), random_ids(5, VOCAB, seed=3), random_ids(6, VOCAB, seed=4)]
    params = [SamplingParams(temperature=0), SamplingParams(temperature=0.9, top_k=40, seed=4),
              SamplingParams(temperature=0), SamplingParams(temperature=0)]
    limits = [12, 14, 14, 100]  # the last runs into the context's end (48)

    def seqs(lookup):
        return [Sequence(ids=list(p), max_tokens=n, params=sp, stop_ids=set(), stop_strings=[], sink=None,
                         lookup=lookup if i == 0 else 0) for i, (p, sp, n) in enumerate(zip(prompts, params, limits))]

    eng, tok = model.engine, model.tokenizer
    plain = [_serve(Scheduler(eng, tok, prefix_cache=0), [s])[0] for s in seqs(0)]
    # the tokens plain decoding gives (from a solo generate_tokens run of each, as the replay source)
    truths = [list(p) + model.generate_tokens(p, max_new_tokens=n, stop=[], temperature=sp.temperature,
                                              top_k=sp.top_k, seed=sp.seed)
              for p, sp, n in zip(prompts, params, limits)]
    for drafter in (ReplayDrafter(truths, [0, 1, 2, 3], VOCAB), ReplayDrafter(truths, [3], VOCAB), model.drafter):
        for lookup in (0, 3):
            got = _serve(Scheduler(eng, tok, max_concurrency=8, prefix_cache=0, drafter=drafter), seqs(lookup))
            assert [(t, ev.reason) for t, ev in got] == [(t, ev.reason) for t, ev in plain], (drafter, lookup)
            assert all(ev.accepted <= ev.drafted for _, ev in got)
            if isinstance(drafter, ReplayDrafter):
                assert sum(ev.drafted for _, ev in got[1:]) > 0 and sum(ev.accepted for _, ev in got[1:]) > 0
    assert plain[3][1].reason == "length"
