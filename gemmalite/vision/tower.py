"""The Gemma 4 vision tower (``gemma4_vision``) and its ``embed_vision`` projection, in numpy.

One image's patches go through in one batch (no padding, so no padding mask):

    h = (2 (pixels - 0.5)) W_in^T + T_x[x] + T_y[y]
    per layer: sandwich-normed bidirectional attention (q/k RMSNorm with scales, v scale-free,
               2-D RoPE: x on the first half of each head, y on the second, scaling 1.0)
               and a gelu-gated MLP; every projection optionally clipped (ClippableLinear)
    pool k x k patches by position, times sqrt(Hv), optionally (h - std_bias) * std_scale
    soft tokens = rms(h) W_proj^T   (scale-free RMSNorm, into the text model's hidden size)

Projections are `Matrix` objects, so int8 / int4 go through the project's quantizer.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np

from ..errors import ConfigError
from ..kernels.ops import apply_rope, attention, gelu_tanh_mul, rms_norm, rope_tables
from ..models.gemma.build import QUANT_KINDS, matrix_factory, table
from ..models.gemma.config import RopeSpec
from ..weights.clipped import CLIP_KEYS, Linear
from ..weights.matrix import Matrix
from ..weights.towers import TowerLayout
from .preprocess import ImagePatches

SUPPORTED_ACTIVATIONS = ("gelu_pytorch_tanh", "gelu_tanh")
# (tower prefix, embedder prefix): Gemma4ForConditionalGeneration, then EmbeddingGemma2Model
PREFIXES = (("model.vision_tower.", "model.embed_vision."), ("vision_tower.", "embed_vision."))
LAYOUT = TowerLayout("vision", PREFIXES, "patch_embedder.input_proj.weight", "vision_config")
ATTN, MLP = ("q_proj", "k_proj", "v_proj", "o_proj"), ("gate_proj", "up_proj", "down_proj")
NORMS = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm")


@dataclass(frozen=True)
class VisionConfig:
    """``vision_config`` of a Gemma 4 / EmbeddingGemma 2 config.json (absent fields: transformers' defaults)."""

    hidden_size: int = 768
    intermediate_size: int = 3072
    num_hidden_layers: int = 16
    num_attention_heads: int = 12
    num_key_value_heads: int = 12
    head_dim: int = 64
    patch_size: int = 16
    pooling_kernel_size: int = 3
    position_embedding_size: int = 10240
    rope_theta: float = 100.0
    rms_norm_eps: float = 1e-6
    use_clipped_linears: bool = False
    standardize: bool = False

    @classmethod
    def from_hf(cls, d: dict) -> "VisionConfig":
        if d.get("model_type", "gemma4_vision") != "gemma4_vision":
            raise ConfigError(f"vision_config.model_type {d.get('model_type')!r} is not gemma4_vision")
        act = d.get("hidden_activation", "gelu_pytorch_tanh")
        if act not in SUPPORTED_ACTIVATIONS:
            raise ConfigError(f"vision_config.hidden_activation {act!r} not supported ({', '.join(SUPPORTED_ACTIVATIONS)})")
        rope = d.get("rope_parameters") or {}
        if rope.get("rope_type", "axial") != "axial":
            raise ConfigError(f"vision_config.rope_parameters.rope_type {rope.get('rope_type')!r} not supported (axial)")
        fields = {k: d[k] for k in cls.__dataclass_fields__ if k in d and d[k] is not None}
        fields.pop("rope_theta", None)
        cfg = cls(**fields, rope_theta=float(rope.get("rope_theta", cls.rope_theta)))
        if cfg.head_dim % 4 or cfg.num_attention_heads % cfg.num_key_value_heads:
            raise ConfigError(f"vision_config: head_dim {cfg.head_dim} must be a multiple of 4 and "
                              f"num_attention_heads {cfg.num_attention_heads} of num_key_value_heads {cfg.num_key_value_heads}")
        return cfg


@dataclass
class VisionLayer:
    norms: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]  # in, post-attn, pre-ff, post-ff
    q: Linear
    k: Linear
    v: Linear
    o: Linear
    q_norm: np.ndarray
    k_norm: np.ndarray
    gate: Linear
    up: Linear
    down: Linear

    def linears(self) -> list[Linear]:
        return [self.q, self.k, self.v, self.o, self.gate, self.up, self.down]


class VisionTower:
    """Patches of one image -> its soft tokens in the text model's hidden size."""

    def __init__(self, cfg: VisionConfig, input_proj: Matrix, pos_x: Matrix, pos_y: Matrix,
                 layers: list[VisionLayer], std: tuple[np.ndarray, np.ndarray] | None, embed: Matrix):
        self.cfg = cfg
        self.input_proj, self.pos_x, self.pos_y = input_proj, pos_x, pos_y
        self.layers = layers
        self.std = std
        self.embed = embed
        self.inv_freq = RopeSpec("default", cfg.rope_theta, cfg.head_dim // 2).inv_freq()

    @property
    def text_hidden_size(self) -> int:
        return self.embed.shape[0]

    def matrices(self) -> list[Matrix]:
        return [self.input_proj, self.embed] + [lin.w for layer in self.layers for lin in layer.linears()]

    def __call__(self, patches: ImagePatches) -> np.ndarray:
        """float32 ``[num_soft_tokens, text_hidden_size]``, in pooled-grid row-major order."""
        return self.project(self.pool(self.encode(patches), patches.grid))

    def encode(self, patches: ImagePatches) -> np.ndarray:
        """The encoder's last hidden states ``[N, Hv]`` (before pooling)."""
        cfg = self.cfg
        pix, pos = patches.pixels, patches.positions
        if pix.ndim != 2 or pix.shape[1] != self.input_proj.shape[1]:
            raise ValueError(f"patches of {pix.shape[1:]} values do not fit this tower ({self.input_proj.shape[1]} per patch)")
        if pos.size and pos.max() >= cfg.position_embedding_size:
            raise ValueError(f"patch position {int(pos.max())} is past the tower's table ({cfg.position_embedding_size})")
        x = self.input_proj.matmul((pix - np.float32(0.5)) * np.float32(2.0))
        x += self.pos_x.rows(pos[:, 0]) + self.pos_y.rows(pos[:, 1])
        cos_x, sin_x = rope_tables(self.inv_freq, pos[:, 0])
        cos_y, sin_y = rope_tables(self.inv_freq, pos[:, 1])
        n = x.shape[0]
        everyone = np.ones(n, np.int64), np.zeros(n, np.int64)  # query pos 1, key pos 0: all keys visible
        nq, kv, D, eps = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.rms_norm_eps

        def rope2d(t: np.ndarray) -> np.ndarray:
            half = D // 2
            return np.concatenate([apply_rope(t[..., :half], cos_x, sin_x), apply_rope(t[..., half:], cos_y, sin_y)], -1)

        for layer in self.layers:
            ln_in, ln_post_attn, ln_pre_ff, ln_post_ff = layer.norms
            h = rms_norm(x, ln_in, eps)
            q = rope2d(rms_norm(layer.q(h).reshape(n, nq, D), layer.q_norm, eps))
            k = rope2d(rms_norm(layer.k(h).reshape(n, kv, D), layer.k_norm, eps))
            v = rms_norm(layer.v(h).reshape(n, kv, D), None, eps)
            # an image's full attention over thousands of patches at a small head size runs ~4x
            # faster in BLAS than in the blocked numba kernel (768x768 image, int8: 3.8 s vs 16 s)
            a = attention(q, k, v, *everyone, None, 1.0, blas=True)
            x = x + rms_norm(layer.o(a), ln_post_attn, eps)
            h = rms_norm(x, ln_pre_ff, eps)
            m = layer.down(gelu_tanh_mul(layer.gate(h), layer.up(h)))
            x = x + rms_norm(m, ln_post_ff, eps)
        return x

    def pool(self, x: np.ndarray, grid: tuple[int, int]) -> np.ndarray:
        """k x k average by position (row-major pooled grid), times sqrt(Hv), standardized."""
        k, hv = self.cfg.pooling_kernel_size, self.cfg.hidden_size
        rows, cols = grid
        if rows % k or cols % k or rows * cols != x.shape[0]:
            raise ValueError(f"a {rows}x{cols} patch grid does not pool by {k} ({x.shape[0]} patches)")
        if k > 1:
            x = x.reshape(rows // k, k, cols // k, k, hv).sum(axis=(1, 3), dtype=np.float32).reshape(-1, hv)
            x *= np.float32(1.0 / (k * k))
        x = x * np.float32(hv**0.5)
        if self.std is not None:
            x = (x - self.std[0]) * self.std[1]
        return x

    def project(self, s: np.ndarray) -> np.ndarray:
        """``embed_vision``: scale-free RMSNorm, then the projection into the text hidden size."""
        return self.embed.matmul(rms_norm(s, None, self.cfg.rms_norm_eps))


# ------------------------------------------------------------------------------------------
# from checkpoint tensors
# ------------------------------------------------------------------------------------------

def vision_prefixes(tensors: Mapping[str, Any]) -> tuple[str, str] | None:
    """(tower, embedder) prefixes of a checkpoint's tensors, or None when it has no vision tower."""
    return LAYOUT.find(tensors)


def vision_tensors(tensors: Mapping[str, Any], config: dict) -> tuple[list[str], list[str]]:
    """Stored names of the tower's tensors: (projections, which quantize; the rest, kept as
    stored). Both empty when the checkpoint has no vision tower."""
    prefixes = vision_prefixes(tensors)
    if prefixes is None or not isinstance(config.get("vision_config"), dict):
        return [], []
    cfg = VisionConfig.from_hf(config["vision_config"])
    shapes = expected_shapes(cfg, 0, *prefixes)
    projections = [n for n, s in shapes.items() if len(s) == 2]
    return projections, [n for n in shapes if n not in projections]


def expected_shapes(cfg: VisionConfig, text_hidden: int, tower: str, embed: str) -> dict[str, tuple[int, ...]]:
    """Every tensor the tower reads, with its shape (the contract a checkpoint must meet)."""
    hv, inter, D = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    nq, kv = cfg.num_attention_heads * D, cfg.num_key_value_heads * D
    shapes = {tower + "patch_embedder.input_proj.weight": (hv, 3 * cfg.patch_size**2),
              tower + "patch_embedder.position_embedding_table": (2, cfg.position_embedding_size, hv),
              embed + "embedding_projection.weight": (text_hidden, hv)}
    if cfg.standardize:
        shapes[tower + "std_bias"] = shapes[tower + "std_scale"] = (hv,)
    proj = {"q_proj": (nq, hv), "k_proj": (kv, hv), "v_proj": (kv, hv), "o_proj": (hv, nq),
            "gate_proj": (inter, hv), "up_proj": (inter, hv), "down_proj": (hv, inter)}
    for i in range(cfg.num_hidden_layers):
        p = f"{tower}encoder.layers.{i}."
        for n in NORMS:
            shapes[p + n + ".weight"] = (hv,)
        shapes[p + "self_attn.q_norm.weight"] = shapes[p + "self_attn.k_norm.weight"] = (D,)
        for name, shape in proj.items():
            base = p + ("self_attn." if name in ATTN else "mlp.") + name
            shapes[base + ".linear.weight"] = shape
            if cfg.use_clipped_linears:
                for c in CLIP_KEYS:
                    shapes[f"{base}.{c}"] = ()
    return shapes


def build_vision_tower(tensors: Mapping[str, Any], config: dict, *, quant: str | None = None) -> VisionTower:
    """The tower of a Gemma 4 ConditionalGeneration or EmbeddingGemma 2 checkpoint.

    ``tensors``: the folder's tensors under their stored names (memory-mapped is fine);
    ``config``: its config.json (``vision_config`` and ``text_config`` are read);
    ``quant``: None (float32 projections), "int8" or "int4"."""
    if quant not in QUANT_KINDS:
        raise ValueError(f"quant must be one of {QUANT_KINDS}, got {quant!r}")
    cfg, tower, embed = LAYOUT.open(tensors, config, VisionConfig.from_hf, expected_shapes)

    mat = matrix_factory(quant)

    def vec(name: str) -> np.ndarray:
        return np.asarray(tensors[name], dtype=np.float32)

    def linear(base: str) -> Linear:
        clip = tuple(float(vec(f"{base}.{c}")) for c in CLIP_KEYS) if cfg.use_clipped_linears else None
        return Linear(mat(tensors[base + ".linear.weight"]), clip)

    layers = []
    for i in range(cfg.num_hidden_layers):
        p = f"{tower}encoder.layers.{i}."
        layers.append(VisionLayer(
            norms=tuple(vec(p + n + ".weight") for n in NORMS),
            **{n[0]: linear(p + "self_attn." + n) for n in ATTN},
            q_norm=vec(p + "self_attn.q_norm.weight"), k_norm=vec(p + "self_attn.k_norm.weight"),
            **{n.split("_")[0]: linear(p + "mlp." + n) for n in MLP},
        ))
    positions = tensors[tower + "patch_embedder.position_embedding_table"]
    std = (vec(tower + "std_bias"), vec(tower + "std_scale")) if cfg.standardize else None
    return VisionTower(cfg, mat(tensors[tower + "patch_embedder.input_proj.weight"]),
                       table(positions[0]), table(positions[1]),
                       layers, std, mat(tensors[embed + "embedding_projection.weight"]))
