#!/usr/bin/env python3
"""MTP speculative decoding at the real E2B shape (random weights: `gemmalite synth --preset e2b`
and `--preset e2b-assistant`), every figure a ratio within this one run (the machine may be busy):

* the drafter's time per drafted token (its step: 4 Q-only layers, the centroid head), against a
  one-row target step;
* the verify cost of a step of 1..4 rows (the current token and 0..3 drafts) against one row;
* end-to-end greedy tok/s, plain against speculative with a replaying drafter kept right with
  probability 0, 0.35, 0.5, 0.7, 0.8 per draft (random weights cannot show the real drafter's
  acceptance), which also runs the real drafter's step so its cost is charged; drafts chosen by
  the adaptive `DraftPolicy`; runs alternate, repeated ``--rounds`` times, medians reported;
* the speed-up projected from the measured costs for acceptance rates from 0.3 to 0.9.

    gemmalite synth --preset e2b --layout causal --no-vision e2b
    gemmalite synth --preset e2b-assistant e2b-assistant
    python scripts/bench_mtp.py e2b e2b-assistant --quant int8
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np

import gemmalite
from gemmalite.kernels import common
from gemmalite.runtime.drafting import ReplayDrafter
from gemmalite.runtime.generate import GenerationStats, generate_ids
from gemmalite.runtime.sampling import SamplingParams


class Charged:
    """A replaying drafter that also runs the real drafter's steps (their time is charged)."""

    def __init__(self, replay: ReplayDrafter, real):
        self.replay, self.real = replay, real

    def draft(self, state, token, hidden, k):
        self.real.draft(state, token, hidden, k)
        return self.replay.draft(state, token, hidden, k)


def timed(fn, n: int) -> float:
    """Median seconds of ``fn()`` over ``n`` calls."""
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("target")
    ap.add_argument("drafter")
    ap.add_argument("--quant", choices=["int8", "int4"], default=None)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--reps", type=int, default=9, help="repeats of each micro-measurement")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--rates", default="0,0.35,0.5,0.7,0.8", help="replayed acceptance rates, comma-separated")
    a = ap.parse_args()

    model = gemmalite.load(a.target, quant=a.quant, context=1024, drafter=a.drafter, threads=a.threads)
    eng, mtp = model.engine, model.drafter
    V = model.config.vocab_size
    prompt = np.random.default_rng(0).integers(10, V, a.prompt_tokens)

    # micro: a one-row step and 1..4-row verification steps on one prefilled state, rolled back each time
    state = eng.new_state()
    h = eng.prefill(state, prompt)[0]
    n0 = state.length
    rows = {}
    for _ in range(2):  # warm-up, then interleaved rounds
        for r in range(1, common.FEW_ROWS + 1):
            eng.decode_hidden([state], [list(range(100, 100 + r))])
            state.truncate(n0)
    samples = {r: [] for r in range(1, common.FEW_ROWS + 1)}
    drafts = []
    for _ in range(a.reps):
        for r in samples:
            samples[r].append(timed(lambda: eng.decode_hidden([state], [list(range(100, 100 + r))]), 1))
            state.truncate(n0)
        drafts.append(timed(lambda: mtp.draft(state, 100, h, 3), 1) / 3)
    rows = {r: statistics.median(v) for r, v in samples.items()}
    draft_s = statistics.median(drafts)
    print(json.dumps({"one_row_step_ms": round(1e3 * rows[1], 1),
                      "verify_cost_vs_one_row": {r: round(rows[r] / rows[1], 3) for r in rows},
                      "drafter_ms_per_token": round(1e3 * draft_s, 2),
                      "drafter_vs_one_row_step": round(draft_s / rows[1], 4)}))

    # end to end: greedy, plain against replayed drafts at chosen acceptance (real drafter charged)
    params = SamplingParams(temperature=0.0)

    def run(drafter):
        st = GenerationStats()
        out = list(generate_ids(eng, eng.new_state(), prompt, max_new_tokens=a.new_tokens, params=params,
                                stop_ids=set(), stats=st, drafter=drafter))
        return out, st

    plain, _ = run(None)
    truth = prompt.tolist() + plain
    rates = tuple(float(r) for r in a.rates.split(","))
    tok_s: dict = {"plain": []}
    kept: dict = {}
    for rnd in range(a.rounds):
        for acc in ("plain", *rates):
            drafter = None if acc == "plain" else Charged(ReplayDrafter(truth, acc, V, seed=rnd), mtp)
            out, st = run(drafter)
            assert out == plain, "speculative decoding changed the tokens"
            tok_s.setdefault(acc, []).append(st.new_tokens / st.decode_s)
            if acc != "plain":
                kept.setdefault(acc, []).append((st.draft_tokens, st.accepted_tokens))
    base = statistics.median(tok_s["plain"])
    print(json.dumps({"plain_tok_s": round(base, 2), "identical_tokens": True,
                      "speculative": {str(acc): {"tok_s": round(statistics.median(tok_s[acc]), 2),
                                                 "vs_plain": round(statistics.median(tok_s[acc]) / base, 3),
                                                 "drafted_kept": kept[acc]} for acc in rates}}))

    # projection from the measured costs: expected tokens per step over its cost, best draft count
    proj = {}
    for alpha in (0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9):
        best = max(((1 - alpha ** (k + 1)) / (1 - alpha) / ((rows[k + 1] + k * draft_s) / rows[1]), k)
                   for k in range(0, common.FEW_ROWS))
        proj[alpha] = {"speedup": round(best[0], 2), "drafts": best[1]}
    print(json.dumps({"projected_speedup_by_acceptance": proj}))


if __name__ == "__main__":
    main()
