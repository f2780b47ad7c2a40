"""KV cache: one ring buffer per layer that owns K/V.

Full-attention layers get a ring as long as the context (it never wraps, since a sequence
may not outgrow the context); sliding layers get a ring of ``sliding_window + SPARE_SLOTS``
entries: the most a query can see, plus room for a step of a few tokens (prompt-lookup
verification) to be written in place and rolled back without losing an entry still needed.
KV-shared layers have no cache: they read their producer's. Each slot remembers its absolute position, so attention masks by position and
the slot order does not matter.

A sliding ring forgets: it cannot roll back further than its spare slots. A `KVState` therefore
keeps `Checkpoint`s, copies of its sliding rings taken at chosen positions (where a prompt's
last turn starts, where it ends: `runtime.checkpoints`), within a byte budget; `KVState.rollback`
restores the newest one at or before the position asked for when the rings cannot truncate
there (the full rings always can), so a caller reruns only the tokens after it.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

SPARE_SLOTS = 4  # extra slots per sliding ring: steps of up to SPARE_SLOTS + 1 tokens write in place, and
# a step of up to SPARE_SLOTS + 2 tokens can roll back to any of its positions
CHECKPOINTS = 4  # a state's default checkpoint budget: this many copies of its sliding rings (a
# conversation's next turn needs one of its last prompt's: its last turn's header end, its
# generation prompt's empty thought, its end; or, in a tool loop, the current turn's header end)


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

    @property
    def slot_bytes(self) -> int:
        return self.k[0].nbytes + self.v[0].nbytes

    def snapshot(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Copies of the written slots' K, V and positions (what `restore` puts back)."""
        n = self.filled
        return self.k[:n].copy(), self.v[:n].copy(), self.pos[:n].copy()

    def restore(self, snap: tuple[np.ndarray, np.ndarray, np.ndarray], length: int) -> None:
        """Put back a `snapshot` taken when the ring held ``length`` positions (slot for slot)."""
        k, v, pos = snap
        n = pos.shape[0]
        self.k[:n] = k
        self.v[:n] = v
        self.pos[:] = -1
        self.pos[:n] = pos
        self.length = length

    def can_truncate(self, n: int) -> bool:
        """Are the entries that a query at position ``n`` needs still stored?"""
        need_from = 0 if self.window is None else max(0, n - self.window + 1)
        return n <= self.length and need_from >= max(0, self.length - self.capacity)

    def truncate(self, n: int) -> None:
        """Forget positions >= n (call `can_truncate` first)."""
        assert self.can_truncate(n)
        self.pos[self.pos >= n] = -1
        self.length = n


@dataclass(frozen=True, eq=False)
class Checkpoint:
    """A state's sliding rings after its first ``position`` tokens (`KVRing.snapshot` of each; the
    arrays are never written, so clones of a state share them)."""

    position: int
    rings: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for snap in self.rings.values() for a in snap)


class KVState:
    """The decoder's state for one sequence: a ring per K/V-owning layer, the tokens cached, and
    `Checkpoint`s of the sliding rings (``checkpoint_budget`` bytes of them at most; by default
    CHECKPOINTS copies of the sliding rings; 0: none)."""

    def __init__(self, rings: dict[int, KVRing], context: int):
        self.rings = rings
        self.context = context
        self.length = 0  # positions computed (the graph advances it)
        self.tokens: list[int] = []  # their token ids (the host keeps them, to reuse a prefix)
        self.checkpoints: list[Checkpoint] = []  # least recently taken or restored first
        self.checkpoint_budget = CHECKPOINTS * sum(r.k.nbytes + r.v.nbytes + r.pos.nbytes
                                                   for r in self._sliding().values())

    def _sliding(self) -> dict[int, KVRing]:
        return {i: r for i, r in self.rings.items() if r.window is not None}

    def can_truncate(self, n: int) -> bool:
        """Can every ring roll back to ``n`` tokens?"""
        return n <= self.length and all(r.can_truncate(n) for r in self.rings.values())

    def truncate(self, n: int) -> bool:
        """Roll back to the first ``n`` tokens; False (state unchanged) if a ring cannot. Checkpoints
        past ``n`` are dropped."""
        if not self.can_truncate(n):
            return False
        for r in self.rings.values():
            r.truncate(n)
        self.length = n
        del self.tokens[n:]
        self.checkpoints = [c for c in self.checkpoints if c.position <= n]
        return True

    def checkpoint(self) -> None:
        """Keep a checkpoint at the current length (one already there counts as just taken). The
        least recently taken or restored ones go while the checkpoints exceed the budget. A state
        without sliding rings keeps none (its rings can always truncate)."""
        if self.touch(self.length):
            return
        sliding = self._sliding()
        if not sliding:
            return
        cp = Checkpoint(self.length, {i: r.snapshot() for i, r in sliding.items()})
        self.checkpoints.append(cp)
        while self.checkpoints and self.checkpoint_nbytes > self.checkpoint_budget:
            del self.checkpoints[0]

    def touch(self, position: int) -> bool:
        """Count the checkpoint at ``position`` as just taken (False: there is none)."""
        for c in self.checkpoints:
            if c.position == position:
                self.checkpoints.remove(c)
                self.checkpoints.append(c)
                return True
        return False

    def reach(self, n: int) -> int:
        """The length `rollback` (``n``) would reach, without rolling back."""
        n = min(n, self.length)
        if self.can_truncate(n):
            return n
        return max((c.position for c in self.checkpoints if c.position <= n), default=0)

    def rollback(self, n: int) -> int:
        """Roll back to at most ``n`` tokens, as far as possible: to ``n`` where the rings can
        truncate there, else to the newest checkpoint at or before ``n`` (sliding rings restored,
        full rings truncated), else to nothing. Returns the length reached: the caller runs the
        tokens from there on."""
        n = min(n, self.length)
        if self.truncate(n):
            return n
        best = max((c for c in self.checkpoints if c.position <= n), key=lambda c: c.position, default=None)
        if best is None:
            self.reset()
            return 0
        p = best.position
        for i, r in self.rings.items():
            if i in best.rings:
                r.restore(best.rings[i], p)
            else:
                r.truncate(p)  # a full ring: it holds the whole context
        self.length = p
        del self.tokens[p:]
        self.checkpoints = [c for c in self.checkpoints if c.position <= p and c is not best] + [best]
        return p

    def clone(self, n: int | None = None) -> "KVState | None":
        """A copy of the first ``n`` tokens (all by default) that shares nothing written with this
        state (several requests that start alike take one prefill), with the checkpoints up to
        ``n``; None where a ring cannot roll back to ``n``."""
        n = self.length if n is None else n
        if not self.can_truncate(n):
            return None
        state = KVState({i: r.clone() for i, r in self.rings.items()}, self.context)
        state.length = self.length
        state.tokens = list(self.tokens)
        state.checkpoints = list(self.checkpoints)
        state.checkpoint_budget = self.checkpoint_budget
        state.truncate(n)
        return state

    def reset(self) -> None:
        for r in self.rings.values():
            r.pos[:] = -1
            r.length = 0
        self.length = 0
        self.tokens.clear()
        self.checkpoints.clear()

    @property
    def nbytes(self) -> int:
        """The rings' arrays (allocated for the whole context)."""
        return sum(r.k.nbytes + r.v.nbytes for r in self.rings.values())

    @property
    def checkpoint_nbytes(self) -> int:
        return sum(c.nbytes for c in self.checkpoints)

    @property
    def held_bytes(self) -> int:
        """What the state holds: its written K/V slots and its checkpoints (a prefix cache's measure)."""
        return sum(r.filled * r.slot_bytes for r in self.rings.values()) + self.checkpoint_nbytes
