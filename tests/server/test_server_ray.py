"""The app as two Ray Serve replicas on a local Ray instance answers the openai client, each reply
equal to the model's own (the ``ray`` extra; skipped without it)."""
from __future__ import annotations

import os
import socket

import pytest

ray = pytest.importorskip("ray")  # an optional extra, unlike the server's own packages
serve = pytest.importorskip("ray.serve")
openai = pytest.importorskip("openai")



def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_ray_replicas_answer_openai(tmp_path_factory, gl):
    from gemmalite.server.ray_serve import deployment
    from gemmalite.tools.synth import synth

    path = str(synth("tiny", tmp_path_factory.mktemp("tiny"), progress=False))
    model = gl.load(path, context=128)
    prompts = ["Hello there", "The capital of France is", "1, 2, 3,", "Once upon a time"]
    want = [model.generate(p, max_new_tokens=6, temperature=0) for p in prompts]

    port = _free_port()
    env = {k: os.environ[k] for k in ("NUMBA_CACHE_DIR", "OPENBLAS_THREAD_TIMEOUT") if k in os.environ}
    ray.init(num_cpus=2, include_dashboard=False, runtime_env={"env_vars": env})
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(deployment(path, num_replicas=2, context=128, model_id="tiny"), route_prefix="/")
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=300)
        assert [m.id for m in client.models.list().data] == ["tiny"]
        got = [client.completions.create(model="tiny", prompt=p, max_tokens=6, temperature=0).choices[0].text
               for p in prompts]
        stream = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}],
                                                max_tokens=4, temperature=0, stream=True)
        assert sum(1 for _ in stream) >= 2
        replicas = serve.status().applications["default"].deployments["GemmaliteReplica"].replica_states
        assert replicas.get("RUNNING") == 2
    finally:
        serve.shutdown()
        ray.shutdown()
    assert got == want
