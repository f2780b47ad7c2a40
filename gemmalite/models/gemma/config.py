"""Model configuration: one resolved description of the text decoder, whatever the source.

Hugging Face ``config.json`` files (``gemma4``, ``gemma4_text``, ``gemma3``, ``gemma3_text``) and
GGUF metadata are both turned into a `ModelConfig` whose `LayerSpec` list says, for every
layer, exactly what it computes (head size, KV heads, window, RoPE frequencies, where its
K/V come from). The engine reads only this; it never re-derives shapes from class defaults.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ...errors import ConfigError


SLIDING, FULL = "sliding_attention", "full_attention"
SUPPORTED_ACTIVATIONS = ("gelu_pytorch_tanh", "gelu_tanh")


@dataclass(frozen=True)
class RopeSpec:
    """Rotary embedding of one layer type: inverse frequencies as transformers computes them."""

    rope_type: str
    theta: float
    head_dim: int
    factor: float = 1.0
    partial_rotary_factor: float = 1.0

    def inv_freq(self) -> np.ndarray:
        """float32 ``[head_dim // 2]``; float32 ``pow`` like transformers (matters at long context)."""
        d = self.head_dim
        if self.rope_type == "proportional":
            n = int(self.partial_rotary_factor * d // 2)
            exps = np.arange(0, 2 * n, 2, dtype=np.float32) / np.float32(d)
            rot = np.float32(1.0) / (np.float32(self.theta) ** exps)
            f = np.concatenate([rot, np.zeros(d // 2 - n, np.float32)])
            return (f / np.float32(self.factor)).astype(np.float32)
        exps = np.arange(0, d, 2, dtype=np.float32) / np.float32(d)
        f = np.float32(1.0) / (np.float32(self.theta) ** exps)
        if self.rope_type == "linear":
            f = f / np.float32(self.factor)
        return f.astype(np.float32)


@dataclass(frozen=True)
class LayerSpec:
    index: int
    layer_type: str  # SLIDING or FULL
    head_dim: int
    num_kv_heads: int
    intermediate_size: int
    kv_source: int  # layer whose K/V this layer attends to (itself unless KV-shared)
    k_eq_v: bool  # V is the raw K projection (Gemma 4 `attention_k_eq_v`, full layers)
    rope: RopeSpec

    @property
    def sliding(self) -> bool:
        return self.layer_type == SLIDING

    @property
    def owns_kv(self) -> bool:
        return self.kv_source == self.index


@dataclass
class ModelConfig:
    family: str  # "gemma4" or "gemma3"
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    vocab_size: int
    rms_norm_eps: float
    sliding_window: int
    max_position_embeddings: int
    attn_scale: float  # 1.0 for Gemma 4, query_pre_attn_scalar**-0.5 for Gemma 3
    norm_offset: float  # RMSNorm multiplies by (offset + w): 0 for Gemma 4, 1 for Gemma 3
    v_norm: bool  # scale-free RMSNorm on V (Gemma 4)
    final_logit_softcapping: float | None
    tie_word_embeddings: bool
    attention_bias: bool
    ple_dim: int  # hidden_size_per_layer_input, 0 = no per-layer embeddings
    ple_vocab: int
    bos_token_id: int | None
    eos_token_ids: list[int]
    pad_token_id: int | None
    layers: list[LayerSpec] = field(default_factory=list)
    raw: dict[str, Any] = field(default_factory=dict)

    @property
    def first_shared_layer(self) -> int:
        """Index of the first KV-consumer layer (``num_hidden_layers`` if none)."""
        return next((s.index for s in self.layers if not s.owns_kv), self.num_hidden_layers)

    @property
    def embed_scale(self) -> np.float32:
        return np.float32(math.sqrt(self.hidden_size))

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> "ModelConfig":
        """Build from a Hugging Face config dict (top-level or nested ``text_config``)."""
        model_type = cfg.get("model_type", "")
        text = cfg.get("text_config") if model_type in ("gemma4", "gemma3") else cfg
        if not isinstance(text, dict):
            raise ConfigError(f"config of model_type {model_type!r} has no text_config")
        text_type = text.get("model_type") or (model_type + "_text")
        if model_type.startswith("embedding_gemma2"):
            raise ConfigError(f"model_type {model_type!r} is an EmbeddingGemma 2 encoder: load it with "
                              "gemmalite.load_embedder (or `gemmalite embed`)")
        if text_type not in ("gemma4_text", "gemma3_text"):
            raise ConfigError(
                f"unsupported model_type {model_type or '(missing)'!r}: gemmalite runs gemma4, gemma4_text, gemma3, gemma3_text"
            )
        family = text_type.removesuffix("_text")
        return _parse_text(text, family)


def _req(d: dict, key: str) -> Any:
    if d.get(key) is None:
        raise ConfigError(f"config field {key!r} is missing")
    return d[key]


def _layer_types(text: dict, n: int, family: str) -> list[str]:
    types = text.get("layer_types")
    if types is None:
        pattern = int(text.get("sliding_window_pattern", 6))
        types = [SLIDING if (i + 1) % pattern else FULL for i in range(n)]
    types = list(types)
    if len(types) != n:
        raise ConfigError(f"layer_types has {len(types)} entries for {n} layers")
    bad = set(types) - {SLIDING, FULL}
    if bad:
        raise ConfigError(f"unsupported layer types {sorted(bad)}")
    if family == "gemma4":
        types[-1] = FULL  # transformers forces the last Gemma 4 layer to full attention
    return types


def _rope_params(text: dict, family: str) -> dict[str, dict]:
    rp = text.get("rope_parameters")
    if isinstance(rp, dict) and (SLIDING in rp or FULL in rp):
        return {k: dict(v or {}) for k, v in rp.items()}
    if family == "gemma4":
        return {
            SLIDING: {"rope_type": "default", "rope_theta": 10_000.0},
            FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0},
        }
    # Gemma 3 legacy keys: rope_theta (global), rope_local_base_freq, rope_scaling (global layers only)
    full = {"rope_type": "default", "rope_theta": float(text.get("rope_theta", 1_000_000.0))}
    if isinstance(text.get("rope_scaling"), dict):
        full.update(text["rope_scaling"])
    local = {"rope_type": "default", "rope_theta": float(text.get("rope_local_base_freq", 10_000.0))}
    return {SLIDING: local, FULL: full}


def _rope_spec(params: dict, head_dim: int) -> RopeSpec:
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ("default", "proportional", "linear"):
        raise ConfigError(f"unsupported rope_type {rope_type!r}")
    return RopeSpec(
        rope_type=rope_type,
        theta=float(_req(params, "rope_theta")),
        head_dim=head_dim,
        factor=float(params.get("factor", 1.0) or 1.0),
        partial_rotary_factor=float(params.get("partial_rotary_factor", 1.0) or 1.0),
    )


def _kv_sources(types: list[str], shared: int) -> list[int]:
    """Producer index per layer: consumers (the last ``shared`` layers) use the last earlier layer of their type."""
    n = len(types)
    first = n - shared
    if shared < 0 or first < 1 and shared:
        raise ConfigError(f"num_kv_shared_layers={shared} leaves no layer with its own K/V")
    sources = list(range(n))
    for i in range(first, n):
        producers = [j for j in range(first) if types[j] == types[i]]
        if not producers:
            raise ConfigError(f"KV-shared layer {i} ({types[i]}) has no earlier layer of its type to share from")
        sources[i] = producers[-1]
    return sources


def _parse_text(text: dict, family: str) -> ModelConfig:
    if text.get("enable_moe_block"):
        raise ConfigError("enable_moe_block: mixture-of-experts Gemma 4 models are not supported")
    if text.get("use_bidirectional_attention") in ("all", True):
        raise ConfigError("use_bidirectional_attention='all' (encoder models) is not supported by the decoder engine")
    act = text.get("hidden_activation", "gelu_pytorch_tanh")
    if act not in SUPPORTED_ACTIVATIONS:
        raise ConfigError(f"unsupported hidden_activation {act!r}")
    if text.get("attn_logit_softcapping") is not None:
        raise ConfigError("attn_logit_softcapping is not supported")

    n = int(_req(text, "num_hidden_layers"))
    hidden = int(_req(text, "hidden_size"))
    nq = int(_req(text, "num_attention_heads"))
    head_dim = int(text.get("head_dim") or hidden // nq)
    kv_heads = int(text.get("num_key_value_heads") or nq)
    inter = int(_req(text, "intermediate_size"))
    types = _layer_types(text, n, family)
    rope = _rope_params(text, family)

    shared = int(text.get("num_kv_shared_layers") or 0) if family == "gemma4" else 0
    sources = _kv_sources(types, shared)
    k_eq_v = bool(text.get("attention_k_eq_v")) and family == "gemma4"
    double = bool(text.get("use_double_wide_mlp")) and family == "gemma4"

    # Per-layer head size / KV heads (Gemma 4): `per_layer_config` when saved by transformers,
    # else the hub builder keys `global_head_dim` (default 512) / `num_global_key_value_heads`.
    overrides: dict[int, dict] = {}
    if family == "gemma4":
        if "per_layer_config" in text and text["per_layer_config"] is not None:
            overrides = {int(k): dict(v) for k, v in text["per_layer_config"].items()}
        else:
            o: dict[str, Any] = {"head_dim": int(text.get("global_head_dim") or 512)}
            if k_eq_v and text.get("num_global_key_value_heads") is not None:
                o["num_key_value_heads"] = int(text["num_global_key_value_heads"])
            overrides = {i: o for i, t in enumerate(types) if t == FULL}

    layers: list[LayerSpec] = []
    for i in range(n):
        o = overrides.get(i, {})
        d = int(o.get("head_dim", head_dim))
        kv = int(o.get("num_key_value_heads", kv_heads))
        if nq % kv:
            raise ConfigError(f"layer {i}: {nq} attention heads are not a multiple of {kv} KV heads")
        params = rope.get(types[i])
        if params is None:
            raise ConfigError(f"rope_parameters has no entry for {types[i]}")
        layers.append(
            LayerSpec(
                index=i,
                layer_type=types[i],
                head_dim=d,
                num_kv_heads=kv,
                intermediate_size=inter * (2 if double and sources[i] != i else 1),
                kv_source=sources[i],
                k_eq_v=k_eq_v and types[i] == FULL,
                rope=_rope_spec(params, d),
            )
        )
    for spec in layers:  # a consumer attends with the producer's geometry
        src = layers[spec.kv_source]
        if (spec.head_dim, spec.num_kv_heads) != (src.head_dim, src.num_kv_heads):
            raise ConfigError(f"KV-shared layer {spec.index} geometry differs from its producer {src.index}")

    eos = text.get("eos_token_id", 1)
    eos_ids = [int(e) for e in (eos if isinstance(eos, list) else [eos]) if e is not None]
    ple = int(text.get("hidden_size_per_layer_input") or 0) if family == "gemma4" else 0
    softcap = text.get("final_logit_softcapping")
    return ModelConfig(
        family=family,
        hidden_size=hidden,
        num_hidden_layers=n,
        num_attention_heads=nq,
        vocab_size=int(_req(text, "vocab_size")),
        rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)),
        sliding_window=int(text.get("sliding_window") or 4096),
        max_position_embeddings=int(text.get("max_position_embeddings") or 131072),
        attn_scale=1.0 if family == "gemma4" else float(text.get("query_pre_attn_scalar", head_dim)) ** -0.5,
        norm_offset=0.0 if family == "gemma4" else 1.0,
        v_norm=family == "gemma4",
        final_logit_softcapping=float(softcap) if softcap else None,
        tie_word_embeddings=bool(text.get("tie_word_embeddings", True)),
        attention_bias=bool(text.get("attention_bias", False)),
        ple_dim=ple,
        ple_vocab=int(text.get("vocab_size_per_layer_input") or text.get("vocab_size")) if ple else 0,
        bos_token_id=text.get("bos_token_id", 2),
        eos_token_ids=eos_ids,
        pad_token_id=text.get("pad_token_id", 0),
        layers=layers,
        raw=text,
    )
