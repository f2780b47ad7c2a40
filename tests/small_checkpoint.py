"""A small random Gemma 4 checkpoint folder (every feature of the `tiny` preset, a 512-token
vocabulary, byte-level tokenizer) written without torch: for tests of files, not of numerics."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from gemmalite.formats.safetensors import write_safetensors
from gemmalite.models.gemma.config import ModelConfig
from gemmalite.models.gemma.contract import expected_shapes
from gemmalite.tokenizer import fallback_tokenizer, save_tokenizer
from gemmalite.tools.synth import BF16, GENERATION_CONFIG, _tensor_bytes, text_config

VOCAB = 512


def write_small_checkpoint(path: Path, *, seed: int = 0, vocab: int = VOCAB) -> Path:
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    text = text_config("tiny", vocab_size=vocab)
    shapes = {"model." + k: v for k, v in expected_shapes(ModelConfig.from_hf(text)).items()}
    rng = np.random.default_rng(seed)
    write_safetensors(path, {k: (v, BF16) for k, v in shapes.items()}, lambda n: _tensor_bytes(n, shapes[n], rng))
    (path / "config.json").write_text(json.dumps({**text, "architectures": ["Gemma4ForCausalLM"]}, indent=1))
    (path / "generation_config.json").write_text(json.dumps(GENERATION_CONFIG))
    save_tokenizer(fallback_tokenizer(), path)
    return path
