"""OpenAI-compatible server: `build_app` (Starlette) over a continuous-batching `Scheduler`.

Needs the ``server`` extra (starlette, uvicorn)."""
from .app import Server, build_app

__all__ = ["Server", "build_app"]
