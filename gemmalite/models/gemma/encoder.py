"""EmbeddingGemma 2 text encoder, on the decoder's layer code (architecture map §5).

The layer body is the decoder's (`layer_step`): sandwich norms, q/k norms, RoPE, scale-free
v-norm, GELU MLP, the PLE block and ``layer_scalar``. What differs is around it:

* attention is bidirectional, with no KV cache: sliding layers see keys with
  ``|q - k| <= sliding_window`` (an inclusive radius), full layers every key of the sequence;
* PLE is projection-only: ``rms(x0·Wᵀ·H^-½ per layer slice; norm)``, no token table;
* the output is ``rms(h; norm)·W_projᵀ`` per token; the sentence embedding is their mean.

Batches are packed: the tokens of several sequences form one ``[N, H]`` block for every
projection and MLP product, and attention runs per sequence (a block-diagonal mask), so no
padding is ever computed. Positions restart at 0 in each sequence, as in a one-by-one run.

A sequence's vector is bit for bit the same alone, in any batch and on any thread count: every
product computes each row as among any other rows (`Matrix.matmul_alike`: the same kernel
whatever the row count, never BLAS), and attention is the blocked numba kernel for every
sequence (each query row summed by one thread).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from ...errors import ConfigError
from ...kernels.ops import attention_numba, rms_norm, rope_tables
from ...weights.matrix import Matrix
from .config import (FULL, MAX_HEADS, MAX_LAYERS, MAX_POSITIONS, MAX_VOCAB, MAX_WIDTH, SLIDING, SUPPORTED_ACTIVATIONS,
                     LayerSpec, ModelConfig, _bool, _float, _int, _layer_types, _overrides, layer_geometry)
from .contract import expected_shapes
from .graph import ALIKE, LayerWeights, PLEWeights, layer_step

ENCODER_TYPES = ("embedding_gemma2", "embedding_gemma2_text")
DEFAULT_ROPE = {SLIDING: {"rope_type": "default", "rope_theta": 10_000.0},
                FULL: {"rope_type": "default", "rope_theta": 1_000_000.0}}


@dataclass
class EncoderConfig(ModelConfig):
    """A `ModelConfig` (so the shared layer code reads it unchanged) plus the output size."""

    embedding_dim: int = 768

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> "EncoderConfig":
        """``embedding_gemma2`` (text part in ``text_config``) or ``embedding_gemma2_text``."""
        model_type = cfg.get("model_type", "")
        if model_type not in ENCODER_TYPES:
            raise ConfigError(f"model_type {model_type or '(missing)'!r} is not an EmbeddingGemma 2 encoder "
                              f"({', '.join(ENCODER_TYPES)})")
        text = cfg.get("text_config") if model_type == "embedding_gemma2" else cfg
        if not isinstance(text, dict):
            raise ConfigError("embedding_gemma2 config has no text_config")
        if text.get("model_type", "embedding_gemma2_text") != "embedding_gemma2_text":
            raise ConfigError(f"text_config.model_type {text.get('model_type')!r} is not embedding_gemma2_text")
        return _parse_encoder(text)


def is_encoder_config(raw: dict) -> bool:
    return isinstance(raw, dict) and raw.get("model_type") in ENCODER_TYPES


def _parse_encoder(text: dict) -> EncoderConfig:
    act = text.get("hidden_activation", "gelu_pytorch_tanh")
    if act not in SUPPORTED_ACTIVATIONS:
        raise ConfigError(f"unsupported hidden_activation {act!r}")
    n = _int(text, "num_hidden_layers", 1, MAX_LAYERS)
    hidden = _int(text, "hidden_size", 1, MAX_WIDTH)
    nq = _int(text, "num_attention_heads", 1, MAX_HEADS)
    vocab = _int(text, "vocab_size", 1, MAX_VOCAB)
    head_dim = _int(text, "head_dim", 2, 8192, None) or hidden // nq
    kv_heads = _int(text, "num_key_value_heads", 1, nq, None) or nq
    inter = _int(text, "intermediate_size", 1, MAX_WIDTH * 8)
    ple = _int(text, "hidden_size_per_layer_input", 0, MAX_WIDTH, 0)
    if ple <= 0:
        raise ConfigError("hidden_size_per_layer_input must be positive (EmbeddingGemma 2 always has PLE)")
    window = _int(text, "sliding_window", 1, MAX_POSITIONS, None) or 512
    types = _layer_types(text, n, "gemma4")  # the last layer is forced full, as transformers does
    rope = text.get("rope_parameters") or DEFAULT_ROPE
    if not isinstance(rope, dict):
        raise ConfigError("config field 'rope_parameters' must be an object")
    # per_layer_config as saved by transformers, else the builder keys; for EmbeddingGemma 2 the
    # KV-head override applies to full layers unconditionally (default 1), unlike Gemma 4.
    if text.get("per_layer_config") is not None:
        overrides = _overrides(text, types, False, nq)
    else:
        o = {"head_dim": _int(text, "global_head_dim", 2, 8192, 512),
             "num_key_value_heads": _int(text, "num_global_key_value_heads", 1, nq, 1)}
        overrides = {i: o for i, t in enumerate(types) if t == FULL}
    layers = []
    for i in range(n):
        d, kv, rope_spec = layer_geometry(i, overrides.get(i, {}), head_dim, kv_heads, nq, rope, types[i])
        layers.append(LayerSpec(index=i, layer_type=types[i], head_dim=d, num_kv_heads=kv, intermediate_size=inter,
                                kv_source=i, k_eq_v=False, rope=rope_spec))
    eos = text.get("eos_token_id", 1)
    return EncoderConfig(
        family="embedding_gemma2",
        hidden_size=hidden,
        num_hidden_layers=n,
        num_attention_heads=nq,
        vocab_size=vocab,
        rms_norm_eps=_float(text, "rms_norm_eps", 0, 1, 1e-6),
        sliding_window=window,
        max_position_embeddings=_int(text, "max_position_embeddings", 1, MAX_POSITIONS, None) or 262144,
        attn_scale=1.0,
        norm_offset=0.0,
        v_norm=True,
        final_logit_softcapping=None,
        tie_word_embeddings=True,  # no LM head: nothing is read or written for one
        attention_bias=_bool(text, "attention_bias", False),
        ple_dim=ple,
        ple_vocab=0,
        bos_token_id=text.get("bos_token_id", 2),
        eos_token_ids=[int(e) for e in (eos if isinstance(eos, list) else [eos]) if e is not None],
        pad_token_id=text.get("pad_token_id", 0),
        layers=layers,
        raw=text,
        embedding_dim=_int(text, "embedding_dim", 1, MAX_WIDTH, None) or 768,
    )


def encoder_shapes(cfg: EncoderConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor the encoder reads (names relative to the text prefix), with its shape: the
    decoder's layer contract without its PLE table, plus the encoder's PLE and output tensors."""
    H, L, P = cfg.hidden_size, cfg.num_hidden_layers, cfg.ple_dim
    shapes = expected_shapes(replace(cfg, ple_dim=0))
    shapes["ple.per_layer_model_projection.weight"] = (L * P, H)
    shapes["ple.per_layer_projection_norm.weight"] = (P,)
    shapes["embedding_projection.weight"] = (cfg.embedding_dim, H)
    for i in range(L):
        p = f"layers.{i}."
        shapes[p + "ple_block.per_layer_input_gate.weight"] = (P, H)
        shapes[p + "ple_block.per_layer_projection.weight"] = (H, P)
        shapes[p + "ple_block.post_per_layer_input_norm.weight"] = (H,)
        shapes[p + "layer_scalar"] = (1,)
    return shapes


class EncoderGraph:
    """Token ids in, mean-pooled (not yet normalised) sentence embeddings out."""

    def __init__(self, cfg: EncoderConfig, embed: Matrix, layers: list[LayerWeights], final_norm: np.ndarray,
                 ple: PLEWeights, projection: Matrix):
        self.cfg = cfg
        self.embed = embed
        self.layers = layers
        self.final_norm = final_norm
        self.ple = ple
        self.projection = projection
        self._inv_freq = {s.rope: s.rope.inv_freq() for s in cfg.layers}

    def encode(self, sequences: list[np.ndarray],
               soft: list[tuple[np.ndarray, np.ndarray] | None] | None = None) -> np.ndarray:
        """Mean over each sequence's tokens of ``rms(h; norm)·W_projᵀ``: float32 ``[n, embedding_dim]``.
        ``soft[i]``: (rows, vectors) whose input embeddings replace sequence i's token embeddings
        at those rows (image soft tokens, already in the hidden size, not scaled)."""
        lengths = np.array([len(s) for s in sequences], dtype=np.int64)
        bounds = np.concatenate([[0], np.cumsum(lengths)])
        ids = np.concatenate([np.asarray(s, dtype=np.int64) for s in sequences])
        parts = [(rv[0] + b, rv[1]) for rv, b in zip(soft or (), bounds[:-1]) if rv is not None and len(rv[0])]
        rows = (np.concatenate([r for r, _ in parts]), np.concatenate([v for _, v in parts])) if parts else None
        h = self.hidden(ids, bounds, rows)
        # the projection is linear and per token: project the mean instead of every token
        sums = np.add.reduceat(h.astype(np.float64), bounds[:-1], axis=0)
        mean = (sums / lengths[:, None]).astype(np.float32)
        return self.projection.matmul_alike(mean)

    def hidden(self, ids: np.ndarray, bounds: np.ndarray,
               soft: tuple[np.ndarray, np.ndarray] | None = None) -> np.ndarray:
        """Final-normed hidden states ``[N, H]`` of packed sequences (``bounds``: their starts + total);
        ``soft``: (packed rows, vectors) replacing those rows' input embeddings."""
        x0, pos = self.inputs(ids, bounds, soft)
        return self.run(x0, pos, bounds)

    def inputs(self, ids: np.ndarray, bounds: np.ndarray,
               soft: tuple[np.ndarray, np.ndarray] | None = None) -> tuple[np.ndarray, np.ndarray]:
        """The host's part: scaled input embeddings ``[N, H]`` (``soft`` rows replaced) and each row's position."""
        cfg = self.cfg
        pos = np.concatenate([np.arange(b - a, dtype=np.int64) for a, b in zip(bounds[:-1], bounds[1:])])
        if soft is not None:  # the placeholder ids may lie outside the vocabulary: look up padding instead
            ids = ids.copy()
            ids[soft[0]] = cfg.pad_token_id or 0
        h = self.embed.rows(ids) * cfg.embed_scale
        if soft is not None:
            h[soft[0]] = soft[1]
        return h, pos

    def run(self, h: np.ndarray, pos: np.ndarray, bounds: np.ndarray) -> np.ndarray:
        """The layers and the final norm on packed input embeddings (what another backend takes over)."""
        cfg = self.cfg
        ple = self._ple(h)  # from the merged input embeddings, as the reference computes it
        ropes = {r: rope_tables(f, pos) for r, f in self._inv_freq.items()}
        segments = list(zip(bounds[:-1].tolist(), bounds[1:].tolist()))
        for spec, w in zip(cfg.layers, self.layers):
            window = cfg.sliding_window if spec.sliding else None

            def attend(q, k, v, window=window):
                if len(segments) == 1:
                    return self._attend(q, k, v, pos, window)
                out = np.empty((q.shape[0], q.shape[1] * q.shape[2]), np.float32)
                for a, b in segments:
                    out[a:b] = self._attend(q[a:b], k[a:b], v[a:b], pos[a:b], window)
                return out

            h = layer_step(cfg, spec, w, h, ple[:, spec.index, :], ropes[spec.rope], attend, ALIKE)
        return rms_norm(h, self.final_norm, cfg.rms_norm_eps)

    def _attend(self, q, k, v, pos, window):
        """One sequence's attention, the same kernel whatever its length or the thread count (not
        `ops.attention`'s few-row kernels, which split a row's keys over the threads)."""
        if window is not None and window >= len(pos) - 1:
            window = None  # the radius covers the whole sequence: no mask to apply
        return attention_numba(q, k, v, pos, pos, window, self.cfg.attn_scale, causal=False)

    def _ple(self, x0: np.ndarray) -> np.ndarray:
        """Projection-only PLE ``[N, L, P]``: the per-layer signal from the input embeddings alone."""
        cfg, n = self.cfg, x0.shape[0]
        ctx = self.ple.projection.matmul_alike(x0) * np.float32(cfg.hidden_size**-0.5)
        return rms_norm(ctx.reshape(n, cfg.num_hidden_layers, cfg.ple_dim), self.ple.norm, cfg.rms_norm_eps)


def build_encoder(cfg: EncoderConfig, tensors: dict[str, Any], mat, table) -> EncoderGraph:
    """The graph from checked tensors: ``mat`` makes projection matrices (float32 / int8 / int4),
    ``table`` the memory-mapped embedding table."""
    def vec(name: str) -> np.ndarray:
        return np.asarray(tensors[name], dtype=np.float32)

    layers = []
    for s in cfg.layers:
        p = f"layers.{s.index}."
        a = p + "self_attn."
        w = LayerWeights(
            ln_in=vec(p + "input_layernorm.weight"),
            ln_post_attn=vec(p + "post_attention_layernorm.weight"),
            ln_pre_ff=vec(p + "pre_feedforward_layernorm.weight"),
            ln_post_ff=vec(p + "post_feedforward_layernorm.weight"),
            q=mat(tensors[a + "q_proj.weight"]), q_norm=vec(a + "q_norm.weight"),
            k=mat(tensors[a + "k_proj.weight"]), k_norm=vec(a + "k_norm.weight"),
            v=mat(tensors[a + "v_proj.weight"]),
            o=mat(tensors[a + "o_proj.weight"]),
            gate=mat(tensors[p + "mlp.gate_proj.weight"]),
            up=mat(tensors[p + "mlp.up_proj.weight"]),
            down=mat(tensors[p + "mlp.down_proj.weight"]),
            ple_gate=mat(tensors[p + "ple_block.per_layer_input_gate.weight"]),
            ple_proj=mat(tensors[p + "ple_block.per_layer_projection.weight"]),
            ple_norm=vec(p + "ple_block.post_per_layer_input_norm.weight"),
            layer_scalar=np.float32(vec(p + "layer_scalar").reshape(-1)[0]),
        )
        if cfg.attention_bias:
            w.bias = {x[0]: vec(a + f"{x}.bias") for x in ("q_proj", "k_proj", "v_proj", "o_proj")
                      if a + f"{x}.bias" in tensors}
        layers.append(w)
    ple = PLEWeights(projection=mat(tensors["ple.per_layer_model_projection.weight"]),
                     norm=vec("ple.per_layer_projection_norm.weight"))
    return EncoderGraph(cfg, table(tensors["embed_tokens.weight"]).lookup_only(), layers, vec("norm.weight"), ple,
                        mat(tensors["embedding_projection.weight"]))
