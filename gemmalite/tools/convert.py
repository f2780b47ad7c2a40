"""`gemmalite convert`: write a self-describing int8/int4 checkpoint that loads by memory-mapping.

Every projection (and the LM head, stored apart from the tied embedding table) becomes an
`Int8Matrix` or `Int4Matrix` in the format of `gemmalite.formats.converted`; the embedding and
PLE tables, norms and scalars are copied as stored. Loading takes well under two seconds.

A tied embedding is thus stored twice: as stored (bfloat16) for the row lookups, and quantized
for the LM head, whose every row each step reads (``quantization_config.tied_lm_head`` says
so). For a model whose embedding is a large share of it (Gemma 3 270M: two thirds) the output
is larger than a bfloat16 source; `gemmalite convert` prints both sizes.

Only Hugging Face folders convert: a GGUF file is already quantized, and runs as it is.
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
from ..formats.folder import load_folder
from ..formats.gguf import is_gguf
from ..formats.safetensors import save_arrays
from ..loader import resolve
from ..models.gemma.contract import check_tensors, expected_shapes, quantizable
from ..weights.matrix import Matrix
from ..weights.quant import quantize

SIDE_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "chat_template.json",
              "special_tokens_map.json", "generation_config.json", "tokenizer.model")


def _dense(t: Any) -> np.ndarray:
    return t.dense() if isinstance(t, Matrix) else t


def convert(src: str | Path, out: str | Path, quant: str, *, progress: bool = True) -> Path:
    given, src, out = str(src), resolve(src), Path(out)
    if quant not in ("int8", "int4"):
        raise ValueError(f"quant must be int8 or int4, got {quant!r}")
    if src.is_file() and is_gguf(src):
        raise CheckpointError(f"{given}: a GGUF file is already quantized, and convert takes a Hugging Face checkpoint "
                              f"folder: run the GGUF directly (gemmalite run {given}), or requantize on load (--quant {quant})")
    if not src.is_dir():
        raise CheckpointError(f"{src}: convert takes a Hugging Face checkpoint folder")
    cfg, tensors, raw = load_folder(src)
    if isinstance(raw.get("quantization_config"), dict):
        raise CheckpointError(f"{src} is already quantized ({raw['quantization_config'].get('quant_method')})")
    check_tensors(cfg, tensors, str(src))
    names = list(expected_shapes(cfg))
    jobs = quantizable(cfg)
    if cfg.tie_word_embeddings:
        jobs.append("lm_head.weight")
    arrays: dict[str, np.ndarray] = {}
    formats: dict[str, str] = {}

    def source(name: str) -> Any:
        return tensors["embed_tokens.weight" if name == "lm_head.weight" and name not in tensors else name]

    # compile the quantizer on a toy matrix first: the bar's estimate then measures quantizing only
    quantize(np.zeros((2, source(jobs[0]).shape[1]), np.float32), quant)
    bar = tqdm(total=sum(int(np.prod(source(n).shape)) for n in jobs), desc=f"quantizing to {quant}",
               disable=not progress, unit="param", unit_scale=True)
    for name in jobs:
        m = quantize(_dense(source(name)), quant)
        for part, a in m.tensors().items():
            arrays[f"{name}.{part}"] = a
        formats[name] = format_name(m)
        bar.update(int(np.prod(m.shape)))
    bar.close()
    for name in names:
        if name not in formats:
            arrays[name] = np.asarray(tensors[name])
    out.mkdir(parents=True, exist_ok=True)
    save_arrays(out, arrays, progress=progress)
    config = dict(raw)
    config["quantization_config"] = {"quant_method": QUANT_METHOD, "default": quant, "formats": formats,
                                     "tied_lm_head": bool(cfg.tie_word_embeddings)}
    (out / "config.json").write_text(json.dumps(config, indent=2))
    for f in SIDE_FILES:
        if (src / f).exists():
            shutil.copy2(src / f, out / f)
    return out
