"""The ring-buffer KV cache: what it keeps, what it forgets, when it can roll back."""
import numpy as np
import pytest
from conftest import random_ids

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


# -- checkpoints of the sliding rings ----------------------------------------------------------
def _state(window=4, spare=4, context=64):
    rings = {0: KVRing(window + spare, 1, 2, window=window), 1: KVRing(context, 1, 2, window=None)}
    return KVState(rings, context=context)


def _advance(state, positions):
    """Write ``positions`` (K = the position) into every ring, as the graph would."""
    positions = list(positions)
    for r in state.rings.values():
        r.write(*_kv(positions), start=state.length)
    state.length += len(positions)
    state.tokens += [100 + p for p in positions]


def _visible(ring, length):
    """(position, K, V) of each slot a query after ``length`` positions can see, by position."""
    k, v, pos = ring.view()
    lo = 0 if ring.window is None else length - ring.window
    live = np.flatnonzero((pos >= max(lo, 0)) & (pos < length))
    live = live[np.argsort(pos[live])]
    return pos[live], k[live], v[live]


def assert_same_state(got, want):
    """Equal tokens and, ring by ring, every entry a later query can see (bit for bit)."""
    assert (got.length, got.tokens) == (want.length, want.tokens)
    for i, ring in want.rings.items():
        for x, y in zip(_visible(got.rings[i], got.length), _visible(ring, want.length)):
            np.testing.assert_array_equal(x, y)


def test_rollback_restores_the_newest_checkpoint_at_or_before_n():
    """Past the sliding ring's reach, `rollback` restores the newest checkpoint within ``n`` (the
    state then equals one computed from scratch to there) and drops the later ones; within reach
    it truncates exactly; with no checkpoint before ``n`` it starts over."""
    state = _state()
    for stop in (10, 20, 30):
        _advance(state, range(state.length, stop))
        state.checkpoint()
    _advance(state, range(30, 40))
    assert not state.can_truncate(25) and state.reach(25) == 20
    assert state.rollback(25) == 20
    fresh = _state()
    _advance(fresh, range(20))
    assert_same_state(state, fresh)
    assert [c.position for c in state.checkpoints] == [10, 20]
    _advance(state, range(20, 27))  # and it goes on as the fresh one does
    _advance(fresh, range(20, 27))
    assert_same_state(state, fresh)
    assert state.rollback(26) == 26 and state.length == 26  # within the ring's reach: exactly
    assert state.rollback(5) == 0 and state.length == 0 and state.tokens == [] and state.checkpoints == []


def test_checkpoints_stay_within_their_budget_least_recently_used_out_first():
    state = _state()
    one = None
    for stop in (10, 20, 30):
        _advance(state, range(state.length, stop))
        state.checkpoint()
        one = one or state.checkpoints[0].nbytes
    assert state.checkpoint_nbytes <= state.checkpoint_budget and len(state.checkpoints) == 3
    state.checkpoint_budget = 2 * one
    assert state.touch(10) and not state.touch(11)  # 10 is now the most recently used
    _advance(state, range(30, 40))
    state.checkpoint()
    assert [c.position for c in state.checkpoints] == [10, 40]  # 20, then 30 went
    assert state.checkpoint_nbytes <= state.checkpoint_budget
    state.checkpoint()  # the same position again: no copy
    assert [c.position for c in state.checkpoints] == [10, 40]
    state.checkpoint_budget = 0
    _advance(state, range(40, 41))
    state.checkpoint()
    assert state.checkpoints == []


def test_a_state_without_sliding_rings_keeps_no_checkpoints():
    state = KVState({0: KVRing(16, 1, 2, window=None)}, context=16)
    _advance(state, range(9))
    state.checkpoint()
    assert state.checkpoints == [] and state.rollback(3) == 3


def test_clone_keeps_the_checkpoints_up_to_its_length():
    state = _state()
    for stop in (10, 20):
        _advance(state, range(state.length, stop))
        state.checkpoint()
    _advance(state, range(20, 22))
    copy = state.clone(21)
    assert [c.position for c in copy.checkpoints] == [10, 20]
    assert copy.checkpoints[0] is state.checkpoints[0]  # snapshots are never written: shared
    _advance(copy, range(21, 40))
    assert copy.rollback(30) == 20 and state.length == 22  # the original is untouched
    fresh = _state()
    _advance(fresh, range(20))
    assert_same_state(copy, fresh)


# -- on the engine: prefill in pieces, roll back, against the state computed from scratch ------
@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    from gemmalite.tools.synth import synth

    return synth("tiny", tmp_path_factory.mktemp("tiny"), progress=False)  # sliding window 16


@pytest.mark.parametrize("quant", [None, "int8"])
def test_rollback_to_a_checkpoint_gives_the_bits_of_the_state_never_rolled_back(tiny_path, gl, quant):
    """A prompt prefilled in pieces, checkpointed between them, then decoded past the sliding ring's
    reach: `rollback` restores the newest checkpoint within the point asked (the later ones go),
    and running the rest of the prompt from there gives, bit for bit, the logits and state of
    the same pieces run straight through."""
    eng = gl.load(tiny_path, context=256, quant=quant).engine
    ids = np.array(random_ids(150, 5000, seed=3))
    cuts = [0, 37, 90, 91, 150]
    straight = eng.new_state()
    for a, b in zip(cuts, cuts[1:]):
        want = eng.logits(eng.prefill(straight, ids[a:b]))
    state = eng.new_state()
    for a, b in zip(cuts, cuts[1:]):
        eng.prefill(state, ids[a:b])
        state.checkpoint()
    for t in random_ids(30, 5000, seed=4):
        eng.decode_step(state, t)
    assert not state.can_truncate(95) and state.reach(95) == 91 and state.rollback(95) == 91
    assert [c.position for c in state.checkpoints] == [37, 90, 91]
    np.testing.assert_array_equal(eng.logits(eng.prefill(state, ids[91:])), want)
    assert_same_state(state, straight)


def test_prompts_prefilled_together_in_pieces_get_their_solo_bits(tiny_path, gl):
    """`prefill_heads` of two chat prompts in one call (each round one `prefill_many`) leaves each
    state, its checkpoints and its last logits as the prompt alone would."""
    from gemmalite.chat import chat_ids
    from gemmalite.runtime.checkpoints import marker_ids, prefill_heads, split_points

    model = gl.load(tiny_path, context=256)
    eng, markers = model.engine, marker_ids(model.tokenizer)
    prompts = [np.array(chat_ids(model.tokenizer, [{"role": "system", "content": s}, {"role": "user", "content": u}]))
               for s, u in (("Be brief.", "Weather in Paris?"), ("Answer in French, and in full sentences.", "Hi"))]

    def run(states, ids_list):
        prefill_heads(eng, states, ids_list, markers)
        return [eng.logits(eng.prefill(st, ids[st.length:])) for st, ids in zip(states, ids_list)]

    alone = [eng.new_state() for _ in prompts]
    want = [run([st], [ids])[0] for st, ids in zip(alone, prompts)]
    together = [eng.new_state() for _ in prompts]
    got = run(together, prompts)
    for g, w, a, t, ids in zip(got, want, alone, together, prompts):
        np.testing.assert_array_equal(g, w)
        assert_same_state(t, a)
        assert [c.position for c in t.checkpoints] == split_points(ids, markers) != []
        for c, d in zip(t.checkpoints, a.checkpoints):
            for i in c.rings:
                for x, y in zip(c.rings[i], d.rings[i]):
                    np.testing.assert_array_equal(x, y)
