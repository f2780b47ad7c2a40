"""The Embedder inside Ray Data (`gemmalite.embeddings.ray`) gives the single-process vectors.

A local Ray instance; the ``ray`` extra is in the ``test`` one, so CI runs it (a skip fails there)."""
from __future__ import annotations

import numpy as np
import pytest

ray = pytest.importorskip("ray")
pytest.importorskip("sentence_transformers")
import eg2_oracle as o  # noqa: E402

from gemmalite import load_embedder  # noqa: E402
from gemmalite.embeddings.ray import embed_dataset  # noqa: E402


def test_ray_data_equals_single_process(tmp_path):
    o.make_eg2_checkpoint(tmp_path, seed=4, st=True)
    rng = np.random.RandomState(0)
    words = "alpha beta gamma delta epsilon zeta eta theta".split()
    texts = [" ".join(rng.choice(words, size=rng.randint(1, 30))) for _ in range(40)]
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, ignore_reinit_error=True)
    try:
        ds = ray.data.from_items([{"id": i, "text": t} for i, t in enumerate(texts)])
        rows = embed_dataset(ds, tmp_path, concurrency=2, batch_size=8, prompt_name="Document", threads=1).take_all()
    finally:
        ray.shutdown()
    rows.sort(key=lambda r: r["id"])
    assert [r["text"] for r in rows] == texts
    got = np.stack([r["embedding"] for r in rows])
    ref = load_embedder(tmp_path).embed(texts, prompt_name="Document")
    # Bit for bit, although Ray's actors are other processes that compiled or loaded the kernels on
    # their own: every float sum of the kernels is ordered by their source, not by which compiled
    # copy of a kernel a process runs (kernels.fdot; test_determinism.test_compiled_equals_cached).
    np.testing.assert_array_equal(got, ref)
