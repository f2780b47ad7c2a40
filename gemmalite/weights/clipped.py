"""transformers' ``Gemma4ClippableLinear`` over a `Matrix`: the projection of the Gemma 4 vision and
audio towers, with the clip bounds a checkpoint carries when ``use_clipped_linears`` is on."""
from __future__ import annotations

import numpy as np

from .matrix import Matrix

#: the scalar buffers stored beside ``<name>.linear.weight``
CLIP_KEYS = ("input_min", "input_max", "output_min", "output_max")
NO_BOUNDS = (np.float32(-np.inf), np.float32(np.inf))  # (lo, hi) of no clip


class Linear:
    """A projection; with clip bounds, ``clip(clip(x, in) W^T, out)`` (Gemma4ClippableLinear)."""

    def __init__(self, w: Matrix, clip: tuple[float, float, float, float] | None = None):
        self.w = w
        self.clip = None if clip is None or all(np.isinf(clip)) else tuple(np.float32(c) for c in clip)

    @property
    def in_bounds(self) -> tuple[np.float32, np.float32]:
        """(lo, hi) of the input clip (the whole float32 range without one), for fused stages."""
        return NO_BOUNDS if self.clip is None else self.clip[:2]

    @property
    def out_bounds(self) -> tuple[np.float32, np.float32]:
        return NO_BOUNDS if self.clip is None else self.clip[2:]

    def __call__(self, x: np.ndarray) -> np.ndarray:
        if self.clip is None:
            return self.w.matmul(x)
        lo, hi, out_lo, out_hi = self.clip
        y = self.w.matmul(np.clip(x, lo, hi))
        return np.clip(y, out_lo, out_hi, out=y)
