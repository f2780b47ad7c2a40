"""The thread governor: several threads while the machine gives them CPUs, one while it is busy."""
from __future__ import annotations

import numba
import pytest

from gemmalite.runtime import threads as th


class FakeMachine:
    """A machine the test drives: each step's thread gets ``share`` of its wall time on a CPU and
    waits on the run queue for the rest."""

    def __init__(self, cpus=2, share=1.0):
        self.cpus, self.share = cpus, share

    def governor(self) -> th.Governor:
        return th.Governor(cpus=lambda: self.cpus)

    def step(self, g: th.Governor, wall=0.05) -> int:
        n = g.choose()
        g.observe(n, wall, (1 - self.share) * wall)
        return n


def test_idle_machine_keeps_every_cpu():
    m = FakeMachine(cpus=2)
    g = m.governor()
    assert [m.step(g) for _ in range(100)] == [2] * 100 and g.drops == 0


def test_a_busy_machine_sends_steps_to_one_thread_and_tries_again_ever_less_often():
    m = FakeMachine(cpus=2)
    g = m.governor()
    assert m.step(g) == 2
    m.share = 0.33  # four CPU-bound processes arrive: our two threads get a third of their time
    got = [m.step(g) for _ in range(1 + 16 + 1 + 32 + 1 + 64 + 1)]
    tries = [i for i, n in enumerate(got) if n == 2]
    assert tries == [0, 17, 50, 115]  # the step that shows it, then tries 16, 32, 64 steps apart
    assert g.drops == 4
    for _ in range(3000):
        m.step(g)
    assert g.wait == th.Governor.LAST_WAIT  # the spacing stops growing
    m.share = 1.0  # the load is gone: back on every CPU at the next try, and staying there
    got = [m.step(g) for _ in range(th.Governor.LAST_WAIT + 100)]
    first = got.index(2)
    assert first <= th.Governor.LAST_WAIT and set(got[first:]) == {2}


def test_a_good_try_resets_the_spacing():
    m = FakeMachine(cpus=2, share=0.3)
    g = m.governor()
    for _ in range(200):
        m.step(g)
    assert g.wait > th.Governor.FIRST_WAIT
    m.share = 1.0
    while m.step(g) == 1:
        pass
    m.step(g)  # settled on two threads
    m.share = 0.3  # busy again: the first spell is short again
    m.step(g)
    assert g.busy and g.left == th.Governor.FIRST_WAIT


def test_short_steps_and_fair_shares_do_not_drop():
    m = FakeMachine(cpus=4)
    g = m.governor()
    m.share = 0.1
    assert m.step(g, wall=th.Governor.MIN_WALL / 3) == 4  # too short to judge alone
    assert m.step(g, wall=th.Governor.MIN_WALL / 3) == 4
    assert m.step(g, wall=th.Governor.MIN_WALL / 3) == 4  # three short steps make a span
    assert m.step(g) == 1
    g = m.governor()
    m.share = 1 - th.Governor.HIGH_WAIT + 0.05
    assert m.step(g) == 4 and m.step(g) == 4
    m.share = 1 - th.Governor.HIGH_WAIT - 0.05
    assert m.step(g) == 4 and m.step(g) == 1


def test_run_queue_wait_reads_the_schedstat_wait_field(tmp_path):
    """The second field of schedstat (run-queue wait, ns) in seconds; 0.0 where the file is
    missing or unreadable, which keeps every thread."""
    f = tmp_path / "schedstat"
    f.write_bytes(b"81234567 250000000 42\n")
    assert th.run_queue_wait(str(f)) == 0.25
    for bad in (b"", b"81234567\n", b"81234567 x 42\n"):
        f.write_bytes(bad)
        assert th.run_queue_wait(str(f)) == 0.0
    assert th.run_queue_wait(str(tmp_path / "missing")) == 0.0


@pytest.mark.slow  # measures the machine: spinning processes must really take our CPU
def test_run_queue_wait_grows_only_while_waiting_for_a_cpu():
    import multiprocessing as mp
    import time

    def spin(seconds):
        t = time.perf_counter()
        while time.perf_counter() - t < seconds:
            pass

    w0 = th.run_queue_wait()
    time.sleep(0.05)  # sleeping is not waiting for a CPU
    assert th.run_queue_wait() - w0 < 0.04
    if th.run_queue_wait() == 0.0:
        pytest.skip("the kernel does not report run-queue waits")
    burners = [mp.get_context("fork").Process(target=spin, args=(3,), daemon=True) for _ in range(3 * th.usable_cpus())]
    for p in burners:
        p.start()
    try:
        w0, t0 = th.run_queue_wait(), time.perf_counter()
        spin(0.4)
        assert th.run_queue_wait() - w0 > th.Governor.HIGH_WAIT * (time.perf_counter() - t0)
    finally:
        for p in burners:
            p.terminate()


def test_one_cpu_is_one_thread():
    m = FakeMachine(cpus=1, share=0.1)
    g = m.governor()
    assert [m.step(g) for _ in range(20)] == [1] * 20 and g.drops == 0


class Clocks:
    """A wall clock and a run-queue wait counter that move only when the test says."""

    def __init__(self):
        self.wall = self.waited = 0.0

    def advance(self, wall: float, waited: float) -> None:
        self.wall += wall
        self.waited += waited


def test_compute_judges_the_step_by_the_governors_clocks(monkeypatch):
    """`compute(None)` gives the governor the wall time and run-queue wait its clocks counted
    between the step's start and end: a step that waited 60 % of its time sends the next to one thread."""
    c = Clocks()
    g = th.Governor(cpus=lambda: 2, clock=lambda: c.wall, wait_clock=lambda: c.waited)
    monkeypatch.setattr(th, "GOVERNOR", g)
    c.advance(100.0, 40.0)  # what happened before the step is not the step's
    with th.compute(None) as n:
        assert n == min(2, numba.config.NUMBA_NUM_THREADS)
        c.advance(0.01, 0.002)  # 20 %: not busy
    assert not g.busy and g.drops == 0
    with th.compute(None):
        c.advance(0.01, 0.006)
    assert g.busy and g.drops == 1 and g.left == th.Governor.FIRST_WAIT
    with th.compute(None) as n:
        assert n == 1
    assert g.left == th.Governor.FIRST_WAIT - 1


def test_compute_uses_an_explicit_count_as_given_and_the_governor_otherwise(monkeypatch):
    c = Clocks()  # frozen: no step is judged busy, whatever the machine does meanwhile
    monkeypatch.setattr(th, "GOVERNOR", th.Governor(cpus=lambda: 2, clock=lambda: c.wall, wait_clock=lambda: c.waited))
    pool = numba.config.NUMBA_NUM_THREADS
    with th.compute(1) as n:
        assert n == 1 == numba.get_num_threads()
    with th.compute(None) as n:
        assert n == min(2, pool) == numba.get_num_threads()
    th.GOVERNOR.busy, th.GOVERNOR.left = True, 5
    with th.compute(None) as n:
        assert n == 1 == numba.get_num_threads()
    assert th.GOVERNOR.left == 4
    with th.compute(min(2, pool)):  # an inner step keeps the outer count and is not judged apart
        with th.compute(None) as n:
            assert n == min(2, pool) == numba.get_num_threads()
    assert th.GOVERNOR.left == 4


def test_check_threads():
    assert th.check_threads(None) is None and th.check_threads(3) == 3
    for bad in (0, -1, True, 1.5, "2"):
        with pytest.raises(ValueError, match="threads"):
            th.check_threads(bad)
