"""transformers oracle for the audio tests (imported by tests, contains no tests).

Tiny random Gemma 4 audio towers inside a Gemma4ForConditionalGeneration or an
EmbeddingGemma2Model, saved with ``save_pretrained``, and the reference soft tokens:
``get_audio_features(...).pooler_output`` of transformers' Gemma4AudioFeatureExtractor
features, padding rows dropped (what Gemma4Model merges at the ``<|audio|>`` placeholders).
Every audio weight and persistent buffer is randomised: projections and convolutions
~ N(0, 1/fan-in), norm and LayerNorm scales in [0.5, 1.5], ``per_dim_scale`` ~ N(0, 0.5),
the output bias, and clip bounds that bind (|bound| in [1, 2.5]). The first subsampling
convolution is 128 wide, as it must be (transformers sizes the input projection (c0 / 4) * c1
for a grid that is (128 mel / 4) * c1 wide).
"""
from __future__ import annotations

import json
import math
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch

import hf_oracle
from vision_oracle import EG2_TEXT

torch.set_num_threads(1)

#: the options real checkpoints carry (clipped linears, chunk 12 / context 13 / 0, kernel 5, cap 50)
CLIPPED = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, subsampling_conv_channels=[128, 4],
               conv_kernel_size=5, output_proj_dims=24, use_clipped_linears=True, rms_norm_eps=1e-6,
               attention_chunk_size=12, attention_context_left=13, attention_context_right=0,
               attention_logit_cap=50.0, residual_weight=0.5)
#: plain linears and other sizes: a 6-key band (chunk 6 / context 7), kernel 3, cap 20, eps 1e-5,
#: residual weight 0.7 (the feed-forward / layer norms keep Gemma4RMSNorm's default eps 1e-6)
PLAIN = dict(hidden_size=48, num_hidden_layers=2, num_attention_heads=2, subsampling_conv_channels=[128, 6],
             conv_kernel_size=3, output_proj_dims=40, use_clipped_linears=False, rms_norm_eps=1e-5,
             attention_chunk_size=6, attention_context_left=7, attention_context_right=0,
             attention_logit_cap=20.0, residual_weight=0.7)


@torch.no_grad()
def randomize_audio_weights(modules, seed: int, gentle: bool = False) -> None:
    """Every weight random. ``gentle``: norm scales in [0.8, 1.2] and projections at 0.7 of their
    fan-in scale (a less chaotic net, for the int8 bound)."""
    g = torch.Generator().manual_seed(seed)
    for mod in modules:
        named = dict(mod.named_parameters())
        named.update((k, b) for k, b in mod.named_buffers() if not k.endswith(("inv_timescales", "softcap")))
        for name, t in sorted(named.items()):
            if name.endswith(("input_min", "output_min")):
                t.copy_(-(1.0 + 1.5 * torch.rand((), generator=g)))
            elif name.endswith(("input_max", "output_max")):
                t.copy_(1.0 + 1.5 * torch.rand((), generator=g))
            elif name.endswith("per_dim_scale"):
                t.copy_(torch.randn(t.shape, generator=g) * 0.5)
            elif name.endswith(".bias"):
                t.copy_(torch.randn(t.shape, generator=g) * 0.3)
            elif t.ndim == 1:  # RMSNorm / LayerNorm scales
                t.copy_((0.8 + 0.4 * torch.rand(t.shape, generator=g)) if gentle else 0.5 + torch.rand(t.shape, generator=g))
            elif t.ndim >= 2:  # linears, the subsampling and depthwise convolutions
                fan_in = int(np.prod(t.shape[1:]))
                t.copy_(torch.randn(t.shape, generator=g) / math.sqrt(fan_in) * (0.7 if gentle else 1.0))
            else:
                raise AssertionError(f"audio weight {name} {tuple(t.shape)} left unrandomised")


def make_audio_checkpoint(path, audio_config: dict, *, layout: str, seed: int = 0, dtype: str = "float32",
                          gentle: bool = False):
    """Save a tiny random checkpoint with an audio tower (and no vision tower); return the
    (float32, eager) torch model and its inner model (``.audio_tower``, ``.embed_audio``).
    ``layout``: "gemma4" or "eg2"; ``dtype="bfloat16"`` stores bf16 (as on the hub) and returns
    transformers' float32 load of those files."""
    torch.manual_seed(seed)
    if layout == "gemma4":
        from transformers import Gemma4Config, Gemma4ForConditionalGeneration

        cfg = Gemma4Config(text_config=hf_oracle._text_config_kwargs({}), vision_config=None,
                           audio_config=dict(audio_config), attn_implementation="eager")
        model = Gemma4ForConditionalGeneration(cfg)
    elif layout == "eg2":
        from transformers import EmbeddingGemma2Config, EmbeddingGemma2Model

        cfg = EmbeddingGemma2Config(text_config=dict(EG2_TEXT), vision_config=None,
                                    audio_config=dict(audio_config, model_type="gemma4_audio"),
                                    attn_implementation="eager")
        model = EmbeddingGemma2Model(cfg)
    else:
        raise ValueError(layout)
    inner = model.model if layout == "gemma4" else model
    model = model.float().eval()
    randomize_audio_weights([inner.audio_tower, inner.embed_audio], seed + 1, gentle)
    if dtype == "bfloat16":
        model.to(torch.bfloat16).save_pretrained(path, safe_serialization=True)
        model = type(model).from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
        inner = model.model if layout == "gemma4" else model
    else:
        model.save_pretrained(path, safe_serialization=True)
    return model, inner


class StandaloneAudio(torch.nn.Module):
    """transformers' Gemma4AudioModel + embed_audio alone (no text model), with the
    ``get_audio_features`` that `hf_audio_features` calls."""

    def __init__(self, audio_config: dict, text_hidden: int):
        from transformers.models.gemma4.configuration_gemma4 import Gemma4AudioConfig, Gemma4TextConfig
        from transformers.models.gemma4.modeling_gemma4 import Gemma4AudioModel, Gemma4MultimodalEmbedder

        super().__init__()
        cfg = Gemma4AudioConfig(**{k: v for k, v in audio_config.items() if k != "model_type"})
        self.audio_tower = Gemma4AudioModel(cfg).float().eval()
        self.embed_audio = Gemma4MultimodalEmbedder(cfg, Gemma4TextConfig(hidden_size=text_hidden)).float().eval()

    def load(self, tensors: dict, prefix: str) -> "StandaloneAudio":
        """Load ``{prefix}audio_tower.*`` / ``{prefix}embed_audio.*`` strictly (every name, every shape)."""
        for module, p in ((self.audio_tower, prefix + "audio_tower."), (self.embed_audio, prefix + "embed_audio.")):
            state = {k[len(p):]: torch.from_numpy(np.asarray(v, np.float32)) for k, v in tensors.items() if k.startswith(p)}
            module.load_state_dict(state, strict=True)
        return self

    def tensors(self, prefix: str = "audio_tower.", embed: str = "embed_audio.") -> dict[str, np.ndarray]:
        """Its weights as a checkpoint stores them (EmbeddingGemma 2 names by default)."""
        out = {}
        for module, p in ((self.audio_tower, prefix), (self.embed_audio, embed)):
            out |= {p + k: v.detach().numpy().copy() for k, v in module.state_dict().items()}
        return out

    def get_audio_features(self, feats, mask, return_dict=True):
        out = self.audio_tower(feats, mask, return_dict=True)
        out.pooler_output = self.embed_audio(out.last_hidden_state)
        return out


def feature_extractor():
    from transformers.models.gemma4.feature_extraction_gemma4 import Gemma4AudioFeatureExtractor

    return Gemma4AudioFeatureExtractor()


#: transformers' float32 casts kept in float64 in a float64 run (hf_oracle)
_float64_throughout = hf_oracle.float64_throughout


@torch.no_grad()
def hf_audio_features(inner, samples: np.ndarray, dtype=torch.float64, fe=None) -> np.ndarray:
    """The soft tokens of one clip (at most 30 s: the extractor truncates) as Gemma4Model merges
    them: ``get_audio_features(features, mask).pooler_output`` at the encoder's valid rows."""
    fe = fe or feature_extractor()
    out = fe([np.asarray(samples, np.float32)], return_tensors="pt")
    feats, mask = out["input_features"], out["input_features_mask"]
    if dtype == torch.float64:
        inner.double()
        feats = feats.double()
    try:
        with _float64_throughout() if dtype == torch.float64 else _nothing():
            res = inner.get_audio_features(feats, mask, return_dict=True)
    finally:
        inner.float()
    return res.pooler_output[res.attention_mask].double().numpy()


@contextmanager
def _nothing():
    yield


def speechy(n: int, seed: int = 0) -> np.ndarray:
    """float32 samples at 16 kHz: a glide, a tone, an envelope and noise."""
    rng = np.random.default_rng(seed)
    t = np.arange(n) / 16000
    x = 0.3 * np.sin(2 * np.pi * (200 + 300 * t) * t) + 0.1 * np.sin(2 * np.pi * 3100 * t)
    x *= 0.5 + 0.5 * np.sin(2 * np.pi * 1.3 * t)
    return (x + 0.02 * rng.standard_normal(n)).astype(np.float32)


def row_cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a = np.asarray(a, np.float64)
    b = np.asarray(b, np.float64)
    return (a * b).sum(-1) / (np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1))


def read_config(path) -> dict:
    return json.loads((Path(path) / "config.json").read_text())
