"""The engine step: token ids in, logits out, over an explicit per-request state.

`Engine` holds what every request shares and nobody changes: the decoder graph and the host's
tables (token embedding, PLE table, LM head). Everything a request changes lives in its
`KVState`, so requests on one engine never see each other:

    state = engine.new_state()
    logits = engine.logits(engine.prefill(state, ids))[0]   # the prompt; logits of its last position
    logits = engine.decode_step(state, next_id)             # one token

The host side (row lookups, LM head, softcap) is here; the graph (layers + KV cache) is behind
``graph.forward(state, x0, ple_rows, keep)``, the one call another backend would implement.
One step computes at a time in a process (`COMPUTE_LOCK`): the kernels already use every core,
and numba's thread pool is shared by the whole process.
"""
from __future__ import annotations

import threading
from typing import Protocol

import numpy as np

from ..kernels.ops import softcap
from ..settings import usable_cpus
from ..weights.matrix import Matrix
from .cache import KVState

COMPUTE_LOCK = threading.RLock()


def check_threads(threads: int | None) -> int | None:
    if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
        raise ValueError(f"threads must be a positive integer, got {threads!r}")
    return threads


def use_threads(threads: int | None) -> None:
    """Compute threads for the steps this thread runs next (numba's count is per calling thread):
    ``threads``, capped at the pool numba started with; None = the CPUs this process may use now
    (its affinity mask). OpenBLAS is capped process-wide by `limit_blas_threads`."""
    import numba

    pool = numba.config.NUMBA_NUM_THREADS
    numba.set_num_threads(min(threads or usable_cpus(), pool))


def limit_blas_threads(threads: int | None) -> None:
    """Cap OpenBLAS (numpy's BLAS) threads process-wide; None leaves it as it is."""
    if threads is None:
        return
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:  # optional: without it BLAS keeps its own count
        return
    threadpool_limits(threads, user_api="blas")


class Graph(Protocol):
    def new_state(self, context: int) -> KVState: ...

    def forward(self, state: KVState, x0: np.ndarray, ple_rows: np.ndarray | None,
                keep: np.ndarray | None = None, capture: list | None = None) -> np.ndarray: ...


class Engine:
    """Shared, read-only weights and the public step functions over a `KVState`."""

    def __init__(self, graph: Graph, embed: Matrix, lm_head: Matrix, ple_table: Matrix | None, *,
                 vocab_size: int, embed_scale: float, ple_scale: float, softcap: float | None, context: int,
                 threads: int | None = None):
        self.graph = graph
        self.embed = embed
        self.lm_head = lm_head
        self.ple_table = ple_table
        self.vocab_size = vocab_size
        self.embed_scale = np.float32(embed_scale)
        self.ple_scale = np.float32(ple_scale)
        self.softcap = softcap
        self.context = context
        self.threads = check_threads(threads)  # compute threads per step; None = every usable CPU

    def new_state(self) -> KVState:
        """Empty KV caches for one sequence of up to ``context`` tokens."""
        return self.graph.new_state(self.context)

    def forward(self, state: KVState, ids: np.ndarray, keep: np.ndarray | None = None,
                capture: list | None = None) -> np.ndarray:
        """Run ``ids`` after what ``state`` holds; final hidden states of the ``keep`` rows (all by
        default). Host row lookups, then the graph; the ids are recorded in ``state.tokens``."""
        ids = np.asarray(ids, dtype=np.int64)
        with COMPUTE_LOCK:
            use_threads(self.threads)
            x0 = self.embed.rows(ids) * self.embed_scale
            ple = self.ple_table.rows(ids) * self.ple_scale if self.ple_table is not None else None
            h = self.graph.forward(state, x0, ple, keep=keep, capture=capture)
        state.tokens.extend(int(i) for i in ids)
        return h

    def prefill(self, state: KVState, ids: np.ndarray) -> np.ndarray:
        """Run a prompt (or the new part of one); the final hidden state of its last position ``[1, H]``."""
        return self.forward(state, ids, keep=np.array([len(ids) - 1]))

    def logits(self, h: np.ndarray) -> np.ndarray:
        """float32 logits ``[n, vocab]`` of final hidden states ``[n, H]`` (LM head, then softcap)."""
        with COMPUTE_LOCK:
            use_threads(self.threads)
            return softcap(self.lm_head.matmul(h), self.softcap)

    def decode_step(self, state: KVState, token: int) -> np.ndarray:
        """Append one token to ``state``; the logits ``[vocab]`` of the next position."""
        return self.logits(self.forward(state, np.array([token], dtype=np.int64)))[0]
