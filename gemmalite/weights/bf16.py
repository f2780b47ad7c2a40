"""bfloat16, a storage format only (the math is float32): numpy's dtype from ``ml_dtypes``,
imported on first use. Loading ``ml_dtypes`` takes most of a second, and a GGUF or int8
checkpoint never needs it."""
from __future__ import annotations

import sys
from functools import cache

import numpy as np


@cache
def dtype() -> np.dtype:
    """numpy's bfloat16 dtype (imports ``ml_dtypes``)."""
    import ml_dtypes

    return np.dtype(ml_dtypes.bfloat16)


def is_bf16(dt: np.dtype) -> bool:
    """Is ``dt`` bfloat16? Imports nothing: before ``ml_dtypes`` is loaded no array holds bfloat16."""
    return "ml_dtypes" in sys.modules and dt == dtype()
