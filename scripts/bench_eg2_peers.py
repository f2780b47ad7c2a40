#!/usr/bin/env python3
"""EmbeddingGemma 2 side by side: gemmalite (float, int8) vs transformers (float32 CPU) [vs egemma2].

The workload of issue 11 on one checkpoint folder (e.g. ``gemmalite synth --preset eg2 OUT``):
the latency of one short query and texts/s for 32 documents of 512 tokens (``--docs``), plus peak RSS.
Each engine runs in its own process with ``--threads`` threads, rounds interleaved; the table
gives medians over the rounds.

    python scripts/bench_eg2_peers.py MODEL [--converted-int8 DIR] [--rounds 3] [--threads 2] [--json]

``--converted-int8``: a ``gemmalite convert --quant int8`` output of MODEL, timed as the int8 row
(what a user runs; without it, MODEL is quantized on load, and the source's float32 pages count
in its peak RSS). egemma2 (``pip install egemma2``, CPU, ``--threads`` / ``--small-threads`` set
to the same count) runs through its Python client; it reads the whole multimodal checkpoint
(``processor_config.json``, tower weights), so a text-only folder makes it fail, which the
table reports. Its peak RSS is its server process's (``VmHWM``). Documents: random ordinary
tokens for gemmalite and transformers (token ids), and a 510-word text that tokenizes to 512
tokens with ``<bos>``/``<eos>`` for egemma2 (it takes text only).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

QUERY = "which planet is known as the red planet?"
PROMPT = "task: search result | query: "

_WORKERS = {
    "gemmalite": """
import json, sys
from gemmalite.tools.bench_embed import bench_embedder
r = bench_embedder(sys.argv[1], quant=None if sys.argv[2] in ("none", "converted") else sys.argv[2], runs=1,
                   docs=int(sys.argv[6]))
print(json.dumps({k: r[k] for k in ("load_s", "query_ms", "docs_texts_s", "peak_rss_bytes")}))
""",
    "transformers": """
import json, resource, sys, time, statistics
import numpy as np, torch
from transformers import AutoConfig, AutoModel, AutoTokenizer
torch.set_num_threads(int(sys.argv[3]))
t0 = time.perf_counter()
tok = AutoTokenizer.from_pretrained(sys.argv[1])
model = AutoModel.from_pretrained(sys.argv[1], dtype=torch.float32).eval()
load = time.perf_counter() - t0
def embed(ids):
    x = torch.tensor(ids)
    with torch.no_grad():
        h = model(input_ids=x, attention_mask=torch.ones_like(x)).last_hidden_state.mean(1)
    return torch.nn.functional.normalize(h, dim=-1)
q = tok([sys.argv[4] + sys.argv[5]])["input_ids"]
embed(q); ts = []
for _ in range(10):
    t = time.perf_counter(); embed(q); ts.append(time.perf_counter() - t)
rng = np.random.default_rng(0)
n = int(sys.argv[6])
docs = [[2, *rng.integers(1000, 262144, 510).tolist(), 1] for _ in range(n)]
embed(docs[:2]); t = time.perf_counter()
for i in range(0, n, 8):
    embed(docs[i:i + 8])
d = time.perf_counter() - t
print(json.dumps({"load_s": load, "query_ms": 1000 * statistics.median(ts), "docs_texts_s": n / d,
                  "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))
""",
    "egemma2": """
import json, os, stat, sys, tempfile, time, statistics
from egemma2 import Egemma2, find_egemma2_bin
n = sys.argv[3]
exe = os.path.join(tempfile.mkdtemp(), "egemma2")  # the client puts no options before `serve`
with open(exe, "w") as f:
    f.write(f'#!/bin/sh\\nexec {find_egemma2_bin()} --threads {n} --small-threads {n} "$@"\\n')
os.chmod(exe, stat.S_IRWXU)
def hwm(pid):
    with open(f"/proc/{pid}/status") as f:
        return next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmHWM"))
t0 = time.perf_counter()
with Egemma2(exe=exe, model_dir=sys.argv[1], device="cpu") as m:
    m.embed("warm up")
    load = time.perf_counter() - t0
    m.embed(sys.argv[5], prompt_name="SearchQuery"); ts = []
    for _ in range(10):
        t = time.perf_counter(); m.embed(sys.argv[5], prompt_name="SearchQuery"); ts.append(time.perf_counter() - t)
    docs = [" ".join(["word"] * 510) for _ in range(int(sys.argv[6]))]
    m.embed(docs[:2]); t = time.perf_counter(); m.embed(docs); d = time.perf_counter() - t
    rss = hwm(m._proc.pid)
print(json.dumps({"load_s": load, "query_ms": 1000 * statistics.median(ts), "docs_texts_s": len(docs) / d,
                  "peak_rss_bytes": rss}))
""",
}


def run(engine: str, model: str, quant: str, threads: int, docs: int = 32) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), NUMBA_NUM_THREADS=str(threads),
               OPENBLAS_NUM_THREADS=str(threads), EGEMMA2_THREADS=str(threads))
    p = subprocess.run([sys.executable, "-c", _WORKERS[engine], model, quant, str(threads), PROMPT, QUERY, str(docs)],
                       capture_output=True, text=True, env=env)
    if p.returncode:
        return {"error": (p.stderr.strip().splitlines() or ["failed"])[-1][:200]}
    return json.loads(p.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--converted-int8", default=None, help="gemmalite convert --quant int8 output of MODEL")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--engines", default="gemmalite/none,gemmalite/int8,transformers/none,egemma2/none",
                    help="comma-separated ENGINE/QUANT list (default: all four; the int8 row is the "
                         "converted checkpoint when --converted-int8 is given)")
    ap.add_argument("--docs", type=int, default=32, help="documents of 512 tokens (default 32)")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    int8 = ("gemmalite", "converted", a.converted_int8) if a.converted_int8 else ("gemmalite", "int8", a.model)
    engines = [int8 if e == "gemmalite/int8" else (*e.split("/"), a.model) for e in a.engines.split(",")]
    results: dict[str, list[dict]] = {f"{e}/{q}": [] for e, q, _ in engines}
    for _ in range(a.rounds):
        for e, q, path in engines:
            results[f"{e}/{q}"].append(run(e, path, q, a.threads, a.docs))
    table = {}
    for name, rs in results.items():
        ok = [r for r in rs if "error" not in r]
        if not ok:
            table[name] = {"error": rs[0]["error"]}
            continue
        table[name] = {k: statistics.median(r[k] for r in ok) if ok[0][k] is not None else None
                       for k in ("load_s", "query_ms", "docs_texts_s", "peak_rss_bytes")}
    if a.json:
        print(json.dumps(table))
        return 0
    print(f"{'engine':24s} {'load s':>8s} {'query ms':>10s} {'docs texts/s':>13s} {'peak RSS GiB':>13s}")
    for name, r in table.items():
        if "error" in r:
            print(f"{name:24s} error: {r['error']}")
            continue
        rss = f"{r['peak_rss_bytes'] / 2**30:.2f}" if r["peak_rss_bytes"] else "-"
        print(f"{name:24s} {r['load_s']:8.2f} {r['query_ms']:10.1f} {r['docs_texts_s']:13.3f} {rss:>13s}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
