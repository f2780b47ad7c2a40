#!/usr/bin/env python
"""Where a long prompt's time goes: prefill and the decode steps after it, split into attention
(by layer kind: sliding / full), matrix products, and everything else (norms, RoPE, host work).

    python scripts/profile_long_prompt.py MODEL [--prompt 2048] [--tokens 16] [--threads 2]

Wraps the graph's attention call and every matrix class's products in timers (only the outermost
call counts), runs one warm-up prompt (compiles kernels, pages in the rows), then a timed one.
"""
from __future__ import annotations

import argparse
import collections
import time

import gemmalite  # first: sets the BLAS thread timeout before numpy starts
import numpy as np
from gemmalite.models.gemma import graph as graph_mod
from gemmalite.weights import ggml, matrix, quant


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model")
    ap.add_argument("--prompt", type=int, default=2048)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--threads", type=int, default=None)
    a = ap.parse_args()
    m = gemmalite.load(a.model, threads=a.threads, context=a.prompt + a.tokens + 8)
    stats: dict = collections.defaultdict(float)
    depth = [0]

    def timer(key_of, orig):
        def timed(*args, **kw):
            depth[0] += 1
            t = time.perf_counter()
            try:
                return orig(*args, **kw)
            finally:
                depth[0] -= 1
                if depth[0] == 0:
                    stats[key_of(*args, **kw)] += time.perf_counter() - t
        return timed

    graph_mod.attention = timer(lambda q, k, v, qp, kp, window, *r, **kw: f"attention {'sliding' if window else 'full'}",
                                graph_mod.attention)
    for cls in (quant.Int8Matrix, quant.Int4Matrix, matrix.F32Matrix, matrix.HalfMatrix, ggml.GGMLMatrix):
        for meth in ("matmul", "matmul_each"):
            if (orig := cls.__dict__.get(meth)) is not None:
                setattr(cls, meth, timer(lambda self, x, *r, **kw: "products", orig))
    from gemmalite.weights import matrix as mm
    if hasattr(mm, "matmul_all"):
        graph_mod.matmul_all = timer(lambda mats, x, *r, **kw: "products", graph_mod.matmul_all)
    engine = m.engine
    ids = np.random.default_rng(0).integers(1000, m.config.vocab_size, a.prompt)
    for label in ("warm-up", "timed"):
        stats.clear()
        state = engine.new_state()
        t = time.perf_counter()
        tok = int(np.argmax(engine.logits(engine.prefill(state, ids))[0]))
        pre = time.perf_counter() - t
        pre_stats = dict(stats)
        stats.clear()
        t = time.perf_counter()
        for _ in range(a.tokens):
            tok = int(np.argmax(engine.decode_step(state, tok)))
        dec = (time.perf_counter() - t) / a.tokens
        dec_stats = dict(stats)
    print(f"prefill {a.prompt} tokens: {pre:.2f} s ({a.prompt / pre:.1f} tok/s)")
    for k, v in sorted(pre_stats.items(), key=lambda kv: -kv[1]):
        print(f"  {k:20s} {v:7.3f} s  {100 * v / pre:5.1f} %")
    print(f"  {'everything else':20s} {pre - sum(pre_stats.values()):7.3f} s")
    print(f"decode step after it: {dec * 1e3:.1f} ms ({1 / dec:.2f} tok/s)")
    for k, v in sorted(dec_stats.items(), key=lambda kv: -kv[1]):
        print(f"  {k:20s} {v / a.tokens * 1e3:7.2f} ms  {100 * v / a.tokens / dec:5.1f} %")
    print(f"  {'everything else':20s} {(dec - sum(dec_stats.values()) / a.tokens) * 1e3:7.2f} ms")


if __name__ == "__main__":
    main()
