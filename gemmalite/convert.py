"""`gemmalite convert`: write a self-describing int8/int4 checkpoint that loads by memory-mapping.

Every projection (and the LM head, stored apart from the tied embedding table) becomes the
arrays of an `Int8Matrix` or `Int4Matrix`, stored as ``<name>.<part>`` (e.g.
``layers.0.mlp.up_proj.weight.q``); the embedding and PLE tables, norms and scalars are
copied as stored. ``config.json`` gains a ``quantization_config`` naming each quantized
tensor's format, so `gemmalite.load` rebuilds the matrices around the mapped arrays with no
copy and no work: loading takes well under two seconds.
"""
from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from .checkpoint import check_tensors, expected_shapes, load_folder, save_arrays
from .errors import CheckpointError
from .matrix import Matrix

QUANT_METHOD = "gemmalite"
TABLES = ("embed_tokens.weight", "embed_tokens_per_layer.weight")
SIDE_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "chat_template.json",
              "special_tokens_map.json", "generation_config.json", "tokenizer.model")


def quantizer(fmt: str):
    from .quant import Int4Matrix, Int8Matrix

    return {"int8": Int8Matrix, "int4": Int4Matrix}[fmt]


def is_projection(name: str, t: Any) -> bool:
    return name.endswith(".weight") and len(t.shape) == 2 and name not in TABLES


def _dense(t: Any) -> np.ndarray:
    return t.dense() if isinstance(t, Matrix) else t


def convert(src: str | Path, out: str | Path, quant: str, *, progress: bool = True) -> Path:
    src, out = Path(src), Path(out)
    if quant not in ("int8", "int4"):
        raise ValueError(f"quant must be int8 or int4, got {quant!r}")
    if not src.is_dir():
        raise CheckpointError(f"{src}: convert takes a Hugging Face checkpoint folder")
    cfg, tensors, raw = load_folder(src)
    if isinstance(raw.get("quantization_config"), dict):
        raise CheckpointError(f"{src} is already quantized ({raw['quantization_config'].get('quant_method')})")
    check_tensors(cfg, tensors, str(src))
    from .quant import Int4Matrix, quantize

    names = list(expected_shapes(cfg))
    jobs = [n for n in names if is_projection(n, tensors[n])]
    if cfg.tie_word_embeddings:
        jobs.append("lm_head.weight")
    arrays: dict[str, np.ndarray] = {}
    formats: dict[str, str] = {}
    for name in tqdm(jobs, desc=f"quantizing to {quant}", disable=not progress, unit="tensor"):
        source = tensors["embed_tokens.weight" if name == "lm_head.weight" and name not in tensors else name]
        m = quantize(_dense(source), quant)
        for part, a in m.tensors().items():
            arrays[f"{name}.{part}"] = a
        formats[name] = "int4" if isinstance(m, Int4Matrix) else "int8"
    for name in names:
        if name not in formats:
            arrays[name] = np.asarray(tensors[name])
    out.mkdir(parents=True, exist_ok=True)
    save_arrays(out, arrays, progress=progress)
    config = dict(raw)
    config["quantization_config"] = {"quant_method": QUANT_METHOD, "default": quant, "formats": formats}
    (out / "config.json").write_text(json.dumps(config, indent=2))
    for f in SIDE_FILES:
        if (src / f).exists():
            shutil.copy2(src / f, out / f)
    return out


def assemble(tensors: dict[str, np.ndarray], qconf: dict) -> dict[str, Any]:
    """Rebuild quantized matrices (zero-copy, around the mapped arrays) from a converted checkpoint."""
    if qconf.get("quant_method") != QUANT_METHOD:
        raise CheckpointError(f"unsupported quantization_config.quant_method {qconf.get('quant_method')!r}")
    out = dict(tensors)
    for name, fmt in qconf.get("formats", {}).items():
        cls = quantizer(fmt)
        parts = {k[len(name) + 1:]: out.pop(k) for k in [k for k in out if k.startswith(name + ".")]}
        try:
            out[name] = cls.from_tensors(parts)
        except (KeyError, ValueError) as e:
            raise CheckpointError(f"quantized tensor {name} ({fmt}) is malformed: {e}") from None
    return out


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("convert", help="write an int8/int4 checkpoint that loads instantly")
    p.add_argument("model", help="Hugging Face checkpoint folder")
    p.add_argument("out")
    p.add_argument("--quant", choices=["int8", "int4"], required=True)
    p.add_argument("-q", "--quiet", action="store_true")
    p.set_defaults(func=lambda a: (convert(a.model, a.out, a.quant, progress=not a.quiet), print(f"wrote {a.out}"))[-1] or 0)
