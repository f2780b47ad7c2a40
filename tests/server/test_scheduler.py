"""The scheduler's bookkeeping on a fake engine (no model): sequences join one batch, finish by
length / stop token / stop string, a cancelled one leaves at the next step, a resent prefix is
reused, and shutdown answers everyone."""
from __future__ import annotations

import queue
import threading
import time

import numpy as np

from gemmalite.runtime.cache import KVState
from gemmalite.runtime.sampling import SamplingParams
from gemmalite.server.scheduler import Finish, Piece, Scheduler, Sequence
from gemmalite.tokenizer import fallback_tokenizer

VOCAB = 105  # the fallback tokenizer's ids up to <unused104>; id n >= 5 reads "<unusedn>"


def _text(*ids: int) -> str:
    return "".join(f"<unused{i}>" for i in ids)


class CountingEngine:
    """Next token = last token + 1 (greedy); records every decode batch's size. Its decode steps
    run only as the test allows (`allow`), so what arrives between two steps is the test's
    choice, not the machine's speed."""

    def __init__(self, steps: int | None = None):
        self.batches: list[int] = []
        self.prefills: list[int] = []  # sequences per prefill_many call
        self.prefilled = 0  # prompt tokens run
        self._steps = steps  # decode steps it may still run (None: any number)
        self._gate = threading.Condition()
        self.held = 0  # steps that have waited at the gate so far

    def allow(self, steps: int | None = None) -> None:
        """Let ``steps`` more decode steps run (None: any number)."""
        with self._gate:
            self._steps = None if steps is None else (self._steps or 0) + steps
            self._gate.notify_all()

    def wait_held(self, count: int = 1) -> None:
        """Until ``count`` steps in all have waited at the gate (the scheduler is inside a step)."""
        with self._gate:
            assert self._gate.wait_for(lambda: self.held >= count, timeout=30), "no step reached the gate"

    def new_state(self) -> KVState:
        return KVState({}, context=64)

    def prefill(self, state, ids, soft=None):
        self.prefilled += len(ids)
        state.length += len(ids)
        state.tokens.extend(int(i) for i in ids)
        return np.array([[float(ids[-1])]])

    def prefill_many(self, states, prompts):
        self.prefills.append(len(prompts))
        return np.concatenate([self.prefill(s, p) for s, p in zip(states, prompts)])

    def logits(self, h, each=False):
        out = np.zeros((h.shape[0], VOCAB), np.float32)
        out[np.arange(h.shape[0]), (h[:, 0].astype(int) + 1) % VOCAB] = 1.0
        return out

    def decode_batch(self, states, tokens):
        with self._gate:
            if self._steps == 0:
                self.held += 1
                self._gate.notify_all()
            # a bound on a test's mistake, not a timing: the test's thread allows the step
            assert self._gate.wait_for(lambda: self._steps != 0, timeout=60), "the test never allowed the step"
            if self._steps is not None:
                self._steps -= 1
        self.batches.append(len(states))
        rows = []
        for s, t in zip(states, tokens):  # a token, or a run of them (prompt-lookup drafts)
            run = [int(i) for i in np.asarray(t).reshape(-1)]
            s.length += len(run)
            s.tokens.extend(run)
            rows += run
        return self.logits(np.array([[float(t)] for t in rows]))


def _seq(ids, max_tokens, events, stop_ids=(), stops=()):
    return Sequence(ids=list(ids), max_tokens=max_tokens, params=SamplingParams(temperature=0), stop_ids=set(stop_ids),
                    stop_strings=list(stops), sink=events.put)


def _until(done, timeout=30.0) -> None:
    """Wait for another thread to make ``done()`` true (a bound against a hang, not a timing)."""
    t0 = time.monotonic()
    while not done():
        assert time.monotonic() - t0 < timeout, "never happened"
        time.sleep(0.001)


def _drain(events: queue.Queue, timeout=10.0):
    text, t0 = [], time.time()
    while True:
        ev = events.get(timeout=max(0.1, timeout - (time.time() - t0)))
        if isinstance(ev, Finish):
            return "".join(text), ev
        text.append(ev.text)


def test_batching_finish_reasons_and_prefix_reuse():
    eng = CountingEngine(steps=0)
    sch = Scheduler(eng, fallback_tokenizer(), max_concurrency=4).start()
    try:
        a, b, c = queue.Queue(), queue.Queue(), queue.Queue()
        sch.submit(_seq([10], 5, a))
        sch.submit(_seq([20], 10, b, stop_ids=[24]))
        sch.submit(_seq([30], 10, c, stops=["d34>"]))
        eng.wait_held()  # a's first step waits; b and c are admitted by the next step at the latest
        eng.allow()
        text_a, fin_a = _drain(a)
        text_b, fin_b = _drain(b)
        text_c, fin_c = _drain(c)
        assert (text_a, fin_a.reason, fin_a.completion_tokens) == (_text(11, 12, 13, 14, 15), "length", 5)
        assert (text_b, fin_b.reason, fin_b.completion_tokens) == (_text(21, 22, 23), "stop", 3)
        assert (text_c, fin_c.reason) == (_text(31, 32, 33) + "<unuse", "stop")
        assert max(eng.batches) == 3  # the sequences stepped together
        # a prompt that extends a finished sequence's tokens reuses its state (all but its last token)
        d = queue.Queue()
        sch.submit(_seq([10, 11, 12, 13, 14, 15, 60], 2, d))
        text_d, fin_d = _drain(d)
        assert (fin_d.cached_tokens, fin_d.prompt_tokens, text_d) == (5, 7, _text(61, 62))
    finally:
        sch.close()
    assert not sch.alive


def test_length_and_cancel_and_shutdown():
    eng = CountingEngine(steps=0)
    sch = Scheduler(eng, fallback_tokenizer(), max_concurrency=1, prefix_cache=0).start()
    a, b = queue.Queue(), queue.Queue()
    seq_a = _seq([10], 50, a)
    sch.submit(seq_a)
    sch.submit(_seq([40], 3, b))  # waits: one sequence at a time
    assert isinstance(a.get(timeout=10), Piece)  # a's first token (its prefill)
    eng.wait_held()  # a's first step waits at the gate
    seq_a.cancel()
    eng.allow()
    _, fin_a = _drain(a)
    assert fin_a.reason == "cancelled" and fin_a.completion_tokens == 2  # left after the step it was in
    text_b, fin_b = _drain(b)  # admitted once a left
    assert (text_b, fin_b.reason) == (_text(41, 42, 43), "length")
    assert sch.active == []
    # shutdown: the running sequence and the waiting ones all get an answer
    eng.allow(0)
    c, d = queue.Queue(), queue.Queue()
    sch.submit(_seq([5], 60, c))
    sch.submit(_seq([6], 60, d))
    c.get(timeout=10)
    eng.wait_held(2)  # c's first step waits at the gate
    closing = threading.Thread(target=sch.close)
    closing.start()
    _until(lambda: sch._stop)  # close() has asked the thread to stop; now let c's step end
    eng.allow()
    fin_c = _drain(c)[1]
    assert (fin_c.reason, fin_c.completion_tokens) == ("cancelled", 2)  # the step it was in, no other
    assert _drain(d)[1].reason == "cancelled"
    closing.join(timeout=30)
    assert not sch.alive


def test_requests_waiting_together_are_prefilled_together():
    """Requests that wait at the same moment go through one `prefill_many` call (a burst does
    not queue behind one prefill after another), and each then streams its own continuation."""
    eng = CountingEngine()
    sch = Scheduler(eng, fallback_tokenizer(), max_concurrency=3, prefix_cache=0)
    sinks = [queue.Queue() for _ in range(4)]
    for i, q in enumerate(sinks):
        sch.waiting.put_nowait(_seq([10 * (i + 1)], 2, q))  # waiting before the thread starts
    sch.start()
    try:
        results = [_drain(q) for q in sinks]
    finally:
        sch.close()
    assert [text for text, _ in results] == [_text(10 * (i + 1) + 1, 10 * (i + 1) + 2) for i in range(4)]
    assert eng.prefills[0] == 3  # the first three together (max_concurrency); the fourth later, alone


def test_a_request_shares_a_running_sequences_prompt():
    """A request whose prompt starts with a running sequence's tokens copies that state and runs
    only its own tail (the running one's prompt is not recomputed); the same prompt as a running
    or just prefilled sequence takes that one's first logits and runs nothing."""
    from gemmalite.server.scheduler import SHARE_MIN

    eng = CountingEngine(steps=0)
    sch = Scheduler(eng, fallback_tokenizer(), max_concurrency=4, prefix_cache=0).start()
    base = list(range(5, 5 + SHARE_MIN + 4))
    try:
        a, b = queue.Queue(), queue.Queue()
        sch.submit(_seq(base, 40, a))
        a.get(timeout=10)  # running: its first step waits at the gate
        sch.submit(_seq(base + [90, 91], 2, b))
        eng.allow(2)  # a's first step; then b joins and takes its second token in the next one
        text_b, fin_b = _drain(b)
        assert (text_b, fin_b.cached_tokens) == (_text(92, 93), len(base))
        assert eng.prefilled == len(base) + 2
        c = queue.Queue()  # the running one's prompt again, after it has taken several steps
        eng.wait_held(2)  # step 3 waits
        eng.allow(3)
        eng.wait_held(3)  # step 6 waits
        sch.submit(_seq(base, 2, c))
        eng.allow(2)  # step 6; c joins (no prefill) and takes its second token in step 7
        text_c, fin_c = _drain(c)
        assert (text_c, fin_c.cached_tokens) == (_text(25, 26), len(base))
        eng.allow()
        assert eng.prefilled == len(base) + 2 and _drain(a)[1].reason == "length"
    finally:
        sch.close()
    eng = CountingEngine()
    sch = Scheduler(eng, fallback_tokenizer(), max_concurrency=4, prefix_cache=0)
    sinks = [queue.Queue() for _ in range(3)]
    for q in sinks:
        sch.waiting.put_nowait(_seq(base, 2, q))
    sch.waiting.put_nowait(_seq(base[: SHARE_MIN - 1] + [99], 1, queue.Queue()))  # shares too little
    sch.start()
    try:
        results = [_drain(q) for q in sinks]
    finally:
        sch.close()
    assert [(t, f.cached_tokens) for t, f in results] == [(_text(25, 26), 0), (_text(25, 26), len(base)), (_text(25, 26), len(base))]
    assert eng.prefilled == len(base) + SHARE_MIN
