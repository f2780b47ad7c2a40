#!/usr/bin/env python
"""Attention alone on E2B's shapes (8 query heads, 1 KV head; sliding head dim 256 with a ring of
516 slots, full head dim 512): a decode step at a position, and a 512-row prefill chunk at an
offset. Median ms per call, and GFLOP/s of the score + weighted-sum work actually visible.

    python scripts/bench_attention.py [--threads 2] [--pos 2048] [--repeat 20]
"""
from __future__ import annotations

import argparse
import statistics
import time

import gemmalite  # noqa: F401 - first: sets the BLAS thread timeout before numpy starts
import numba
import numpy as np
from gemmalite.kernels import ops


def case(t: int, pos: int, d: int, window: int | None, repeat: int) -> tuple[float, float]:
    rng = np.random.default_rng(0)
    ring = min(pos + t, window + 4) if window else pos + t
    k = rng.standard_normal((ring, 1, d)).astype(np.float32)
    v = rng.standard_normal((ring, 1, d)).astype(np.float32)
    q = rng.standard_normal((t, 8, d)).astype(np.float32)
    k_pos = np.arange(pos + t - ring, pos + t, dtype=np.int64)
    k_pos = np.roll(k_pos, pos % ring)  # a ring that has wrapped: slots out of position order
    q_pos = np.arange(pos, pos + t, dtype=np.int64)
    ops.attention(q, k, v, q_pos, k_pos, window, 0.0625)
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        ops.attention(q, k, v, q_pos, k_pos, window, 0.0625)
        times.append(time.perf_counter() - t0)
    ms = statistics.median(times) * 1e3
    pairs = sum(min(p + 1, window or p + 1) for p in range(pos, pos + t))
    return ms, pairs * 8 * d * 4 / (ms * 1e-3) / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--pos", type=int, default=2048)
    ap.add_argument("--repeat", type=int, default=20)
    a = ap.parse_args()
    numba.set_num_threads(a.threads)
    for name, t, pos, d, w in 2 * [("decode sliding", 1, a.pos, 256, 512), ("decode full", 1, a.pos, 512, None),
                               ("decode sliding @128", 1, 128, 256, 512), ("decode full @128", 1, 128, 512, None),
                               ("prefill 512 sliding", 512, a.pos - 512, 256, 512),
                               ("prefill 512 full", 512, a.pos - 512, 512, None)]:
        ms, gf = case(t, pos, d, w, a.repeat if t == 1 else max(3, a.repeat // 10))
        print(f"{name:22s} {ms:8.3f} ms  {gf:6.1f} GFLOP/s")


if __name__ == "__main__":
    main()
