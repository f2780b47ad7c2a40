"""Log-probabilities of the generated tokens, from the exact logits of each step (softcapped;
before the grammar's mask, penalties and temperature: the model's own distribution, as
OpenAI's ``logprobs`` reports it)."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..kernels.common import scratch
from ..kernels.numba_ops import top_ids
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
    """log_softmax of one row of logits (in float64) at ``token``, and its ``top`` best ids (ties:
    the lower id first). The exponentials go into the calling thread's float64 scratch row: a
    fresh 2 MB array a token cost more in page faults than the sum itself (3.2 -> 0.4 ms a token
    on a 262,144-token vocabulary; 7.1 -> 0.5 ms with five top ids)."""
    z = np.asarray(logits)
    e = scratch(z.shape[0], np.float64)
    m = np.float64(z.max())
    np.subtract(z, m, out=e, dtype=np.float64)
    np.exp(e, out=e)
    lse = m + np.log(e.sum())
    best = [(int(i), float(np.float64(z[i]) - lse)) for i in top_ids(z, top)] if top else []
    return TokenLogprob(int(token), float(np.float64(z[token]) - lse), best)
