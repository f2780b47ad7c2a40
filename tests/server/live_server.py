"""A live uvicorn server on loopback for the server tests, and helpers to read its answers."""
from __future__ import annotations

import contextlib
import http.client
import json
import re
import socket
import threading
import time

import openai
import uvicorn

KEY = "test-key-123"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LiveServer:
    def __init__(self, app):
        self.app = app
        self.srv = app.state.server
        self.port = _free_port()
        self.uv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.uv.run, daemon=True)
        self.thread.start()
        t0 = time.time()
        while not self.uv.started:
            assert time.time() - t0 < 30, "server did not start"
            time.sleep(0.02)

    def stop(self):
        self.uv.should_exit = True
        self.thread.join(timeout=30)

    def client(self, key=KEY, **kw):
        return openai.OpenAI(base_url=f"http://127.0.0.1:{self.port}/v1", api_key=key, max_retries=0, timeout=60, **kw)

    def raw(self, method, path, body=None, headers=None, key=KEY):
        """(status, headers, parsed JSON or text) of one plain HTTP request."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
        h = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {}), **(headers or {})}
        data = body if isinstance(body, (bytes, str)) or body is None else json.dumps(body)
        conn.request(method, path, body=data, headers=h)
        r = conn.getresponse()
        text = r.read().decode()
        conn.close()
        try:
            return r.status, dict(r.getheaders()), json.loads(text)
        except ValueError:
            return r.status, dict(r.getheaders()), text

    def drop_stream(self, path, body, until: bytes, count: int = 1, headers=None):
        """POST ``body`` (a streamed request) on a raw socket, read until ``until`` has come ``count``
        times (the reply is running), then close the connection: a client that leaves."""
        data = json.dumps(body).encode()
        head = {"Authorization": f"Bearer {KEY}"} if headers is None else headers
        lines = "".join(f"{k}: {v}\r\n" for k, v in head.items())
        sock = socket.create_connection(("127.0.0.1", self.port), timeout=60)
        sock.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n{lines}"
                     f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
        got = b""
        while got.count(until) < count:
            chunk = sock.recv(65536)
            assert chunk, got
            got += chunk
        sock.close()

    def wait_cancelled(self, before: float):
        """Wait (10 s at most) until more than ``before`` sequences have finished as cancelled; then
        no slot may be busy and the server must be healthy."""
        t0 = time.time()
        while self.metric("gemmalite_finished_total", '{reason="cancelled"}') == before:
            assert time.time() - t0 < 10, "the dropped stream was not cancelled"
            time.sleep(0.05)
        assert self.metric("gemmalite_active_sequences") == 0
        assert self.raw("GET", "/health", key=None)[0] == 200

    @contextlib.contextmanager
    def full_queue(self):
        """Within: the scheduler admits nothing and its queue is full of requests that are not
        cancelled (a cancelled one leaves the queue at once). After: they leave unstarted, the
        scheduler admits again, and the queue is empty (10 s at most)."""
        from gemmalite.server.scheduler import Sequence

        sch = self.srv.scheduler
        admitted, parked = sch.max_concurrency, []
        sch.max_concurrency = 0
        try:
            while not sch.waiting.full():
                parked.append(Sequence([2, 3], 1, None, set(), [], sink=lambda ev: None))
                sch.submit(parked[-1])
            yield
        finally:
            for seq in parked:
                seq.cancel()
            sch.max_concurrency = admitted
            sch._wake.set()
        t0 = time.time()
        while sch.queue_depth:
            assert time.time() - t0 < 10
            time.sleep(0.02)

    def metric(self, name, labels=""):
        _, _, text = self.raw("GET", "/metrics")
        m = re.search(rf"^{re.escape(name + labels)} (\S+)$", text, re.M)
        return float(m.group(1)) if m else 0.0


def stream_text(stream) -> tuple[str, str | None, object]:
    text, finish, usage = [], None, None
    for ch in stream:
        if ch.usage is not None:
            usage = ch.usage
        for c in ch.choices:
            text.append(getattr(c, "delta", None) and c.delta.content or getattr(c, "text", "") or "")
            finish = c.finish_reason or finish
    return "".join(text), finish, usage
