#!/usr/bin/env python
"""Multiply-add rate of the int8 decode kernel (`Int8Matrix.matmul_each`, int16 activations) on
E2B's projection shapes for 1, 4 and 8 activation rows (a batch of sequences), cache-resident
weights: how much a batch costs beyond its one weight read. Best of 3 timings.

    python scripts/bench_rows_kernel.py [--threads 2]
"""
from __future__ import annotations

import argparse
import time

import gemmalite  # noqa: F401  (process settings first)
import numpy as np
from gemmalite.runtime.threads import set_numba_threads
from gemmalite.weights.quant import Int8Matrix


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    set_numba_threads(a.threads)
    rng = np.random.default_rng(0)
    for n, k in [(512, 1536), (6144, 1536), (1536, 6144)]:
        m = Int8Matrix(rng.integers(-127, 128, (n, k), dtype=np.int8), rng.random(n, dtype=np.float32))
        line = f"{n}x{k}:"
        for t in (1, 4, 8):
            x = rng.standard_normal((t, k), dtype=np.float32)
            m.matmul_each(x)
            reps = max(5, int(1e9 / (n * k * t)))
            best = 1e9
            for _ in range(3):
                t0 = time.perf_counter()
                for _ in range(reps):
                    m.matmul_each(x)
                best = min(best, (time.perf_counter() - t0) / reps)
            line += f"  T={t} {best * 1e3:6.3f} ms {n * k * t / best / 1e9:5.1f} GMAC/s"
        print(line, flush=True)


if __name__ == "__main__":
    main()
