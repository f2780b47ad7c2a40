"""`gemmalite inspect`: what a loaded model is made of, in parameters and bytes."""
from __future__ import annotations

from collections import defaultdict

import numpy as np

from ..model import Model
from ..weights.matrix import Matrix


def _count(m: Matrix | np.ndarray | None) -> tuple[int, int]:
    if m is None:
        return 0, 0
    shape = m.shape
    return int(np.prod(shape)), int(m.nbytes)


def storage(m: Matrix | np.ndarray) -> str:
    """How one weight is held: int8, int4, a GGML block type (Q4_K, ...), float32, bfloat16, float16."""
    for cls, name in (("Int8Matrix", "int8"), ("Int4Matrix", "int4")):
        if type(m).__name__ == cls:
            return name
    if hasattr(m, "qtype"):
        return str(m.qtype)
    w = getattr(m, "w", m)
    return str(getattr(w, "dtype", "?"))


def weight_formats(model: Model) -> str:
    """The storage of the layer projections and the LM head, by share of parameters:
    "int8", or "Q4_K 62%, Q6_K 38%" (what a run really computes with, whatever was asked)."""
    e = model.engine
    count: dict[str, int] = defaultdict(int)
    for m in [e.lm_head, *(m for w in e.graph.layers for m in w.matrices())]:
        count[storage(m)] += int(np.prod(m.shape))
    total = sum(count.values()) or 1
    ranked = sorted(count.items(), key=lambda kv: -kv[1])
    if len(ranked) == 1:
        return ranked[0][0]
    return ", ".join(f"{k} {100 * v / total:.0f}%" for k, v in ranked)


def parts(model: Model) -> dict[str, tuple[int, int]]:
    """Parameter count and bytes held, per part of the model."""
    cfg = model.config
    out: dict[str, list[int]] = defaultdict(lambda: [0, 0])

    def add(part: str, m) -> None:
        n, b = _count(m)
        out[part][0] += n
        out[part][1] += b

    e = model.engine
    add("token embedding" + (" (= tied LM head)" if e.lm_head is e.embed else ""), e.embed)
    if e.lm_head is not e.embed:
        add("LM head", e.lm_head)
    if e.ple_table is not None:
        add("PLE token table", e.ple_table)
        add("PLE model projection", e.graph.ple.projection)
    for spec, w in zip(cfg.layers, e.graph.layers):
        kind = ("sliding" if spec.sliding else "full") + (" own-KV" if spec.owns_kv else " KV-shared")
        for m in w.matrices():
            add(f"layers ({kind})", m)
        for v in (w.ln_in, w.ln_post_attn, w.ln_pre_ff, w.ln_post_ff, w.q_norm, w.k_norm, w.ple_norm):
            add("norms", v)
    return {k: (v[0], v[1]) for k, v in out.items()}


def describe(model: Model) -> str:
    cfg = model.config
    types = [s.layer_type for s in cfg.layers]
    n_shared = cfg.num_hidden_layers - cfg.first_shared_layer
    lines = [
        f"source          {model.source}",
        f"family          {cfg.family}",
        f"hidden size     {cfg.hidden_size}",
        f"layers          {cfg.num_hidden_layers} ({types.count('sliding_attention')} sliding, "
        f"{types.count('full_attention')} full; full at {[s.index for s in cfg.layers if not s.sliding]})",
        "KV-shared       " + (f"{n_shared} (from layer {cfg.first_shared_layer})" if n_shared else "none"),
        f"heads           {cfg.num_attention_heads} query; head dim / KV heads: "
        + ", ".join(sorted({f"{s.layer_type.split('_')[0]} {s.head_dim}/{s.num_kv_heads}" for s in cfg.layers})),
        f"sliding window  {cfg.sliding_window}",
        f"PLE width       {cfg.ple_dim or 'none'}",
        f"vocab           {cfg.vocab_size}",
        f"final softcap   {cfg.final_logit_softcapping or 'none'}",
        f"weights         {weight_formats(model)}",
        f"context         {model.context} (KV cache {model.new_state().nbytes / 2**20:.1f} MiB)",
        "",
        f"{'part':38s} {'parameters':>16s} {'bytes':>12s}",
    ]
    total_n = total_b = 0
    for name, (n, b) in parts(model).items():
        lines.append(f"{name:38s} {n:16,d} {b / 2**20:10.1f} MiB")
        total_n += n
        total_b += b
    lines.append(f"{'total':38s} {total_n:16,d} {total_b / 2**20:10.1f} MiB")
    return "\n".join(lines)
