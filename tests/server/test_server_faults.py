"""The server under faults and load, on a tiny synthetic checkpoint behind a live uvicorn: clients
that leave (streamed or not, running or queued, generation or embeddings) free their work; a
draining server refuses new work with 503 and ends what runs cleanly; hostile bodies get a 4xx
naming the cause; a soak of mixed, malformed and abandoned requests from several threads leaves
no 5xx, no hang, every slot free and nothing kept per request.

The oracles are the server's own state (its scheduler's queues, `/metrics`) and, for replies,
`Model.generate` on the same model. Waits are on that state, each bounded; nothing is timed."""
from __future__ import annotations

import gc
import http.client
import json
import random
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
from live_server import KEY, LiveServer

MODEL_ID, EMB_ID = "tiny-gemma", "eg2-tiny"
WAIT_S = 60  # the bound of every wait on the server's state


@pytest.fixture(scope="module")
def model(tmp_path_factory, gl):
    from gemmalite.tools.synth import synth

    return gl.load(synth("tiny", tmp_path_factory.mktemp("tiny"), progress=False), context=256)


@pytest.fixture(scope="module")
def embedder(tmp_path_factory, gl):
    from gemmalite.tools.synth_eg2 import synth_eg2

    return gl.load_embedder(synth_eg2("eg2-tiny", tmp_path_factory.mktemp("eg2"), progress=False))


class Throttle:
    """The model's engine, each decode step held until ``go`` is set and then ``pace`` seconds long:
    a long reply whose tokens keep flowing, as a real model's do (a tiny one would end first)."""

    def __init__(self, engine):
        self.engine, self.go, self.stepped, self.pace = engine, threading.Event(), threading.Event(), 0.0
        self.go.set()

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def decode_batch(self, states, tokens):
        self.stepped.set()
        assert self.go.wait(WAIT_S), "the test never released the decode step"
        time.sleep(self.pace)
        return self.engine.decode_batch(states, tokens)


class GatedEmbedder:
    """The embedder, each call held until ``go`` is set; counts the calls that started."""

    def __init__(self, embedder):
        self.embedder, self.go, self.started = embedder, threading.Event(), []
        self.go.set()

    def __getattr__(self, name):
        return getattr(self.embedder, name)

    def embed(self, inputs, **kw):
        self.started.append(list(inputs))
        assert self.go.wait(WAIT_S)
        return self.embedder.embed(inputs, **kw)


@pytest.fixture(scope="module")
def live(model, embedder):
    from gemmalite.server import build_app
    from gemmalite.server.protocol import Limits

    app = build_app(model, GatedEmbedder(embedder), model_id=MODEL_ID, embedder_id=EMB_ID, api_key=KEY,
                    max_concurrency=2, max_queue=4, prefix_cache=2,
                    limits=Limits(max_body_bytes=1 << 20, max_messages=64, default_max_tokens=16))
    s = LiveServer(app)
    s.srv.scheduler.engine = Throttle(s.srv.scheduler.engine)
    yield s
    s.stop()


def until(check, what: str) -> None:
    """Wait (bounded) until ``check()`` holds: the server's state, read every few milliseconds."""
    deadline = time.monotonic() + WAIT_S
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        time.sleep(0.01)


def post_raw(port: int, path: str, body: dict) -> socket.socket:
    """A request sent on a socket the test closes itself (a client that leaves)."""
    data = json.dumps(body).encode()
    sock = socket.create_connection(("127.0.0.1", port))
    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 f"Authorization: Bearer {KEY}\r\nContent-Length: {len(data)}\r\n\r\n".encode() + data)
    return sock


def cancelled(live, cause: str) -> float:
    return live.metric("gemmalite_cancelled_total", f'{{cause="{cause}"}}')


LONG = {"model": MODEL_ID, "prompt": "Once upon a time", "max_tokens": 200, "ignore_eos": True, "temperature": 0}


# -- clients that leave ------------------------------------------------------------------------------
def test_non_streamed_request_is_cancelled_when_its_client_leaves(live):
    """Tokens flow (a step every 20 ms: the reply cannot end first, and is never quiet), the client
    closes its connection: the sequence is cancelled at once, and its slot is free."""
    sch, gate = live.srv.scheduler, live.srv.scheduler.engine
    before, tokens = cancelled(live, "client_gone"), live.metric("gemmalite_completion_tokens_total")
    gate.pace = 0.02
    gate.stepped.clear()
    sock = post_raw(live.port, "/v1/completions", LONG)
    try:
        assert gate.stepped.wait(WAIT_S)  # running: its decode steps are under way
        [seq] = sch.active
        sock.close()
        until(lambda: seq.cancelled, "the server saw the client leave")
    finally:
        gate.pace = 0.0
    until(lambda: cancelled(live, "client_gone") == before + 1, "the sequence was cancelled")
    assert not sch.active and seq.cancel_cause == "client_gone"
    assert live.metric("gemmalite_completion_tokens_total") - tokens < LONG["max_tokens"]
    assert live.raw("POST", "/v1/completions", {**LONG, "max_tokens": 3})[0] == 200  # the slot serves again


def test_queued_request_whose_client_left_never_starts(live):
    sch = live.srv.scheduler
    before, prompts = cancelled(live, "client_gone"), live.metric("gemmalite_prompt_tokens_total")
    sch.max_concurrency = 0  # nothing is admitted: the request waits in the queue
    try:
        for path, body in [("/v1/completions", LONG),
                           ("/v1/chat/completions", {"model": MODEL_ID, "stream": True,
                                                     "messages": [{"role": "user", "content": "Hi"}]})]:
            sock = post_raw(live.port, path, body)
            until(lambda: sch.queue_depth == 1, "the request is queued")
            sock.close()
            until(lambda: sch.queue_depth == 0, "the queue let go of the request")  # its place is free at once
    finally:
        sch.max_concurrency = 2
        sch._wake.set()
    until(lambda: cancelled(live, "client_gone") == before + 2, "both were cancelled")
    assert live.metric("gemmalite_prompt_tokens_total") == prompts  # neither ever started


def test_queued_embedding_whose_client_left_never_starts(live, embedder):
    emb = live.srv.embedder
    before = cancelled(live, "client_gone")
    emb.go.clear()
    first = threading.Thread(target=live.raw, args=("POST", "/v1/embeddings", {"model": EMB_ID, "input": "first"}))
    first.start()
    try:
        until(lambda: emb.started == [["first"]], "the first embedding runs")
        sock = post_raw(live.port, "/v1/embeddings", {"model": EMB_ID, "input": "second"})  # waits for the first
        until(lambda: live.srv._embed_lock._waiters, "the second waits its turn")
        sock.close()
        until(lambda: cancelled(live, "client_gone") == before + 1, "the waiting embedding was cancelled")
    finally:
        emb.go.set()
        first.join(WAIT_S)
    status, _, body = live.raw("POST", "/v1/embeddings", {"model": EMB_ID, "input": "third"})
    assert status == 200 and body["data"][0]["embedding"] == pytest.approx(embedder.embed(["third"])[0].tolist())
    assert emb.started == [["first"], ["third"]]  # the second never ran


# -- hostile input -----------------------------------------------------------------------------------
def _post_bytes(live, body: bytes, path: str = "/v1/chat/completions"):
    return live.raw("POST", path, body)


@pytest.mark.parametrize("name, body, status, code", [
    ("nesting bomb", b'{"model": "tiny-gemma", "messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", 400,
     "json_too_deep"),
    ("65 levels", json.dumps({"model": MODEL_ID, "x": json.loads("[" * 64 + "]" * 64)}).encode(), 400, "json_too_deep"),
    ("lone surrogate", b'{"model": "tiny-gemma", "messages": [{"role": "user", "content": "a\\ud800b"}]}', 400,
     "invalid_text"),
    ("lone surrogate key", b'{"model": "tiny-gemma", "\\udc00": 1, "messages": []}', 400, "invalid_text"),
    ("an encoded surrogate", b'{"model": "tiny-gemma", "messages": "\xed\xa0\x80"}', 400, "invalid_text"),
    ("invalid UTF-8", b'{"model": "tiny-gemma", "messages": "\xff"}', 400, None),
    ("10,000 messages", json.dumps({"model": MODEL_ID, "messages": [{"role": "user", "content": "a"}] * 10_000}).encode(),
     400, "too_many_messages"),
    ("a 5 MB field", json.dumps({"model": MODEL_ID, "messages": [{"role": "user", "content": "a" * (5 << 20)}]}).encode(),
     413, "request_too_large"),
    ("a prompt past the context", json.dumps({"model": MODEL_ID, "messages": [
        {"role": "user", "content": "word " * 400}]}).encode(), 400, "context_length_exceeded"),
    ("an unknown content part", json.dumps({"model": MODEL_ID, "messages": [
        {"role": "user", "content": [{"type": "video", "video": "x"}]}]}).encode(), 400, "unsupported_content_part"),
    ("not an object", b"[1, 2]", 400, None),
])
def test_hostile_bodies_answer_4xx_naming_the_cause(live, name, body, status, code):
    got, _, r = _post_bytes(live, body)
    assert got == status, (name, r)
    assert set(r["error"]) == {"message", "type", "param", "code"} and r["error"]["message"], r
    assert r["error"]["code"] == code, r
    assert live.raw("GET", "/health", key=None)[0] == 200


def test_default_max_tokens_caps_a_request_that_sets_none(live, model):
    """No max_tokens: the server's default (16 here, shown in /v1/capabilities) caps the reply."""
    caps = live.raw("GET", "/v1/capabilities")[2]["limits"]
    assert caps["default_max_tokens"] == 16 and caps["max_messages"] == 64
    status, _, r = live.raw("POST", "/v1/completions", {"model": MODEL_ID, "prompt": "Once", "ignore_eos": True,
                                                        "temperature": 0})
    assert status == 200 and r["usage"]["completion_tokens"] == 16 and r["choices"][0]["finish_reason"] == "length"
    assert r["choices"][0]["text"] == model.generate("Once", max_new_tokens=16, temperature=0, stop=[])


# -- the soak --------------------------------------------------------------------------------------------
def _soak_one(port: int, i: int) -> int | None:
    """One request of the mix (by ``i``): valid chats, completions and embeddings, streamed or not; a
    third malformed; some abandoned before the reply or mid-stream. The status, or None if abandoned."""
    rng = random.Random(i)
    kind = i % 9
    msgs = [{"role": "user", "content": f"Tell me about {i}"}]
    bodies = [
        ("/v1/chat/completions", {"model": MODEL_ID, "messages": msgs, "max_tokens": rng.randint(1, 12)}),
        ("/v1/completions", {"model": MODEL_ID, "prompt": f"{i}, {i + 1},", "max_tokens": 6, "stream": True}),
        ("/v1/embeddings", {"model": EMB_ID, "input": [f"text {i}", "more"]}),
        ("/v1/chat/completions", {"model": MODEL_ID, "messages": msgs, "stream": True, "n": 2, "max_tokens": 5}),
        ("/v1/completions", {"model": MODEL_ID, "prompt": "x", "max_tokens": 40, "ignore_eos": True}),  # abandoned
        ("/v1/chat/completions", {"model": MODEL_ID, "messages": msgs, "stream": True, "max_tokens": 40}),  # abandoned
        ("/v1/chat/completions", b'{"model": "tiny-gemma", "messages": [' * 50),  # malformed from here on
        ("/v1/completions", {"model": MODEL_ID, "prompt": "x", "max_tokens": -3}),
        ("/v1/chat/completions", {"model": MODEL_ID, "messages": [{"role": "robot", "content": 1}]}),
    ]
    path, body = bodies[kind]
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    if kind in (4, 5):  # a client that leaves: before any reply, or after the first streamed bytes
        sock = post_raw(port, path, body)
        if kind == 5:
            sock.settimeout(WAIT_S)
            sock.recv(1)
        sock.close()
        return None
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=WAIT_S)
    conn.request("POST", path, body=data, headers={"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"})
    r = conn.getresponse()
    r.read()
    conn.close()
    return r.status


def test_soak_mixed_malformed_and_abandoned_requests(live, model):
    from gemmalite.server.scheduler import Sequence

    sch = live.srv.scheduler
    with ThreadPoolExecutor(6) as pool:
        statuses = list(pool.map(lambda i: _soak_one(live.port, i), range(300)))
    seen = {s for s in statuses if s is not None}
    assert seen <= {200, 400, 429}, seen  # (429: the queue of 4 was full; never a 5xx)
    assert 200 in seen and 400 in seen
    until(lambda: not sch.active and sch.queue_depth == 0, "every slot is free")
    until(lambda: not live.srv._embed_lock.locked(), "the embedder is free")
    text = live.raw("GET", "/metrics")[2]
    assert 'status="5' not in text, [ln for ln in text.splitlines() if 'status="5' in ln]
    # nothing is kept per request: no sequence outlives its request, the prefix cache keeps its size
    gc.collect()
    assert not [o for o in gc.get_objects() if type(o) is Sequence]
    assert sch.cache.held <= sch.cache.budget
    # and the server still answers as the model does
    want = model.generate("Hello there", max_new_tokens=6, temperature=0)
    status, _, r = live.raw("POST", "/v1/completions", {"model": MODEL_ID, "prompt": "Hello there", "max_tokens": 6,
                                                        "temperature": 0})
    assert status == 200 and r["choices"][0]["text"] == want


# -- draining ---------------------------------------------------------------------------------------
def test_drain_refuses_new_work_and_ends_what_runs(model, embedder):
    """`Server.drain` (what SIGTERM calls): a new generation or embedding 503 with Retry-After,
    /health 503; a running non-streamed request gets a 503 and a running stream an error event
    once the grace is over."""
    from gemmalite.server import build_app

    s = LiveServer(build_app(model, embedder, model_id=MODEL_ID, embedder_id=EMB_ID, api_key=KEY, max_concurrency=2))
    gate = s.srv.scheduler.engine = Throttle(s.srv.scheduler.engine)
    try:
        gate.go.clear()
        results: dict[str, object] = {}

        def plain():
            results["plain"] = s.raw("POST", "/v1/completions", LONG)

        def streamed():
            try:
                for _ in s.client().completions.create(model=MODEL_ID, prompt="Once upon a time", max_tokens=200,
                                                       temperature=0, stream=True, extra_body={"ignore_eos": True}):
                    pass
            except openai.APIError as e:  # the stream's error event, raised by the client
                results["stream_error"] = e

        threads = [threading.Thread(target=plain), threading.Thread(target=streamed)]
        for t in threads:
            t.start()
        sch = s.srv.scheduler
        until(lambda: len(sch.active) + sch.queue_depth == 2, "both are in (running, or queued behind the step)")
        s.srv.drain(0.0)
        status, headers, body = s.raw("POST", "/v1/completions", {**LONG, "max_tokens": 2})
        assert status == 503 and headers.get("retry-after") and body["error"]["code"] == "shutting_down"
        status, headers, body = s.raw("POST", "/v1/embeddings", {"model": EMB_ID, "input": "x"})
        assert status == 503 and headers.get("retry-after") and body["error"]["code"] == "shutting_down"
        assert s.raw("GET", "/health", key=None)[0] == 503
        gate.go.set()
        for t in threads:
            t.join(WAIT_S)
        status, _, body = results["plain"]
        assert status == 503 and body["error"]["code"] == "shutting_down"
        assert "shutting down" in str(results.get("stream_error")), results
        until(lambda: not s.srv.scheduler.active, "nothing runs")
        assert s.metric("gemmalite_cancelled_total", '{cause="shutdown"}') == 2
    finally:
        gate.go.set()
        s.stop()


# -- SIGTERM on `gemmalite serve` -------------------------------------------------------------------
def test_sigterm_cancels_requests_in_flight_after_the_grace(tmp_path_factory):
    """`gemmalite serve --shutdown-grace 1` in a process of its own, two long requests in flight
    (one streamed, one not) when SIGTERM comes: the process ends by itself (no second signal, no
    kill), the non-streamed client gets a 503 and the streamed one an error event, both
    "shutting_down"; nothing in the log is a traceback."""
    import os
    import queue
    import re
    import signal
    import subprocess
    import sys
    from pathlib import Path

    from gemmalite.tools.synth import synth

    path = synth("tiny", tmp_path_factory.mktemp("serve"), progress=False)
    repo = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONPATH": repo + os.pathsep + os.environ.get("PYTHONPATH", "")}
    p = subprocess.Popen([sys.executable, "-m", "gemmalite.cli", "serve", str(path), "--port", "0", "--context", "16384",
                          "--shutdown-grace", "1", "--model-name", MODEL_ID], env=env, stdout=subprocess.DEVNULL,
                         stderr=subprocess.PIPE, text=True)
    lines: queue.Queue = queue.Queue()
    log: list[str] = []
    threading.Thread(target=lambda: [lines.put(ln) for ln in p.stderr] + [lines.put(None)], daemon=True).start()
    long = {"model": MODEL_ID, "prompt": "Once upon a time", "max_tokens": 16000, "ignore_eos": True}
    try:
        port = None
        while port is None:  # bounded: the model loads and uvicorn says where it listens
            line = lines.get(timeout=600)
            assert line is not None, "gemmalite serve exited:\n" + "".join(log)[-2000:]
            log.append(line)
            m = re.search(r"Uvicorn running on http://127\.0\.0\.1:(\d+)", line)
            port = int(m.group(1)) if m else None
        results: dict[str, object] = {}

        def plain():
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
            conn.request("POST", "/v1/completions", body=json.dumps(long), headers={"Content-Type": "application/json"})
            r = conn.getresponse()
            results["plain"] = (r.status, json.loads(r.read()))

        def streamed():
            sock = socket.create_connection(("127.0.0.1", port), timeout=120)
            data = json.dumps({**long, "stream": True}).encode()
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         + f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
            got = b""
            while chunk := sock.recv(65536):
                got += chunk
                results["streaming"] = got.count(b"data:") >= 2
            results["stream"] = got.decode(errors="replace")

        threads = [threading.Thread(target=plain), threading.Thread(target=streamed)]
        for t in threads:
            t.start()

        def active() -> float:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
            conn.request("GET", "/metrics")
            m = re.search(r"^gemmalite_active_sequences (\S+)$", conn.getresponse().read().decode(), re.M)
            return float(m.group(1))

        until(lambda: results.get("streaming") and active() == 2, "both requests run")
        p.send_signal(signal.SIGTERM)
        assert p.wait(timeout=60) == 0  # a graceful shutdown that ran its course
        for t in threads:
            t.join(60)
        status, body = results["plain"]
        assert status == 503 and body["error"]["code"] == "shutting_down", results["plain"]
        last = [ln for ln in results["stream"].splitlines() if ln.startswith("data:")][-1]
        assert json.loads(last.removeprefix("data:"))["error"]["code"] == "shutting_down", last
    finally:
        p.kill()
        p.wait()
    while (line := lines.get(timeout=10)) is not None:
        log.append(line)
    assert "Traceback" not in "".join(log), "".join(log)[-3000:]
