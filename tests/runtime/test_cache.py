"""The ring-buffer KV cache: what it keeps, what it forgets, when it can roll back."""
import numpy as np

from gemmalite.runtime.cache import KVRing, KVState


def _kv(positions, heads=1, dim=2):
    k = np.stack([np.full((heads, dim), p, np.float32) for p in positions])
    return k, -k


def test_sliding_ring_keeps_exactly_the_last_window():
    ring = KVRing(4, 1, 2, window=4)
    for p in range(10):
        ring.write(*_kv([p]), start=p)
    k, v, pos = ring.view()
    assert sorted(pos.tolist()) == [6, 7, 8, 9]
    assert ring.k.shape[0] == 4  # never grows past the window
    for kk, pp in zip(k, pos):
        assert kk[0, 0] == pp


def test_prefill_longer_than_ring_keeps_tail():
    ring = KVRing(4, 1, 2, window=4)
    ring.write(*_kv(range(7)), start=0)
    assert sorted(ring.view()[2].tolist()) == [3, 4, 5, 6]
    assert ring.evicts(2) and not ring.evicts(1)


def test_full_ring_views_without_copy_and_truncates():
    ring = KVRing(16, 1, 2, window=None)
    ring.write(*_kv(range(5)), start=0)
    k, _, pos = ring.view()
    assert np.shares_memory(k, ring.k) and pos.tolist() == [0, 1, 2, 3, 4]
    assert ring.can_truncate(3)
    ring.truncate(3)
    assert ring.length == 3 and ring.view()[2].tolist() == [0, 1, 2]


def test_wrapped_sliding_ring_refuses_deep_rollback():
    ring = KVRing(4, 1, 2, window=4)
    ring.write(*_kv(range(10)), start=0)
    assert ring.can_truncate(9)  # position 9 needs 6..8: still stored
    assert not ring.can_truncate(7)  # position 7 needs 4..6: 4 and 5 were overwritten


def test_state_truncate_is_all_or_nothing():
    rings = {0: KVRing(4, 1, 2, window=4), 1: KVRing(32, 1, 2, window=None)}
    state = KVState(rings, context=32)
    for r in rings.values():
        r.write(*_kv(range(10)), start=0)
    state.length, state.tokens = 10, list(range(10))
    assert not state.truncate(5)
    assert state.length == 10 and rings[1].length == 10  # unchanged
    assert state.truncate(9) and state.tokens == list(range(9)) and rings[1].length == 9


def test_spare_slots_let_a_short_step_write_in_place_and_roll_back():
    """window 4 + 4 spare slots: a 4-token step writes in place (nothing the new queries need is
    overwritten) and rolls back to any of its positions; a longer step cannot roll back to every position."""
    ring = KVRing(8, 1, 2, window=4)
    ring.write(*_kv(range(20)), start=0)
    assert not ring.evicts(4) and not ring.evicts(5) and ring.evicts(6)
    ring.write(*_kv(range(20, 24)), start=20)
    assert all(ring.can_truncate(n) for n in range(20, 25))
    ring.truncate(21)
    pos = ring.view()[2]
    assert sorted(pos[pos >= 0].tolist()) == list(range(16, 21))  # what position 21's query needs, and more
    ring.write(*_kv(range(21, 28)), start=21)  # 7 tokens: rolls back no further than its 3rd position
    assert not ring.can_truncate(22) and ring.can_truncate(23)


def test_clone_shares_nothing_and_rolls_back_only_where_the_rings_can():
    """`KVState.clone`: the copy holds the same entries (of a wrapped sliding ring too), writing to
    either leaves the other as it was, and a prefix the sliding ring no longer holds gives None."""
    full, sliding = KVRing(16, 1, 2, window=None), KVRing(6, 1, 2, window=4)
    state = KVState({0: full, 1: sliding}, context=16)
    for r in (full, sliding):
        r.write(*_kv(range(9)), start=0)
    state.length, state.tokens = 9, list(range(100, 109))
    copy = state.clone()
    for a, b in zip(state.rings.values(), copy.rings.values()):
        assert sorted(a.view()[2].tolist()) == sorted(b.view()[2].tolist())
        np.testing.assert_array_equal(a.view()[0], b.view()[0])
    for r in copy.rings.values():
        r.write(*_kv([50]), start=9)
    assert full.length == 9 and 9 not in sliding.pos and copy.length == 9 and state.tokens == list(range(100, 109))
    short = state.clone(7)  # the sliding ring still holds positions 3.. (needs 4.. for a query at 7)
    assert short.length == 7 and short.tokens == list(range(100, 107)) and state.length == 9
    assert state.clone(2) is None and state.length == 9  # position 2 left the 6-slot ring
    assert state.clone(10) is None
