#!/usr/bin/env python3
r"""Decode speed of gemmalite against llama.cpp and the machine's read bandwidth, finely interleaved.

The benchmark machines drift by up to 1.5x within minutes (a neighbour's memory traffic): a ratio of two
runs a minute apart says more about the minute than about the runtimes. Here every runtime loads once,
in its own long-lived process, and then they take turns: one turn is a prompt and ``--new-tokens``
greedy decode steps (a second or two), or, for the probe, passes of `bandwidth_probe`'s parallel sum over
2 GiB; a round is one turn of each, in a rotating order. Ratios are taken within a round and their
median quoted, with the spread; so are each decode's weight reads per second as a share of the probe's
bandwidth of the same round (the "share of the bandwidth" the decode criteria ask for).

    python scripts/paired_decode.py --gemmalite PATH [--gemmalite PATH2] --llama GGUF [--llama GGUF2] \
        [--prompt-tokens 128] [--new-tokens 16] [--rounds 15] [--threads 2] [--out FILE.json]

``PATH`` is anything `gemmalite.load` takes (a folder, a GGUF, ``gemma3-270m``); the prompt is
`compare_peers.prompt_ids` of ``--prompt-model`` (a checkpoint folder: BOS and random ids, what
``gemmalite bench`` feeds) or, without it, `bench_gemma3_gguf.prompt_ids` (real text for the bundled
Gemma 3 270M). llama.cpp runs through llama-cpp-python (``eval`` of the prompt after ``reset``, then one
``eval`` per token with greedy argmax), as `compare_peers.py`'s llama-cpp-python worker does.
Run by hand, never in CI.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent  # numpy is imported in the workers, after gemmalite (its BLAS settings)


# ---------------------------------------------------------------- workers (each in its own process)

def gemmalite_worker(a) -> tuple[callable, dict]:
    import gemmalite  # first: it configures OpenBLAS threads before numpy loads it
    import numba
    from gemmalite.tools.bench import run_once, weight_bytes_per_token

    numba.set_num_threads(a.threads)
    model = gemmalite.load(a.path, context=max(256, len(a.ids) + a.new_tokens + 1), threads=a.threads)

    def turn() -> dict:  # `gemmalite bench`'s own run: the prompt, then greedy steps
        prefill_s, decode_s = run_once(model, a.ids, a.new_tokens)
        return {"prefill_s": prefill_s, "decode_s": decode_s}

    return turn, {"weight_bytes_per_token": weight_bytes_per_token(model)}


def llama_worker(a) -> tuple[callable, dict]:
    from llama_cpp import llama_cpp

    sys.path.insert(0, str(HERE))
    from compare_peers import gguf_bytes_per_token, llama_open, llama_run

    llm = llama_open(a.path, len(a.ids) + a.new_tokens, a.threads)

    def turn() -> dict:  # `compare_peers.py`'s own run
        prefill_s, decode_s = llama_run(llm, a.ids, a.new_tokens)
        return {"prefill_s": prefill_s, "decode_s": decode_s}

    return turn, {"weight_bytes_per_token": gguf_bytes_per_token(a.path),
                  "system_info": llama_cpp.llama_print_system_info().decode(errors="replace").strip()}


def probe_worker(a) -> tuple[callable, dict]:
    import numpy as np

    sys.path.insert(0, str(HERE))
    from bandwidth_probe import _huge_array, _huge_pages_offered, _numba_sum, _time

    n = 2**31 // 4
    arr = _huge_array(n) if _huge_pages_offered() else np.ones(n, np.float32)
    psum = _numba_sum(a.threads)

    def turn() -> dict:  # the probe's own timing: a warm-up pass, the median of three
        return {"gb_s": _time(psum, arr, 3)}

    return turn, {"array_bytes": arr.nbytes}


WORKERS = {"gemmalite": gemmalite_worker, "llama": llama_worker, "probe": probe_worker}


def serve(a) -> None:
    """A worker: load, say ready (with its facts), then one turn per line read, one JSON line each."""
    a.ids = json.loads(a.ids)
    turn, facts = WORKERS[a.worker](a)
    turn()  # warm-up: compiles kernels, pages in the prompt's table rows
    print(json.dumps({"ready": True, **facts}), flush=True)
    for line in sys.stdin:
        if line.strip() != "turn":
            break
        print(json.dumps(turn()), flush=True)


# ---------------------------------------------------------------- coordinator

def prompt(a) -> list[int]:
    sys.path.insert(0, str(HERE))
    if a.prompt_model:
        from compare_peers import prompt_ids

        return prompt_ids(Path(a.prompt_model), a.prompt_tokens)
    from bench_gemma3_gguf import prompt_ids

    return prompt_ids(a.prompt_tokens)


def spread(xs: list[float]) -> dict:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gemmalite", action="append", default=[], help="a model gemmalite.load takes (repeatable)")
    ap.add_argument("--llama", action="append", default=[], help="a GGUF for llama.cpp (repeatable)")
    ap.add_argument("--no-probe", action="store_true", help="leave the bandwidth probe out of the rounds")
    ap.add_argument("--prompt-model", help="checkpoint folder whose config draws the random prompt ids")
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", help="write every turn and the summary as JSON")
    ap.add_argument("--worker", choices=sorted(WORKERS), help=argparse.SUPPRESS)
    ap.add_argument("--path", help=argparse.SUPPRESS)
    ap.add_argument("--ids", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker:
        serve(a)
        return 0
    if not a.gemmalite:
        ap.error("give at least one --gemmalite model")
    ids = prompt(a)
    engines = [(f"gemmalite {Path(p).name}", "gemmalite", p) for p in a.gemmalite]
    engines += [(f"llama.cpp {Path(p).name}", "llama", p) for p in a.llama]
    if not a.no_probe:
        engines.append(("probe", "probe", ""))
    procs, facts = {}, {}
    try:
        for name, kind, path in engines:  # loaded one after the other: no load competes with another
            procs[name] = subprocess.Popen(
                [sys.executable, __file__, "--worker", kind, "--path", path, "--ids", json.dumps(ids),
                 "--new-tokens", str(a.new_tokens), "--threads", str(a.threads)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)
            line = procs[name].stdout.readline()
            if not line:
                raise SystemExit(f"{name}: the worker exited before it was ready")
            facts[name] = json.loads(line)
            print(f"[ready] {name}", file=sys.stderr)
        names = [e[0] for e in engines]
        rounds = []
        for r in range(a.rounds):
            order = names[r % len(names):] + names[:r % len(names)]
            res = {}
            for name in order:
                procs[name].stdin.write("turn\n")
                res[name] = json.loads(procs[name].stdout.readline())
            rounds.append(res)
            print(f"[round {r + 1}/{a.rounds}] " + ", ".join(
                f"{n} {a.new_tokens / v['decode_s']:.2f} tok/s" if "decode_s" in v else f"{n} {v['gb_s']:.1f} GB/s"
                for n, v in res.items()), file=sys.stderr)
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.stdin.close()
                p.wait(timeout=60)
    summary = summarize(a, engines, facts, rounds)
    print(table(summary))
    if a.out:
        Path(a.out).write_text(json.dumps({"args": vars(a), "facts": facts, "rounds": rounds, "summary": summary},
                                          indent=1))
    return 0


def summarize(a, engines, facts, rounds) -> dict:
    """Per runtime: decode / prefill tok/s and the share of the round's probe; per pair of runtimes
    (the first gemmalite against each other one): the within-round decode and prefill ratios."""
    runtimes = [e[0] for e in engines if e[1] != "probe"]
    out = {"prompt_tokens": a.prompt_tokens, "new_tokens": a.new_tokens, "rounds": len(rounds),
           "threads": a.threads, "cpu": os.uname().machine}
    for n in runtimes:
        dec = [a.new_tokens / r[n]["decode_s"] for r in rounds]
        pre = [a.prompt_tokens / r[n]["prefill_s"] for r in rounds]
        row = {"decode_tok_s": spread(dec), "prefill_tok_s": spread(pre),
               "weight_bytes_per_token": facts[n]["weight_bytes_per_token"]}
        if "probe" in rounds[0]:
            share = [d * facts[n]["weight_bytes_per_token"] / 1e9 / r["probe"]["gb_s"] for d, r in zip(dec, rounds)]
            row["share_of_probe"] = spread(share)
        out[n] = row
    if "probe" in rounds[0]:
        out["probe_gb_s"] = spread([r["probe"]["gb_s"] for r in rounds])
    base = runtimes[0]
    for n in runtimes[1:]:
        out[f"{base} / {n}"] = {
            k: spread([r[n][f"{k}_s"] / r[base][f"{k}_s"] for r in rounds]) for k in ("decode", "prefill")}
    return out


def table(s: dict) -> str:
    """The summary as text: median [min, max] of every figure."""
    def f(d: dict, fmt: str) -> str:
        return f"{d['median']:{fmt}} [{d['min']:{fmt}}, {d['max']:{fmt}}]"

    lines = [f"{s['rounds']} rounds, {s['prompt_tokens']}-token prompt, {s['new_tokens']} decode steps a turn, "
             f"{s['threads']} threads (median [min, max])"]
    if "probe_gb_s" in s:
        lines.append(f"{'probe':44s} {f(s['probe_gb_s'], '.1f')} GB/s")
    for k, v in s.items():
        if isinstance(v, dict) and "decode_tok_s" in v:
            share = f"; share of the probe {f(v['share_of_probe'], '.3f')}" if "share_of_probe" in v else ""
            lines.append(f"{k:44s} decode {f(v['decode_tok_s'], '.2f')} tok/s; prefill {f(v['prefill_tok_s'], '.1f')}"
                         f" tok/s; {v['weight_bytes_per_token'] / 1e9:.3f} GB a token{share}")
        elif isinstance(v, dict) and "decode" in v:
            lines.append(f"{k:44s} decode {f(v['decode'], '.3f')}x; prefill {f(v['prefill'], '.3f')}x")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
