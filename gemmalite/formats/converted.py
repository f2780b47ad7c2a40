"""gemmalite's quantized checkpoint format, as written by `gemmalite convert`.

Every quantized matrix is stored as the arrays of an `Int8Matrix` or `Int4Matrix` under
``<name>.<part>`` (e.g. ``layers.0.mlp.up_proj.weight.q``); ``config.json`` carries a
``quantization_config`` naming each one's format, so loading rebuilds the matrices around the
memory-mapped arrays with no copy and no work.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from ..errors import CheckpointError
from ..weights.quant import Int4Matrix, Int8Matrix

QUANT_METHOD = "gemmalite"
FORMATS = {"int8": Int8Matrix, "int4": Int4Matrix}


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
