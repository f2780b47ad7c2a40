"""Thinking budgets: a reply's thought (``<|channel>`` ... ``<channel|>``) closed after a number of tokens.

A `ThoughtBudget` follows a reply's tokens as they are sampled (`push`). Once ``limit`` tokens
have been generated inside thoughts (every token between ``<|channel>`` and ``<channel|>``, the
channel's name ``thought\\n`` included; all the reply's thoughts together), the next token of an
open thought is forced to be ``<channel|>`` (`mask`): the thought ends and the answer begins.
The decode loops apply it where each token is sampled (`generate.generate_ids`, the server's
`Scheduler._accept`), so drafts are kept or dropped against it as against any sampled token,
and the forced token is drawn like any other (a seeded sampler's draws stay in step). A reply
whose thoughts end within the budget never sees a narrowed mask: it is the unbudgeted reply bit
for bit. Under a grammar that cannot end the thought at that token, the budget waits for the
first token where it can.
"""
from __future__ import annotations

import numpy as np

from ..errors import InputError
from . import inputs

THOUGHT_OPEN, THOUGHT_CLOSE = "<|channel>", "<channel|>"


class ThoughtBudget:
    """One reply's thought budget (not shared: one per generation, like a grammar's matcher)."""

    def __init__(self, open_id: int, close_id: int, limit: int):
        self.open_id, self.close_id = open_id, close_id
        self.limit = inputs.integer(limit, "thinking_budget", 0)
        self.spent = 0  # thought tokens generated so far
        self.inside = False  # a thought is open

    @classmethod
    def of(cls, tokenizer, limit: int) -> "ThoughtBudget":
        """The budget of ``limit`` thought tokens in ``tokenizer``'s vocabulary (`InputError`
        without Gemma 4's thinking channel)."""
        ids = [tokenizer.token_id(t) for t in (THOUGHT_OPEN, THOUGHT_CLOSE)]
        if None in ids:
            raise InputError(f"thinking_budget: this model's vocabulary has no {THOUGHT_OPEN} / {THOUGHT_CLOSE} "
                             "tokens (Gemma 4's thinking channel)")
        return cls(ids[0], ids[1], limit)

    @property
    def due(self) -> bool:
        """The thought is open and its budget spent: its end is forced next."""
        return self.inside and self.spent >= self.limit

    def mask(self, allowed: np.ndarray | None, vocab: int) -> np.ndarray | None:
        """The mask of the next token: ``allowed`` (a grammar's, or None: all) as it is, or, when
        `due`, only ``<channel|>`` (if ``allowed`` permits it)."""
        if not self.due or (allowed is not None and not allowed[self.close_id]):
            return allowed
        only = np.zeros(vocab, dtype=bool)
        only[self.close_id] = True
        return only

    def push(self, token: int) -> None:
        """A token was sampled."""
        if token == self.close_id:
            self.inside = False
        elif self.inside:
            self.spent += 1
        elif token == self.open_id:
            self.inside = True
