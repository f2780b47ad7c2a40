"""`gemmalite bench` on an EmbeddingGemma 2 folder: load time, one short query, a batch of documents.

The workload of issue 11: the latency of one short query (with the SearchQuery prompt when the
model has it) and texts/s for ``docs`` documents of ``doc_tokens`` tokens, plus peak RSS.
Figures are medians over ``runs`` after a warm-up. ``scripts/bench_eg2_peers.py`` runs the
same workload with transformers and egemma2 for a side-by-side table.
"""
from __future__ import annotations

import statistics
import time
from typing import Any

QUERY = "which planet is known as the red planet?"


def bench_embedder(path: str, *, quant: str | None = None, runs: int = 3, docs: int = 32, doc_tokens: int = 512,
                   query_runs: int = 10, seed: int = 0) -> dict[str, Any]:
    import numpy as np

    from ..embeddings import load_embedder
    from .bench import _threads, peak_rss_bytes

    t0 = time.perf_counter()
    emb = load_embedder(path, quant=quant)
    load_s = time.perf_counter() - t0
    prompt = "SearchQuery" if "SearchQuery" in emb.prompts else None
    emb.embed(QUERY, prompt_name=prompt)
    q = []
    for _ in range(query_runs):
        t = time.perf_counter()
        emb.embed(QUERY, prompt_name=prompt)
        q.append(time.perf_counter() - t)
    rng = np.random.default_rng(seed)
    vocab = emb.cfg.vocab_size
    # documents as token ids: <bos>, random ordinary tokens, <eos> (the length a 512-token text has)
    seqs = [np.concatenate([[2], rng.integers(1000 if vocab > 2000 else 5, vocab, doc_tokens - 2), [1]])
            for _ in range(docs)]
    emb.embed_ids(seqs[:2])
    d = []
    for _ in range(runs):
        t = time.perf_counter()
        emb.embed_ids(seqs)
        d.append(time.perf_counter() - t)
    return {
        "model": str(path), "quant": quant, "threads": _threads(), "load_s": round(load_s, 3),
        "query_tokens": int(len(emb.tokenize([QUERY], prompt=emb.resolve_prompt(prompt, None))[0])),
        "query_ms": round(1000 * statistics.median(q), 2),
        "docs": docs, "doc_tokens": doc_tokens, "docs_texts_s": round(docs / statistics.median(d), 3),
        "peak_rss_bytes": peak_rss_bytes(), "runs": runs,
    }


def format_embed_table(r: dict[str, Any]) -> str:
    rows = [("model", r["model"]), ("quant", r["quant"] or "none (stored precision)"), ("threads", r["threads"]),
            ("load", f"{r['load_s']:.2f} s"), (f"one query ({r['query_tokens']} tokens)", f"{r['query_ms']:.1f} ms"),
            (f"{r['docs']} documents x {r['doc_tokens']} tokens", f"{r['docs_texts_s']:.3f} texts/s"),
            ("peak RSS", f"{r['peak_rss_bytes'] / 2**30:.2f} GiB")]
    return "\n".join(f"{k:32s} {v}" for k, v in rows) + f"\n(medians after a warm-up; documents: {r['runs']} runs)"
