"""The engine step the scheduler drives: the model's own `Engine` when it has one.

Until the runtime layer's Engine lands, a thin adapter over `Model`'s host pieces gives the
same calls (new_state, prefill, logits, decode_step, decode_batch)."""
from __future__ import annotations

import numpy as np

from ..kernels import softcap


class _ModelEngine:
    def __init__(self, model):
        self.model = model

    def new_state(self):
        return self.model.new_state()

    def prefill(self, state, ids: np.ndarray) -> np.ndarray:
        return self.model._forward(state, np.asarray(ids, dtype=np.int64), keep=np.array([len(ids) - 1]))

    def logits(self, h: np.ndarray) -> np.ndarray:
        return self.model._logits(h)

    def decode_step(self, state, tok: int) -> np.ndarray:
        return self.logits(self.model._forward(state, np.array([tok], dtype=np.int64)))[0]

    def decode_batch(self, states, tokens) -> np.ndarray:
        """One token for each sequence in one pass over the weights: logits ``[B, vocab]``,
        row b equal to ``decode_step(states[b], tokens[b])``."""
        m, cfg = self.model, self.model.config
        ids = np.asarray(tokens, dtype=np.int64)
        x0 = m.embed.rows(ids) * cfg.embed_scale
        ple = m.ple_table.rows(ids) * np.float32(np.sqrt(cfg.ple_dim)) if m.ple_table is not None else None
        h = m.graph.forward_batch(states, x0, ple)
        for s, t in zip(states, ids):
            s.tokens.append(int(t))
        return softcap(m.lm_head.matmul_each(h), cfg.final_logit_softcapping)


class _Batched:
    """Adds a per-sequence ``decode_batch`` to an engine that has none."""

    def __init__(self, engine):
        self._engine = engine

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def decode_batch(self, states, tokens) -> np.ndarray:
        return np.stack([self._engine.decode_step(s, int(t)) for s, t in zip(states, tokens)])


def engine_for(model):
    eng = getattr(model, "engine", None) or _ModelEngine(model)
    return eng if hasattr(eng, "decode_batch") else _Batched(eng)
