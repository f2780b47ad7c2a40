#!/usr/bin/env python
"""Time the quantized matmul kernels on Gemma-4-E2B-like shapes.

Decode (T=1): achieved GB/s of weight bytes read, for float32 numpy (BLAS gemv), int8 and
int4. Each small matrix is replicated into enough copies to overflow the L3 cache and the copies
are used in turn, so the figures are memory-bandwidth figures, as in a real decode step (the
model is far larger than the cache), not cache-resident ones.

Prefill (T=128): GFLOP/s (2*T*rows*cols / time) of the blocked dequantize + BLAS path against
float32 numpy BLAS.

The machine is noisy: every figure is the median over --reps timed calls (min in brackets).

    python scripts/bench_kernels.py [--reps 15] [--threads N] [--no-head] [--head-prefill]

On a shared machine, --threads 1 gives the steadiest per-core figures (no barrier waits on
a descheduled second thread).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

if __name__ == "__main__":  # thread counts must be fixed before numpy / numba start their pools
    for i, a in enumerate(sys.argv):
        if a == "--threads" and i + 1 < len(sys.argv) and int(sys.argv[i + 1]) > 0:
            os.environ["NUMBA_NUM_THREADS"] = os.environ["OPENBLAS_NUM_THREADS"] = sys.argv[i + 1]

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import gemmalite  # noqa: E402,F401  (before numpy: OpenBLAS workers must not spin against numba's)
import numpy as np  # noqa: E402

from gemmalite.weights.quant import Int4Matrix, Int8Matrix  # noqa: E402
from gemmalite.weights.matrix import F32Matrix  # noqa: E402

SHAPES = [  # (rows=out, cols=in, label)
    (6144, 1536, "1536->6144 (gate/up)"),
    (1536, 6144, "6144->1536 (down)"),
    (2048, 1536, "1536->2048 (q)"),
]
HEAD = (262144, 1536, "LM head 262144x1536")
CACHE_BYTES = 96 << 20  # working set per measurement: 3x the 32 MiB L3


def timeit(fns, reps):
    """Median and min seconds per call; cycles through the list (one call per copy)."""
    for f in fns[: min(len(fns), 2)]:
        f()
    ts = []
    i = 0
    for _ in range(reps):
        f = fns[i % len(fns)]
        i += 1
        t0 = time.perf_counter()
        f()
        ts.append(time.perf_counter() - t0)
    return float(np.median(ts)), float(np.min(ts))


def copies_of(m, nbytes):
    n = max(1, -(-CACHE_BYTES // nbytes))
    out = [m]
    for _ in range(n - 1):
        if isinstance(m, Int8Matrix):
            out.append(Int8Matrix(m.q.copy(), m.scale.copy()))
        elif isinstance(m, Int4Matrix):
            out.append(Int4Matrix(m.packed.copy(), m.scales.copy(), m.mins.copy()))
        else:
            out.append(F32Matrix(m.w.copy()))
    return out


def fmt_bw(name, nbytes, t):
    med, mn = t
    return f"{name:>5}: {med * 1e3:8.3f} ms [{mn * 1e3:7.3f}]  {nbytes / med / 1e9:6.1f} GB/s [{nbytes / mn / 1e9:5.1f}]"


def fmt_fl(name, flop, t):
    med, mn = t
    return f"{name:>5}: {med * 1e3:8.2f} ms [{mn * 1e3:7.2f}]  {flop / med / 1e9:6.1f} GFLOP/s [{flop / mn / 1e9:5.1f}]"


def bench_shape(rows, cols, label, reps, rng, prefill=True):
    print(f"\n== {label}: W [{rows}, {cols}]")
    w = (0.02 * rng.standard_normal((rows, cols))).astype(np.float32)
    mats = {"f32": F32Matrix(w), "int8": Int8Matrix.quantize(w), "int4": Int4Matrix.quantize(w)}
    x1 = rng.standard_normal((1, cols)).astype(np.float32)
    print(" decode T=1 (weights streamed from memory):")
    for name, m in mats.items():
        cs = copies_of(m, m.nbytes)
        t = timeit([(lambda c=c: c.matmul(x1)) for c in cs], reps * 2)
        print("  " + fmt_bw(name, m.nbytes, t) + f"   ({m.nbytes / 1e6:.1f} MB x{len(cs)} copies)")
    if prefill:
        T = 128
        xp = rng.standard_normal((T, cols)).astype(np.float32)
        flop = 2.0 * T * rows * cols
        print(f" prefill T={T}:")
        for name, m in mats.items():
            t = timeit([lambda m=m: m.matmul(xp)], reps)
            print("  " + fmt_fl(name, flop, t))


def bench_head(reps, rng, prefill):
    rows, cols, label = HEAD
    print(f"\n== {label} (random stored arrays, no quantization)")
    q = rng.integers(-127, 128, size=(rows, cols), dtype=np.int8)
    m8 = Int8Matrix(q, (rng.random(rows, dtype=np.float32) * 1e-3).astype(np.float32))
    ng = cols // 32
    m4 = Int4Matrix(rng.integers(0, 256, size=(rows, cols // 2), dtype=np.uint8),
                    (rng.random((rows, ng)) * 1e-3).astype(np.float16),
                    (-rng.random((rows, ng)) * 1e-2).astype(np.float16))
    x1 = rng.standard_normal((1, cols)).astype(np.float32)
    print(" decode T=1:")
    for name, m in (("int8", m8), ("int4", m4)):
        t = timeit([lambda m=m: m.matmul(x1)], max(5, reps // 2))
        print("  " + fmt_bw(name, m.nbytes, t) + f"   ({m.nbytes / 1e6:.0f} MB)")
    # float32 reference: the bf16 table converted whole would be 1.6 GB; time gemv over blocks
    # of a float32 copy of the int8 table made block by block (same bytes/row as a real one).
    blk = 16384
    wf = np.empty((rows, cols), dtype=np.float32)
    for r0 in range(0, rows, blk):
        wf[r0 : r0 + blk] = m8.rows(np.arange(r0, min(rows, r0 + blk)))
    t = timeit([lambda: x1 @ wf.T], max(5, reps // 2))
    print("  " + fmt_bw("f32", wf.nbytes, t) + f"   ({wf.nbytes / 1e6:.0f} MB)")
    if prefill:
        T = 128
        xp = rng.standard_normal((T, cols)).astype(np.float32)
        flop = 2.0 * T * rows * cols
        print(f" prefill T={T}:")
        for name, f in (("f32", lambda: xp @ wf.T), ("int8", lambda: m8.matmul(xp)), ("int4", lambda: m4.matmul(xp))):
            print("  " + fmt_fl(name, flop, timeit([f], 3)))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--threads", type=int, default=0, help="numba and OpenBLAS threads (default: all cores)")
    ap.add_argument("--no-head", action="store_true", help="skip the 262144-row LM head")
    ap.add_argument("--head-prefill", action="store_true", help="also time T=128 on the LM head (slow)")
    ap.add_argument("--no-prefill", action="store_true")
    a = ap.parse_args()
    import numba

    print(f"numba {numba.__version__}, {numba.get_num_threads()} threads, numpy {np.__version__}; "
          f"load average {os.getloadavg()[0]:.1f}")
    rng = np.random.default_rng(0)
    for rows, cols, label in SHAPES:
        bench_shape(rows, cols, label, a.reps, rng, prefill=not a.no_prefill)
    if not a.no_head:
        bench_head(a.reps, rng, a.head_prefill)


if __name__ == "__main__":
    main()
