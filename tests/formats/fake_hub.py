"""A Hugging Face Hub on 127.0.0.1 speaking the file protocol huggingface_hub 2.5 uses to download:

- ``GET /api/models/{repo}[/revision/{rev}]``: the model info (``sha``, ``siblings``, ``gated``);
- ``GET /api/models/{repo}/tree/{rev}``: the file listing (one page);
- ``HEAD`` / ``GET /{repo}/resolve/{rev}/{file}``: the file, with ``ETag``, ``X-Repo-Commit`` and
  ``Content-Length``, a ``Range: bytes=N-`` request answered 206 with the rest.

Errors carry the Hub's ``X-Error-Code`` header (``RepoNotFound``, ``EntryNotFound``, ``GatedRepo``:
401 without a token, 403 with another one; a repository's ``error_code=None`` refuses without one). Every request is logged (method, path, Range,
Authorization); `cut` makes the next full GET of a file stop after N bytes and the next resumes of
it (``Range``) fail with 500, as many as asked.
"""
from __future__ import annotations

import hashlib
import json
import os
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlparse


@dataclass
class Repo:
    files: dict[str, bytes]
    commit: str = field(default_factory=lambda: os.urandom(20).hex())  # unique across repositories, as git's
    token: str | None = None  # gated: only this token may download files
    error_code: str | None = "GatedRepo"  # the X-Error-Code of a refusal (None: a bare 401 / 403)


@dataclass
class Request:
    method: str
    path: str
    range: str | None
    auth: str | None
    status: int


@dataclass
class FakeHub:
    repos: dict[str, Repo] = field(default_factory=dict)
    log: list[Request] = field(default_factory=list)
    cuts: dict[str, tuple[int, int]] = field(default_factory=dict)  # file -> (bytes sent, resumes to fail)

    def add_folder(self, repo: str, folder: Path, extra: dict[str, bytes] | None = None, **kw) -> Repo:
        files = {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}
        self.repos[repo] = Repo({**files, **(extra or {})}, **kw)
        return self.repos[repo]

    def cut(self, file: str, after: int, failed_resumes: int = 1) -> None:
        self.cuts[file] = (after, failed_resumes)

    def requests(self, method: str | None = None, under: str = "") -> list[Request]:
        return [r for r in self.log if (method is None or r.method == method) and r.path.startswith(under)]

    def start(self) -> str:
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def do_HEAD(self) -> None:
                hub._answer(self, body=False)

            def do_GET(self) -> None:
                hub._answer(self, body=True)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)  # bound: ready before the thread runs
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=30)

    # --- the endpoints
    def _answer(self, h: BaseHTTPRequestHandler, body: bool) -> None:
        path = unquote(urlparse(h.path).path)
        status = self._route(h, path, body)
        self.log.append(Request(h.command, path, h.headers.get("Range"), h.headers.get("Authorization"), status))

    def _route(self, h: BaseHTTPRequestHandler, path: str, body: bool) -> int:
        parts = path.strip("/").split("/")
        if parts[:2] == ["api", "models"] and len(parts) >= 4:
            repo = self.repos.get("/".join(parts[2:4]))
            if repo is None:
                return self._send(h, 404, b'{"error": "Repository not found"}', {"X-Error-Code": "RepoNotFound"})
            if len(parts) >= 6 and parts[4] == "tree":
                listing = [{"type": "file", "path": f, "size": len(data), "oid": hashlib.sha1(data).hexdigest()}
                           for f, data in sorted(repo.files.items())]
                return self._send(h, 200, json.dumps(listing).encode(), {"Content-Type": "application/json"})
            info = {"id": "/".join(parts[2:4]), "sha": repo.commit, "private": False,
                    "gated": "manual" if repo.token else False, "siblings": [{"rfilename": f} for f in sorted(repo.files)]}
            return self._send(h, 200, json.dumps(info).encode(), {"Content-Type": "application/json"})
        if len(parts) >= 5 and parts[2] == "resolve":
            return self._file(h, "/".join(parts[:2]), "/".join(parts[4:]), body)
        return self._send(h, 404, b"not found", {})

    def _file(self, h: BaseHTTPRequestHandler, name: str, file: str, body: bool) -> int:
        repo = self.repos.get(name)
        if repo is None:
            return self._send(h, 404, b"", {"X-Error-Code": "RepoNotFound"})
        if repo.token is not None and h.headers.get("Authorization") != f"Bearer {repo.token}":
            status = 401 if h.headers.get("Authorization") is None else 403
            code = {"X-Error-Code": repo.error_code} if repo.error_code else {}
            return self._send(h, status, b"", {**code, "X-Error-Message": "Access restricted"})
        if file not in repo.files:
            return self._send(h, 404, b"", {"X-Error-Code": "EntryNotFound", "X-Repo-Commit": repo.commit})
        data = repo.files[file]
        headers = {"ETag": f'"{hashlib.sha256(data).hexdigest()}"', "X-Repo-Commit": repo.commit,
                   "Accept-Ranges": "bytes", "Content-Type": "application/octet-stream"}
        start = 0
        rng = h.headers.get("Range")
        if rng:
            start = int(rng.removeprefix("bytes=").split("-")[0])
            headers["Content-Range"] = f"bytes {start}-{len(data) - 1}/{len(data)}"
        after, failing = self.cuts.get(file, (0, 0)) if body else (0, 0)
        if after and not rng:  # the first try stops after `after` bytes: the connection closes
            self.cuts[file] = (0, failing)
            headers["Content-Length"] = str(len(data))
            h.send_response(200)
            for k, v in headers.items():
                h.send_header(k, v)
            h.end_headers()
            h.wfile.write(data[:after])
            h.wfile.flush()
            h.close_connection = True
            return 200
        if failing and rng:
            self.cuts[file] = (after, failing - 1)
            return self._send(h, 500, b"", {})
        return self._send(h, 206 if rng else 200, data[start:], headers, body)

    @staticmethod
    def _send(h: BaseHTTPRequestHandler, status: int, data: bytes, headers: dict[str, str], body: bool = True) -> int:
        h.send_response(status)
        for k, v in headers.items():
            h.send_header(k, v)
        h.send_header("Content-Length", str(len(data)))
        h.end_headers()
        if body and h.command != "HEAD":
            h.wfile.write(data)
        return status
