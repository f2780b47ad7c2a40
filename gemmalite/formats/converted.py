"""gemmalite's quantized checkpoint format, as written by `gemmalite convert`.

Every quantized matrix is stored as the arrays of an `Int8Matrix` or `Int4Matrix` under
``<name>.<part>`` (e.g. ``layers.0.mlp.up_proj.weight.q``); ``config.json`` carries a
``quantization_config`` naming each one's format, so loading rebuilds the matrices around the
memory-mapped arrays with no copy and no work.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import CheckpointError
from ..weights.quant import Int4Matrix, Int8Matrix

QUANT_METHOD = "gemmalite"
FORMATS = {"int8": Int8Matrix, "int4": Int4Matrix}
# Written last by `gemmalite convert`: every file of the folder with its size. A folder whose
# manifest is missing or disagrees with its files is an interrupted or damaged conversion.
MANIFEST = "gemmalite-manifest.json"


def write_manifest(folder: Path) -> Path:
    """List every file under ``folder`` (relative POSIX paths) with its size in ``MANIFEST``, flushed to disk."""
    files = {p.relative_to(folder).as_posix(): p.stat().st_size for p in sorted(folder.rglob("*"))
             if p.is_file() and p.name != MANIFEST}
    path = folder / MANIFEST
    with open(path, "w") as f:
        json.dump({"format": QUANT_METHOD, "version": 1, "files": files}, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    return path


def check_manifest(folder: Path) -> None:
    """CheckpointError unless ``folder`` holds every file its manifest lists, each of the listed size."""
    path = folder / MANIFEST
    if not path.is_file():
        raise CheckpointError(f"{folder}: converted checkpoint without {MANIFEST}: the conversion did not "
                              "finish (run gemmalite convert again)")
    try:
        files = json.loads(path.read_text())["files"]
        items = [(str(k), int(v)) for k, v in files.items()]
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError):
        raise CheckpointError(f"{path}: malformed manifest") from None
    for name, size in items:
        f = folder / name
        if name.startswith("/") or ".." in Path(name).parts or not f.is_file():
            raise CheckpointError(f"{folder}: {name}, listed in {MANIFEST}, is missing")
        if f.stat().st_size != size:
            raise CheckpointError(f"{f}: {f.stat().st_size} bytes, the manifest says {size}: the file is damaged")


def format_name(m: Int8Matrix | Int4Matrix) -> str:
    return "int4" if isinstance(m, Int4Matrix) else "int8"


def assemble(tensors: dict[str, np.ndarray], qconf: dict) -> dict[str, Any]:
    """Rebuild quantized matrices (zero-copy, around the mapped arrays) from a converted checkpoint."""
    if qconf.get("quant_method") != QUANT_METHOD:
        raise CheckpointError(f"unsupported quantization_config.quant_method {qconf.get('quant_method')!r}")
    out = dict(tensors)
    for name, fmt in qconf.get("formats", {}).items():
        cls = FORMATS.get(fmt)
        if cls is None:
            raise CheckpointError(f"quantized tensor {name}: unknown format {fmt!r}")
        parts = {k[len(name) + 1:]: out.pop(k) for k in [k for k in out if k.startswith(name + ".")]}
        try:
            out[name] = cls.from_tensors(parts)
        except (KeyError, ValueError) as e:
            raise CheckpointError(f"quantized tensor {name} ({fmt}) is malformed: {e}") from None
    return out
