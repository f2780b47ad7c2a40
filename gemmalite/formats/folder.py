"""Hugging Face checkpoint folders: config.json plus (sharded) safetensors, memory-mapped in
their stored dtype, with the text model's tensors named relative to their prefix."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

import numpy as np

from ..errors import CheckpointError, ConfigError
from ..models.gemma.config import ModelConfig
from .converted import QUANT_METHOD, assemble, check_manifest
from .safetensors import read_safetensors

TEXT_PREFIXES = ("model.language_model.", "model.", "language_model.model.", "language_model.", "")


def read_json(path: Path, error: type[ValueError] = CheckpointError) -> Any:
    """A JSON file's value; ``error`` naming the file when it cannot be read or parsed."""
    try:
        return json.loads(path.read_bytes())
    except OSError as e:
        raise error(f"{path}: cannot be read ({e.strerror})") from None
    except RecursionError:
        raise error(f"{path}: not valid JSON (nested too deeply)") from None
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
        raise error(f"{path}: not valid JSON ({e})") from None


def safetensors_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.exists():
        wm = read_json(index)
        wm = wm.get("weight_map") if isinstance(wm, dict) else None
        if not isinstance(wm, dict) or not all(isinstance(v, str) and v and Path(v).name == v for v in wm.values()):
            raise CheckpointError(f"{index}: malformed index (weight_map must map tensor names to file names "
                                  "in the folder)")
        files = [folder / n for n in sorted(set(wm.values()))]
        missing = [str(p) for p in files if not p.is_file()]
        if missing:
            raise CheckpointError(f"{index} names missing shard(s): {', '.join(missing)}")
        return files
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{folder}: no .safetensors files")
    return files


def read_config(folder: Path) -> dict:
    path = folder / "config.json"
    if not path.exists():
        raise CheckpointError(f"{folder}: config.json is missing")
    raw = read_json(path)
    if not isinstance(raw, dict):
        raise CheckpointError(f"{path}: the config must be a JSON object, got {type(raw).__name__}")
    return raw


def load_folder(folder: str | Path, parse: Callable[[dict], ModelConfig] = ModelConfig.from_hf,
                ) -> tuple[ModelConfig, dict[str, np.ndarray], dict]:
    """Config (read by ``parse``: the decoder's, or the encoder's) and text tensors (prefix
    stripped, memory-mapped) of a checkpoint folder."""
    folder = Path(folder)
    if not folder.is_dir():
        raise CheckpointError(f"{folder}: not a checkpoint folder")
    raw = read_config(folder)
    qconf = raw.get("quantization_config")
    if isinstance(qconf, dict) and qconf.get("quant_method") == QUANT_METHOD:  # `gemmalite convert`, manifest last
        check_manifest(folder)
    try:
        cfg = parse(raw)
    except ConfigError as e:
        raise CheckpointError(f"{folder / 'config.json'}: {e}") from None
    return cfg, strip_prefix(read_tensors(folder, raw)), raw


def read_tensors(folder: Path, raw: dict) -> dict[str, Any]:
    """Every tensor of a folder under its stored name, memory-mapped; the quantized matrices of a
    `gemmalite convert` checkpoint (which stores the text tensors without a prefix) rebuilt."""
    tensors: dict[str, Any] = {}
    for f in safetensors_files(folder):
        tensors.update(read_safetensors(f))
    if isinstance(raw.get("quantization_config"), dict):
        tensors = assemble(tensors, raw["quantization_config"])
    return tensors


def strip_prefix(tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Keep the text-decoder tensors, named relative to their prefix (plus an untied lm_head)."""
    for p in TEXT_PREFIXES:
        if p + "embed_tokens.weight" in tensors:
            out = {k[len(p) :]: v for k, v in tensors.items() if k.startswith(p)}
            if "lm_head.weight" in tensors:
                out["lm_head.weight"] = tensors["lm_head.weight"]
            return out
    raise CheckpointError("no embed_tokens.weight under any known prefix (" + ", ".join(repr(p) for p in TEXT_PREFIXES) + ")")
