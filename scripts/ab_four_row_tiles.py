#!/usr/bin/env python
"""A/B of `weights.quant.FOUR_ROW_TILES` (from how many activation rows the int8 decode kernel
takes tiles of 4 weight rows) on whole `Engine.decode_batch` steps, settings alternated in one
process, 3 rounds, min reported.

    python scripts/ab_four_row_tiles.py MODEL BATCHES SETTINGS     # e.g. /work/models/e2b-int8 1,2,4,8 2,4,99
"""
import sys
import time

import gemmalite
import numpy as np
from gemmalite.weights import quant

m = gemmalite.load(sys.argv[1], threads=2)
eng = m.engine
rng = np.random.default_rng(0)
res: dict = {}
for rnd in range(3):
    for B in [int(b) for b in sys.argv[2].split(",")]:
        for v in [int(v) for v in sys.argv[3].split(",")]:
            quant.FOUR_ROW_TILES = v
            states = [eng.new_state() for _ in range(B)]
            toks = [int(np.argmax(eng.logits(eng.prefill(s, rng.integers(1000, 200000, 40)))[0])) for s in states]
            eng.decode_batch(states, toks)
            t = time.perf_counter()
            for _ in range(3):
                toks = list(np.argmax(eng.decode_batch(states, toks), axis=1))
            res.setdefault((B, v), []).append((time.perf_counter() - t) / 3)
for (B, v), ts in sorted(res.items()):
    print(f"B={B} FOUR_ROW_TILES={v}: " + " ".join(f"{x * 1e3:.0f}" for x in ts) + f" ms, min {min(ts) * 1e3:.0f} ms "
          f"-> {B / min(ts):.1f} tok/s")
