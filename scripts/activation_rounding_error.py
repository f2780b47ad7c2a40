#!/usr/bin/env python
"""What rounding the activations costs on real weights: Gemma 3 270M (the packaged Q4_K_M GGUF,
its weights taken as float), every projection and the LM head emulated in float64 numpy as
int8 weights per output row times activations rounded per block, against the float model.

    python scripts/activation_rounding_error.py [--tokens 200]

Prints, for int8 weights alone and with each activation rounding (int16 / int8 per 32, 128 or
256 values; a width that the block does not divide takes the largest power-of-two divisor),
the top-1 agreement with the float model over the prompt's positions and the mean / max
|delta logit|.
"""
from __future__ import annotations

import argparse

import numpy as np
from _emulate import Emulating, emulate, errors, load_gemma3, logits_per_mode, readme_ids

MODES = {"int8 weights": None, "+ int16 x / 32": (16, 32), "+ int16 x / 256": (16, 256),
         "+ int8 x / 32": (8, 32), "+ int8 x / 128": (8, 128), "+ int8 x / 256": (8, 256)}


def round_blocks(x: np.ndarray, bits: int, block: int) -> np.ndarray:
    t, k = x.shape
    while k % block:
        block //= 2
    xb = x.reshape(t, k // block, block)
    d = np.abs(xb).max(-1, keepdims=True) / (127 if bits == 8 else 32767)
    q = np.rint(xb / np.where(d > 0, d, 1.0))
    return (q * d).reshape(t, k)


class Emulated(Emulating):
    """A projection as float64 math: float weights (mode "float"), or int8 ones with ``x``
    rounded as the mode says."""

    def __init__(self, inner):
        super().__init__(inner)
        self.w = inner.dense().astype(np.float64)
        s = np.abs(self.w).max(1, keepdims=True) / 127
        self.wq = np.clip(np.rint(self.w / np.where(s > 0, s, 1.0)), -127, 127) * s

    def matmul(self, x):
        x = np.asarray(x, np.float64)
        if self.mode == "float":
            return (x @ self.w.T).astype(np.float32)
        if MODES[self.mode] is not None:
            x = round_blocks(x, *MODES[self.mode])
        return (x @ self.wq.T).astype(np.float32)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=200)
    a = ap.parse_args()
    model = load_gemma3()
    eng = model.engine
    emulate(eng, Emulated)
    ids = readme_ids(model.tokenizer, a.tokens)
    logits = logits_per_mode(eng, ids, ["float", *MODES])
    ref = logits.pop("float")
    print(f"{len(ids)} positions of README.md; against the float model:")
    for mode, lg in logits.items():
        top1, mean, worst = errors(lg, ref)
        print(f"{mode:18s} top-1 {top1:.3f}  mean |dlogit| {mean:.4f}  max {worst:.3f}")


if __name__ == "__main__":
    main()
