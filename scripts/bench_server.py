"""Load benchmark of an OpenAI-compatible server: aggregate decode tokens/s and time to first
token with 1, 2, 4, 8 concurrent streams.

    python scripts/bench_server.py --gemmalite MODEL_DIR [--context 2048]
    python scripts/bench_server.py --llama-server /path/to/llama-server --gguf model.gguf
    python scripts/bench_server.py --url http://127.0.0.1:8080/v1 --model NAME   # already running

Each level starts N streaming completions of the same prompt at once (max_tokens fixed,
end-of-sequence ignored where the server allows it) and reports: aggregate tokens/s (all
tokens after each stream's first, over the time from the first stream's first token to the
last stream's end), p50 / p99 time to first token, and the speed-up over one stream.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

PROMPT = ("Write a long and detailed story about a lighthouse keeper who finds a message in a bottle. "
          "Describe the sea, the weather, the keeper's daily routine and the people of the nearby village.")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(url: str, proc: subprocess.Popen, timeout: float = 600) -> None:
    import urllib.request

    t0 = time.time()
    while time.time() - t0 < timeout:
        if proc.poll() is not None:
            raise SystemExit(f"server exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url.rsplit("/v1", 1)[0] + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise SystemExit("server did not become ready")


def one_stream(client, model: str, max_tokens: int, t_start: float) -> dict:
    t0 = time.perf_counter()
    first = None
    n = 0
    stream = client.completions.create(model=model, prompt=PROMPT, max_tokens=max_tokens, temperature=0,
                                       stream=True, extra_body={"ignore_eos": True})
    for chunk in stream:
        if chunk.choices and chunk.choices[0].text:
            n += 1  # one token per chunk on both servers (text held back at a stop is rare here)
            if first is None:
                first = time.perf_counter()
    end = time.perf_counter()
    return {"ttft": (first or end) - t0, "first_at": (first or end) - t_start, "end_at": end - t_start, "chunks": n}


def run_level(client, model: str, n: int, max_tokens: int) -> dict:
    t_start = time.perf_counter()
    with ThreadPoolExecutor(n) as ex:
        res = list(ex.map(lambda _: one_stream(client, model, max_tokens, t_start), range(n)))
    decode_tokens = sum(max(0, r["chunks"] - 1) for r in res)
    span = max(r["end_at"] for r in res) - min(r["first_at"] for r in res)
    ttft = np.array([r["ttft"] for r in res])
    return {"streams": n, "tokens_per_s": decode_tokens / span if span > 0 else 0.0,
            "ttft_p50_s": float(np.percentile(ttft, 50)), "ttft_p99_s": float(np.percentile(ttft, 99))}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--gemmalite", metavar="MODEL", help="start `gemmalite serve MODEL`")
    src.add_argument("--llama-server", metavar="BIN", help="start this llama-server binary (with --gguf)")
    src.add_argument("--url", help="a server already running (base URL ending in /v1)")
    ap.add_argument("--gguf", help="model file for llama-server")
    ap.add_argument("--model", default=None, help="model id to send (default: the first of /v1/models)")
    ap.add_argument("--context", type=int, default=2048, help="per-sequence context")
    ap.add_argument("--levels", default="1,2,4,8")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)

    import openai

    proc = None
    levels = [int(x) for x in a.levels.split(",")]
    url = a.url
    if url is None:
        port = free_port()
        url = f"http://127.0.0.1:{port}/v1"
        if a.gemmalite:
            cmd = [sys.executable, "-m", "gemmalite.cli", "serve", a.gemmalite, "--port", str(port), "--context",
                   str(a.context), "--max-concurrency", str(max(levels)), "--prefix-cache", "0"]
        else:
            if not a.gguf:
                ap.error("--llama-server needs --gguf")
            n = max(levels)  # llama-server splits its context over the slots
            cmd = [a.llama_server, "-m", a.gguf, "--port", str(port), "--parallel", str(n), "--cont-batching",
                   "-c", str(a.context * n), "-t", str(a.threads)]
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        if proc is not None:
            wait_ready(url, proc)
        client = openai.OpenAI(base_url=url, api_key=os.environ.get("OPENAI_API_KEY", "none"), max_retries=0,
                               timeout=3600)
        model = a.model or client.models.list().data[0].id
        run_level(client, model, 1, 4)  # warm-up (kernel compilation, caches)
        rows = [run_level(client, model, n, a.max_tokens) for n in levels]
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=60)
    base = rows[0]["tokens_per_s"] or 1.0
    for r in rows:
        r["speedup"] = r["tokens_per_s"] / base
    if a.json:
        print(json.dumps({"server": a.gemmalite or a.llama_server or url, "rows": rows}, indent=2))
    else:
        print(f"{'streams':>7} {'tok/s':>8} {'x1':>6} {'TTFT p50':>9} {'TTFT p99':>9}")
        for r in rows:
            print(f"{r['streams']:>7} {r['tokens_per_s']:>8.2f} {r['speedup']:>6.2f} {r['ttft_p50_s']:>8.2f}s "
                  f"{r['ttft_p99_s']:>8.2f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
