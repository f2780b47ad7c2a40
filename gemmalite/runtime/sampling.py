"""Next-token choice from one row of logits.

Order as in transformers' generate: repetition penalty, then temperature, top-k, top-p,
min-p; temperature 0 (or top_k 1) is greedy argmax. A grammar's mask (``allowed``) comes
first: the disallowed logits are removed before any of them, so they all work over the
allowed tokens.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from . import inputs


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None

    def __post_init__(self) -> None:
        """Type and range checks (`InputError` naming the option); values normalised to Python types."""
        checked = {
            "temperature": inputs.number(self.temperature, "temperature", 0),
            "top_k": None if self.top_k is None else inputs.integer(self.top_k, "top_k", 0),
            "top_p": None if self.top_p is None else inputs.number(self.top_p, "top_p", 0, 1, open_low=True),
            "min_p": None if self.min_p is None else inputs.number(self.min_p, "min_p", 0, 1),
            "repetition_penalty": None if self.repetition_penalty is None else
            inputs.number(self.repetition_penalty, "repetition_penalty", 0, open_low=True),
            "seed": None if self.seed is None else inputs.integer(self.seed, "seed", 0),
        }
        for k, v in checked.items():
            object.__setattr__(self, k, v)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1


class Sampler:
    def __init__(self, params: SamplingParams):
        self.params = params
        self.rng = np.random.default_rng(params.seed)

    def __call__(self, logits: np.ndarray, history: list[int] | None = None, allowed: np.ndarray | None = None) -> int:
        """The next token; ``allowed`` (bool ``[vocab]``, a grammar's mask) limits the choice:
        sampling then works on the allowed ids only (the same distribution as their logits with
        every other one at -inf)."""
        p = self.params
        z = np.asarray(logits, dtype=np.float32)
        ids = None
        if allowed is not None:
            ids = np.flatnonzero(allowed)
            if ids.size == 0:
                raise RuntimeError("the grammar allows no token here")
        z = penalized(z, history, p.repetition_penalty)
        if ids is not None:
            z = z[ids]
        if p.greedy:
            best = int(np.argmax(z))
            return best if ids is None else int(ids[best])
        cand = candidates(z, p.top_k)
        probs = allowed_probs(z[cand].astype(np.float64) / p.temperature, p.top_p, p.min_p)
        pick = int(cand[self.rng.choice(len(probs), p=probs)])
        return pick if ids is None else int(ids[pick])


def penalized(z: np.ndarray, history: list[int] | None, penalty: float | None) -> np.ndarray:
    """Logits after the repetition penalty (transformers' RepetitionPenaltyLogitsProcessor): each
    token seen in ``history`` has its logit divided by ``penalty`` when positive, else multiplied."""
    if not penalty or penalty == 1.0 or not history:
        return z
    z = z.copy()
    seen = np.unique(np.asarray(history, dtype=np.int64))
    vals = z[seen]
    z[seen] = np.where(vals > 0, vals / penalty, vals * penalty)
    return z


def candidates(z: np.ndarray, top_k: int | None) -> np.ndarray:
    """Ids of the top-k logits (all ids that tie with the k-th too), or every id. Sampling
    then works on these few values instead of the whole 262k vocabulary."""
    if not top_k or top_k >= z.shape[0]:
        return np.arange(z.shape[0])
    kth = np.partition(z, -top_k)[-top_k]
    return np.flatnonzero(z >= kth)


def allowed_probs(z: np.ndarray, top_p: float | None, min_p: float | None) -> np.ndarray:
    """Softmax of ``z`` (the top-k candidates' logits) restricted by top-p (nucleus), then
    min-p; renormalised."""
    keep = np.ones(z.shape[0], dtype=bool)
    probs = _softmax(z)
    if top_p is not None and top_p < 1.0:
        order = np.argsort(-probs, kind="stable")
        cum = np.cumsum(probs[order])
        # keep the smallest prefix whose mass reaches top_p (always at least the top token)
        cut = int(np.searchsorted(cum, top_p) + 1)
        nucleus = np.zeros_like(keep)
        nucleus[order[:cut]] = True
        keep &= nucleus
        probs = _softmax(np.where(keep, z, -np.inf))
    if min_p:
        keep &= probs >= min_p * probs.max()
        probs = _softmax(np.where(keep, z, -np.inf))
    return probs


def _softmax(z: np.ndarray) -> np.ndarray:
    e = np.exp(z - z.max())
    return e / e.sum()
