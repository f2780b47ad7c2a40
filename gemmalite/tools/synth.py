"""Random-weight checkpoints of the real Gemma 4 shapes, in the Hugging Face layout.

Real E2B/E4B weights cannot be downloaded here, so full-size speed and memory figures come
from checkpoints of exactly the published shapes (architecture map §0) filled with random
bfloat16 values, plus a working tokenizer and chat template, so every path runs end to end.
"""
from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from typing import Iterator

import ml_dtypes
import numpy as np

from ..errors import CheckpointError
from ..formats.gguf_tokenizer import gemma4_tokenizer_gguf_path
from ..formats.safetensors import write_safetensors
from ..loader import load_tokenizer
from ..models.gemma.config import FULL, SLIDING, ModelConfig
from ..models.gemma.contract import expected_shapes
from ..tokenizer import fallback_tokenizer, save_tokenizer

BF16 = np.dtype(ml_dtypes.bfloat16)
SHARD_BYTES = 2 << 30


def _layer_types(n: int, every: int, offset: int) -> list[str]:
    return [FULL if i % every == offset else SLIDING for i in range(n)]


PRESETS: dict[str, dict] = {
    # The published E2B text shapes (§0 of the architecture map).
    "e2b": dict(hidden_size=1536, num_hidden_layers=35, intermediate_size=6144, num_attention_heads=8,
                num_key_value_heads=1, head_dim=256, global_head_dim=512, layer_types=_layer_types(35, 5, 4),
                sliding_window=512, num_kv_shared_layers=20, use_double_wide_mlp=True,
                hidden_size_per_layer_input=256),
    # E4B-like (third-party configs).
    "e4b": dict(hidden_size=2560, num_hidden_layers=42, intermediate_size=10240, num_attention_heads=8,
                num_key_value_heads=2, head_dim=256, global_head_dim=512, layer_types=_layer_types(42, 6, 5),
                sliding_window=512, num_kv_shared_layers=18, use_double_wide_mlp=False,
                hidden_size_per_layer_input=256),
    # Every feature at toy size: PLE, KV sharing of both layer types, double-wide MLP, two head sizes.
    "tiny": dict(hidden_size=128, num_hidden_layers=6, intermediate_size=256, num_attention_heads=4,
                 num_key_value_heads=1, head_dim=32, global_head_dim=64, layer_types=_layer_types(6, 2, 1),
                 sliding_window=16, num_kv_shared_layers=2, use_double_wide_mlp=True,
                 hidden_size_per_layer_input=16),
}
COMMON = dict(model_type="gemma4_text", vocab_size=262144, vocab_size_per_layer_input=262144, rms_norm_eps=1e-6,
              hidden_activation="gelu_pytorch_tanh", max_position_embeddings=131072, final_logit_softcapping=30.0,
              tie_word_embeddings=True, attention_k_eq_v=False, enable_moe_block=False, attention_bias=False,
              pad_token_id=0, bos_token_id=2, eos_token_id=1,
              rope_parameters={SLIDING: {"rope_type": "default", "rope_theta": 10000.0},
                               FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                      "rope_theta": 1000000.0}})
GENERATION_CONFIG = {"bos_token_id": 2, "eos_token_id": [1, 106, 50], "pad_token_id": 0, "do_sample": True,
                     "temperature": 1.0, "top_k": 64, "top_p": 0.95}


def text_config(preset: str, vocab_size: int | None = None) -> dict:
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose from {sorted(PRESETS)}")
    cfg = {**COMMON, **PRESETS[preset]}
    if vocab_size:
        cfg["vocab_size"] = cfg["vocab_size_per_layer_input"] = vocab_size
    return cfg


def random_bf16(shape: tuple[int, ...], scale: float, rng: np.random.Generator) -> Iterator[bytes]:
    """Random bfloat16 values of magnitude ~scale, produced in chunks straight from random bits
    (sign, a 2-bit exponent spread, 7 mantissa bits): fast enough for billions of values."""
    n = int(np.prod(shape))
    e = 127 + math.floor(math.log2(scale))
    for i in range(0, n, 1 << 26):
        r = rng.integers(0, 1 << 16, size=min(1 << 26, n - i), dtype=np.uint16)
        exp = (np.uint16(e) - ((r >> 7) & 3)).astype(np.uint16)
        yield ((r & 0x807F) | (exp << 7)).tobytes()


def _tensor_bytes(name: str, shape: tuple[int, ...], rng: np.random.Generator) -> Iterator[bytes]:
    if name.endswith("layer_scalar"):
        yield np.array([rng.uniform(0.5, 1.0)], dtype=BF16).tobytes()
    elif len(shape) == 1:  # norm scales: Gemma 4 multiplies by w, stored around 1
        yield (1.0 + 0.1 * rng.standard_normal(shape)).astype(BF16).tobytes()
    elif "embed_tokens" in name:
        yield from random_bf16(shape, 0.03, rng)
    else:
        yield from random_bf16(shape, 1.0 / math.sqrt(shape[1]), rng)


def synth(preset: str, out: str | Path, *, tokenizer: str | Path | None = None, layout: str = "conditional",
          seed: int = 0, progress: bool = True, force: bool = False) -> Path:
    """Write a random-weight checkpoint folder for ``preset`` (tiny, e2b, e4b). An existing,
    non-empty ``out`` is an error unless ``force`` (then it is replaced)."""
    out = Path(out)
    text = text_config(preset)
    if out.exists() and not (out.is_dir() and not any(out.iterdir())):
        if not force:
            raise CheckpointError(f"{out} already exists: choose another folder, or pass --force (force=True) to replace it")
        if out.is_dir():
            shutil.rmtree(out)
        else:
            out.unlink()
    out.mkdir(parents=True, exist_ok=True)
    cfg = ModelConfig.from_hf(text)
    prefix = {"conditional": "model.language_model.", "causal": "model."}[layout]
    shapes = {prefix + k: v for k, v in expected_shapes(cfg).items()}
    rng = np.random.default_rng(seed)
    write_safetensors(out, {k: (v, BF16) for k, v in shapes.items()},
                      lambda name: _tensor_bytes(name, shapes[name], rng), shard_bytes=SHARD_BYTES, progress=progress)
    if layout == "conditional":
        config = {"model_type": "gemma4", "architectures": ["Gemma4ForConditionalGeneration"],
                  "text_config": text, "vision_config": None, "audio_config": None, "dtype": "bfloat16",
                  "tie_word_embeddings": True, "image_token_id": 258880, "boi_token_id": 255999,
                  "eoi_token_id": 258882, "audio_token_id": 258881, "video_token_id": 258884}
    else:
        config = {**text, "architectures": ["Gemma4ForCausalLM"], "dtype": "bfloat16"}
    (out / "config.json").write_text(json.dumps(config, indent=2))
    (out / "generation_config.json").write_text(json.dumps(GENERATION_CONFIG, indent=2))
    export_tokenizer(tokenizer, out)
    return out


def export_tokenizer(src: str | Path | None, out: Path) -> None:
    """Give a checkpoint folder tokenizer files: from ``src`` (tokenizer.json, folder or GGUF), else
    the real Gemma 4 vocabulary bundled with the package, else a byte-level fallback."""
    if src is None:
        try:
            src = gemma4_tokenizer_gguf_path()
        except FileNotFoundError:
            src = None
    tok = load_tokenizer(src) if src is not None else fallback_tokenizer()
    save_tokenizer(tok, out)
