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
        """Build from a Hugging Face config dict (top-level or nested ``text_config``); every field
        is type- and range-checked, a bad one raises `ConfigError` naming it."""
        if not isinstance(cfg, dict):
            raise ConfigError(f"the config must be a JSON object, got {type(cfg).__name__}")
        model_type = cfg.get("model_type", "")
        text = cfg.get("text_config") if model_type in ("gemma4", "gemma3") else cfg
        if not isinstance(text, dict):
            raise ConfigError(f"config of model_type {model_type!r} has no text_config object")
        text_type = text.get("model_type") or (f"{model_type}_text" if isinstance(model_type, str) else "")
        if isinstance(model_type, str) and model_type.startswith("embedding_gemma2"):
            raise ConfigError(f"model_type {model_type!r} is an EmbeddingGemma 2 encoder: load it with "
                              "gemmalite.load_embedder (or `gemmalite embed`)")
        if text_type not in ("gemma4_text", "gemma3_text"):
            raise ConfigError(
                f"unsupported model_type {model_type or '(missing)'!r}: gemmalite runs gemma4, gemma4_text, gemma3, gemma3_text"
            )
        family = text_type.removesuffix("_text")
        return _parse_text(text, family)


# Upper bounds far above any Gemma, low enough that a corrupted value cannot allocate the machine away
MAX_LAYERS, MAX_WIDTH, MAX_HEADS, MAX_VOCAB, MAX_POSITIONS = 1024, 1 << 17, 1024, 1 << 24, 1 << 31
_MISSING = object()


def _is_int(v: Any) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_)) or \
        isinstance(v, (float, np.floating)) and math.isfinite(v) and float(v).is_integer()


def _field(d: dict, key: str, default: Any, name: str) -> tuple[Any, bool]:
    """``(value, present)``: ``d[key]`` (null counts as absent), or the default; ConfigError when
    the field is absent and has no default."""
    v = d.get(key)
    if v is not None:
        return v, True
    if default is _MISSING:
        raise ConfigError(f"config field {name!r} is missing")
    return default, False


def _int(d: dict, key: str, lo: int, hi: int, default: Any = _MISSING, *, what: str = "") -> int:
    """``d[key]`` as an int in ``[lo, hi]`` (null counts as absent); ConfigError naming the field otherwise."""
    name = what or key
    v, present = _field(d, key, default, name)
    if not present:
        return v
    if not _is_int(v):
        raise ConfigError(f"config field {name!r} must be an integer, got {v!r}")
    if not lo <= int(v) <= hi:
        raise ConfigError(f"config field {name!r} must be between {lo} and {hi}, got {int(v)}")
    return int(v)


def _float(d: dict, key: str, lo: float, hi: float, default: Any = _MISSING, *, what: str = "",
           open_low: bool = False) -> float:
    """``d[key]`` as a finite float in ``[lo, hi]`` (``(lo, hi]`` with ``open_low``)."""
    name = what or key
    v, present = _field(d, key, default, name)
    if not present:
        return v
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, float, np.integer, np.floating)) \
            or not math.isfinite(v):
        raise ConfigError(f"config field {name!r} must be a finite number, got {v!r}")
    if not (lo < v if open_low else lo <= v) or v > hi:
        raise ConfigError(f"config field {name!r} must be in {'(' if open_low else '['}{lo}, {hi}], got {v}")
    return float(v)


def _bool(d: dict, key: str, default: bool) -> bool:
    v = d.get(key)
    if v is None:
        return default
    if not isinstance(v, (bool, np.bool_)):
        raise ConfigError(f"config field {key!r} must be true or false, got {v!r}")
    return bool(v)


def _token_id(d: dict, key: str, vocab: int, default: Any) -> Any:
    if key not in d:
        return default
    return _int(d, key, 0, vocab - 1, None)


def _layer_types(text: dict, n: int, family: str) -> list[str]:
    types = text.get("layer_types")
    if types is None:
        pattern = _int(text, "sliding_window_pattern", 1, MAX_LAYERS, 6)
        types = [SLIDING if (i + 1) % pattern else FULL for i in range(n)]
    if not isinstance(types, list):
        raise ConfigError(f"config field 'layer_types' must be a list, got {type(types).__name__}")
    types = list(types)
    if len(types) != n:
        raise ConfigError(f"layer_types has {len(types)} entries for {n} layers")
    bad = {repr(t) for t in types if t not in (SLIDING, FULL)}
    if bad:
        raise ConfigError(f"unsupported layer types {sorted(bad)}")
    if family == "gemma4":
        types[-1] = FULL  # transformers forces the last Gemma 4 layer to full attention
    return types


def _rope_params(text: dict, family: str) -> dict[str, dict]:
    rp = text.get("rope_parameters")
    if isinstance(rp, dict) and (SLIDING in rp or FULL in rp):
        bad = [k for k, v in rp.items() if v is not None and not isinstance(v, dict)]
        if bad:
            raise ConfigError(f"config field 'rope_parameters.{bad[0]}' must be an object")
        return {k: dict(v or {}) for k, v in rp.items()}
    if family == "gemma4":
        return {
            SLIDING: {"rope_type": "default", "rope_theta": 10_000.0},
            FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0},
        }
    # Gemma 3 legacy keys: rope_theta (global), rope_local_base_freq, rope_scaling (global layers only)
    full = {"rope_type": "default", "rope_theta": _float(text, "rope_theta", 0, 1e12, 1_000_000.0, open_low=True)}
    if isinstance(text.get("rope_scaling"), dict):
        full.update(text["rope_scaling"])
    local = {"rope_type": "default",
             "rope_theta": _float(text, "rope_local_base_freq", 0, 1e12, 10_000.0, open_low=True)}
    return {SLIDING: local, FULL: full}


def _rope_spec(params: dict, head_dim: int, layer_type: str) -> RopeSpec:
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ("default", "proportional", "linear"):
        raise ConfigError(f"unsupported rope_type {rope_type!r}")
    where = f"rope_parameters.{layer_type}."
    return RopeSpec(
        rope_type=rope_type,
        theta=_float(params, "rope_theta", 0, 1e12, what=where + "rope_theta", open_low=True),
        head_dim=head_dim,
        factor=_float(params, "factor", 0, 1e6, 1.0, what=where + "factor", open_low=True) if params.get("factor") else 1.0,
        partial_rotary_factor=_float(params, "partial_rotary_factor", 0, 1, 1.0, what=where + "partial_rotary_factor",
                                     open_low=True) if params.get("partial_rotary_factor") else 1.0,
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


def _overrides(text: dict, types: list[str], k_eq_v: bool, nq: int) -> dict[int, dict]:
    """Per-layer head size / KV heads (Gemma 4): `per_layer_config` when saved by transformers,
    else the hub builder keys `global_head_dim` (default 512) / `num_global_key_value_heads`."""
    n = len(types)
    plc = text.get("per_layer_config")
    if plc is not None:
        if not isinstance(plc, dict):
            raise ConfigError("config field 'per_layer_config' must be an object")
        out: dict[int, dict] = {}
        for k, v in plc.items():
            if not (isinstance(k, str) and k.isdigit() and int(k) < n) or not isinstance(v, dict):
                raise ConfigError(f"config field 'per_layer_config' has a malformed entry {k!r}")
            out[int(k)] = v
        return out
    o: dict[str, Any] = {"head_dim": _int(text, "global_head_dim", 2, 8192, 512)}
    if k_eq_v and text.get("num_global_key_value_heads") is not None:
        o["num_key_value_heads"] = _int(text, "num_global_key_value_heads", 1, nq)
    return {i: o for i, t in enumerate(types) if t == FULL}


def layer_geometry(i: int, o: dict, head_dim: int, kv_heads: int, nq: int, rope: dict,
                   layer_type: str) -> tuple[int, int, RopeSpec]:
    """Layer ``i``'s head size, KV heads (its override ``o`` over the defaults) and RoPE, checked:
    shared by the decoder's and the encoder's configs."""
    d = _int(o, "head_dim", 2, 8192, head_dim, what=f"per_layer_config.{i}.head_dim")
    kv = _int(o, "num_key_value_heads", 1, nq, kv_heads, what=f"per_layer_config.{i}.num_key_value_heads")
    if d % 2:
        raise ConfigError(f"layer {i}: head size {d} is odd (rotary embeddings need pairs)")
    if nq % kv:
        raise ConfigError(f"layer {i}: {nq} attention heads are not a multiple of {kv} KV heads")
    params = rope.get(layer_type)
    if not isinstance(params, dict):
        raise ConfigError(f"rope_parameters has no entry for {layer_type}")
    return d, kv, _rope_spec(params, d, layer_type)


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

    n = _int(text, "num_hidden_layers", 1, MAX_LAYERS)
    hidden = _int(text, "hidden_size", 1, MAX_WIDTH)
    nq = _int(text, "num_attention_heads", 1, MAX_HEADS)
    vocab = _int(text, "vocab_size", 1, MAX_VOCAB)
    head_dim = _int(text, "head_dim", 2, 8192, None) or hidden // nq
    if head_dim < 2:
        raise ConfigError(f"config has no head_dim and hidden_size {hidden} / {nq} heads gives {head_dim}")
    kv_heads = _int(text, "num_key_value_heads", 1, nq, None) or nq
    inter = _int(text, "intermediate_size", 1, MAX_WIDTH * 8)
    types = _layer_types(text, n, family)
    rope = _rope_params(text, family)

    shared = _int(text, "num_kv_shared_layers", 0, n - 1, 0) if family == "gemma4" else 0
    sources = _kv_sources(types, shared)
    k_eq_v = _bool(text, "attention_k_eq_v", False) and family == "gemma4"
    double = _bool(text, "use_double_wide_mlp", False) and family == "gemma4"
    overrides = _overrides(text, types, k_eq_v, nq) if family == "gemma4" else {}

    layers: list[LayerSpec] = []
    for i in range(n):
        d, kv, rope_spec = layer_geometry(i, overrides.get(i, {}), head_dim, kv_heads, nq, rope, types[i])
        layers.append(
            LayerSpec(
                index=i,
                layer_type=types[i],
                head_dim=d,
                num_kv_heads=kv,
                intermediate_size=inter * (2 if double and sources[i] != i else 1),
                kv_source=sources[i],
                k_eq_v=k_eq_v and types[i] == FULL,
                rope=rope_spec,
            )
        )
    for spec in layers:  # a consumer attends with the producer's geometry
        src = layers[spec.kv_source]
        if (spec.head_dim, spec.num_kv_heads) != (src.head_dim, src.num_kv_heads):
            raise ConfigError(f"KV-shared layer {spec.index} geometry differs from its producer {src.index}")

    eos = text.get("eos_token_id", 1)
    eos_list = eos if isinstance(eos, list) else [eos]
    eos_ids = [_int({"eos_token_id": e}, "eos_token_id", 0, vocab - 1) for e in eos_list if e is not None]
    ple = _int(text, "hidden_size_per_layer_input", 0, MAX_WIDTH, 0) if family == "gemma4" else 0
    softcap = _float(text, "final_logit_softcapping", 0, 1e6, None, open_low=True) \
        if text.get("final_logit_softcapping") else None
    return ModelConfig(
        family=family,
        hidden_size=hidden,
        num_hidden_layers=n,
        num_attention_heads=nq,
        vocab_size=vocab,
        rms_norm_eps=_float(text, "rms_norm_eps", 0, 1, 1e-6),
        sliding_window=_int(text, "sliding_window", 1, MAX_POSITIONS, None) or 4096,
        max_position_embeddings=_int(text, "max_position_embeddings", 1, MAX_POSITIONS, None) or 131072,
        attn_scale=1.0 if family == "gemma4" else
        _float(text, "query_pre_attn_scalar", 0, 1e9, float(head_dim), open_low=True) ** -0.5,
        norm_offset=0.0 if family == "gemma4" else 1.0,
        v_norm=family == "gemma4",
        final_logit_softcapping=softcap,
        tie_word_embeddings=_bool(text, "tie_word_embeddings", True),
        attention_bias=_bool(text, "attention_bias", False),
        ple_dim=ple,
        ple_vocab=_int(text, "vocab_size_per_layer_input", 1, MAX_VOCAB, None) or vocab if ple else 0,
        bos_token_id=_token_id(text, "bos_token_id", vocab, 2),
        eos_token_ids=eos_ids,
        pad_token_id=_token_id(text, "pad_token_id", vocab, 0),
        layers=layers,
        raw=text,
    )
