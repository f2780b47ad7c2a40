#!/usr/bin/env python3
"""Memory read bandwidth of this machine, the ceiling for memory-bound decode.

Decode reads every weight once per token, so ``bandwidth / weight bytes per token`` is the
fastest decode any runtime can reach here. This sums a large float32 array (default 2 GiB,
far bigger than any cache) with a numba ``@njit(parallel=True)`` loop on ``--threads``
threads and with numpy on one thread, and reports GB/s (1e9 bytes/s), the median of
``--repeats`` passes after a warm-up pass. The numba sum runs twice: over an array as numpy
allocates it (4 KiB pages, unless the kernel's THP mode is ``always``) and over one in 2 MiB pages (anonymous memory that asks for
transparent huge pages, as gemmalite's streamed weights do: `gemmalite.weights.pages`, where the
kernel offers them); ``numba_parallel_gb_s``, the ceiling the benchmarks divide by, is the higher.

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
    n = int(gib * 2**30) // 4
    arrays = {"4k": np.ones(n, dtype=np.float32)}  # written once, so every page is resident
    if _huge_pages_offered():
        arrays["2m"] = _huge_array(n)
    psum = _numba_sum(threads)
    for a in arrays.values():  # warm-up passes
        psum(a)
    rates: dict[str, list[float]] = {k: [] for k in arrays}
    for _ in range(repeats):  # the page sizes alternate, so the machine's drift falls on both alike
        for k, a in arrays.items():
            t0 = time.perf_counter()
            psum(a)
            rates[k].append(a.nbytes / (time.perf_counter() - t0) / 1e9)
    med = {k: statistics.median(v) for k, v in rates.items()}
    numpy_gb_s = _time(np.sum, arrays["4k"], repeats)
    return {"array_bytes": n * 4, "threads": threads, "repeats": repeats,
            "numba_parallel_gb_s": round(max(med.values()), 2),
            "numba_4k_pages_gb_s": round(med["4k"], 2),
            "numba_2m_pages_gb_s": round(med["2m"], 2) if "2m" in med else None,
            "numpy_1thread_gb_s": round(numpy_gb_s, 2)}


def _huge_pages_offered() -> bool:
    """Transparent huge pages ``always`` or ``madvise`` (gemmalite.weights.pages.offered, without
    importing gemmalite: the probe runs beside it)."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            mode = f.read()
    except OSError:
        return False
    return "[always]" in mode or "[madvise]" in mode


def _huge_array(n: int) -> np.ndarray:
    """float32 ones in anonymous memory that asks for 2 MiB pages."""
    import mmap

    m = mmap.mmap(-1, n * 4, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    m.madvise(mmap.MADV_HUGEPAGE)
    a = np.frombuffer(m, np.float32)
    a[:] = 1.0
    return a


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
        print(f"numba parallel sum, {r['threads']} threads: {r['numba_parallel_gb_s']:.1f} GB/s (4 KiB pages "
              f"{r['numba_4k_pages_gb_s']:.1f}, 2 MiB pages {r['numba_2m_pages_gb_s'] or 'not offered'})")
        print(f"numpy sum, 1 thread:            {r['numpy_1thread_gb_s']:.1f} GB/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
