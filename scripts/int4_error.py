#!/usr/bin/env python
"""Logit error of int4 formats on the same weights: gemmalite's symmetric int4 (decode kernel, int8
activations per 32), the earlier asymmetric int4 (W4A16 kernel) and llama.cpp's Q4_0 (emulated in
float64: its weights from the `gguf` package's quantizer, activations rounded to int8 per 32 as its
Q8_0 dot products do), against float64 products with the unquantized weights.

Every layer projection and the LM head is swapped for a wrapper; each activation row goes through
the decode path (`Matrix.matmul_each`: the rounding of a one-token step). Prints top-1 agreement
and mean / max |delta logit| per format, and the same with the weights alone (no activation rounding).

    python scripts/int4_error.py tiny      # transformers-made random Gemma 4 checkpoint (as the tests)
    python scripts/int4_error.py gemma3    # real Gemma 3 270M (its Q4_K_M GGUF, dequantized, is the reference)
"""
from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import numpy as np
from _emulate import Emulating, emulate, errors, load_gemma3, logits_per_mode, readme_ids
from gguf import GGMLQuantizationType, quants

import gemmalite
from gemmalite.weights.quant import Int4Matrix


def round_int8(x: np.ndarray) -> np.ndarray:
    """llama.cpp's Q8_0 rounding of activations: int8 per 32 values, step max|x| / 127."""
    t, k = x.shape
    xb = x.reshape(t, k // 32, 32).astype(np.float64)
    d = np.abs(xb).max(-1, keepdims=True) / 127
    return (np.rint(xb / np.where(d > 0, d, 1)) * d).reshape(t, k)


class Swap(Emulating):
    """One projection in every format; the mode picks which one computes."""

    def __init__(self, inner):
        super().__init__(inner)
        w = inner.dense().astype(np.float32)
        self.w = w.astype(np.float64)
        self.new = Int4Matrix.quantize(w, symmetric=True)
        self.old = Int4Matrix.quantize(w)
        self.q40 = quants.dequantize(quants.quantize(w, GGMLQuantizationType.Q4_0), GGMLQuantizationType.Q4_0)
        self.dense_of = {"new": self.new.dense(), "old": self.old.dense(), "q4_0": self.q40}

    def matmul(self, x):
        mode = self.mode
        x = np.ascontiguousarray(x, dtype=np.float32)
        if mode == "ref":
            return (x.astype(np.float64) @ self.w.T).astype(np.float32)
        if mode.endswith("-w"):  # weights alone
            return (x.astype(np.float64) @ self.dense_of[mode[:-2]].astype(np.float64).T).astype(np.float32)
        if mode == "q4_0":
            return (round_int8(x) @ self.q40.astype(np.float64).T).astype(np.float32)
        return (self.new if mode == "new" else self.old).matmul_each(x)


def measure(model, ids: np.ndarray) -> None:
    eng = model.engine
    emulate(eng, Swap)
    res = logits_per_mode(eng, ids, ("ref", "new", "old", "q4_0", "new-w", "old-w", "q4_0-w"))
    ref = res.pop("ref")
    print(f"{len(ids)} positions, logit std {ref.std():.3f}")
    for mode, lg in res.items():
        top1, mean, worst = errors(lg, ref)
        print(f"{mode:7s} top-1 {top1:.3f}  mean|dlogit| {mean:.4f}  max {worst:.3f}")


def main() -> None:
    which = sys.argv[1] if len(sys.argv) > 1 else "tiny"
    if which == "gemma3":
        model = load_gemma3(threads=2)
        ids = readme_ids(model.tokenizer, 200, chars=3000)
    else:
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
        from hf_oracle import make_gemma4_checkpoint

        path = Path(tempfile.mkdtemp(prefix="int4err"))
        make_gemma4_checkpoint(path, seed=1, hidden_size=128, intermediate_size=256, head_dim=32, global_head_dim=64,
                               vocab_size=1024, vocab_size_per_layer_input=1024)
        model = gemmalite.load(path)
        ids = np.random.RandomState(0).randint(5, 1024, size=64).astype(np.int64)
    measure(model, ids)


if __name__ == "__main__":
    main()
