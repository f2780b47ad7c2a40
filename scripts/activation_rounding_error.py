#!/usr/bin/env python
"""What rounding the activations costs on real weights: Gemma 3 270M (the packaged Q4_K_M GGUF,
its weights taken as float), every projection and the LM head emulated in float64 numpy as
int8 weights per output row times activations rounded per block, against the float model.

    python scripts/activation_rounding_error.py [--tokens 200]
    python scripts/activation_rounding_error.py --pooled [--texts 24]

Prints, for int8 weights alone and with each activation rounding (int16 / int8 per 32, 128 or
256 values; a width that the block does not divide takes the largest power-of-two divisor),
the top-1 agreement with the float model over the prompt's positions and the mean / max
|delta logit|. ``--pooled``: what an embedding sees instead (the proxy for EmbeddingGemma 2's
int8 rounding): the mean over each text's positions of the final-normed hidden states, for
``--texts`` paragraphs of README.md, and 1 - cos to the float model's (mean and max over texts).
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


def pooled(model, texts: int) -> None:
    """1 - cos of mean-pooled final hidden states against the float model's, per mode."""
    import re

    from _emulate import README

    paras = [p for p in re.split(r"\n\s*\n", README.read_text()) if len(p) > 80][:texts]
    eng = model.engine
    vecs: dict[str, list[np.ndarray]] = {m: [] for m in ["float", *MODES]}
    for p in paras:
        ids = np.asarray(model.tokenizer.encode(p)[:256], np.int64)
        for mode in vecs:
            Emulating.mode = mode
            vecs[mode].append(eng.forward(eng.new_state(), ids).astype(np.float64).mean(0))
    ref = np.array(vecs.pop("float"))
    ref /= np.linalg.norm(ref, axis=1, keepdims=True)
    print(f"{len(paras)} README.md paragraphs, mean-pooled final hidden states; 1 - cos to the float model:")
    for mode, v in vecs.items():
        v = np.array(v)
        d = 1 - (v / np.linalg.norm(v, axis=1, keepdims=True) * ref).sum(1)
        print(f"{mode:18s} mean {d.mean():.3e}  max {d.max():.3e}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=200)
    ap.add_argument("--pooled", action="store_true", help="mean-pooled hidden states, as an embedding")
    ap.add_argument("--texts", type=int, default=24)
    a = ap.parse_args()
    model = load_gemma3()
    eng = model.engine
    emulate(eng, Emulated)
    if a.pooled:
        return pooled(model, a.texts)
    ids = readme_ids(model.tokenizer, a.tokens)
    logits = logits_per_mode(eng, ids, ["float", *MODES])
    ref = logits.pop("float")
    print(f"{len(ids)} positions of README.md; against the float model:")
    for mode, lg in logits.items():
        top1, mean, worst = errors(lg, ref)
        print(f"{mode:18s} top-1 {top1:.3f}  mean |dlogit| {mean:.4f}  max {worst:.3f}")


if __name__ == "__main__":
    main()
