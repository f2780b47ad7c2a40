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
        self._work = np.empty(0)  # this sampler's float64 workspace, reused (fresh pages fault)

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
        src = z if cand is None else z[cand]
        if self._work.shape[0] < src.shape[0]:
            self._work = np.empty(src.shape[0])
        x = self._work[: src.shape[0]]
        np.divide(src, p.temperature, out=x, dtype=np.float64)
        keep, probs = allowed_probs(x, p.top_p, p.min_p)
        pick = draw(self.rng, probs)
        pick = pick if keep is None else int(keep[pick])
        pick = pick if cand is None else int(cand[pick])
        return pick if ids is None else int(ids[pick])


def draw(rng: np.random.Generator, probs: np.ndarray) -> int:
    """An index drawn with probabilities ``probs`` (float64, summing to 1; overwritten): what
    ``rng.choice(len(probs), p=probs)`` draws, the same uniform and the same arithmetic, without its
    checks of ``probs`` and its copy (a few milliseconds on a whole vocabulary)."""
    cdf = np.cumsum(probs, out=probs)
    cdf /= cdf[-1]
    return int(cdf.searchsorted(rng.random(), side="right"))


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


def candidates(z: np.ndarray, top_k: int | None) -> np.ndarray | None:
    """Ids of the top-k logits (all ids that tie with the k-th too), or None: every id. Sampling
    then works on these few values instead of the whole 262k vocabulary."""
    if not top_k or top_k >= z.shape[0]:
        return None
    kth = np.partition(z, -top_k)[-top_k]
    return np.flatnonzero(z >= kth)


def allowed_probs(z: np.ndarray, top_p: float | None, min_p: float | None) -> tuple[np.ndarray | None, np.ndarray]:
    """Softmax of ``z`` (float64: the candidates' logits over the temperature; it may be
    overwritten) restricted by top-p (nucleus), then min-p; renormalised. Returns the kept
    positions of ``z`` (ascending; None: all of them) and their probabilities: the values of a
    softmax over the whole of ``z`` with every dropped one at -inf (its zeros left out, which
    changes no sum: `_softmax_of`)."""
    nucleate = top_p is not None and top_p < 1.0
    if not nucleate and not min_p:
        return None, _softmax(z, out=z)
    keep = np.arange(z.shape[0])
    probs = _softmax(z)
    if nucleate and top_p is not None:
        keep = nucleus(probs, top_p)
        probs = _softmax_of(z, keep)
    if min_p:
        keep = keep[probs >= min_p * probs.max()]
        probs = _softmax_of(z, keep)
    return keep, probs


def nucleus(probs: np.ndarray, top_p: float) -> np.ndarray:
    """The ids (ascending) of the smallest prefix of ``probs`` in descending order (ties: the lower
    id first) whose mass reaches ``top_p``, always at least the top one: what a stable argsort of
    the whole vocabulary gives, without one (36 ms on 262,144 float64 values, more than a decode
    step of the real Gemma 3 270M). The running sums need only the values in descending order,
    which the head of the distribution holds (the values at or above the m-th largest; m x4 until
    their mass reaches ``top_p``); the cut's value ``t`` then names the set: every id above ``t``,
    and of the ids at ``t`` the lowest, as many as the cut takes."""
    n = probs.shape[0]
    m = 256
    while True:
        head = probs if m >= n // 4 else probs[probs >= np.partition(probs, n - m)[n - m]]
        desc = np.sort(head)[::-1]
        cum = np.cumsum(desc)
        if cum[-1] >= top_p or head.shape[0] == n:
            cut = min(int(np.searchsorted(cum, top_p) + 1), n)
            t = desc[cut - 1]
            keep = probs > t
            keep[np.flatnonzero(probs == t)[: cut - int(keep.sum())]] = True
            return np.flatnonzero(keep)
        m *= 4


def _softmax(z: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """``exp(z - max) / sum``, into ``out`` (``z`` itself allowed) or a new array."""
    e = np.subtract(z, z.max(), out=out)
    np.exp(e, out=e)
    e /= e.sum()
    return e


def _softmax_of(z: np.ndarray, keep: np.ndarray) -> np.ndarray:
    """``_softmax(z with every id but keep's at -inf)[keep]``, to the bit: the exponentials of the
    kept ones, over their sum taken with the zeros of the others in place (numpy's pairwise sum
    groups by position)."""
    zk = z[keep]
    e = zk - zk.max()
    np.exp(e, out=e)
    full = np.zeros(z.shape[0])
    full[keep] = e
    e /= full.sum()
    return e
