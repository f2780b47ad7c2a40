"""Where a conversation's KV state is checkpointed: the prefill of a prompt stops at the last
turn's markup and at its end, and `KVState.checkpoint` copies the sliding rings there.

A chat template re-renders the last reply otherwise than the tokens the model generated
(Gemma 4: the generation prompt's empty thought ``<|channel>thought\\n<channel|>`` is not in the
history, thoughts of earlier turns are dropped, a tool call is followed by its response in the
same turn), so the next prompt shares with the state a prefix that ends where the last reply
began or a few tokens before: further back than a sliding ring can roll back. Checkpoints where
the prompt's last turn starts (after its ``<|turn>model\n`` header), at its last thought channel
(the generation prompt's empty thought) and at its end put one at every such common prefix;
`KVState.rollback` then restores it and the next turn runs only the rest.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..tokenizer import Tokenizer
from .cache import KVState
from .engine import Engine, SoftTokens

TURN_MARKERS = ("<|turn>", "<start_of_turn>")  # Gemma 4's, Gemma 3's turn start ("<|turn>model\n")
OTHER_MARKERS = ("<|channel>",)  # Gemma 4's thought channel (the generation prompt's empty thought)
HEADER_MAX = 4  # tokens of a turn's header after its marker: the role, then the newline


@dataclass(frozen=True)
class Markers:
    """The token ids a prompt's prefill stops at (`marker_ids`)."""

    turns: frozenset[int] = frozenset()
    others: frozenset[int] = frozenset()
    newline: int | None = None


def marker_ids(tokenizer: Tokenizer | None) -> Markers:
    """The ids of the markers ``tokenizer`` has (none without a tokenizer)."""
    if tokenizer is None:
        return Markers()

    def ids(names: tuple[str, ...]) -> frozenset[int]:
        return frozenset(t for s in names if (t := tokenizer.token_id(s)) is not None)

    return Markers(ids(TURN_MARKERS), ids(OTHER_MARKERS), tokenizer.token_id("\n"))


def split_points(ids: np.ndarray, markers: Markers) -> list[int]:
    """The positions (not 0, before the prompt's end) where a prefill of ``ids`` stops for a
    checkpoint, ascending: the end of the last turn's header (its newline within HEADER_MAX tokens
    of the turn marker; the marker itself without one), and the last occurrence of each other
    marker."""
    arr = np.asarray(ids)
    points = set()
    for m in markers.turns | markers.others:
        hits = np.flatnonzero(arr == m)
        if not hits.size:
            continue
        p = int(hits[-1])
        if m in markers.turns and markers.newline is not None:
            nl = np.flatnonzero(arr[p + 1 : p + 1 + HEADER_MAX] == markers.newline)
            p += 2 + int(nl[0]) if nl.size else 0
        points.add(p)
    return sorted(q for q in points if 0 < q < len(arr))


def prefill_heads(engine: Engine, states: list[KVState], prompts: list[np.ndarray], markers: Markers,
                  soft: list[SoftTokens | None] | None = None) -> None:
    """Run each prompt from its state's length up to its last split point, in pieces, keeping a
    checkpoint at each split point (those before where a prompt starts count as used again: the
    next turn needs them too). Round by round, every prompt's next piece runs in one
    `Engine.prefill_many` (alone with ``soft`` rows: pictures). The caller runs the rest of each
    prompt (from ``state.length``), then calls ``state.checkpoint()`` at the prompt's end."""
    soft = soft or [None] * len(states)
    todo = [(st, ids, sf, split_points(ids, markers)) for st, ids, sf in zip(states, prompts, soft)]
    while True:
        batch = []
        for st, ids, sf, points in todo:
            while points and points[0] <= st.length:
                p = points.pop(0)
                if p == st.length:
                    st.checkpoint()
                else:
                    st.touch(p)
            if points:
                a, b = st.length, points[0]
                batch.append((st, ids[a:b], sf.after(a, b) if sf is not None else None))
        if not batch:
            return
        plain = [b for b in batch if b[2] is None]
        if len(plain) > 1:
            engine.prefill_many([b[0] for b in plain], [b[1] for b in plain])
        for st, piece, sf in batch:
            if sf is not None or len(plain) <= 1:
                engine.prefill(st, piece, sf)
