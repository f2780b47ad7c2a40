#!/usr/bin/env python
"""Where a decode step's time goes, per weight shape: calls, ms per step, achieved GB/s.

Wraps every quantized/float matrix product of a decode step in a timer while a model decodes
greedily (the uncompiled step, whose products are called from Python; q/k/v and gate/up count as
one line where they share a parallel region), then prints one line per matrix shape (largest time
first) and the time outside the products. ``--batch B`` steps B sequences together (`Engine.decode_batch`, what the server's
continuous batching runs): the products then read each weight once for B rows.

    python scripts/profile_decode.py MODEL [--tokens 20] [--prompt 16] [--batch 1]

``--kernels`` instead splits a one-sequence step into the time inside compiled code (cProfile's
own time of every numba dispatcher of gemmalite, the kernels and the operands' products, and of
the compiled entry points called directly, the compiled decode step's layers) and the rest
(Python, numpy, dispatch): the median plain step minus the median profiled compiled time, plain
and profiled steps alternating, so cProfile's own overhead does not inflate the rest.
``--uncompiled`` runs the uncompiled decode step (Python driving each layer's kernels) instead of
the compiled one (`models.gemma.compiled`), for an A/B on one machine.
"""
from __future__ import annotations

import argparse
import collections
import cProfile
import importlib
import pstats
import time

import gemmalite  # first: sets the BLAS thread timeout before numpy starts
import numpy as np
from gemmalite.models.gemma import graph
from gemmalite.weights import ggml, matrix, quant


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model")
    ap.add_argument("--tokens", type=int, default=20)
    ap.add_argument("--prompt", type=int, default=16)
    ap.add_argument("--batch", type=int, default=1, help="sequences stepped together (Engine.decode_batch)")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--kernels", action="store_true", help="time inside compiled code against the rest of a step")
    ap.add_argument("--uncompiled", action="store_true", help="the uncompiled decode step (Python driving the kernels)")
    a = ap.parse_args()
    m = gemmalite.load(a.model, threads=a.threads)
    m.engine.graph.compiled_step = not a.uncompiled
    ids = list(np.random.default_rng(0).integers(1000, m.config.vocab_size, a.prompt))
    list(m.generate_tokens(ids, max_new_tokens=4, temperature=0))  # warm-up (compiles kernels)
    if a.kernels:
        return kernel_share(m.engine, ids, a.tokens)
    # the products are timed from Python: the uncompiled step (the compiled one calls them from compiled code)
    m.engine.graph.compiled_step = False
    stats: dict = collections.defaultdict(lambda: [0, 0.0, 0])
    depth = [0]  # only the outermost product counts (a fallback matmul_each calls matmul)

    def timed(orig, key_of):
        """``orig(*w, x)`` timed under ``key_of(*w)`` = (stats key, bytes of weights read)."""
        def call(*args):
            depth[0] += 1
            t = time.perf_counter()
            try:
                return orig(*args)
            finally:
                depth[0] -= 1
                if depth[0] == 0 and args[-1].shape[0] <= a.batch:
                    key, nbytes = key_of(*args[:-1])
                    s = stats[key]
                    s[0] += 1
                    s[1] += time.perf_counter() - t
                    s[2] = nbytes
        return call

    # q/k/v, gate/up: one region where the format fuses them (the graph calls it, and so does
    # matrix.matmul_all for a one-row step)
    fused = timed(matrix.matmul_each_all, lambda mats: (
        ("+".join(type(w).__name__ for w in mats), tuple(w.shape for w in mats)), sum(w.nbytes for w in mats)))
    graph.matmul_each_all = matrix.matmul_each_all = fused
    for cls in (quant.Int8Matrix, quant.Int4Matrix, matrix.F32Matrix, matrix.HalfMatrix, ggml.GGMLMatrix):
        for meth in ("matmul", "matmul_each"):
            if meth in cls.__dict__:
                setattr(cls, meth, timed(cls.__dict__[meth], lambda w: ((type(w).__name__, w.shape), w.nbytes)))
    engine = m.engine
    states = [engine.new_state() for _ in range(a.batch)]
    toks = []
    for b, state in enumerate(states):  # prefill, not counted
        pids = list(np.random.default_rng(b).integers(1000, m.config.vocab_size, a.prompt))
        toks.append(int(np.argmax(engine.logits(engine.prefill(state, np.asarray(pids)))[0])))
    if a.batch > 1:
        engine.decode_batch(states, toks)  # warm-up of the batch-width kernels
    stats.clear()
    t = time.perf_counter()
    for _ in range(a.tokens):  # greedy decode steps, as `gemmalite bench` times them
        if a.batch == 1:
            toks = [int(np.argmax(engine.decode_step(states[0], toks[0])))]
        else:
            toks = [int(i) for i in np.argmax(engine.decode_batch(states, toks), axis=1)]
    n = a.tokens
    step = (time.perf_counter() - t) / n
    for (kind, shape), (calls, sec, nbytes) in sorted(stats.items(), key=lambda kv: -kv[1][1]):
        print(f"{kind:12s} {str(shape):16s} calls/step {calls / n:5.0f}  ms/step {sec / n * 1e3:7.2f}  "
              f"{nbytes * calls / sec / 1e9:5.1f} GB/s")
    products = sum(s[1] for s in stats.values()) / n
    print(f"decode step of {a.batch} sequence(s) {step * 1e3:.1f} ms ({a.batch / step:.2f} tokens/s): products "
          f"{products * 1e3:.1f} ms, everything else {(step - products) * 1e3:.1f} ms")


def kernel_share(engine, ids: list[int], n: int) -> None:
    """Median one-sequence step, and the part of it spent inside numba kernels: plain steps and
    profiled steps alternate (the machine's drift then moves both), each profiled step on its own."""
    state = engine.new_state()
    tok = int(np.argmax(engine.logits(engine.prefill(state, np.asarray(ids)))[0]))
    times, insides, kernel_calls, calls = [], [], 0, 0
    for _ in range(n):
        t = time.perf_counter()
        tok = int(np.argmax(engine.decode_step(state, tok)))
        times.append(time.perf_counter() - t)
        prof = cProfile.Profile()
        prof.enable()
        tok = int(np.argmax(engine.decode_step(state, tok)))
        prof.disable()
        inside = 0.0
        for (path, _line, name), (_cc, nc, own, _cum, _callers) in pstats.Stats(prof).stats.items():
            calls += nc
            if _compiled(path, name):
                inside += own
                kernel_calls += nc
        insides.append(inside)
    step, inside = float(np.median(times)), float(np.median(insides))
    print(f"decode step {step * 1e3:.2f} ms median (min {min(times) * 1e3:.2f}, max {max(times) * 1e3:.2f}); "
          f"inside compiled code {inside * 1e3:.2f} ms in {kernel_calls / n:.0f} calls; Python calls/step "
          f"{calls / n:.0f}; outside kernels {(step - inside) * 1e3:.2f} ms = {100 * (step - inside) / step:.1f} % of the step")


def _compiled(path: str, name: str) -> bool:
    """Is this cProfile entry compiled code of gemmalite: a numba dispatcher, or an entry point
    called directly (the compiled decode step's layers, `compiled.CompiledLayers.run`)?"""
    if path == "~":
        return name.startswith("<built-in method gemmalite.")
    if "/gemmalite/" not in path or not path.endswith(".py"):
        return False
    module = importlib.import_module("gemmalite." + path.rsplit("/gemmalite/", 1)[1][:-3].replace("/", "."))
    return hasattr(getattr(module, name, None), "py_func")

if __name__ == "__main__":
    main()
