"""Load benchmark of OpenAI-compatible servers under the same load, side by side: aggregate
decode tokens/s with 1, 2, 4, 8 concurrent streams, p50 / p99 time to first token, and the solo
prefill time of the same prompt.

    python scripts/bench_server.py --gemmalite MODEL_DIR --llama-server BIN --gguf FILE [--threads 2]
    python scripts/bench_server.py --gemmalite MODEL_DIR                      # one server
    python scripts/bench_server.py --url http://127.0.0.1:8080/v1 [--model NAME]   # already running

Every server named is started (and loaded) first; then each measurement runs on each server in
turn, the order alternating from one level to the next, so both see the same machine state;
``--rounds R`` runs the levels R times and reports each figure's median.
A level starts N streaming completions of the same prompt at once (``--distinct``: each opening
with its own words; max_tokens fixed, end of sequence ignored; no prompt kept from one request
to the next: llama.cpp's ``cache_prompt`` off, gemmalite ``--prefix-cache 0``; gemmalite still
shares one prefill between requests of one burst that start alike) and reports: aggregate
decode tokens/s (the tokens after each stream's first, over the time from the first stream's
first token to the last stream's end), p50 / p99 time to first token, and the speed-up over
one stream. Solo prefill: the median time to first token of one request alone (max_tokens 1).
llama-server runs with ``--parallel`` = the largest level and continuous batching on.

``--task summarise|edit``: the input-grounded chat prompts of `bench_prompt_lookup.py` instead,
sent as chat completions that end at the model's end of turn (greedy, so every run gives the
same text). ``--prompt-lookup``: the gemmalite server is measured twice, with and without
``prompt_lookup`` in the requests (one server, the two alternating like two servers).
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

import numpy as np

PROMPT = ("Write a long and detailed story about a lighthouse keeper who finds a message in a bottle. "
          "Describe the sea, the weather, the keeper's daily routine and the people of the nearby village.")
NO_CACHE = {"ignore_eos": True, "cache_prompt": False}  # llama.cpp's keys; gemmalite ignores cache_prompt


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(url: str, proc: subprocess.Popen, timeout: float = 900) -> None:
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


def prompt_for(i: int, distinct: bool, task: str | None = None) -> str:
    """The prompt of stream ``i``: all the same, or each opening with its own words (so that no
    server can share a prefill between streams)."""
    if task:
        from bench_prompt_lookup import PROMPTS

        return (f"Document {i + 1}. " if distinct else "") + PROMPTS[task]
    return f"Story {i + 1}, in your own words. " + PROMPT if distinct else PROMPT


def one_stream(client, model: str, max_tokens: int, t_start: float, prompt: str = PROMPT, chat: bool = False,
               extra: dict | None = None) -> dict:
    """One streamed request: a completion of ``prompt`` (through end of sequence), or with ``chat``
    a chat turn that ends at the model's end of turn."""
    t0 = time.perf_counter()
    first, chunks, usage = None, 0, None
    common = {"model": model, "max_tokens": max_tokens, "temperature": 0, "stream": True,
              "stream_options": {"include_usage": True}}
    if chat:
        stream = client.chat.completions.create(messages=[{"role": "user", "content": prompt}], **common,
                                                extra_body={"cache_prompt": False, **(extra or {})})
    else:
        stream = client.completions.create(prompt=prompt, **common, extra_body={**NO_CACHE, **(extra or {})})
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        if chunk.choices and (chunk.choices[0].delta.content if chat else chunk.choices[0].text):
            chunks += 1
            if first is None:
                first = time.perf_counter()
    end = time.perf_counter()
    tokens = usage.completion_tokens if usage is not None else chunks  # a chunk may hold held-back text
    return {"ttft": (first or end) - t0, "first_at": (first or end) - t_start, "end_at": end - t_start,
            "tokens": tokens}


def run_level(t: Target, n: int, max_tokens: int, distinct: bool = False, task: str | None = None) -> dict:
    t_start = time.perf_counter()
    with ThreadPoolExecutor(n) as ex:
        res = list(ex.map(lambda i: one_stream(t.client, t.model, max_tokens, t_start, prompt_for(i, distinct, task),
                                               chat=task is not None, extra=t.extra), range(n)))
    decode_tokens = sum(max(0, r["tokens"] - 1) for r in res)
    span = max(r["end_at"] for r in res) - min(r["first_at"] for r in res)
    ttft = np.array([r["ttft"] for r in res])
    return {"streams": n, "tokens_per_s": decode_tokens / span if span > 0 else 0.0,
            "tokens_per_stream": float(np.mean([r["tokens"] for r in res])),
            "ttft_p50_s": float(np.percentile(ttft, 50)), "ttft_p99_s": float(np.percentile(ttft, 99))}


def solo_prefill(t: Target, task: str | None = None, repeats: int = 3) -> float:
    return float(np.median([one_stream(t.client, t.model, 1, time.perf_counter(), prompt_for(0, False, task),
                                       chat=task is not None, extra=t.extra)["ttft"] for _ in range(repeats)]))


class Target:
    """One server: started here (or already running at ``url``), and its openai client."""

    def __init__(self, name: str, cmd: list[str] | None, url: str, model: str | None, extra: dict | None = None):
        import openai

        self.name, self.url, self.extra = name, url, extra
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) if cmd else None
        self.client = openai.OpenAI(base_url=url, api_key=os.environ.get("OPENAI_API_KEY", "none"), max_retries=0,
                                    timeout=3600)
        self.model = model

    def ready(self) -> "Target":
        if self.proc is not None:
            wait_ready(self.url, self.proc)
        self.model = self.model or self.client.models.list().data[0].id
        return self

    def close(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def targets(a, levels: list[int]) -> list[Target]:
    out = []
    if a.gemmalite:
        port = free_port()
        cmd = [sys.executable, "-m", "gemmalite.cli", "serve", a.gemmalite, "--port", str(port), "--context",
               str(a.context), "--max-concurrency", str(max(levels)), "--prefix-cache", "0", "--threads", str(a.threads)]
        out.append(Target("gemmalite", cmd, f"http://127.0.0.1:{port}/v1", a.model))
        if a.prompt_lookup:  # the same server, its requests asking for prompt lookup
            out.append(Target("gemmalite+lookup", None, out[-1].url, a.model, {"prompt_lookup": True}))
    if a.llama_server:
        port, n = free_port(), max(levels)  # llama-server splits its context over the slots
        cmd = [a.llama_server, "-m", a.gguf, "--port", str(port), "--parallel", str(n), "--cont-batching",
               "-c", str(a.context * n), "-t", str(a.threads), "-tb", str(a.threads), "--no-webui", "-cram", "0",
               *a.llama_args.split()]
        out.append(Target("llama-server", cmd, f"http://127.0.0.1:{port}/v1", a.model))
    if a.url:
        out.append(Target(a.url, None, a.url, a.model))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gemmalite", metavar="MODEL", help="start `gemmalite serve MODEL`")
    ap.add_argument("--llama-server", metavar="BIN", help="start this llama-server binary (with --gguf)")
    ap.add_argument("--gguf", help="model file for llama-server")
    ap.add_argument("--llama-args", default="", help="more llama-server flags, e.g. '--poll 0' (no spinning waits)")
    ap.add_argument("--url", help="a server already running (base URL ending in /v1)")
    ap.add_argument("--model", default=None, help="model id to send (default: the first of /v1/models)")
    ap.add_argument("--context", type=int, default=2048, help="per-sequence context")
    ap.add_argument("--levels", default="1,2,4,8")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=1, help="run every level this many times; medians reported")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--distinct", action="store_true",
                    help="each stream's prompt opens with its own words (no prefill to share between streams)")
    ap.add_argument("--task", choices=["summarise", "edit"], default=None,
                    help="an input-grounded chat prompt (bench_prompt_lookup.py's), ending at the end of turn")
    ap.add_argument("--prompt-lookup", action="store_true",
                    help="also measure the gemmalite server with prompt_lookup in its requests")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    if not (a.gemmalite or a.llama_server or a.url):
        ap.error("name a server: --gemmalite, --llama-server or --url")
    if a.llama_server and not a.gguf:
        ap.error("--llama-server needs --gguf")
    levels = [int(x) for x in a.levels.split(",")]

    ts = targets(a, levels)
    results: dict[str, dict] = {t.name: {"rows": []} for t in ts}
    try:
        for t in ts:
            t.ready()
        for t in ts:  # warm-up: kernel compilation, first-touch of the weights, every batch width
            run_level(t, 1, 4, task=a.task)
            run_level(t, max(levels), 4, task=a.task)
        runs: dict[str, list[list[dict]]] = {t.name: [[] for _ in levels] for t in ts}
        for rnd in range(a.rounds):
            for i, n in enumerate(levels):
                for t in (ts if (i + rnd) % 2 == 0 else ts[::-1]):
                    row = run_level(t, n, a.max_tokens, a.distinct, a.task)
                    runs[t.name][i].append(row)
                    print(f"[{t.name}] round {rnd + 1} {json.dumps(row)}", file=sys.stderr)
        for name, per_level in runs.items():  # each figure: the median over the rounds
            results[name]["rows"] = [{k: float(np.median([r[k] for r in rows])) if k != "streams" else rows[0][k]
                                      for k in rows[0]} for rows in per_level]
        for t in (ts[::-1] if len(levels) % 2 else ts):
            results[t.name]["solo_prefill_s"] = solo_prefill(t, a.task)
    finally:
        for t in ts:
            t.close()
    for r in results.values():
        base = r["rows"][0]["tokens_per_s"] or 1.0
        for row in r["rows"]:
            row["speedup"] = row["tokens_per_s"] / base
            row["ttft_p99_over_solo_prefill"] = row["ttft_p99_s"] / r["solo_prefill_s"]
    if a.json:
        print(json.dumps({"prompt": prompt_for(0, False, a.task), "distinct": a.distinct, "max_tokens": a.max_tokens, "threads": a.threads, "servers": results},
                         indent=2))
        return 0
    print(f"{'server':<14} {'streams':>7} {'tok/s':>8} {'x1':>6} {'TTFT p50':>9} {'TTFT p99':>9} {'p99/solo':>8}")
    for name, r in results.items():
        for row in r["rows"]:
            print(f"{name:<14} {row['streams']:>7} {row['tokens_per_s']:>8.2f} {row['speedup']:>6.2f} "
                  f"{row['ttft_p50_s']:>8.2f}s {row['ttft_p99_s']:>8.2f}s {row['ttft_p99_over_solo_prefill']:>8.2f}")
        print(f"{name:<14} solo prefill (time to first token, one request alone): {r['solo_prefill_s']:.3f} s")
    if len(results) == 2:
        (na, ra), (nb, rb) = results.items()
        print(f"tok/s {na} / {nb}: " + "  ".join(f"{x['streams']}: {x['tokens_per_s'] / max(y['tokens_per_s'], 1e-9):.2f}"
                                                  for x, y in zip(ra["rows"], rb["rows"])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
