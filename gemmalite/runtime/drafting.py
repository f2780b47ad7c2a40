"""Model drafters for speculative decoding: the protocol, how many drafts a step takes, and a
replaying drafter (tests and benchmarks: chosen acceptance on any model).

A drafter proposes tokens after the current one; `generate_ids` and the server verify them in
one multi-row step as they verify prompt-lookup drafts, so the text never depends on them.
"""
from __future__ import annotations

from typing import Protocol

import numpy as np

from ..kernels import common
from .cache import KVState


class Drafter(Protocol):
    def draft(self, state: KVState, token: int, hidden: np.ndarray, k: int) -> list[int]:
        """Up to ``k`` tokens to follow ``token`` (the current token, at position ``state.length``);
        ``hidden``: the target's final-normed hidden state of the position before it."""
        ...


class DraftPolicy:
    """Drafts for the next step: the count that maximises expected tokens per second under the
    acceptance and costs measured so far (a step's time by its rows, the drafter's per token),
    none where no count pays -- then one draft now and then (ever more rarely while it fails) to
    notice when acceptance comes back. The first step is plain, so that every cost is judged
    against a measured one-row step. One per generation: its measurements are its own."""

    PRIOR_ROWS = (1.0, 1.08, 1.16, 1.24)  # a step of 1..4 rows against one row, until measured
    PRIOR_DRAFT = 0.02  # a drafted token against a one-row step, until measured
    FIRST_GAP, MAX_GAP = 8, 256  # steps between probes: at first, and at the most

    def __init__(self, max_drafts: int = common.FEW_ROWS - 1, decay: float = 0.9, timed: bool = True):
        self.max_drafts = max_drafts
        self.timed = timed  # False: no step times come (the server's batched steps), the priors stand
        self.decay = decay
        self.accepted, self.tried = 1.0, 2.0  # prior acceptance 0.5, worth two drafts
        self.step_s: dict[int, float] = {}  # rows -> EMA seconds of a step
        self.draft_s: float | None = None  # EMA seconds per drafted token
        self.wait, self.gap = 0, self.FIRST_GAP

    @property
    def acceptance(self) -> float:
        """The chance that a draft is kept, given the ones before it were (decayed counts)."""
        return self.accepted / self.tried

    def _base(self) -> float:
        known = [s / self.PRIOR_ROWS[r - 1] for r, s in self.step_s.items()]
        return self.step_s.get(1) or (sum(known) / len(known) if known else 1.0)

    def cost(self, k: int) -> float:
        """Expected seconds of a step with ``k`` drafts (their drafting included)."""
        base = self._base()
        step = self.step_s.get(k + 1, base * self.PRIOR_ROWS[k])
        per = self.draft_s if self.draft_s is not None else base * self.PRIOR_DRAFT
        return step + k * per

    def choose(self, room: int) -> int:
        """Drafts for the next step, at most ``room``."""
        if self.timed and 1 not in self.step_s:
            return 0
        a = min(self.acceptance, 0.99)
        best, best_k = 1.0 / self.cost(0), 0
        for k in range(1, min(room, self.max_drafts) + 1):
            rate = (1 - a ** (k + 1)) / (1 - a) / self.cost(k)  # expected tokens per second
            if rate > best:
                best, best_k = rate, k
        if best_k or room < 1:
            return best_k
        self.wait += 1
        if self.wait < self.gap:
            return 0
        self.wait, self.gap = 0, min(2 * self.gap, self.MAX_GAP)
        return 1  # a probe

    def update(self, drafts: int, kept: int, step_s: float | None = None, draft_s: float | None = None) -> None:
        """A step with ``drafts`` drafts, ``kept`` of them kept, took ``step_s`` (verification) and
        ``draft_s`` (drafting) seconds (None: not measured; the costs stay as they were)."""
        r = drafts + 1
        if step_s is not None:
            self.step_s[r] = step_s if r not in self.step_s else 0.8 * self.step_s[r] + 0.2 * step_s
        if not drafts:
            return
        if draft_s is not None:
            per = draft_s / drafts
            self.draft_s = per if self.draft_s is None else 0.8 * self.draft_s + 0.2 * per
        self.accepted = self.decay * self.accepted + kept
        self.tried = self.decay * self.tried + kept + (kept < drafts)
        if kept:
            self.gap = self.FIRST_GAP


class ReplayDrafter:
    """Drafts from known token sequences (``tokens``: prompt and reply as plain decoding gives
    them; a list of such lists for several sequences, told apart by what their states hold),
    wrong where told: ``accept`` a list of kept-draft counts used in turn (each step's first
    ``n`` drafts right, the next wrong), or a probability that each draft is right."""

    def __init__(self, tokens: list, accept, vocab_size: int, seed: int = 0):
        self.sequences = [list(t) for t in tokens] if tokens and isinstance(tokens[0], list) else [list(tokens)]
        self.accept = accept
        self.vocab_size = vocab_size
        self.rng = np.random.default_rng(seed)
        self.calls = 0

    def draft(self, state: KVState, token: int, hidden: np.ndarray, k: int) -> list[int]:
        p = state.length  # the position of ``token``
        known = [t for t in self.sequences if t[:p] == state.tokens[:p]]
        tokens = known[0] if known else []
        if isinstance(self.accept, (list, tuple)):
            good = self.accept[self.calls % len(self.accept)]
        else:
            good = 0
            while good < k and self.rng.random() < self.accept:
                good += 1
        self.calls += 1
        out = []
        for j in range(k):
            i = p + 1 + j
            right = tokens[i] if i < len(tokens) else 0
            out.append(right if j < good else (right + 1 + j) % self.vocab_size)
        return out
