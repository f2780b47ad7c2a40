"""pytest plugin: do gemmalite's numba kernels compute the same bits from numba's disk cache as
freshly compiled? For every kernel called from Python during a test run (up to PER_SIGNATURE
calls per kernel and argument types), the arguments before and the results after are recorded;
at the end each call is replayed through the object code numba's cache would store for that
compiled kernel, loaded into a second, empty JIT engine (which is what a process that loads the
cache runs), and every output array and return value is compared bit for bit.

Why a second engine: numba compiles a parallel kernel's body (and any function a kernel calls)
twice, once alone and once linked into the kernel's library; in the compiling process the first
copy's symbol wins, so the linked copy that the cache holds only runs elsewhere. A fastmath
``reassoc`` sum could be ordered differently in the two (see `gemmalite.kernels.fdot`).

    PYTHONPATH=scripts NUMBA_CACHE_DIR=$(mktemp -d) python -m pytest -q -p audit_kernel_cache tests/kernels tests/weights

prints ``kernel cache audit: N calls replayed, M differ`` and each difference (kernel, argument
types, how many values, the largest gap), and fails the run if any differs. A fresh
NUMBA_CACHE_DIR makes the run compile every kernel itself. Uses numba internals (codegen
libraries, `get_executable`): a development tool. It found the two hazards `common.FAST` names:
``reassoc`` sums (attention_blocked, softmax_rows on main) and an addition of two products
(a fused multiply-add may take either).
"""
from __future__ import annotations

import inspect

import numpy as np
from numba import typeof
from numba.core import codegen
from numba.core.registry import CPUDispatcher, cpu_target

PER_SIGNATURE = 40
_calls: dict[tuple, list] = {}
_plain_call = CPUDispatcher.__call__


def _copy(a):
    return a.copy() if isinstance(a, np.ndarray) else a


def _positional(disp, args, kwargs):
    """``args`` with ``kwargs`` folded in, or None where a default is skipped before a given one."""
    params = list(inspect.signature(disp.py_func).parameters)
    bound = inspect.signature(disp.py_func).bind(*args, **kwargs).arguments
    given = [p for p in params if p in bound]
    return tuple(bound[p] for p in given) if given == params[: len(given)] else None


def _recording_call(self, *args, **kwargs):
    if self.py_func.__module__.startswith("gemmalite."):
        pos = _positional(self, args, kwargs) if kwargs else args
        if pos is not None:
            key = (self, tuple(typeof(a) for a in pos))
            if len(_calls.get(key, ())) < PER_SIGNATURE:
                before = [_copy(a) for a in pos]
                result = _plain_call(self, *pos)
                _calls.setdefault(key, []).append((before, [_copy(a) for a in pos], _copy(result)))
                return result
    return _plain_call(self, *args, **kwargs)


CPUDispatcher.__call__ = _recording_call


def _same(a, b) -> bool:
    if isinstance(a, np.ndarray):
        return a.tobytes() == b.tobytes()
    if isinstance(a, tuple):
        return all(_same(x, y) for x, y in zip(a, b))
    return np.asarray(a).tobytes() == np.asarray(b).tobytes()


def replay() -> tuple[int, list]:
    """(calls replayed, differences) over every recorded call."""
    ctx = cpu_target.target_context
    loaded, diffs, n = {}, [], 0
    for (disp, sig), calls in _calls.items():
        cres = disp.overloads.get(sig)
        if cres is None:
            continue
        if id(cres) not in loaded:  # the cache's object code, alone in an engine of its own
            lib = codegen.JITCPUCodegen("kernel-cache-audit").unserialize_library(
                cres.library.serialize_using_object_code())
            loaded[id(cres)] = (lib, ctx.get_executable(lib, cres.fndesc, cres.environment))
        run = loaded[id(cres)][1]
        for before, after, result in calls:
            args = [_copy(a) for a in before]
            got = run(*args)
            n += 1
            bad = [i for i, (x, y) in enumerate(zip(args, after)) if isinstance(x, np.ndarray) and not _same(x, y)]
            if bad or not _same(got, result):
                count = sum(int(np.count_nonzero(args[i] != after[i])) for i in bad)
                gap = max((float(np.max(np.abs(args[i].astype(np.float64) - after[i]))) for i in bad
                           if args[i].dtype.kind == "f"), default=0.0)
                diffs.append((f"{disp.py_func.__module__}.{disp.py_func.__name__}", sig, count, gap))
    return n, diffs


def pytest_sessionfinish(session, exitstatus):
    n, diffs = replay()
    print(f"\nkernel cache audit: {n} calls replayed, {len(diffs)} differ")
    for name, sig, count, gap in diffs:
        print(f"  {name}{sig}: {count} values differ, up to {gap:.3g}")
    if diffs and session.exitstatus == 0:
        session.exitstatus = 1
