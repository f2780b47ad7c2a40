"""transformers oracle for the vision tests (imported by tests, contains no tests).

Tiny random Gemma 4 vision towers inside a Gemma4ForConditionalGeneration or an
EmbeddingGemma2Model, saved with ``save_pretrained``, and transformers' Gemma 4 image processor
(its PIL module, imported directly: the processor package wants torchvision). Every vision
weight and persistent buffer is randomised: projections ~ N(0, 1/in), RMSNorm scales in
[0.5, 1.5] (q/k norms in [0.25, 0.75]: softer attention, less float32 amplification), the
position tables, std_bias / std_scale, and clip bounds that bind (|bound| in [1, 2.5]).
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import torch

import hf_oracle

torch.set_num_threads(1)

#: non-default options: clipped linears, standardize, GQA, patch 4 / pooling 2
CLIPPED = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
               head_dim=8, patch_size=4, pooling_kernel_size=2, position_embedding_size=128,
               use_clipped_linears=True, standardize=True, rms_norm_eps=1e-6,
               rope_parameters={"rope_type": "axial", "rope_theta": 100.0})
#: plain linears, no standardize, patch 8 / pooling 4, another RoPE base
PLAIN = dict(hidden_size=48, intermediate_size=80, num_hidden_layers=2, num_attention_heads=3, num_key_value_heads=3,
             head_dim=16, patch_size=8, pooling_kernel_size=4, position_embedding_size=96,
             use_clipped_linears=False, standardize=False, rms_norm_eps=1e-5,
             rope_parameters={"rope_type": "axial", "rope_theta": 1000.0})
EG2_TEXT = dict(vocab_size=512, hidden_size=40, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                num_key_value_heads=1, head_dim=16, hidden_size_per_layer_input=8, embedding_dim=24,
                max_position_embeddings=256, sliding_window=16)


IMG, BOI, EOI = 60, 61, 62  # image / begin-of-image / end-of-image ids: unused ids of the tiny vocabulary
AUD, BOA, EOA = 63, 64, 65  # audio / begin-of-audio / end-of-audio ids


def write_tokenizer_with_image_tokens(path, audio: bool = False) -> None:
    """The tiny tokenizer (hf_oracle), with the image tokens at IMG / BOI / EOI (special, as in
    Gemma 4's), and with ``audio`` the audio tokens at AUD / BOA / EOA."""
    hf_oracle.write_tiny_tokenizer(path)
    f = Path(path) / "tokenizer.json"
    t = json.loads(f.read_text())
    media = ((IMG, "<|image|>"), (BOI, "<|image>"), (EOI, "<image|>"))
    media += ((AUD, "<|audio|>"), (BOA, "<|audio>"), (EOA, "<audio|>")) if audio else ()
    for tid, text in media:
        del t["model"]["vocab"][f"<unused{tid}>"]
        t["model"]["vocab"][text] = tid
        t["added_tokens"].append({"id": tid, "content": text, "single_word": False, "lstrip": False, "rstrip": False,
                                  "normalized": False, "special": True})
    f.write_text(json.dumps(t))


@torch.no_grad()
def randomize_vision_weights(modules, seed: int, gentle: bool = False) -> None:
    """Every weight random. ``gentle``: norm scales in [0.8, 1.2], post-norms in [0.2, 0.4] (as
    `eg2_oracle.randomize_eg2_weights` does): about as sensitive to weight noise as a trained
    tower, for the int8 bounds (the wide ranges make a random net chaotic)."""
    g = torch.Generator().manual_seed(seed)
    for mod in modules:
        named = dict(mod.named_parameters())
        named.update((k, b) for k, b in mod.named_buffers() if "inv_freq" not in k)
        for name, t in sorted(named.items()):
            if name.endswith(("input_min", "output_min")):
                t.copy_(-(1.0 + 1.5 * torch.rand((), generator=g)))
            elif name.endswith(("input_max", "output_max")):
                t.copy_(1.0 + 1.5 * torch.rand((), generator=g))
            elif name.endswith("position_embedding_table"):
                t.copy_(torch.randn(t.shape, generator=g) * 0.5)
            elif name.endswith("std_bias"):
                t.copy_(torch.randn(t.shape, generator=g))
            elif name.endswith(("q_norm.weight", "k_norm.weight")):
                t.copy_(0.25 + 0.5 * torch.rand(t.shape, generator=g))
            elif t.ndim == 1 and gentle and ".post_" in name:  # sub-block outputs: a moderate update
                t.copy_(0.2 + 0.2 * torch.rand(t.shape, generator=g))
            elif t.ndim == 1 and gentle:
                t.copy_(0.8 + 0.4 * torch.rand(t.shape, generator=g))
            elif t.ndim == 1:  # RMSNorm scales, std_scale
                t.copy_(0.5 + torch.rand(t.shape, generator=g))
            elif t.ndim == 2:
                t.copy_(torch.randn(t.shape, generator=g) / math.sqrt(t.shape[1]))
            else:
                raise AssertionError(f"vision weight {name} {tuple(t.shape)} left unrandomised")


def make_vision_checkpoint(path, vision_config: dict, *, layout: str, seed: int = 0, dtype: str = "float32",
                           gentle: bool = False):
    """Save a tiny random checkpoint with a vision tower; return the (float32, eager) torch
    model and its (vision tower, embed_vision) modules. ``layout``: "gemma4" or "eg2".
    ``dtype="bfloat16"`` stores bf16 (as on the hub); the model returned is then transformers'
    float32 load of those files."""
    torch.manual_seed(seed)
    if layout == "gemma4":
        from transformers import Gemma4Config, Gemma4ForConditionalGeneration

        cfg = Gemma4Config(text_config=hf_oracle._text_config_kwargs({}), vision_config=dict(vision_config),
                           attn_implementation="eager")
        model = Gemma4ForConditionalGeneration(cfg)
        inner = model.model
    elif layout == "eg2":
        from transformers import EmbeddingGemma2Config, EmbeddingGemma2Model

        cfg = EmbeddingGemma2Config(text_config=dict(EG2_TEXT), vision_config=dict(vision_config, model_type="gemma4_vision"),
                                    attn_implementation="eager")
        model = EmbeddingGemma2Model(cfg)
        inner = model
    else:
        raise ValueError(layout)
    model = model.float().eval()
    randomize_vision_weights([inner.vision_tower, inner.embed_vision], seed + 1, gentle)
    if dtype == "bfloat16":
        model.to(torch.bfloat16).save_pretrained(path, safe_serialization=True)
        model = type(model).from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
        inner = model.model if layout == "gemma4" else model
    else:
        model.save_pretrained(path, safe_serialization=True)
    return model, inner


def image_processor(patch_size: int = 16, pooling_kernel_size: int = 3, max_soft_tokens: int = 280):
    from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil

    return Gemma4ImageProcessorPil(patch_size=patch_size, pooling_kernel_size=pooling_kernel_size,
                                   max_soft_tokens=max_soft_tokens)


def reference_patches(image, proc, **kw) -> tuple[np.ndarray, np.ndarray, int]:
    """The processor's (pixels, positions) with the padding stripped, and its soft-token count."""
    out = proc(image, **kw)
    pos = np.asarray(out["image_position_ids"][0])
    real = (pos != -1).all(-1)
    return np.asarray(out["pixel_values"][0])[real], pos[real], int(out["num_soft_tokens_per_image"][0])


@torch.no_grad()
def hf_image_features(inner, image, proc, dtype=torch.float64) -> np.ndarray:
    """``get_image_features(...).pooler_output`` of one image (the soft tokens after embed_vision).
    float64 runs the whole module in float64 except transformers' own float32 islands (RMSNorm,
    softmax, RoPE tables, pooler): relative error ~1e-7, far below the 1e-5 cosine budget."""
    out = proc(image, return_tensors="pt")
    pix, pos = out["pixel_values"], out["image_position_ids"]
    if dtype == torch.float64:
        inner = inner.double()
        pix = pix.double()
    try:
        feats = inner.get_image_features(pix, pos).pooler_output[0]
    finally:
        inner.float()
    return feats.double().numpy()


def row_cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a = np.asarray(a, np.float64)
    b = np.asarray(b, np.float64)
    return (a * b).sum(-1) / (np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1))


def read_config(path) -> dict:
    return json.loads((Path(path) / "config.json").read_text())
