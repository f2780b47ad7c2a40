"""Log-probabilities of the generated tokens, from the exact logits of each step (softcapped;
before the grammar's mask, penalties and temperature: the model's own distribution, as
OpenAI's ``logprobs`` reports it)."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from . import inputs

MAX_TOP_LOGPROBS = 20


@dataclass(frozen=True)
class TokenLogprob:
    """One generated token: its id and log-probability, and the ``top`` most likely tokens of
    that step as (id, log-probability), most likely first (ties by id)."""

    token: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


def logprobs_option(v) -> int | None:
    """A call's ``logprobs`` option: None / False = off, True = the chosen token's only (0 top
    tokens), an integer in [0, 20] = that many top tokens too."""
    if v is None or v is False:
        return None
    if v is True:
        return 0
    return inputs.integer(v, "logprobs", 0, MAX_TOP_LOGPROBS)


def token_logprob(logits: np.ndarray, token: int, top: int = 0) -> TokenLogprob:
    """log_softmax of one row of logits (in float64) at ``token``, and its ``top`` best ids."""
    z = np.asarray(logits, dtype=np.float64)
    m = z.max()
    lse = m + np.log(np.exp(z - m).sum())
    best: list[tuple[int, float]] = []
    if top:
        ids = np.argpartition(-z, top - 1)[:top] if top < z.shape[0] else np.arange(z.shape[0])
        ids = ids[np.lexsort((ids, -z[ids]))]
        best = [(int(i), float(z[i] - lse)) for i in ids]
    return TokenLogprob(int(token), float(z[token] - lse), best)
