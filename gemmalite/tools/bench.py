"""`gemmalite bench`: load time, prefill and decode speed, peak memory, bytes read per token.

Figures are medians over ``--runs`` after a warm-up run. Decode is bound by the weight
bytes read per token, so the implied read bandwidth (bytes/token × tokens/s) says how
close a run is to the machine's limit.
"""
from __future__ import annotations

import os
import resource
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from ..weights import pages


def weight_bytes_per_token(model) -> int:
    """Bytes of weights one decode step reads: every layer matrix, the PLE projection, the LM head."""
    g = model.engine.graph
    total = model.engine.lm_head.nbytes
    if g.ple is not None:
        total += g.ple.projection.nbytes
    return total + sum(m.nbytes for w in g.layers for m in w.matrices())


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def run_once(model, prompt_ids, new_tokens: int) -> tuple[float, float]:
    """Seconds for the prefill (logits of the last position) and for ``new_tokens`` greedy decode steps."""
    import numpy as np

    engine = model.engine
    state = engine.new_state()
    t0 = time.perf_counter()
    tok = int(np.argmax(engine.logits(engine.prefill(state, np.asarray(prompt_ids)))[0]))
    t1 = time.perf_counter()
    for _ in range(new_tokens):
        tok = int(np.argmax(engine.decode_step(state, tok)))
    t2 = time.perf_counter()
    return t1 - t0, t2 - t1


def bench(path: str, *, prompt_tokens: int = 128, new_tokens: int = 64, runs: int = 3, quant: str | None = None,
          context: int | None = None, progress: bool = True, seed: int = 0, threads: int | None = None,
          backend: str = "gemmalite", providers: list | None = None, static_shapes: bool | None = None,
          huge_pages: bool | None = None) -> dict[str, Any]:
    import numpy as np
    from tqdm import tqdm

    import gemmalite

    from .inspect import weight_formats

    t0 = time.perf_counter()
    from ..backends.onnx import MANIFEST

    exported = (Path(path) / MANIFEST).is_file()  # an ONNX export keeps the context it was written for
    model = gemmalite.load(path, context=context or (None if exported else max(prompt_tokens + new_tokens + 1, 256)),
                           quant=quant, threads=threads, backend=backend, huge_pages=huge_pages,
                           **({} if backend == "gemmalite" else {"providers": providers, "static_shapes": static_shapes}))
    load_s = time.perf_counter() - t0
    rng = np.random.default_rng(seed)
    vocab = model.config.vocab_size
    prompt = [model.config.bos_token_id or 2, *rng.integers(1000 if vocab > 2000 else 0, vocab, prompt_tokens - 1).tolist()]
    pre, dec = [], []
    bar = tqdm(total=runs + 1, desc="bench", disable=not progress, file=sys.stderr)
    # warm-up on the whole prompt: compiles kernels and pages in the prompt's embedding / PLE
    # rows, so the timed runs measure compute, not first reads from disk (load_s covers those)
    run_once(model, prompt, min(4, new_tokens))
    bar.update(1)
    for _ in range(runs):
        p, d = run_once(model, prompt, new_tokens)
        pre.append(p)
        dec.append(d)
        bar.update(1)
    bar.close()
    wb = weight_bytes_per_token(model)
    decode_tok_s = new_tokens / statistics.median(dec)
    return {
        "model": str(path),
        "quant": quant,
        "backend": backend if not providers else f"{backend} ({', '.join(map(str, providers))})",
        "weights": weight_formats(model),
        "prompt_tokens": prompt_tokens,
        "new_tokens": new_tokens,
        "runs": runs,
        "threads": _threads(),
        "huge_pages": next(k for k, v in pages.SETTINGS.items() if v is huge_pages),  # `load`'s setting
        "load_s": round(load_s, 3),
        "prefill_tok_s": round(prompt_tokens / statistics.median(pre), 2),
        "decode_tok_s": round(decode_tok_s, 2),
        "peak_rss_bytes": peak_rss_bytes(),
        "weight_bytes_per_token": wb,
        "implied_read_gb_s": round(wb * decode_tok_s / 1e9, 2),
    }


def _threads() -> int:
    try:
        import numba

        return numba.get_num_threads()
    except ImportError:  # pragma: no cover
        return os.cpu_count() or 1


def format_table(r: dict[str, Any]) -> str:
    rows = [
        ("model", r["model"]), ("backend", r.get("backend", "gemmalite")), ("weights", r["weights"] + ("" if r["quant"] else " (as stored)")), ("threads", r["threads"]),
        ("2 MiB pages (--huge-pages)", r.get("huge_pages", "auto")), ("load", f"{r['load_s']:.2f} s"),
        (f"prefill ({r['prompt_tokens']} tokens)", f"{r['prefill_tok_s']:.1f} tok/s"),
        (f"decode ({r['new_tokens']} tokens)", f"{r['decode_tok_s']:.2f} tok/s"),
        ("peak RSS", f"{r['peak_rss_bytes'] / 2**30:.2f} GiB"),
        ("weights read / token", f"{r['weight_bytes_per_token'] / 1e9:.3f} GB"),
        ("implied read bandwidth", f"{r['implied_read_gb_s']:.1f} GB/s"),
    ]
    return "\n".join(f"{k:28s} {v}" for k, v in rows) + f"\n(medians of {r['runs']} runs after a warm-up)"
