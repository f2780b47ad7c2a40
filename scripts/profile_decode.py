#!/usr/bin/env python
"""Where a decode step's time goes, per weight shape: calls, ms per token, achieved GB/s.

Wraps every quantized/float matrix product with T=1 in a timer while a model decodes greedily,
then prints one line per matrix shape (largest time first) and the time outside the products.

    python scripts/profile_decode.py MODEL [--tokens 20] [--prompt 16]
"""
from __future__ import annotations

import argparse
import collections
import time

import gemmalite  # first: sets the BLAS thread timeout before numpy starts
import numpy as np
from gemmalite.weights import ggml, matrix, quant


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model")
    ap.add_argument("--tokens", type=int, default=20)
    ap.add_argument("--prompt", type=int, default=16)
    a = ap.parse_args()
    m = gemmalite.load(a.model)
    ids = list(np.random.default_rng(0).integers(1000, m.config.vocab_size, a.prompt))
    list(m.generate_tokens(ids, max_new_tokens=4, temperature=0))  # warm-up (compiles kernels)
    stats: dict = collections.defaultdict(lambda: [0, 0.0, 0])
    for cls in (quant.Int8Matrix, quant.Int4Matrix, matrix.F32Matrix, matrix.HalfMatrix, ggml.GGMLMatrix):
        def timed(self, x, _orig=cls.matmul):
            t = time.perf_counter()
            y = _orig(self, x)
            if x.shape[0] == 1:
                s = stats[(type(self).__name__, self.shape)]
                s[0] += 1
                s[1] += time.perf_counter() - t
                s[2] = self.nbytes
            return y
        cls.matmul = timed
    engine = m.engine
    state = engine.new_state()
    logits = engine.logits(engine.prefill(state, np.asarray(ids)))[0]  # prefill, not counted
    stats.clear()
    t = time.perf_counter()
    for _ in range(a.tokens):  # greedy decode steps, as `gemmalite bench` times them
        logits = engine.decode_step(state, int(np.argmax(logits)))
    n = a.tokens
    step = (time.perf_counter() - t) / n
    for (kind, shape), (calls, sec, nbytes) in sorted(stats.items(), key=lambda kv: -kv[1][1]):
        print(f"{kind:12s} {str(shape):16s} calls/token {calls / n:5.0f}  ms/token {sec / n * 1e3:7.2f}  "
              f"{nbytes * calls / sec / 1e9:5.1f} GB/s")
    products = sum(s[1] for s in stats.values()) / n
    print(f"decode step {step * 1e3:.1f} ms: products {products * 1e3:.1f} ms, "
          f"everything else {(step - products) * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
