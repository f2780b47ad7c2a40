"""Time to the first token of the demo: import, load, first streamed piece, and the time since the
process started (from /proc, so the interpreter's own start-up counts too).

    python scripts/ttft.py                                   # kernels and tokenizer cached
    GEMMALITE_CACHE_DIR=$(mktemp -d) python scripts/ttft.py  # a first run
"""
import os
import sys
import time

t0 = time.perf_counter()
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # this checkout's gemmalite


def since_start() -> float:
    """Seconds since this process started (clock ticks since boot in /proc/self/stat)."""
    with open("/proc/self/stat") as f:
        start = int(f.read().rsplit(")", 1)[1].split()[19])
    with open("/proc/uptime") as f:
        return float(f.read().split()[0]) - start / os.sysconf("SC_CLK_TCK")


pre = since_start()
import gemmalite

t1 = time.perf_counter()
m = gemmalite.load("gemma3-270m")
t2 = time.perf_counter()
s = m.generate("The three most famous painters of the Renaissance were", stream=True, temperature=0, max_new_tokens=8)
first = next(iter(s))
t3 = time.perf_counter()
print(f"import {t1-t0:.2f} load {t2-t1:.2f} first {t3-t2:.2f} total {t3-t0:.2f} "
      f"from process start {since_start():.2f} (before the script {pre:.2f})", file=sys.stderr)
