"""GGUF files of the Gemma families: llama.cpp tensor names and metadata -> Hugging Face names
and a Hugging Face text config, so GGUF models load through the same tensor contract as folders."""
from __future__ import annotations

import math
import os
import re
from typing import Any

import numpy as np

from ..errors import ConfigError, TokenizerError
from ..models.gemma.config import MAX_LAYERS, ModelConfig
from ..models.gemma.contract import expected_shapes
from ..weights.matrix import Matrix
from .gguf import GGUFError, GGUFFile, TensorInfo, read_gguf
from .gguf_tokenizer import file_cache_key, special_token_info, tokenizer_from_gguf_metadata


def hf_config(gf: GGUFFile) -> dict[str, Any]:
    """The Hugging Face text config a GGUF file's metadata describes."""
    return config_from_gguf(gf.metadata, gf.tensor_info, gf.tensors.get("rope_freqs.weight"))


# ---------------------------------------------------------------------------------------------
# llama.cpp tensor names -> Hugging Face names (relative to the text-model prefix, e.g.
# "model." or "model.language_model."). Source: gguf-py tensor_mapping.py / constants.py and
# convert_hf_to_gguf (conversion/gemma.py) in the llama.cpp tree vendored by llama-cpp-python
# 0.3.36. The converter does not permute Q/K for Gemma (llama.cpp runs Gemma RoPE in NeoX
# mode, the HF layout), so projections map 1:1.
# ---------------------------------------------------------------------------------------------

_GLOBAL_NAMES = {
    "token_embd.weight": "embed_tokens.weight",
    "output_norm.weight": "norm.weight",
    "output.weight": "lm_head.weight",  # only when untied; absolute name, not under the prefix
    "per_layer_token_embd.weight": "embed_tokens_per_layer.weight",  # gemma4 PLE
    "per_layer_model_proj.weight": "per_layer_model_projection.weight",
    "per_layer_proj_norm.weight": "per_layer_projection_norm.weight",
}
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_qkv.weight": "self_attn.qkv_proj.weight",  # only with convert --fuse-qkv; see hf_tensors
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GEMMA4_LAYER_NAMES = {
    "inp_gate.weight": "per_layer_input_gate.weight",
    "proj.weight": "per_layer_projection.weight",
    "post_norm.weight": "post_per_layer_input_norm.weight",
    "layer_output_scale.weight": "layer_scalar",  # converter appends ".weight" to layer_scalar
    # MoE (26B-A4B), unused by the E-series
    "ffn_gate_inp.weight": "router.proj.weight",
    "ffn_gate_inp.scale": "router.scale",
    "ffn_down_exps.scale": "router.per_expert_scale",
    "ffn_gate_up_exps.weight": "experts.gate_up_proj",
    "ffn_down_exps.weight": "experts.down_proj",
    "pre_ffw_norm_2.weight": "pre_feedforward_layernorm_2.weight",
    "post_ffw_norm_1.weight": "post_feedforward_layernorm_1.weight",
    "post_ffw_norm_2.weight": "post_feedforward_layernorm_2.weight",
}
_REQUIRED = object()
_PER_LAYER_KEYS = ("attention.head_count", "attention.head_count_kv", "feed_forward_length")
_LAYER_RE = re.compile(r"blk\.(\d+)\.(.+)")


def hf_name(name: str, arch: str) -> str | None:
    """HF name of a llama.cpp tensor, or None for llama.cpp-only tensors (``rope_freqs.weight``:
    gemma4's proportional-RoPE frequency factors, 1 for rotated pairs and 1e30 for the rest)."""
    if name in _GLOBAL_NAMES:
        if name.startswith("per_layer_") and arch != "gemma4":
            return None
        return _GLOBAL_NAMES[name]
    m = _LAYER_RE.fullmatch(name)
    if not m:
        return None
    table = {**_LAYER_NAMES, **_GEMMA4_LAYER_NAMES} if arch == "gemma4" else _LAYER_NAMES
    rest = table.get(m.group(2))
    return None if rest is None else f"layers.{m.group(1)}.{rest}"


def norm_offset(arch: str) -> float:
    """What llama.cpp's converter added to every RMSNorm weight (HF names ending "norm.weight").

    gemma / gemma2 / gemma3 (and embeddinggemma): 1.0. HF computes ``x * (1 + w)``; the converter
    stores ``w + 1`` computed in float32, i.e. exactly the factor HF multiplies by, so use the
    GGUF value as a plain multiplier, or subtract 1 to get HF's ``w`` (``1 + (g - 1) == g`` holds
    exactly in float32 for every g >= 0.5). gemma3n / gemma4: 0.0 (their RMSNorm is ``x * w``).
    """
    return 1.0 if arch in ("gemma", "gemma2", "gemma3", "gemma-embedding") else 0.0


def hf_tensors(gf: GGUFFile, *, hf_norms: bool = True) -> dict[str, Matrix | np.ndarray]:
    """The file's tensors under HF text names. With ``hf_norms`` the norm offset is removed
    (HF convention); a fused ``attn_qkv`` is split into q/k/v row ranges without copying, at the
    row counts the tensor contract gives q and k."""
    arch, shapes, out = gf.arch, None, {}
    shift = norm_offset(arch) if hf_norms else 0.0
    for name, t in gf.tensors.items():
        hf = hf_name(name, arch)
        if hf is None:
            continue
        if shift and hf.endswith("norm.weight"):
            t = t - np.float32(shift)
        if hf.endswith("qkv_proj.weight"):
            shapes = shapes or expected_shapes(_model_config(gf))
            base = hf[: -len("qkv_proj.weight")]
            q, k = shapes[base + "q_proj.weight"][0], shapes[base + "k_proj.weight"][0]
            out |= {base + "q_proj.weight": t.row_slice(0, q), base + "k_proj.weight": t.row_slice(q, q + k),
                    base + "v_proj.weight": t.row_slice(q + k, t.shape[0])}
            continue
        out[hf] = t
    return out


def _model_config(gf: GGUFFile) -> ModelConfig:
    try:
        return ModelConfig.from_hf(hf_config(gf))
    except (ConfigError, GGUFError) as e:
        raise GGUFError(f"{gf.path}: {e}") from None


# ---------------------------------------------------------------------------------------------
# GGUF metadata -> Hugging Face text config. Key names and semantics from the converter
# (conversion/base.py TextModel.set_gguf_parameters, conversion/gemma.py Gemma3Model /
# Gemma4Model) and the loader (src/llama-model.cpp, src/models/gemma3.cpp, gemma4.cpp).
# ---------------------------------------------------------------------------------------------


def _per_layer(v, n: int) -> list:
    """A key that is either one value or one value per layer (llama.cpp get_key_or_arr)."""
    if isinstance(v, (list, np.ndarray)):
        v = [x.item() if hasattr(x, "item") else x for x in v]
        if len(v) != n:
            raise GGUFError(f"per-layer metadata has {len(v)} entries for {n} layers")
        return v
    return [v] * n


def _sliding_flags(meta: dict, arch: str, n: int, window=None) -> list[bool]:
    """Which layers use sliding-window attention (llama_model_base::load_swa_pattern)."""
    pat = meta.get(f"{arch}.attention.sliding_window_pattern")
    if pat is not None and not isinstance(pat, (list, np.ndarray)) and not (isinstance(pat, int) and not isinstance(pat, bool)):
        raise GGUFError(f"metadata key {arch}.attention.sliding_window_pattern has a value of the wrong type: {pat!r:.60}")
    if isinstance(pat, (list, np.ndarray)):  # gemma4 (and newer gemma3 files): one bool per layer
        return [bool(x) for x in _per_layer(pat, n)]
    if arch == "gemma3" and not window:
        return [False] * n  # no window written: every layer is global
    p = int(pat) if pat is not None else 6  # gemma3 default: 5 sliding, then 1 full
    return [p == 0 or (i % p) < p - 1 for i in range(n)]


def config_from_gguf(meta: dict[str, Any], tensor_info: dict[str, TensorInfo] | None = None,
                     rope_freqs: np.ndarray | None = None) -> dict[str, Any]:
    """An HF-style text config (``gemma3_text`` / ``gemma4_text``) from GGUF metadata.

    Optional extras settle what only tensors reveal: ``tensor_info`` an untied LM head,
    gemma4's ``attention_k_eq_v`` (full layers without ``attn_v``) and the PLE vocabulary;
    ``rope_freqs`` (gemma4's ``rope_freqs.weight``) the partial-rotary factor of the full
    layers, which otherwise takes HF's default 0.25.
    """
    arch = str(meta.get("general.architecture", ""))
    if arch not in ("gemma3", "gemma4"):
        raise GGUFError(f"unsupported architecture {arch!r} (gemmalite reads gemma3 and gemma4)")

    def get(key: str, default=_REQUIRED):
        """A numeric metadata value (an array only for the per-layer keys); GGUFError naming a
        missing or mistyped key."""
        v = meta.get(f"{arch}.{key}")
        if v is None:
            if default is _REQUIRED:
                raise GGUFError(f"metadata key {arch}.{key} is missing")
            return default
        ok = (isinstance(v, np.ndarray) and v.dtype.kind in "iu" and v.ndim == 1 and key in _PER_LAYER_KEYS) or \
            (isinstance(v, (int, float)) and not isinstance(v, bool)) or (key == "rope.scaling.type" and isinstance(v, str))
        if not ok or isinstance(v, float) and not math.isfinite(v):
            raise GGUFError(f"metadata key {arch}.{key} has a value of the wrong type: {v!r:.60}")
        return v

    n = int(get("block_count"))
    if not 1 <= n <= MAX_LAYERS:  # before anything is sized by it
        raise GGUFError(f"metadata key {arch}.block_count = {n} is out of range (1..{MAX_LAYERS})")
    tokens = meta.get("tokenizer.ggml.tokens")
    tokens = tokens if isinstance(tokens, list) else None
    names = set(tensor_info or ())
    sliding = _sliding_flags(meta, arch, n, get("attention.sliding_window", None))
    layer_types = ["sliding_attention" if s else "full_attention" for s in sliding]
    n_head = int(_per_layer(get("attention.head_count"), n)[0])
    if n_head < 1:
        raise GGUFError(f"metadata key {arch}.attention.head_count = {n_head}: a model needs attention heads")
    kv = [int(x) for x in _per_layer(get("attention.head_count_kv", n_head), n)]
    ff = [int(x) for x in _per_layer(get("feed_forward_length"), n)]
    cfg: dict[str, Any] = {
        "model_type": f"{arch}_text",
        "architectures": ["Gemma3ForCausalLM" if arch == "gemma3" else "Gemma4ForCausalLM"],
        "hidden_size": int(get("embedding_length")),
        "num_hidden_layers": n,
        "intermediate_size": ff[0],
        "num_attention_heads": n_head,
        "num_key_value_heads": kv[sliding.index(True)] if any(sliding) else kv[0],
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        "max_position_embeddings": int(get("context_length", 131072)),
        "layer_types": layer_types,
        "hidden_activation": "gelu_pytorch_tanh",
        "final_logit_softcapping": float(get("final_logit_softcapping", None)) if get("final_logit_softcapping", None) else None,
        "vocab_size": int(get("vocab_size", len(tokens) if tokens is not None else _embedding_rows(tensor_info))),
        "tie_word_embeddings": "output.weight" not in names,
        "attention_bias": False,
    }
    if get("attention.sliding_window", None) is not None:
        cfg["sliding_window"] = int(get("attention.sliding_window", None))
    for hf, key in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"),
                    ("pad_token_id", "padding_token_id")):
        if f"tokenizer.ggml.{key}" in meta:
            cfg[hf] = meta[f"tokenizer.ggml.{key}"]  # ModelConfig checks the type and range
    if arch == "gemma3":
        _gemma3(cfg, get)
    else:
        _gemma4(cfg, get, kv, ff, sliding, names, tensor_info, rope_freqs)
    return cfg


def _embedding_rows(tensor_info: dict[str, TensorInfo] | None) -> int:
    """The vocabulary size a file without a vocabulary implies: its embedding table's rows."""
    info = (tensor_info or {}).get("token_embd.weight")
    return info.shape[0] if info is not None else 262144


def _gemma3(cfg: dict, get) -> None:
    head_dim = int(get("attention.key_length", cfg["hidden_size"] // cfg["num_attention_heads"]))
    cfg["head_dim"] = head_dim
    # gemma3.cpp: attention scale 1/sqrt(head_dim), except 27B (62 layers): 1/sqrt(n_embd/n_head)
    cfg["query_pre_attn_scalar"] = (cfg["hidden_size"] // cfg["num_attention_heads"]
                                    if cfg["num_hidden_layers"] == 62 else head_dim)
    cfg["attn_logit_softcapping"] = None
    theta = float(get("rope.freq_base", 10000.0))
    local = float(get("rope.freq_base_swa", 10000.0))
    full: dict[str, Any] = {"rope_type": "default", "rope_theta": theta}
    if get("rope.scaling.type", "linear") == "linear" and get("rope.scaling.factor", None):
        full = {"rope_type": "linear", "rope_theta": theta, "factor": float(get("rope.scaling.factor", None))}
    cfg["rope_parameters"] = {"sliding_attention": {"rope_type": "default", "rope_theta": local},
                              "full_attention": full}
    cfg["rope_theta"], cfg["rope_local_base_freq"] = theta, local  # transformers < 5 names
    if full["rope_type"] == "linear":
        cfg["rope_scaling"] = {"rope_type": "linear", "factor": full["factor"]}


def _gemma4(cfg: dict, get, kv, ff, sliding, names, tensor_info, rope_freqs) -> None:
    n = cfg["num_hidden_layers"]
    cfg["head_dim"] = int(get("attention.key_length_swa", get("attention.key_length", 256)))
    cfg["global_head_dim"] = int(get("attention.key_length", cfg["head_dim"]))
    full_layers = [i for i, s in enumerate(sliding) if not s]
    kv_full = kv[full_layers[0]] if full_layers else cfg["num_key_value_heads"]
    if tensor_info:
        cfg["attention_k_eq_v"] = any(f"blk.{i}.attn_k.weight" in names and f"blk.{i}.attn_v.weight" not in names
                                      for i in full_layers)
    else:
        cfg["attention_k_eq_v"] = kv_full != cfg["num_key_value_heads"]
    if kv_full != cfg["num_key_value_heads"]:
        cfg["num_global_key_value_heads"] = kv_full
    cfg["num_kv_shared_layers"] = int(get("attention.shared_kv_layers", 0))
    first_shared = n - cfg["num_kv_shared_layers"]
    cfg["use_double_wide_mlp"] = first_shared < n and ff[-1] == 2 * ff[0] != ff[0]
    cfg["hidden_size_per_layer_input"] = int(get("embedding_length_per_layer_input", 0))
    ple = tensor_info.get("per_layer_token_embd.weight") if tensor_info else None
    cfg["vocab_size_per_layer_input"] = ple.shape[0] if ple is not None else cfg["vocab_size"]
    partial = 0.25
    if rope_freqs is not None:  # Gemma4Model.generate_extra_tensors: [1.0]*n_rot + [1e30]*rest
        partial = 2.0 * int(np.sum(np.asarray(rope_freqs) < 1e29)) / cfg["global_head_dim"]
    cfg["rope_parameters"] = {
        "sliding_attention": {"rope_type": "default", "rope_theta": float(get("rope.freq_base_swa", 10000.0))},
        "full_attention": {"rope_type": "proportional", "partial_rotary_factor": partial,
                           "rope_theta": float(get("rope.freq_base", 1000000.0))},
    }
    n_exp = int(get("expert_count", 0) or 0)
    cfg["enable_moe_block"] = n_exp > 0
    if n_exp:
        cfg["num_experts"] = n_exp
        cfg["top_k_experts"] = int(get("expert_used_count"))
        cfg["moe_intermediate_size"] = int(get("expert_feed_forward_length"))


def load_gguf_parts(path: str | os.PathLike):
    """(ModelConfig, HF-named tensors, Tokenizer, generation defaults) for `gemmalite.loader`.

    Tensors follow the HF convention (norm offset removed, so the engine's ``offset + w`` gives
    back the stored factor); generation stops on llama.cpp's end-of-generation tokens."""
    gf = read_gguf(path)
    cfg = _model_config(gf)
    if "tokenizer.ggml.tokens" not in gf.metadata:  # loads for token-id use, like a folder without tokenizer.json
        return cfg, hf_tensors(gf), None, None
    try:
        info = special_token_info(gf.metadata)
        spm = gf.metadata.get("tokenizer.ggml.model") == "llama"  # built directly, no cache (nor its key)
        tokenizer = tokenizer_from_gguf_metadata(gf.metadata, None if spm else file_cache_key(gf.path), info)
    except TokenizerError as e:
        raise TokenizerError(f"{gf.path}: {e}") from None
    gen = {"eos_token_id": info["eog_token_ids"], "bos_token_id": info["bos_token_id"],
           "pad_token_id": info["pad_token_id"]}
    return cfg, hf_tensors(gf), tokenizer, gen
