#!/usr/bin/env python
"""The compiled decode step against the uncompiled one and llama.cpp, side by side in one run.

    python scripts/bench_decode_step.py [MODEL] [--llama-bench BIN] [--gguf FILE] [--depths 128,512]
        [--new-tokens 64] [--prefill 128] [--rounds 3] [--threads 2] [--bandwidth] [--json OUT]

MODEL (default ``gemma3-270m``, the bundled Gemma 3 270M Q4_K_M) decodes ``--new-tokens`` greedy
steps after prompts of each ``--depths`` length, with gemmalite's compiled decode step
(`models.gemma.compiled`: one numba call per layer) and with the uncompiled one (Python driving
each layer's kernels), each in its own process; llama.cpp's ``llama-bench`` runs the GGUF
(``--gguf``, default MODEL's own file when it is one) at the same depths (``-d``) and prefills
``--prefill`` tokens (``-p``) as gemmalite does. Rounds alternate the order of the three. Each
figure is the median of ``--rounds`` (best beside it); the load average is printed before and
after every run. ``--bandwidth`` also measures the machine's read bandwidth each round
(`bandwidth_probe.py`) and reports the decode's achieved GB/s (weight bytes read per token, the
LM head included, times tokens/s) as a share of it.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


def worker(a: argparse.Namespace) -> None:
    sys.path.insert(0, str(ROOT))
    import gemmalite  # first: it configures OpenBLAS threads before numpy loads it
    import numpy as np

    model = gemmalite.load(a.model, context=max(a.depths) + a.new_tokens + 8, threads=a.threads)
    eng = model.engine
    eng.graph.compiled_step = a.worker == "compiled"
    rng = np.random.default_rng(0)
    vocab = model.config.vocab_size

    def decode(depth: int, n: int) -> float:
        state = eng.new_state()
        tok = int(np.argmax(eng.logits(eng.prefill(state, rng.integers(10, vocab, depth)))[0]))
        t = time.perf_counter()
        for _ in range(n):
            tok = int(np.argmax(eng.decode_step(state, tok)))
        return n / (time.perf_counter() - t)

    decode(16, 4)  # warm-up (compiles what the cache does not hold)
    out = {"decode_tok_s": {d: decode(d, a.new_tokens) for d in a.depths}}
    state = eng.new_state()
    ids = rng.integers(10, vocab, a.prefill)
    t = time.perf_counter()
    eng.logits(eng.prefill(state, ids))
    out["prefill_tok_s"] = a.prefill / (time.perf_counter() - t)
    out["bytes_per_token"] = sum(m.nbytes for w in eng.graph.layers for m in w.matrices()) + eng.lm_head.nbytes + (
        eng.graph.ple.projection.nbytes if eng.graph.ple is not None else 0)
    print("RESULT " + json.dumps(out), flush=True)


def run_llama_bench(a) -> dict:
    cmd = [a.llama_bench, "-m", str(a.gguf), "-p", str(a.prefill), "-n", str(a.new_tokens),
           "-d", ",".join(["0"] + [str(d) for d in a.depths]), "-t", str(a.threads), "-r", "1", "-o", "json"]
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode:
        raise SystemExit(f"llama-bench failed ({p.returncode}):\n{p.stderr[-3000:]}")
    rows = json.loads(p.stdout)
    tg = {r["n_depth"]: r["avg_ts"] for r in rows if r["n_gen"] > 0}
    pp = next(r["avg_ts"] for r in rows if r["n_prompt"] > 0 and r["n_depth"] == 0)
    return {"decode_tok_s": {d: tg[d] for d in a.depths}, "prefill_tok_s": pp}


def run_gemmalite(a, which: str) -> dict:
    cmd = [sys.executable, __file__, a.model, "--worker", which, "--depths", ",".join(map(str, a.depths)),
           "--new-tokens", str(a.new_tokens), "--prefill", str(a.prefill), "--threads", str(a.threads)]
    p = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    line = next((ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if p.returncode or line is None:
        raise SystemExit(f"gemmalite ({which}) failed ({p.returncode}):\n{p.stderr[-3000:]}")
    r = json.loads(line[len("RESULT "):])
    r["decode_tok_s"] = {int(k): v for k, v in r["decode_tok_s"].items()}
    return r


def bandwidth(threads: int) -> float:
    p = subprocess.run([sys.executable, str(HERE / "bandwidth_probe.py"), "--threads", str(threads), "--json"],
                       capture_output=True, text=True, check=True)
    return json.loads(p.stdout)["numba_parallel_gb_s"]


def load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?", default="gemma3-270m")
    ap.add_argument("--llama-bench", default=None, metavar="BIN")
    ap.add_argument("--gguf", default=None, help="the GGUF llama-bench runs (default: MODEL's file, if a GGUF)")
    ap.add_argument("--depths", default="128,512")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--prefill", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--bandwidth", action="store_true")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--worker", choices=["compiled", "uncompiled"], help=argparse.SUPPRESS)
    a = ap.parse_args()
    a.depths = [int(d) for d in a.depths.split(",")]
    if a.worker:
        return worker(a)
    if a.gguf is None:
        sys.path.insert(0, str(ROOT))
        from gemmalite.loader import resolve

        path = Path(resolve(a.model))
        a.gguf = path if path.suffix == ".gguf" else None
    engines = ["compiled", "uncompiled"] + (["llama.cpp"] if a.llama_bench and a.gguf else [])
    runs: dict[str, list[dict]] = {e: [] for e in engines}
    bw: list[float] = []
    for r in range(a.rounds):
        order = engines if r % 2 == 0 else engines[::-1]
        for e in order:
            before = load()
            res = run_llama_bench(a) if e == "llama.cpp" else run_gemmalite(a, e)
            runs[e].append(res)
            print(f"round {r + 1} {e:10s} decode " + ", ".join(f"{res['decode_tok_s'][d]:.1f}" for d in a.depths)
                  + f" tok/s, prefill {res['prefill_tok_s']:.1f} tok/s   (load {before} -> {load()})", flush=True)
        if a.bandwidth:
            bw.append(bandwidth(a.threads))
            print(f"round {r + 1} read bandwidth {bw[-1]:.1f} GB/s", flush=True)

    def med(e, key, d=None):
        xs = [x[key][d] if d is not None else x[key] for x in runs[e]]
        return statistics.median(xs), max(xs)

    print(f"\n{a.model}, {a.threads} threads, {a.rounds} rounds (medians, best in brackets)")
    for d in a.depths:
        line = f"decode {a.new_tokens} tokens after {d}: " + ", ".join(
            f"{e} {med(e, 'decode_tok_s', d)[0]:.1f} ({med(e, 'decode_tok_s', d)[1]:.1f})" for e in engines)
        line += f"; compiled / uncompiled {med('compiled', 'decode_tok_s', d)[0] / med('uncompiled', 'decode_tok_s', d)[0]:.2f}x"
        if "llama.cpp" in engines:
            line += f", compiled / llama.cpp {med('compiled', 'decode_tok_s', d)[0] / med('llama.cpp', 'decode_tok_s', d)[0]:.2f}x"
        print(line)
    line = f"prefill {a.prefill} tokens: " + ", ".join(f"{e} {med(e, 'prefill_tok_s')[0]:.1f}" for e in engines)
    if "llama.cpp" in engines:
        line += f"; gemmalite / llama.cpp {med('compiled', 'prefill_tok_s')[0] / med('llama.cpp', 'prefill_tok_s')[0]:.2f}x"
    print(line)
    gb = runs["compiled"][0]["bytes_per_token"] / 1e9
    if bw:
        top = max(med("compiled", "decode_tok_s", d)[0] for d in a.depths)
        print(f"weights read per token {gb * 1e3:.1f} MB; read bandwidth {statistics.median(bw):.1f} GB/s; compiled "
              f"decode reads {gb * top:.1f} GB/s = {100 * gb * top / statistics.median(bw):.0f} % of it")
    if a.json:
        a.json.write_text(json.dumps({"model": a.model, "threads": a.threads, "runs": runs, "bandwidth_gb_s": bw,
                                      "depths": a.depths, "new_tokens": a.new_tokens, "prefill": a.prefill}, indent=1))


if __name__ == "__main__":
    main()
