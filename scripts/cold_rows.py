#!/usr/bin/env python3
"""Time row lookups of a model's host tables (token embedding, PLE table) on rows the page cache
lacks: what a decode step pays per new token when the machine has not read the file lately.

A memory-mapped table read at random costs a page fault per cold row; by default the kernel then
reads its whole read-ahead window around the page (``/sys/block/*/queue/read_ahead_kb``, 8 MiB on
some cloud disks), so a 17.5 KiB PLE row of E2B cost 6-12 ms there. gemmalite advises its lookup-only
tables for random access (`Matrix.lookup_only`); ``--default`` drops that advice (MADV_NORMAL) to
show the difference. Each run should draw rows no earlier run touched (``--seed``), or evict the
file first (``echo 1 > /proc/sys/vm/drop_caches`` as root): a cached row costs microseconds.

    python scripts/cold_rows.py MODEL [--rows 30] [--seed 0] [--default] [--json]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--rows", type=int, default=30, help="rows looked up, one at a time")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--default", action="store_true", help="the kernel's default read-ahead (MADV_NORMAL)")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)

    import gemmalite

    e = gemmalite.load(a.model).engine
    tables = {"PLE table": e.ple_table, "token embedding": e.embed if e.embed is not e.lm_head else None}
    rng = np.random.default_rng(a.seed)
    out = {}
    for name, t in tables.items():
        if t is None:
            continue
        if a.default:
            t.lookup_only(False)
        t.rows(np.array([0]))  # compiles the gather where it is a kernel; row 0 is then cached
        ms = []
        for r in rng.integers(1, t.shape[0], a.rows):
            t0 = time.perf_counter()
            t.rows(np.array([r]))
            ms.append((time.perf_counter() - t0) * 1e3)
        out[name] = {"median_ms": statistics.median(ms), "max_ms": max(ms), "rows": a.rows,
                     "row_bytes": t.nbytes // t.shape[0]}
    if a.json:
        print(json.dumps({"model": a.model, "advice": "normal" if a.default else "random", "tables": out}))
    else:
        for name, r in out.items():
            print(f"{name}: {r['rows']} cold rows of {r['row_bytes']:,} bytes, median {r['median_ms']:.2f} ms, "
                  f"max {r['max_ms']:.2f} ms ({'default read-ahead' if a.default else 'random-access advice'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
