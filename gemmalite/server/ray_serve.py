"""The same app as Ray Serve replicas (the ``ray`` extra): one model and one scheduler per replica,
Ray's proxy spreading requests over them.

    from ray import serve
    from gemmalite.server.ray_serve import deployment

    serve.run(deployment("path/to/model", num_replicas=2, model_id="gemma"), route_prefix="/")
    # OpenAI clients then use http://127.0.0.1:8000/v1 (Ray's HTTP port)

or from the command line, with a module that holds ``app = deployment(...)``::

    serve run my_module:app
"""
from __future__ import annotations

from typing import Any


def deployment(model_path: str, *, num_replicas: int = 2, context: int | None = None, quant: str | None = None,
               embedder_path: str | None = None, ray_actor_options: dict[str, Any] | None = None,
               **server_options: Any):
    """A bound Ray Serve application serving ``model_path`` (a path or a Hub id, as `gemmalite.load`
    takes; ``embedder_path`` likewise) from ``num_replicas`` replicas; each
    replica loads the model and runs `build_app` (``server_options`` as for `Server`).
    ``ray_actor_options`` places replicas (default ``num_cpus=0``: any number per machine; give
    ``{"num_cpus": <cores per machine>}`` for one replica per machine, since each uses every core)."""
    from ray import serve

    def build():
        from ..loader import load, load_embedder
        from .app import build_app

        embedder = load_embedder(embedder_path) if embedder_path is not None else None
        return build_app(load(model_path, context=context, quant=quant), embedder, **server_options)

    @serve.deployment(num_replicas=num_replicas, ray_actor_options=ray_actor_options or {"num_cpus": 0})
    @serve.ingress(build)
    class GemmaliteReplica:
        pass

    return GemmaliteReplica.bind()
