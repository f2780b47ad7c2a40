"""Load figure of the server under the fault mix: `gemmalite serve MODEL` in a process of its own,
then at each client count, REQUESTS requests of the soak's mix from that many client threads
(valid chats and completions, streamed or not; a third malformed; some abandoned before the
reply or mid-stream). Reports requests/s, p50 / p99 latency of the answered requests, the
statuses (errors: any 5xx), and the server's RSS before the first level and after each.

    python scripts/soak_load.py [--model gemma3-270m] [--clients 1 4 8] [--requests 90]

Every level must end with the server's slots free (`gemmalite_active_sequences` and
`gemmalite_queue_depth` at 0), else it says so.
"""
from __future__ import annotations

import argparse
import http.client
import json
import random
import re
import socket
import subprocess
import sys
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

MODEL = "soak"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_mib(pid: int) -> float:
    m = re.search(r"VmRSS:\s+(\d+) kB", Path(f"/proc/{pid}/status").read_text())
    return int(m.group(1)) / 1024 if m else float("nan")


def get(port: int, path: str) -> tuple[int, str]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.request("GET", path)
    r = conn.getresponse()
    return r.status, r.read().decode()


def metric(port: int, name: str) -> float:
    m = re.search(rf"^{name} (\S+)$", get(port, "/metrics")[1], re.M)
    return float(m.group(1)) if m else 0.0


def one(port: int, i: int) -> tuple[int | None, float]:
    """The ``i``-th request of the mix: (status, or None if abandoned; seconds)."""
    rng = random.Random(i)
    msgs = [{"role": "user", "content": f"Say something about the number {i}."}]
    mix = [
        ("/v1/chat/completions", {"model": MODEL, "messages": msgs, "max_tokens": rng.randint(8, 32)}),
        ("/v1/completions", {"model": MODEL, "prompt": f"Count: {i}, {i + 1},", "max_tokens": 16, "stream": True}),
        ("/v1/chat/completions", {"model": MODEL, "messages": msgs, "max_tokens": 16, "stream": True}),
        ("/v1/completions", {"model": MODEL, "prompt": "Once", "max_tokens": 200, "ignore_eos": True}),  # abandoned
        ("/v1/chat/completions", {"model": MODEL, "messages": msgs, "stream": True, "max_tokens": 200}),  # abandoned
        ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 8}),
        ("/v1/chat/completions", b'{"model": "soak", "messages": [' * 100),  # malformed from here on
        ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": -1}),
        ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "a\ud800"}]}),
    ]
    path, body = mix[i % len(mix)]
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    t0 = time.perf_counter()
    if i % len(mix) in (3, 4):
        sock = socket.create_connection(("127.0.0.1", port))
        sock.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
        if i % len(mix) == 4:
            sock.recv(1)  # mid-stream
        sock.close()
        return None, time.perf_counter() - t0
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    conn.request("POST", path, body=data, headers={"Content-Type": "application/json"})
    r = conn.getresponse()
    r.read()
    conn.close()
    return r.status, time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="gemma3-270m")
    ap.add_argument("--clients", type=int, nargs="+", default=[1, 4, 8])
    ap.add_argument("--requests", type=int, default=90)
    ap.add_argument("--max-concurrency", type=int, default=4)
    ap.add_argument("--max-queue", type=int, default=8)
    a = ap.parse_args()
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "gemmalite.cli", "serve", a.model, "--port", str(port),
                             "--model-name", MODEL, "--max-concurrency", str(a.max_concurrency), "--max-queue",
                             str(a.max_queue), "--no-ui"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        t0 = time.time()
        while True:
            try:
                if get(port, "/health")[0] == 200:
                    break
            except OSError:
                pass
            if proc.poll() is not None or time.time() - t0 > 900:
                raise SystemExit("the server did not start")
            time.sleep(0.5)
        one(port, 0)  # warm
        print(f"RSS after start: {rss_mib(proc.pid):.0f} MiB")
        print("| clients | requests/s | p50 s | p99 s | statuses | 5xx | RSS after MiB | slots free |")
        print("|---|---|---|---|---|---|---|---|")
        for n in a.clients:
            t0 = time.perf_counter()
            with ThreadPoolExecutor(n) as pool:
                got = list(pool.map(lambda i: one(port, i), range(a.requests)))
            wall = time.perf_counter() - t0
            lat = [t for s, t in got if s is not None]
            statuses = Counter(s for s, _ in got if s is not None)
            deadline = time.time() + 60
            while (metric(port, "gemmalite_active_sequences") or metric(port, "gemmalite_queue_depth")) \
                    and time.time() < deadline:
                time.sleep(0.1)
            free = not (metric(port, "gemmalite_active_sequences") or metric(port, "gemmalite_queue_depth"))
            print(f"| {n} | {a.requests / wall:.2f} | {np.percentile(lat, 50):.2f} | {np.percentile(lat, 99):.2f} | "
                  f"{dict(sorted(statuses.items()))} | {sum(v for k, v in statuses.items() if k >= 500)} | "
                  f"{rss_mib(proc.pid):.0f} | {free} |")
    finally:
        proc.terminate()
        proc.wait(timeout=30)


if __name__ == "__main__":
    main()
