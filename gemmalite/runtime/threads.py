"""Compute threads: one step at a time in a process, on as many threads as the machine gives it.

Kernel threads wait for each other at the end of every parallel region (a decode step has
hundreds). A short spin before sleeping (``GOMP_SPINCOUNT``, set in `settings`) saves the
wake-up on an idle machine, but on a busy one a spinning thread burns the time slice that the
thread it waits for needs, and a step can take ten times longer. So `Governor` watches each
step when the thread count is left to it:

* on several threads, a step during which the calling thread spent a good part of its time
  ready to run but not running (the kernel's run-queue wait, ``/proc/thread-self/schedstat``:
  other work had the CPUs) sends the next steps to one thread, which never waits for another.
  (Process CPU time against wall time would mistake a step's serial parts for a busy machine);
* on one thread, it tries every usable CPU again after a while, and waits twice as long
  before the next try each time a try finds the machine still busy (a try costs one slow step;
  the run queue cannot tell, since other work may run at a lower priority than ours).

An explicit count (``threads=`` on `load`, ``--threads``) is used as given.
"""
from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from typing import Callable, Iterator

from ..settings import usable_cpus

COMPUTE_LOCK = threading.RLock()  # numba's pool is process-wide: one step computes at a time


def check_threads(threads: int | None) -> int | None:
    if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
        raise ValueError(f"threads must be a positive integer, got {threads!r}")
    return threads


def set_numba_threads(n: int) -> int:
    """Threads for the numba kernels this thread runs next, capped at the pool numba started with."""
    import numba

    n = max(1, min(n, numba.config.NUMBA_NUM_THREADS))
    numba.set_num_threads(n)
    return n


def use_threads(threads: int | None) -> None:
    """``threads`` (None: every CPU this process may use) for this thread's next kernels."""
    set_numba_threads(threads or usable_cpus())


def limit_blas_threads(threads: int | None) -> None:
    """Cap OpenBLAS (numpy's BLAS) threads process-wide; None leaves it as it is."""
    if threads is None:
        return
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:  # optional: without it BLAS keeps its own count
        return
    threadpool_limits(threads, user_api="blas")


SCHEDSTAT = "/proc/thread-self/schedstat"  # cpu time, run-queue wait (ns), time slices of the calling thread


def run_queue_wait(path: str = SCHEDSTAT) -> float:
    """Seconds the calling thread has spent ready to run but waiting for a CPU (Linux schedstat;
    0.0 where the kernel does not say, which keeps every thread)."""
    try:
        with open(path, "rb") as f:
            return int(f.read().split()[1]) * 1e-9
    except (OSError, ValueError, IndexError):
        return 0.0


class Governor:
    """Chooses the thread count of each step from how the previous steps went (see the module)."""

    HIGH_WAIT = 0.25  # run-queue wait above this share of the wall time: the machine is busy
    MIN_WALL = 0.002  # shorter spans say nothing reliable: short steps are judged together
    FIRST_WAIT, LAST_WAIT = 16, 512  # steps on one thread before trying several again (doubling)

    def __init__(self, cpus: Callable[[], int] = usable_cpus,
                 clock: Callable[[], float] = time.perf_counter, wait_clock: Callable[[], float] | None = None):
        self.cpus, self.clock = cpus, clock
        self.wait_clock = wait_clock or run_queue_wait
        self.busy = False  # on one thread because the machine was busy
        self.left = 0  # steps to go on one thread before the next try
        self.wait = self.FIRST_WAIT  # the current spacing of tries
        self.trying = False  # the next several-thread step is a try after a busy spell
        self.drops = 0  # times a busy machine sent the steps to one thread (for stats and tests)
        self.span = [0.0, 0.0]  # wall and run-queue wait seconds of the several-thread steps not judged yet

    def choose(self) -> int:
        if self.busy and self.left <= 0:
            self.busy, self.trying = False, True
        return 1 if self.busy else self.cpus()

    def observe(self, n: int, wall: float, waited: float) -> None:
        """Account one step that ran on ``n`` threads for ``wall`` seconds, ``waited`` of them on the run queue."""
        if self.busy:
            self.left -= 1
            return
        if n < 2:
            return
        self.span[0] += wall
        self.span[1] += waited
        wall, waited = self.span
        if wall < self.MIN_WALL:
            return
        self.span = [0.0, 0.0]
        if waited > self.HIGH_WAIT * wall:
            self.wait = min(2 * self.wait, self.LAST_WAIT) if self.trying else self.FIRST_WAIT
            self.busy, self.left, self.trying = True, self.wait, False
            self.drops += 1
        else:
            self.trying = False


GOVERNOR = Governor()


_inside = threading.local()  # compute() depth per thread: an inner compute() keeps the outer's count


@contextmanager
def compute(threads: int | None) -> Iterator[int]:
    """Hold the compute lock for one step on ``threads`` threads (None: the governor chooses).
    Nested inside another `compute` (of this thread), it runs on the outer one's count."""
    with COMPUTE_LOCK:
        depth = getattr(_inside, "depth", 0)
        _inside.depth = depth + 1
        try:
            if depth:
                import numba

                yield numba.get_num_threads()
            elif threads is not None:
                yield set_numba_threads(threads)
            else:
                n = set_numba_threads(GOVERNOR.choose())
                t0, w0 = GOVERNOR.clock(), GOVERNOR.wait_clock()
                yield n
                GOVERNOR.observe(n, GOVERNOR.clock() - t0, GOVERNOR.wait_clock() - w0)
        finally:
            _inside.depth = depth
