"""``gemmalite serve MODEL``: the OpenAI-compatible server (gemmalite.server) on uvicorn.
The server's packages (the ``server`` extra) are imported only when the command runs."""
from __future__ import annotations

import argparse
import contextlib
import gc
import signal
import threading
from pathlib import Path

from .generate import load_args, load_model

SHUTDOWN_GRACE_S = 5.0


def add_parsers(sub) -> None:
    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server (chat, completions, embeddings)")
    load_args(p)
    p.add_argument("--embedder", default=None, help="EmbeddingGemma checkpoint (folder or Hub id) to serve /v1/embeddings")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default loopback only)")
    p.add_argument("--port", type=int, default=8080)
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' (all but /health)")
    p.add_argument("--max-concurrency", type=int, default=8, help="sequences decoded together")
    p.add_argument("--max-queue", type=int, default=64, help="requests waiting beyond those (then 429)")
    p.add_argument("--model-name", default=None, help="model id clients send (default: the Hub id, or the folder name)")
    p.add_argument("--max-tokens", type=int, default=None, help="cap on max_tokens per request")
    p.add_argument("--default-max-tokens", type=int, default=None,
                   help="reply cap of a request that sets no max_tokens (default 2048; 0: up to the context)")
    p.add_argument("--shutdown-grace", type=float, default=SHUTDOWN_GRACE_S, metavar="SECONDS",
                   help="on SIGTERM / Ctrl-C, how long running requests may finish before they are cancelled "
                        f"(default {SHUTDOWN_GRACE_S:g})")
    p.add_argument("--prefix-cache", type=int, default=None, metavar="MIB",
                   help="MiB of finished KV states (and their checkpoints) kept for prefix reuse, least recently "
                        "used out first (default 1024; 0: none)")
    p.add_argument("--prompt-lookup", action="store_true",
                   help="prompt-lookup decoding for requests that do not set 'prompt_lookup' themselves: same "
                        "output, faster on replies that quote the prompt")
    p.add_argument("--no-ui", dest="ui", action="store_false", help="no chat page at / (the API only)")
    p.set_defaults(func=cmd_serve)


def _name(path: str) -> str:
    """The model id clients send: a Hub id as given, else the folder's (file's) name."""
    from ..formats.hub import parse

    if not Path(path).exists() and parse(path) is not None:
        return path
    return Path(path.rstrip("/")).name or path


def load_embedder(path: str):
    """The EmbeddingGemma embedder of a folder or a Hub id (`gemmalite.loader.load_embedder`)."""
    from ..loader import load_embedder as load

    return load(path)


def _server_imports():
    try:
        import uvicorn

        from ..server import build_app
        from ..server.protocol import Limits
    except ImportError as e:
        raise ValueError(f"gemmalite serve needs the server extra: pip install 'gemmalite[server]' ({e})") from None
    return uvicorn, build_app, Limits


def cmd_serve(a: argparse.Namespace) -> int:
    uvicorn, build_app, Limits = _server_imports()
    if a.shutdown_grace < 0 or (a.default_max_tokens or 0) < 0 or (a.max_tokens is not None and a.max_tokens < 1):
        raise ValueError("--shutdown-grace and --default-max-tokens must be >= 0, --max-tokens >= 1")
    limits = Limits(max_tokens=a.max_tokens)
    if a.default_max_tokens is not None:
        limits.default_max_tokens = a.default_max_tokens or None  # (0: up to the context)
    model = load_model(a)
    embedder = load_embedder(a.embedder) if a.embedder else None
    app = build_app(model, embedder, model_id=a.model_name or _name(a.model),
                    embedder_id=_name(a.embedder) if a.embedder else None, api_key=a.api_key,
                    max_concurrency=a.max_concurrency, max_queue=a.max_queue, limits=limits,
                    prompt_lookup=a.prompt_lookup, ui=a.ui,
                    **({} if a.prefix_cache is None else {"prefix_cache": a.prefix_cache << 20}))
    # what loading left behind lives as long as the server: out of the cyclic collector's sight, its
    # full collections no longer walk it (they cost a request ~15-30 ms of its time to first token)
    gc.collect()
    gc.freeze()
    srv, grace = app.state.server, a.shutdown_grace

    class Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self):
            """SIGINT / SIGTERM begin the graceful shutdown; once it is done the process exits 0
            (uvicorn's own would raise the signal again, ending it as killed by the signal)."""
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            original = {s: signal.signal(s, self.handle_exit) for s in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for s, handler in original.items():
                    signal.signal(s, handler)

        def handle_exit(self, sig, frame) -> None:
            # new requests 503; what runs has ``grace`` seconds, then is cancelled (from a thread: the
            # signal may have interrupted this one inside a lock that draining takes)
            threading.Thread(target=srv.drain, args=(grace,), daemon=True).start()
            super().handle_exit(sig, frame)

    # uvicorn waits for open connections to end; past grace + 1 s it cancels what is left (a slow upload)
    Server(uvicorn.Config(app, host=a.host, port=a.port, log_level="info",
                          timeout_graceful_shutdown=grace + 1.0)).run()
    return 0
