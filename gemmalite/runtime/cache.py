"""KV cache: one ring buffer per layer that owns K/V.

Full-attention layers get a ring as long as the context (it never wraps, since a sequence
may not outgrow the context); sliding layers get a ring of ``sliding_window + SPARE_SLOTS``
entries: the most a query can see, plus room for a step of a few tokens (prompt-lookup
verification) to be written in place and rolled back without losing an entry still needed.
KV-shared layers have no cache: they read their producer's. Each slot remembers its absolute position, so attention masks by position and
the slot order does not matter.
"""
from __future__ import annotations

import numpy as np

SPARE_SLOTS = 4  # extra slots per sliding ring: steps of up to SPARE_SLOTS + 1 tokens write in place, and
# a step of up to SPARE_SLOTS + 2 tokens can roll back to any of its positions


class KVRing:
    def __init__(self, capacity: int, kv_heads: int, head_dim: int, window: int | None):
        self.capacity = capacity
        self.window = window  # the farthest back a query looks (None: the whole context)
        # not zeroed: a slot is read only once written (`view` covers the written ones), so a new
        # state costs no page writes (a burst of requests each allocated ~30 MB of zeros)
        self.k = np.empty((capacity, kv_heads, head_dim), np.float32)
        self.v = np.empty((capacity, kv_heads, head_dim), np.float32)
        self.pos = np.full(capacity, -1, np.int64)
        self.length = 0  # positions 0..length-1 have been written

    @property
    def filled(self) -> int:
        return min(self.length, self.capacity)

    def view(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """K, V, positions of every valid slot (views, no copy)."""
        n = self.filled
        return self.k[:n], self.v[:n], self.pos[:n]

    def evicts(self, t: int) -> bool:
        """Would writing ``t`` new entries overwrite a slot that one of the new queries still needs?
        (The first new query, at position ``length``, needs positions above ``length - window``.)"""
        if self.length + t <= self.capacity:
            return False
        window = self.capacity if self.window is None else self.window
        return t > self.capacity - window + 1

    def write(self, k: np.ndarray, v: np.ndarray, start: int) -> None:
        """Store entries for positions ``start..start+T-1`` (only the last `capacity` survive)."""
        assert start == self.length, "KV cache writes must be sequential"
        t = k.shape[0]
        skip = max(0, t - self.capacity)
        positions = np.arange(start + skip, start + t)
        slots = positions % self.capacity
        self.k[slots] = k[skip:]
        self.v[slots] = v[skip:]
        self.pos[slots] = positions
        self.length = start + t

    def clone(self) -> "KVRing":
        """A copy that shares nothing (only the written slots are copied)."""
        ring = KVRing(self.capacity, self.k.shape[1], self.k.shape[2], self.window)
        n = self.filled
        ring.k[:n] = self.k[:n]
        ring.v[:n] = self.v[:n]
        ring.pos[:n] = self.pos[:n]
        ring.length = self.length
        return ring

    def can_truncate(self, n: int) -> bool:
        """Are the entries that a query at position ``n`` needs still stored?"""
        need_from = 0 if self.window is None else max(0, n - self.window + 1)
        return n <= self.length and need_from >= max(0, self.length - self.capacity)

    def truncate(self, n: int) -> None:
        """Forget positions >= n (call `can_truncate` first)."""
        assert self.can_truncate(n)
        self.pos[self.pos >= n] = -1
        self.length = n


class KVState:
    """The decoder's state for one sequence: a ring per K/V-owning layer, and the tokens cached."""

    def __init__(self, rings: dict[int, KVRing], context: int):
        self.rings = rings
        self.context = context
        self.length = 0  # positions computed (the graph advances it)
        self.tokens: list[int] = []  # their token ids (the host keeps them, to reuse a prefix)

    def truncate(self, n: int) -> bool:
        """Roll back to the first ``n`` tokens; False (state unchanged) if a ring cannot."""
        if n > self.length or not all(r.can_truncate(n) for r in self.rings.values()):
            return False
        for r in self.rings.values():
            r.truncate(n)
        self.length = n
        del self.tokens[n:]
        return True

    def clone(self, n: int | None = None) -> "KVState | None":
        """A copy of the first ``n`` tokens (all by default) that shares nothing with this state
        (several requests that start alike take one prefill), or None where a ring cannot roll
        back to ``n``."""
        n = self.length if n is None else n
        if n > self.length or not all(r.can_truncate(n) for r in self.rings.values()):
            return None
        state = KVState({i: r.clone() for i, r in self.rings.items()}, self.context)
        state.length = self.length
        state.tokens = list(self.tokens)
        state.truncate(n)
        return state

    def reset(self) -> None:
        for r in self.rings.values():
            r.pos[:] = -1
            r.length = 0
        self.length = 0
        self.tokens.clear()

    @property
    def nbytes(self) -> int:
        return sum(r.k.nbytes + r.v.nbytes for r in self.rings.values())

