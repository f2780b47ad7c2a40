"""The Gemma text decoder's tensor contract: every tensor name and shape a checkpoint must
provide, read by loading, GGUF mapping, conversion, `inspect` and `bench`."""
from __future__ import annotations

from ...errors import CheckpointError
from .config import ModelConfig

NORMS = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm")
# A layer's projections: `LayerWeights` attribute -> tensor name under ``layers.{i}.`` (+ ".weight"),
# in the order a decode step reads them
PROJECTIONS = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj", "o": "self_attn.o_proj",
               "gate": "mlp.gate_proj", "up": "mlp.up_proj", "down": "mlp.down_proj",
               "ple_gate": "per_layer_input_gate", "ple_proj": "per_layer_projection"}
# Row-addressed tables (embedding lookups): kept as stored, never quantized
TABLES = ("embed_tokens.weight", "embed_tokens_per_layer.weight")


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor the text decoder needs, with its shape (the contract a checkpoint must meet)."""
    H, L, P = cfg.hidden_size, cfg.num_hidden_layers, cfg.ple_dim
    nq = cfg.num_attention_heads
    shapes: dict[str, tuple[int, ...]] = {"embed_tokens.weight": (cfg.vocab_size, H), "norm.weight": (H,)}
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, H)
    if P:
        shapes["embed_tokens_per_layer.weight"] = (cfg.ple_vocab, L * P)
        shapes["per_layer_model_projection.weight"] = (L * P, H)
        shapes["per_layer_projection_norm.weight"] = (P,)
    for s in cfg.layers:
        p = f"layers.{s.index}."
        D, kv, I = s.head_dim, s.num_kv_heads, s.intermediate_size
        W = {attr: p + name + ".weight" for attr, name in PROJECTIONS.items()}
        for norm in NORMS:
            shapes[p + norm + ".weight"] = (H,)
        shapes[W["q"]] = (nq * D, H)
        shapes[p + "self_attn.q_norm.weight"] = (D,)
        shapes[W["o"]] = (H, nq * D)
        attn = ["q", "o"]
        if s.owns_kv:
            shapes[W["k"]] = (kv * D, H)
            shapes[p + "self_attn.k_norm.weight"] = (D,)
            attn.append("k")
            if not s.k_eq_v:
                shapes[W["v"]] = (kv * D, H)
                attn.append("v")
        if cfg.attention_bias:
            for attr in attn:
                shapes[W[attr].removesuffix("weight") + "bias"] = (shapes[W[attr]][0],)
        shapes[W["gate"]] = (I, H)
        shapes[W["up"]] = (I, H)
        shapes[W["down"]] = (H, I)
        if P:
            shapes[W["ple_gate"]] = (P, H)
            shapes[W["ple_proj"]] = (H, P)
            shapes[p + "post_per_layer_input_norm.weight"] = (H,)
        if cfg.family == "gemma4":
            shapes[p + "layer_scalar"] = (1,)
    return shapes


def check_tensors(cfg: ModelConfig, tensors: dict, where: str, shape_of=lambda t: tuple(t.shape),
                  shapes: dict[str, tuple[int, ...]] | None = None) -> None:
    """Raise CheckpointError naming the first missing or mis-shaped tensor (of ``shapes``, default
    the decoder's contract)."""
    problems: list[str] = []
    for name, shape in (expected_shapes(cfg) if shapes is None else shapes).items():
        if name not in tensors:
            problems.append(f"missing tensor {name} (expected shape {shape})")
        elif tuple(shape_of(tensors[name])) != shape:
            problems.append(f"tensor {name} has shape {tuple(shape_of(tensors[name]))}, expected {shape}")
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise CheckpointError(f"{where}: {problems[0]}{more}")


def quantizable(cfg: ModelConfig, shapes: dict[str, tuple[int, ...]] | None = None) -> list[str]:
    """The matrices a quantized checkpoint stores as int8 / int4: every 2-D tensor but the tables
    (of ``shapes``, default the decoder's contract)."""
    shapes = expected_shapes(cfg) if shapes is None else shapes
    return [n for n, shape in shapes.items() if len(shape) == 2 and n not in TABLES]
