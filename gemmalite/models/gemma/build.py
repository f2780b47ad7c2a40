"""Tensors named by the contract -> the decoder graph and the host's tables.

Big tables (token embeddings, which double as the tied LM head, and the PLE table) stay
memory-mapped in their stored dtype; so do bfloat16 / float16 projections (used in place,
converted as they are read), while float32 ones stay float32; ``quant`` makes them int8/int4
(already-quantized ones are used as they are). The loader may then move what every decode step
streams (`GemmaWeights.streamed`) into 2 MiB pages, still in its stored dtype (`weights.pages`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from ...weights.matrix import Matrix, as_matrix
from ...weights.quant import Int4Matrix, Int8Matrix, quantize
from .config import ModelConfig
from .contract import NORMS, PROJECTIONS, expected_shapes
from .graph import DecoderGraph, LayerWeights, PLEWeights

QUANT_KINDS = (None, "int8", "int4")


@dataclass
class GemmaWeights:
    graph: DecoderGraph
    embed: Matrix
    lm_head: Matrix
    ple_table: Matrix | None

    def streamed(self) -> list[Matrix]:
        """The matrices every decode step reads whole: the layers' projections, the PLE
        projection, the LM head (a tied embedding with it; the tables read a row at a time
        are not among them)."""
        out = [m for layer in self.graph.layers for m in layer.matrices()]
        if self.graph.ple is not None:
            out.append(self.graph.ple.projection)
        return out + [self.lm_head]


def matrix_factory(quant: str | None) -> Callable[[Any], Matrix]:
    """How projection weights are held: as stored (half precision in place, anything else as
    float32), or quantized from whatever is stored."""
    if quant is None:
        return lambda t: t if isinstance(t, Matrix) else as_matrix(t, keep_half=True)

    def make(t: Any) -> Matrix:
        if isinstance(t, (Int8Matrix, Int4Matrix)):  # already quantized (converted checkpoint)
            return t
        return quantize(t.dense() if isinstance(t, Matrix) else t, quant)

    return make


def table(t: Any) -> Matrix:
    """A row-addressable table, left as stored (half precision stays half, memory-mapped)."""
    return t if isinstance(t, Matrix) else as_matrix(t, keep_half=True)


def build_weights(cfg: ModelConfig, tensors: dict[str, Any], quant: str | None) -> GemmaWeights:
    if quant not in QUANT_KINDS:
        raise ValueError(f"quant must be one of {QUANT_KINDS}, got {quant!r}")
    mat = matrix_factory(quant)
    expected = expected_shapes(cfg)
    off = np.float32(cfg.norm_offset)

    def norm(name: str) -> np.ndarray:
        return np.asarray(tensors[name], dtype=np.float32) + off

    def vec(name: str) -> np.ndarray:
        return np.asarray(tensors[name], dtype=np.float32)

    layers = []
    for s in cfg.layers:
        p = f"layers.{s.index}."
        a = p + "self_attn."
        # the projections the contract asks of this layer (stale K/V of KV-shared layers are left)
        present = {attr: mat(tensors[n]) for attr, name in PROJECTIONS.items() if (n := p + name + ".weight") in expected}
        w = LayerWeights(*(norm(p + n + ".weight") for n in NORMS), q_norm=norm(a + "q_norm.weight"), **present)
        if s.owns_kv:
            w.k_norm = norm(a + "k_norm.weight")
        if cfg.attention_bias:
            w.bias = {x[0]: vec(a + f"{x}.bias") for x in ("q_proj", "k_proj", "v_proj", "o_proj") if a + f"{x}.bias" in tensors}
        if cfg.ple_dim:
            w.ple_norm = norm(p + "post_per_layer_input_norm.weight")
        if p + "layer_scalar" in tensors:
            w.layer_scalar = np.float32(vec(p + "layer_scalar").reshape(-1)[0])
        layers.append(w)

    ple = None
    if cfg.ple_dim:
        ple = PLEWeights(projection=mat(tensors["per_layer_model_projection.weight"]),
                         norm=norm("per_layer_projection_norm.weight"))
    graph = DecoderGraph(cfg, layers, norm("norm.weight"), ple)
    return GemmaWeights(graph, *host_tables(cfg, tensors, quant))


def host_tables(cfg: ModelConfig, tensors: dict[str, Any], quant: str | None) -> tuple[Matrix, Matrix, Matrix | None]:
    """The host side's tables: token embedding, LM head (the embedding when tied and not
    quantized; an untied head, or the quantized copy a converted checkpoint stores) and the PLE
    token table; the tables no product reads are marked as looked up only."""
    mat = matrix_factory(quant)
    embed = table(tensors["embed_tokens.weight"])
    head = tensors.get("lm_head.weight")
    if head is None:
        lm_head = embed if quant is None else mat(tensors["embed_tokens.weight"])
    else:
        lm_head = table(head) if quant is None else mat(head)
    if lm_head is not embed:  # read a row at a time only (`Matrix.lookup_only`)
        embed.lookup_only()
    ple_table = table(tensors["embed_tokens_per_layer.weight"]).lookup_only() if cfg.ple_dim else None
    return embed, lm_head, ple_table
