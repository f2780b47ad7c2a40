"""Ray Data integration: the same `Embedder` in an actor pool, for corpora beyond one machine.

    import ray
    from gemmalite.embeddings.ray import embed_dataset

    ds = ray.data.read_json("corpus.jsonl")                   # rows with a "text" column
    ds = embed_dataset(ds, "path/to/embeddinggemma-2", prompt_name="Document", concurrency=4)
    ds.write_parquet("vectors/")                              # an "embedding" column is added

Each actor loads the model once (``quant`` "int8" / "int4" to share memory better) and embeds
whole batches with `Embedder.embed`, so the vectors equal a single-process run's. Install with
``pip install "gemmalite[ray]"``.
"""
from __future__ import annotations

from typing import Any

import numpy as np


class EmbedBatch:
    """A ``map_batches`` callable class: adds ``output_column`` (float32 ``[n, d]``) to numpy batches."""

    def __init__(self, path: str, *, quant: str | None = None, text_column: str = "text",
                 output_column: str = "embedding", threads: int | None = None, **embed_kwargs: Any):
        if threads:
            import numba

            numba.set_num_threads(threads)
        from ..formats.hub import local_path
        from . import load_embedder

        self.embedder = load_embedder(local_path(path), quant=quant)  # a Hub id: each actor's cache
        self.text_column, self.output_column = text_column, output_column
        self.kwargs = embed_kwargs

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        texts = [str(t) if isinstance(t, np.str_) else t for t in batch[self.text_column]]
        batch[self.output_column] = self.embedder.embed(texts, **self.kwargs)
        return batch


def embed_dataset(ds, path: str, *, concurrency: int = 1, batch_size: int = 64, quant: str | None = None,
                  text_column: str = "text", output_column: str = "embedding", threads: int | None = None,
                  **embed_kwargs: Any):
    """``ds`` with an ``output_column`` of embeddings, computed by an actor pool of ``concurrency``
    actors; ``embed_kwargs`` go to `Embedder.embed` (prompt_name, prompt, dimensions, truncate)."""
    return ds.map_batches(
        EmbedBatch, batch_size=batch_size, batch_format="numpy", concurrency=concurrency,
        fn_constructor_kwargs=dict(path=str(path), quant=quant, text_column=text_column, output_column=output_column,
                                   threads=threads, **embed_kwargs),
    )
