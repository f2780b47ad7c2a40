"""`gemmalite convert`: write a self-describing int8/int4 checkpoint that loads by memory-mapping.

Every projection (and the LM head, stored apart from the tied embedding table; and the vision
tower's projections, under their stored names, when the checkpoint has one) becomes an
`Int8Matrix` or `Int4Matrix` in the format of `gemmalite.formats.converted`; the embedding and
PLE tables, norms and scalars are copied as stored. Loading takes well under two seconds.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from ..errors import CheckpointError
from ..formats.converted import QUANT_METHOD, format_name
from ..formats.folder import load_folder, read_config, read_tensors
from ..formats.safetensors import save_arrays
from ..models.gemma.config import ModelConfig
from ..models.gemma.contract import check_tensors, expected_shapes, quantizable
from ..models.gemma.encoder import EncoderConfig, encoder_shapes, is_encoder_config
from ..weights.matrix import Matrix
from ..vision.tower import vision_tensors
from ..weights.quant import quantize

SIDE_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "chat_template.json",
              "special_tokens_map.json", "generation_config.json", "tokenizer.model", "processor_config.json",
              "preprocessor_config.json",
              # sentence-transformers pipeline of an embedding model
              "modules.json", "config_sentence_transformers.json", "sentence_bert_config.json",
              "1_Pooling/config.json", "2_Normalize/config.json")


def _dense(t: Any) -> np.ndarray:
    return t.dense() if isinstance(t, Matrix) else t


def convert(src: str | Path, out: str | Path, quant: str, *, progress: bool = True) -> Path:
    src, out = Path(src), Path(out)
    if quant not in ("int8", "int4"):
        raise ValueError(f"quant must be int8 or int4, got {quant!r}")
    if not src.is_dir():
        raise CheckpointError(f"{src}: convert takes a Hugging Face checkpoint folder")
    encoder = is_encoder_config(read_config(src))  # EmbeddingGemma 2: the encoder's config and contract
    cfg, tensors, raw = load_folder(src, parse=EncoderConfig.from_hf if encoder else ModelConfig.from_hf)
    if isinstance(raw.get("quantization_config"), dict):
        raise CheckpointError(f"{src} is already quantized ({raw['quantization_config'].get('quant_method')})")
    shapes = encoder_shapes(cfg) if encoder else expected_shapes(cfg)
    check_tensors(cfg, tensors, str(src), shapes=shapes)
    names = list(shapes)
    jobs = quantizable(cfg, shapes)
    if cfg.tie_word_embeddings and not encoder:
        jobs.append("lm_head.weight")
    arrays: dict[str, np.ndarray] = {}
    formats: dict[str, str] = {}
    for name in tqdm(jobs, desc=f"quantizing to {quant}", disable=not progress, unit="tensor"):
        source = tensors["embed_tokens.weight" if name == "lm_head.weight" and name not in tensors else name]
        m = quantize(_dense(source), quant)
        for part, a in m.tensors().items():
            arrays[f"{name}.{part}"] = a
        formats[name] = format_name(m)
    for name in names:
        if name not in formats:
            arrays[name] = np.asarray(tensors[name])
    stored = read_tensors(src, raw)  # the vision tower, under its stored names
    projections, rest = vision_tensors(stored, raw)
    for name in tqdm(projections, desc=f"vision tower to {quant}", disable=not progress or not projections, unit="tensor"):
        m = quantize(_dense(stored[name]), quant)
        for part, a in m.tensors().items():
            arrays[f"{name}.{part}"] = a
        formats[name] = format_name(m)
    for name in rest:
        arrays[name] = np.asarray(stored[name])
    out.mkdir(parents=True, exist_ok=True)
    save_arrays(out, arrays, progress=progress)
    config = dict(raw)
    config["quantization_config"] = {"quant_method": QUANT_METHOD, "default": quant, "formats": formats}
    (out / "config.json").write_text(json.dumps(config, indent=2))
    for f in SIDE_FILES:
        if (src / f).exists():
            (out / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src / f, out / f)
    return out
