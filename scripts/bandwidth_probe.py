#!/usr/bin/env python3
"""Memory read bandwidth of this machine, the ceiling for memory-bound decode.

Decode reads every weight once per token, so ``bandwidth / weight bytes per token`` is the
fastest decode any runtime can reach here. This sums a large float32 array (default 2 GiB,
far bigger than any cache) with a numba ``@njit(parallel=True)`` loop on ``--threads``
threads and with numpy on one thread, and reports GB/s (1e9 bytes/s), the median of
``--repeats`` passes after a warm-up pass.

    python scripts/bandwidth_probe.py [--gib 2] [--threads 2] [--repeats 5] [--json]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import numpy as np


def _numba_sum(threads: int):
    import numba
    from numba import njit, prange

    numba.set_num_threads(threads)

    @njit(parallel=True, fastmath=True)
    def parallel_sum(a):
        s = np.float32(0.0)
        for i in prange(a.shape[0]):  # numba splits the range across threads and vectorizes each part
            s += a[i]
        return s

    return parallel_sum


def _time(fn, a: np.ndarray, repeats: int) -> float:
    """Median GB/s of ``repeats`` calls of ``fn(a)`` after one warm-up call."""
    fn(a)
    rates = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn(a)
        rates.append(a.nbytes / (time.perf_counter() - t0) / 1e9)
    return statistics.median(rates)


def probe(gib: float = 2.0, threads: int = 2, repeats: int = 5) -> dict:
    try:
        from threadpoolctl import threadpool_limits

        threadpool_limits(1)  # numpy's sum is single-threaded anyway; keep BLAS out of the way
    except ImportError:
        pass
    a = np.ones(int(gib * 2**30) // 4, dtype=np.float32)  # written once, so every page is resident
    numba_gb_s = _time(_numba_sum(threads), a, repeats)
    numpy_gb_s = _time(np.sum, a, repeats)
    return {"array_bytes": a.nbytes, "threads": threads, "repeats": repeats,
            "numba_parallel_gb_s": round(numba_gb_s, 2), "numpy_1thread_gb_s": round(numpy_gb_s, 2)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gib", type=float, default=2.0, help="array size in GiB (default 2)")
    ap.add_argument("--threads", type=int, default=2, help="numba threads (default 2)")
    ap.add_argument("--repeats", type=int, default=5, help="timed passes; the median is reported (default 5)")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    a = ap.parse_args(argv)
    r = probe(a.gib, a.threads, a.repeats)
    if a.json:
        print(json.dumps(r))
    else:
        print(f"array {r['array_bytes'] / 2**30:.2f} GiB float32, median of {r['repeats']} passes")
        print(f"numba parallel sum, {r['threads']} threads: {r['numba_parallel_gb_s']:.1f} GB/s")
        print(f"numpy sum, 1 thread:            {r['numpy_1thread_gb_s']:.1f} GB/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
