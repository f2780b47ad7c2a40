#!/usr/bin/env python
"""Where a batched decode step's time goes, per phase, at several batch widths (one model load).

Wraps the graph's and engine's building blocks in timers (matrix products by role, attention,
K/V writes, norms/RoPE/GELU, the LM head, softcap, row lookups) while ``Engine.decode_batch``
steps B sequences greedily, then prints ms per step per phase for each B, plus sampling
(one `Sampler` call per row, as the scheduler does) and the rest (Python, thread sync).

    python scripts/profile_batch.py MODEL [--batches 1,2,4,8] [--steps 6] [--threads 2] [--prefill]
"""
from __future__ import annotations

import argparse
import collections
import time

import gemmalite  # first: sets the BLAS thread timeout before numpy starts
import numpy as np
from gemmalite.models.gemma import graph as graph_mod
from gemmalite.runtime import engine as engine_mod
from gemmalite.runtime.sampling import Sampler, SamplingParams
from gemmalite.weights import quant

T: dict = collections.defaultdict(float)
depth = [0]


def timer(name, fn):
    def wrapped(*a, **k):
        depth[0] += 1
        t = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            depth[0] -= 1
            if depth[0] == 0:
                T[name] += time.perf_counter() - t
    return wrapped


def _timed(fn, arg) -> float:
    t = time.perf_counter()
    fn(arg)
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model")
    ap.add_argument("--batches", default="1,2,4,8")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--prompt", type=int, default=40)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prefill", action="store_true", help="also time the prompts' prefill, solo and together")
    a = ap.parse_args()
    m = gemmalite.load(a.model, threads=a.threads)
    eng = m.engine
    names = {}
    for i, w in enumerate(eng.graph.layers):
        for attr in ("q", "k", "v", "o", "gate", "up", "down", "ple_gate", "ple_proj"):
            mat = getattr(w, attr)
            if mat is not None:
                names[id(mat)] = "mlp" if attr in ("gate", "up", "down") else ("ple" if attr.startswith("ple") else "qkvo")
    names[id(eng.lm_head)] = "lm_head"
    if eng.graph.ple is not None:
        names[id(eng.graph.ple.projection)] = "ple"
    for cls in (quant.Int8Matrix,):
        for meth in ("matmul", "matmul_each"):
            orig = cls.__dict__[meth]

            def timed(self, x, _orig=orig):
                return timer("mm:" + names.get(id(self), "other"), lambda: _orig(self, x))()
            setattr(cls, meth, timed)
        orig_rows = cls.rows
        cls.rows = lambda self, ids, _o=orig_rows: timer("lookup", lambda: _o(self, ids))()
    for fn in ("attention", "_write_kv", "rms_norm", "apply_rope", "gelu_tanh_mul", "rope_tables"):
        setattr(graph_mod, fn, timer(fn, getattr(graph_mod, fn)))
    engine_mod.softcap = timer("softcap", engine_mod.softcap)
    rng = np.random.default_rng(0)
    print(f"{'phase':16s}" + "".join(f"{'B=' + b:>9s}" for b in a.batches.split(",")))
    rows = {}
    for B in [int(b) for b in a.batches.split(",")]:
        states = [eng.new_state() for _ in range(B)]
        toks = []
        for s in states:
            ids = rng.integers(1000, m.config.vocab_size, a.prompt)
            toks.append(int(np.argmax(eng.logits(eng.prefill(s, ids))[0])))
        samplers = [Sampler(SamplingParams(temperature=0)) for _ in range(B)]
        eng.decode_batch(states, toks)  # warm-up of this width
        T.clear()
        t0 = time.perf_counter()
        for _ in range(a.steps):
            logits = eng.decode_batch(states, toks)
            ts = time.perf_counter()
            toks = [smp(row, []) for smp, row in zip(samplers, logits)]
            T["sampling"] += time.perf_counter() - ts
        total = (time.perf_counter() - t0) / a.steps
        r = {k: v / a.steps for k, v in T.items()}
        r["rest"] = total - sum(r.values())
        r["STEP"] = total
        r["tok/s"] = B / total
        rows[B] = r
    if a.prefill:  # the same prompts prefilled one by one, then together (Engine.prefill_many)
        B = max(rows)
        prompts = [rng.integers(1000, m.config.vocab_size, a.prompt) for _ in range(B)]
        for label, run in (("solo", lambda ss: [eng.logits(eng.prefill(s, p)) for s, p in zip(ss, prompts)]),
                           ("together", lambda ss: eng.logits(eng.prefill_many(ss, prompts), each=True))):
            best = min(_timed(run, [eng.new_state() for _ in prompts]) for _ in range(2))
            print(f"prefill {B} x {a.prompt} tokens {label}: {best * 1e3:.0f} ms")
    keys = sorted({k for r in rows.values() for k in r}, key=lambda k: -rows[max(rows)].get(k, 0))
    for k in keys:
        fmt = "{:9.2f}" if k == "tok/s" else "{:9.1f}"
        print(f"{k:16s}" + "".join(fmt.format(rows[B].get(k, 0) * (1 if k == 'tok/s' else 1e3)) for B in rows))


if __name__ == "__main__":
    main()
