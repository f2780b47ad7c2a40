"""Time two commands in turn (A B A B ...) while N CPU-bound processes keep the machine busy, and
print each pair's wall-clock ratio A/B: how gemmalite's defaults fare on an oversubscribed machine.

    python scripts/oversubscribed.py --load 4 --pairs 5 \\
        --a "gemmalite run gemma3-270m 'The capital of France is' --max-new-tokens 48 --temperature 0" \\
        --b "gemmalite run gemma3-270m 'The capital of France is' --max-new-tokens 48 --temperature 0 --threads 1"

The load processes are plain Python busy loops (one core each); both commands run one warm-up
first (kernels compiled and cached, files in the page cache), then alternate.
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import shlex
import statistics
import subprocess
import time


def _burn() -> None:  # pragma: no cover - a load process
    x = 0
    while True:
        x += 1


def timed(cmd: str) -> float:
    t0 = time.perf_counter()
    subprocess.run(shlex.split(cmd), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--a", required=True, help="command A (e.g. default threads)")
    ap.add_argument("--b", required=True, help="command B (e.g. --threads 1)")
    ap.add_argument("--load", type=int, default=4, help="CPU-bound load processes")
    ap.add_argument("--pairs", type=int, default=5)
    a = ap.parse_args()
    timed(a.a), timed(a.b)  # warm-up, before the load starts
    burners = [mp.Process(target=_burn, daemon=True) for _ in range(a.load)]
    for p in burners:
        p.start()
    try:
        rows = []
        for i in range(a.pairs):
            ta, tb = timed(a.a), timed(a.b)
            rows.append((ta, tb))
            print(f"pair {i + 1}: A {ta:7.2f} s   B {tb:7.2f} s   A/B {ta / tb:5.2f}", flush=True)
    finally:
        for p in burners:
            p.terminate()
    ratios = [ta / tb for ta, tb in rows]
    print(f"A median {statistics.median(r[0] for r in rows):.2f} s, B median {statistics.median(r[1] for r in rows):.2f} s; "
          f"A/B median {statistics.median(ratios):.2f}, max {max(ratios):.2f} ({a.load} load processes)")


if __name__ == "__main__":
    main()
