"""The Gemma 4 audio tower (``gemma4_audio``, a USM-style conformer) and ``embed_audio``, in numpy.

Per clip (one 30 s window at most, its valid feature frames only; see `AudioTower.encode`):

    subsampling: twice Conv2d(3x3, stride 2, pad 1) -> channel LayerNorm -> ReLU over
                 (time, mel); the [T/4, 32 mel, c1] grid flattened mel-major -> input_proj_linear
    per layer:   x = x + w_res * post(ffw2(silu(ffw1(pre(x)))))       feed_forward1
                 x = x + norm_post_attn(attention(norm_pre_attn(x)))
                 x = x + linear_end(silu(conv_norm(dwconv(glu(linear_start(pre(x)))))))
                 x = x + w_res * post(ffw2(silu(ffw1(pre(x)))))       feed_forward2
                 x = norm_out(x)
    output_proj (with bias), then embed_audio: scale-free RMSNorm, projection to the text width

The attention is transformers' chunked local attention (blocks of ``attention_chunk_size``
queries over windows of context): its mask leaves each query itself and the
``attention_context_left - 2`` keys before it (self + 11 past keys for the published 12 / 13 / 0),
so it is computed here as that band directly. Scores are ``q.k + q.R[distance]`` with
``q`` scaled by ``softplus(per_dim_scale) / (sqrt(D) ln 2)``, ``k`` by ``ln(1 + e) / ln 2``
and ``R`` = relative_k_proj over the sinusoid of each distance (position-only: computed once at
load, in float64), then ``cap * tanh(s / cap)`` and a softmax. The ``gradient_clipping`` clamps
are kept (no-ops at the published 1e10). Projections are `Matrix` objects (int8 / int4 through
the project's quantizer), each ClippableLinear clipped where the checkpoint carries bounds.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np

from ..errors import AudioError, ConfigError
from ..kernels.numba_ops import (banded_attention, clip_silu_clip, conv3x3s2_norm_relu, glu_causal_conv,
                                 norm_stage)
from ..kernels.ops import rms_norm
from ..models.gemma.build import QUANT_KINDS, matrix_factory
from ..weights.clipped import CLIP_KEYS, NO_BOUNDS, Linear
from ..weights.matrix import Matrix
from ..weights.towers import TowerLayout
from .features import MEL_BINS, log_mel, windows

# (tower prefix, embedder prefix): Gemma4ForConditionalGeneration, then EmbeddingGemma2Model
PREFIXES = (("model.audio_tower.", "model.embed_audio."), ("audio_tower.", "embed_audio."))
PROBE = "subsample_conv_projection.input_proj_linear.weight"
LAYOUT = TowerLayout("audio", PREFIXES, PROBE, "audio_config")
FFN_NORMS = ("pre_layer_norm", "post_layer_norm")
LAYER_NORMS = ("norm_pre_attn", "norm_post_attn", "norm_out")
ATTN = ("q_proj", "k_proj", "v_proj", "post")
DEFAULT_EPS = 1e-6  # Gemma4RMSNorm's default: the feed-forward and layer norms do not take the config's


@dataclass(frozen=True)
class AudioConfig:
    """``audio_config`` of a Gemma 4 / EmbeddingGemma 2 config.json (absent fields: transformers'
    defaults, which are the published tower's)."""

    hidden_size: int = 1024
    num_hidden_layers: int = 12
    num_attention_heads: int = 8
    subsampling_conv_channels: tuple[int, int] = (128, 32)
    conv_kernel_size: int = 5
    residual_weight: float = 0.5
    attention_chunk_size: int = 12
    attention_context_left: int = 13
    attention_context_right: int = 0
    attention_logit_cap: float = 50.0
    attention_invalid_logits_value: float = -1e9
    use_clipped_linears: bool = True
    rms_norm_eps: float = 1e-6
    gradient_clipping: float = 1e10
    output_proj_dims: int = 1536

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def band(self) -> int:
        """Keys each query sees: itself and the ``band - 1`` before it."""
        return self.attention_context_left - 1

    @property
    def relative_positions(self) -> int:
        """Rows of the relative-position table (distances 0 ..): transformers' context_size // 2 + 1."""
        return (self.attention_chunk_size + self.attention_context_left - 1 + self.attention_context_right) // 2 + 1

    @classmethod
    def from_hf(cls, d: dict) -> "AudioConfig":
        if d.get("model_type", "gemma4_audio") != "gemma4_audio":
            raise ConfigError(f"audio_config.model_type {d.get('model_type')!r} is not gemma4_audio")
        if d.get("hidden_act", "silu") != "silu":
            raise ConfigError(f"audio_config.hidden_act {d.get('hidden_act')!r} not supported (silu)")
        fields = {k: d[k] for k in cls.__dataclass_fields__ if k in d and d[k] is not None}
        if "subsampling_conv_channels" in fields:
            fields["subsampling_conv_channels"] = tuple(fields["subsampling_conv_channels"])
        cfg = cls(**fields)
        ch = cfg.subsampling_conv_channels
        if len(ch) != 2 or ch[0] != MEL_BINS:
            # transformers sizes input_proj_linear (c0 / 4) * c1, the flattened grid is (128 / 4) * c1
            raise ConfigError(f"audio_config.subsampling_conv_channels {list(ch)}: two layers, the first "
                              f"{MEL_BINS} wide (the input projection's width assumes {MEL_BINS} mel bins)")
        if cfg.hidden_size % cfg.num_attention_heads:
            raise ConfigError(f"audio_config: hidden_size {cfg.hidden_size} is not a multiple of "
                              f"num_attention_heads {cfg.num_attention_heads}")
        # the band (self + context_left - 2 past keys) is what transformers' chunked mask leaves,
        # with relative distances that line up, only for these shapes (the published 12 / 13 / 0)
        if (cfg.attention_context_right != 0 or cfg.band < 1 or cfg.band > cfg.attention_chunk_size + 1
                or cfg.relative_positions != cfg.attention_context_left):
            raise ConfigError(
                f"audio_config: attention_chunk_size {cfg.attention_chunk_size} / attention_context_left "
                f"{cfg.attention_context_left} / attention_context_right {cfg.attention_context_right} not "
                "supported (right context 0, chunk size context_left - 1 or context_left)")
        if not cfg.attention_logit_cap > 0 or cfg.conv_kernel_size < 1:
            raise ConfigError("audio_config: attention_logit_cap must be positive and conv_kernel_size at least 1")
        return cfg


@dataclass
class FeedForward:
    norms: tuple[np.ndarray, np.ndarray]  # pre, post
    up: Linear  # ffw_layer_1
    down: Linear  # ffw_layer_2


@dataclass
class AudioLayer:
    ff1: FeedForward
    ff2: FeedForward
    norms: tuple[np.ndarray, np.ndarray, np.ndarray]  # pre-attn, post-attn, out
    q: Linear
    k: Linear
    v: Linear
    post: Linear
    q_scale: np.ndarray  # [D]: softplus(per_dim_scale) / (sqrt(D) ln 2)
    relative: np.ndarray  # [distances, heads, D]: relative_k_proj over each distance's sinusoid
    conv_norms: tuple[np.ndarray, np.ndarray]  # lconv1d pre_layer_norm, conv_norm
    conv_start: Linear
    conv_end: Linear
    conv_weight: np.ndarray  # [kernel, H]: depthwise taps, oldest first

    def linears(self) -> list[Linear]:
        return [self.ff1.up, self.ff1.down, self.q, self.k, self.v, self.post, self.conv_start, self.conv_end,
                self.ff2.up, self.ff2.down]


def _subsample(x: np.ndarray, w: np.ndarray, ln_w: np.ndarray, eps: float) -> np.ndarray:
    """Conv2d(3x3, stride 2, padding 1, no bias) over ``x [T, F, C_in]`` with ``w [C_out, C_in, 3,
    3]``, then relu(LayerNorm over the channels): ``[ceil(T/2), ceil(F/2), C_out]``
    (`numba_ops.conv3x3s2_norm_relu`, reading ``x`` where it lies)."""
    t, f, _ = x.shape
    out = np.empty(((t - 1) // 2 + 1, (f - 1) // 2 + 1, w.shape[0]), np.float32)
    conv3x3s2_norm_relu(np.ascontiguousarray(x, dtype=np.float32), np.ascontiguousarray(w.transpose(2, 3, 0, 1)),
                        ln_w, float(eps), out)
    return out


def sinusoids(positions: int, hidden: int) -> np.ndarray:
    """float64 ``[positions, hidden]``: ``[sin(d tau), cos(d tau)]`` for distance d = 0 .. positions-1
    (Gemma4AudioRelPositionalEncoding, whose rows run from the farthest distance to 0)."""
    half = hidden // 2
    inv = np.exp(np.arange(half) * -(math.log(1e4) / max(half - 1, 1)))
    t = np.arange(positions)[:, None] * inv[None, :]
    return np.concatenate([np.sin(t), np.cos(t)], -1)


class AudioTower:
    """Audio -> its soft tokens in the text model's hidden size (what Gemma4Model merges at the
    ``<|audio|>`` placeholders, and EmbeddingGemma 2 at its audio tokens)."""

    def __init__(self, cfg: AudioConfig, conv: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray],
                 input_proj: Matrix, layers: list[AudioLayer], output_proj: Matrix, output_bias: np.ndarray,
                 embed: Matrix):
        self.cfg = cfg
        self.conv = conv  # layer0 weight, layer0 norm, layer1 weight, layer1 norm
        self.input_proj = input_proj
        self.layers = layers
        self.output_proj, self.output_bias = output_proj, output_bias
        self.embed = embed

    @property
    def text_hidden_size(self) -> int:
        return self.embed.shape[0]

    def matrices(self) -> list[Matrix]:
        return ([self.input_proj, self.output_proj, self.embed]
                + [lin.w for layer in self.layers for lin in layer.linears()])

    def encode(self, audio: np.ndarray | tuple[np.ndarray, int]) -> np.ndarray:
        """float32 ``[N, text_hidden_size]``: the clip's soft tokens (N = `soft_token_count`).

        ``audio``: float32 mono samples at 16 kHz (as `load_audio` returns them), or one window's
        ``(features, valid_frames)`` as `log_mel` returns them. Samples are cut into consecutive
        30 s windows (transformers truncates a clip at 30 s; llama.cpp windows it too), each
        encoded exactly as the reference encodes a clip of that length, and the tokens
        concatenated; a window of 160 samples or fewer gives no tokens."""
        if isinstance(audio, tuple):
            feats, valid = np.asarray(audio[0]), audio[1]
            if feats.ndim != 2 or feats.shape[1] != MEL_BINS or feats.dtype.kind != "f":
                raise AudioError(f"features must be float [frames, {MEL_BINS}], got {feats.dtype} {feats.shape}")
            if not 0 <= int(valid) <= feats.shape[0] or not np.isfinite(feats[:int(valid)]).all():
                raise AudioError(f"features: {valid} valid frames of {feats.shape[0]}, or non-finite values")
            return self.project(self.forward(feats[:int(valid)].astype(np.float32)))
        x = np.asarray(audio)
        if x.ndim != 1:
            raise AudioError(f"encode takes 1-D samples or (features, valid_frames), got shape {x.shape}")
        parts = []
        for a, b in windows(x.shape[0]):
            feats, valid = log_mel(x[a:b])
            parts.append(self.project(self.forward(feats[:valid])))
        return np.concatenate(parts) if parts else np.zeros((0, self.text_hidden_size), np.float32)

    def forward(self, feats: np.ndarray) -> np.ndarray:
        """The tower's last hidden states after output_proj, ``[ceil(frames / 4), output_proj_dims]``,
        for ``feats [frames, 128]``: valid frames only (no padding in the batch, so no mask)."""
        cfg = self.cfg
        if feats.ndim != 2 or feats.shape[1] != MEL_BINS:
            raise ValueError(f"features must be [frames, {MEL_BINS}], got {feats.shape}")
        if feats.shape[0] == 0:
            return np.zeros((0, cfg.output_proj_dims), np.float32)
        w0, n0, w1, n1 = self.conv
        eps = cfg.rms_norm_eps
        h = _subsample(_subsample(feats[:, :, None], w0, n0, eps), w1, n1, eps)
        x = self.input_proj.matmul(h.reshape(h.shape[0], -1))
        g = np.float32(min(cfg.gradient_clipping, float(np.finfo(np.float32).max)))
        for layer in self.layers:
            x = self._feed_forward(layer.ff1, x, g)
            h = _norm(x, (-g, g), layer.norms[0], DEFAULT_EPS)
            post = layer.post
            a = post.w.matmul(self._attention(layer, h))
            x = _norm(a, _then_clamp(post.out_bounds, g), layer.norms[1], DEFAULT_EPS, res=x, out=a)
            x = self._light_conv(layer, x, g)
            x = self._feed_forward(layer.ff2, x, g)
            x = _norm(x, (-g, g), layer.norms[2], DEFAULT_EPS, out=x)
        return self.output_proj.matmul(x) + self.output_bias

    def project(self, s: np.ndarray) -> np.ndarray:
        """``embed_audio``: scale-free RMSNorm, then the projection into the text hidden size."""
        if s.shape[0] == 0:
            return np.zeros((0, self.text_hidden_size), np.float32)
        return self.embed.matmul(rms_norm(s, None, self.cfg.rms_norm_eps))

    def _feed_forward(self, ff: FeedForward, x: np.ndarray, g: np.float32) -> np.ndarray:
        """``x + w_res * post(clamp(down(silu(up(pre(clamp(x)))))))``, the clipped linears' bounds
        and the clamps folded into the stages around the two products."""
        up, down = ff.up, ff.down
        y = up.w.matmul(_norm(x, (-g, g), ff.norms[0], DEFAULT_EPS, up.in_bounds))
        clip_silu_clip(y, *up.out_bounds, *down.in_bounds)
        h = down.w.matmul(y)
        return _norm(h, _then_clamp(down.out_bounds, g), ff.norms[1], DEFAULT_EPS,
                     scale=self.cfg.residual_weight, res=x, out=h)

    def _attention(self, layer: AudioLayer, h: np.ndarray) -> np.ndarray:
        """The heads' outputs ``[T, H]``, clipped to ``post``'s input bounds."""
        cfg = self.cfg
        t, nh, d, band = h.shape[0], cfg.num_attention_heads, cfg.head_dim, cfg.band
        k_scale = np.float32(math.log(1 + math.e) / math.log(2))
        q = layer.q(h).reshape(t, nh, d) * layer.q_scale
        k = layer.k(h).reshape(t, nh, d) * k_scale
        v = layer.v(h).reshape(t, nh, d)
        out = np.empty((t, nh, d), np.float32)
        banded_attention(np.ascontiguousarray(q), np.ascontiguousarray(k), v, layer.relative, band,
                         np.float32(cfg.attention_logit_cap), np.float32(cfg.attention_invalid_logits_value), out)
        out = out.reshape(t, nh * d)  # post's input, clipped (its product and output clip: the caller's)
        lo, hi = layer.post.in_bounds
        return np.clip(out, lo, hi, out=out) if layer.post.clip is not None else out

    def _light_conv(self, layer: AudioLayer, x: np.ndarray, g: np.float32) -> np.ndarray:
        eps, start, end = self.cfg.rms_norm_eps, layer.conv_start, layer.conv_end
        h = start.w.matmul(_norm(x, NO_BOUNDS, layer.conv_norms[0], eps, start.in_bounds))
        c = np.empty((h.shape[0], self.cfg.hidden_size), np.float32)
        glu_causal_conv(h, *start.out_bounds, layer.conv_weight, c)  # clip, GLU, causal depthwise taps
        y = end.w.matmul(_norm(c, (-g, g), layer.conv_norms[1], eps, end.in_bounds, silu=True, out=c))
        if end.clip is not None:
            np.clip(y, *end.out_bounds, out=y)
        y += x  # x + the update: the same sum
        return y


_NO_WEIGHT = np.zeros(0, np.float32)
_NO_RES = np.zeros((0, 0), np.float32)


def _then_clamp(bounds: tuple[np.float32, np.float32], g: np.float32) -> tuple[np.float32, np.float32]:
    """One clip equal to ``clip(clip(y, *bounds), -g, g)`` (each bound clamped to [-g, g])."""
    return tuple(np.float32(min(max(b, -g), g)) for b in bounds)


def _norm(x: np.ndarray, pre: tuple, w: np.ndarray | None, eps: float, post: tuple = NO_BOUNDS, *,
          silu: bool = False, scale: float = 1.0, res: np.ndarray | None = None,
          out: np.ndarray | None = None) -> np.ndarray:
    """``clip(silu?(rms_norm(clip(x, *pre), w)), *post) * scale + res`` in one pass over the rows
    (`numba_ops.norm_stage`), into ``out`` (default: a new array; ``x`` itself is fine)."""
    out = np.empty_like(x) if out is None else out
    norm_stage(x, *pre, _NO_WEIGHT if w is None else w, float(eps), silu, *post, np.float32(scale),
               _NO_RES if res is None else res, out)
    return out


# ------------------------------------------------------------------------------------------
# from checkpoint tensors
# ------------------------------------------------------------------------------------------

def audio_prefixes(tensors: Mapping[str, Any]) -> tuple[str, str] | None:
    """(tower, embedder) prefixes of a checkpoint's tensors, or None when it has no audio tower."""
    return LAYOUT.find(tensors)


def expected_shapes(cfg: AudioConfig, text_hidden: int, tower: str, embed: str) -> dict[str, tuple[int, ...]]:
    """Every tensor the tower reads, with its shape (the contract a checkpoint must meet; the
    names transformers saves)."""
    H, (c0, c1) = cfg.hidden_size, cfg.subsampling_conv_channels

    def lin(base: str, out: int, inp: int) -> dict[str, tuple[int, ...]]:
        d = {f"{base}.linear.weight": (out, inp)}
        if cfg.use_clipped_linears:
            d.update({f"{base}.{k}": () for k in CLIP_KEYS})
        return d

    sub = tower + "subsample_conv_projection."
    shapes = {sub + "layer0.conv.weight": (c0, 1, 3, 3), sub + "layer0.norm.weight": (c0,),
              sub + "layer1.conv.weight": (c1, c0, 3, 3), sub + "layer1.norm.weight": (c1,),
              sub + "input_proj_linear.weight": (H, (c0 // 4) * c1)}
    for i in range(cfg.num_hidden_layers):
        p = f"{tower}layers.{i}."
        for ff in ("feed_forward1", "feed_forward2"):
            shapes |= lin(p + ff + ".ffw_layer_1", 4 * H, H) | lin(p + ff + ".ffw_layer_2", H, 4 * H)
            for n in FFN_NORMS:
                shapes[f"{p}{ff}.{n}.weight"] = (H,)
        shapes[p + "self_attn.per_dim_scale"] = (cfg.head_dim,)
        for n in ATTN:
            shapes |= lin(p + "self_attn." + n, H, H)
        shapes[p + "self_attn.relative_k_proj.weight"] = (H, H)
        shapes |= lin(p + "lconv1d.linear_start", 2 * H, H) | lin(p + "lconv1d.linear_end", H, H)
        shapes[p + "lconv1d.depthwise_conv1d.weight"] = (H, 1, cfg.conv_kernel_size)
        for n in ("lconv1d.pre_layer_norm", "lconv1d.conv_norm") + LAYER_NORMS:
            shapes[p + n + ".weight"] = (H,)
    shapes[tower + "output_proj.weight"] = (cfg.output_proj_dims, H)
    shapes[tower + "output_proj.bias"] = (cfg.output_proj_dims,)
    shapes[embed + "embedding_projection.weight"] = (text_hidden, cfg.output_proj_dims)
    return shapes


def _projection(name: str) -> bool:
    """Held as a `Matrix` (quantizes): every linear but relative_k_proj, which is used once, at load."""
    return name.endswith(".linear.weight") or name.endswith(("input_proj_linear.weight", "output_proj.weight",
                                                              "embedding_projection.weight"))


def audio_tensors(tensors: Mapping[str, Any], config: dict) -> tuple[list[str], list[str]]:
    """Stored names of the tower's tensors: (projections, which quantize; the rest, kept as
    stored). Both empty when the checkpoint has no audio tower."""
    prefixes = audio_prefixes(tensors)
    if prefixes is None or not isinstance(config.get("audio_config"), dict):
        return [], []
    shapes = expected_shapes(AudioConfig.from_hf(config["audio_config"]), 0, *prefixes)
    projections = [n for n in shapes if _projection(n)]
    return projections, [n for n in shapes if n not in projections]


def build_audio_tower(tensors: Mapping[str, Any], config: dict, *, quant: str | None = None) -> AudioTower:
    """The audio tower of a Gemma 4 ConditionalGeneration or EmbeddingGemma 2 checkpoint.

    ``tensors``: the folder's tensors under their stored names (memory-mapped is fine);
    ``config``: its config.json (``audio_config`` and ``text_config`` are read);
    ``quant``: None (projections as stored), "int8" or "int4"."""
    if quant not in QUANT_KINDS:
        raise ValueError(f"quant must be one of {QUANT_KINDS}, got {quant!r}")
    cfg, tower, embed = LAYOUT.open(tensors, config, AudioConfig.from_hf, expected_shapes)

    mat = matrix_factory(quant)
    H, nh, D = cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim

    def vec(name: str, dtype=np.float32) -> np.ndarray:
        t = tensors[name]
        return np.asarray(t.dense() if isinstance(t, Matrix) else t, dtype=dtype)

    def linear(base: str) -> Linear:
        clip = tuple(float(vec(f"{base}.{c}")) for c in CLIP_KEYS) if cfg.use_clipped_linears else None
        return Linear(mat(tensors[base + ".linear.weight"]), clip)

    def ffn(p: str) -> FeedForward:
        return FeedForward(tuple(vec(f"{p}.{n}.weight") for n in FFN_NORMS), linear(p + ".ffw_layer_1"),
                           linear(p + ".ffw_layer_2"))

    pos = sinusoids(cfg.relative_positions, H)
    layers = []
    for i in range(cfg.num_hidden_layers):
        p = f"{tower}layers.{i}."
        a = p + "self_attn."
        per_dim = vec(a + "per_dim_scale", np.float64)
        softplus = np.logaddexp(0.0, per_dim)
        relative = pos @ vec(a + "relative_k_proj.weight", np.float64).T
        layers.append(AudioLayer(
            ff1=ffn(p + "feed_forward1"), ff2=ffn(p + "feed_forward2"),
            norms=tuple(vec(p + n + ".weight") for n in LAYER_NORMS),
            q=linear(a + "q_proj"), k=linear(a + "k_proj"), v=linear(a + "v_proj"), post=linear(a + "post"),
            q_scale=(softplus * (D**-0.5 / math.log(2))).astype(np.float32),
            relative=relative.reshape(-1, nh, D).astype(np.float32),
            conv_norms=(vec(p + "lconv1d.pre_layer_norm.weight"), vec(p + "lconv1d.conv_norm.weight")),
            conv_start=linear(p + "lconv1d.linear_start"), conv_end=linear(p + "lconv1d.linear_end"),
            conv_weight=np.ascontiguousarray(vec(p + "lconv1d.depthwise_conv1d.weight")[:, 0, :].T),
        ))
    sub = tower + "subsample_conv_projection."
    conv = (vec(sub + "layer0.conv.weight"), vec(sub + "layer0.norm.weight"),
            vec(sub + "layer1.conv.weight"), vec(sub + "layer1.norm.weight"))
    return AudioTower(cfg, conv, mat(tensors[sub + "input_proj_linear.weight"]), layers,
                      mat(tensors[tower + "output_proj.weight"]), vec(tower + "output_proj.bias"),
                      mat(tensors[embed + "embedding_projection.weight"]))
