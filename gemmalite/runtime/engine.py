"""The engine step: token ids in, logits out, over an explicit per-request state.

`Engine` holds what every request shares and nobody changes: the decoder graph and the host's
tables (token embedding, PLE table, LM head). Everything a request changes lives in its
`KVState`, so requests on one engine never see each other:

    state = engine.new_state()
    logits = engine.logits(engine.prefill(state, ids))[0]   # the prompt; logits of its last position
    logits = engine.decode_step(state, next_id)             # one token
    logits = engine.decode_batch(states, next_ids)          # one token for each of B sequences
    h = engine.prefill_many(states, prompts)                # several prompts in one pass

The host side (row lookups, LM head, softcap) is here; the graph (layers + KV cache) is behind
the `Graph` protocol (``new_state``, ``forward``, ``forward_batch``, ``forward_many``), what
another backend implements.
One step computes at a time in a process, on the threads `runtime.threads` gives it: the kernels
already use every core, and numba's thread pool is shared by the whole process.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import numpy as np

from ..errors import ContextError
from ..kernels.ops import softcap
from ..weights.matrix import Matrix
from .cache import KVState
from .threads import check_threads, compute

PREFILL_CHUNK = 512  # prompt tokens per graph call: activations and the attention's key
# windows stay this size however long the prompt, so memory stays flat


S = TypeVar("S", bound=KVState)


class Graph(Protocol[S]):
    """The decoder graph (layers + KV cache) behind `Engine`, on states of its own type ``S``:
    `models.gemma.graph.DecoderGraph` (`KVState`), `backends.onnx.ort.OrtGraph` (`OrtState`).
    ``x0`` ``[R, H]``: scaled embeddings; ``ple_rows`` ``[R, L*P]``: scaled PLE token rows (None
    without PLE); each call appends its rows' K/V to the states and returns final-normed hidden
    states."""

    def new_state(self, context: int) -> S:
        """Empty caches for one sequence of up to ``context`` tokens."""
        ...

    def forward(self, state: S, x0: np.ndarray, ple_rows: np.ndarray | None, keep: np.ndarray | None = None,
                capture: list[np.ndarray] | None = None) -> np.ndarray:
        """One sequence's new rows; the hidden states of the ``keep`` rows (all by default).
        ``capture`` (debugging) receives the input and each layer's output."""
        ...

    def forward_batch(self, states: list[S], x0: np.ndarray, ple_rows: np.ndarray | None,
                      counts: list[int] | None = None) -> np.ndarray:
        """One decode step of B sequences, ``counts[b]`` rows each (default one); every row's hidden
        state, each exactly a one-token step's."""
        ...

    def forward_many(self, states: list[S], x0: np.ndarray, ple_rows: np.ndarray | None,
                     counts: list[int]) -> np.ndarray:
        """Several prompts, ``counts[b]`` rows each, in one pass; the hidden state of each one's last row."""
        ...


@dataclass(frozen=True)
class SoftTokens:
    """Prompt rows whose embeddings are given (an image's soft tokens) instead of looked up.

    Their table lookups (PLE token rows) use the pad id, as transformers does; the state records
    ``keys`` for them instead of the placeholder id, so that a cached prefix is never reused past
    a row whose picture changed (two pictures of one size give the same token ids)."""

    rows: np.ndarray  # int64 [n], ascending positions in the prompt
    vectors: np.ndarray  # float32 [n, H]
    keys: np.ndarray  # int64 [n], negative (never a token id)

    def after(self, start: int, stop: int | None = None) -> "SoftTokens | None":
        """The rows from prompt position ``start`` on (to ``stop``), renumbered from there (None if none)."""
        keep = (self.rows >= start) & (self.rows < (stop if stop is not None else np.iinfo(np.int64).max))
        if not keep.any():
            return None
        return SoftTokens(self.rows[keep] - start, self.vectors[keep], self.keys[keep])

    def keyed(self, ids: np.ndarray) -> list[int]:
        """``ids`` with the keys in place of the placeholders (what a state records)."""
        out = np.array(ids, dtype=np.int64)
        out[self.rows] = self.keys
        return out.tolist()


KEY_SPACE = 1 << 62


@dataclass(frozen=True)
class Block:
    """One input's soft tokens as they enter a prompt, ``begin`` + N x ``token`` + ``end`` (a
    picture, a video frame, an audio clip); ``digest`` identifies the input (KV-cache reuse)."""

    begin: int
    token: int
    end: int
    vectors: np.ndarray  # float32 [N, H]
    digest: bytes


def place_blocks(ids: np.ndarray, slots: list[tuple[int, list[Block]]], hidden: int) -> tuple[np.ndarray, SoftTokens | None]:
    """``ids`` with each placeholder at a slot position replaced by its blocks (in order), as the
    Gemma 4 / EmbeddingGemma 2 processors expand them, and the soft tokens of the new rows (None
    without slots). ``hidden``: the vectors' width (for an empty result)."""
    ids = np.asarray(ids, dtype=np.int64)
    if not slots:
        return ids, None
    pieces, rows, vectors, keys = [], [], [], []
    start = offset = 0
    for slot, blocks in sorted(slots, key=lambda s: s[0]):
        pieces.append(ids[start:slot])
        offset += slot - start
        for b in blocks:
            n = b.vectors.shape[0]
            pieces += [[b.begin], np.full(n, b.token), [b.end]]
            rows.append(np.arange(offset + 1, offset + 1 + n))
            vectors.append(b.vectors)
            base = int.from_bytes(b.digest[:8], "little") % KEY_SPACE
            keys.append(-1 - (base + np.arange(n, dtype=np.int64)) % KEY_SPACE)
            offset += n + 2
        start = slot + 1
    pieces.append(ids[start:])
    expanded = np.concatenate([np.asarray(p, dtype=np.int64) for p in pieces])
    if not vectors:
        return expanded, SoftTokens(np.zeros(0, np.int64), np.zeros((0, hidden), np.float32), np.zeros(0, np.int64))
    return expanded, SoftTokens(np.concatenate(rows), np.concatenate(vectors), np.concatenate(keys))


class Engine:
    """Shared, read-only weights and the public step functions over a `KVState`."""

    def __init__(self, graph: Graph[Any], embed: Matrix, lm_head: Matrix, ple_table: Matrix | None, *,
                 vocab_size: int, embed_scale: float | np.floating, ple_scale: float, softcap: float | None, context: int,
                 pad_id: int = 0, threads: int | None = None):
        self.graph = graph
        self.embed = embed
        self.lm_head = lm_head
        self.ple_table = ple_table
        self.vocab_size = vocab_size
        self.embed_scale = np.float32(embed_scale)
        self.ple_scale = np.float32(ple_scale)
        self.softcap = softcap
        self.context = context
        self.pad_id = pad_id
        self.threads = check_threads(threads)  # compute threads per step; None = every usable CPU

    def new_state(self) -> KVState:
        """Empty KV caches for one sequence of up to ``context`` tokens."""
        return self.graph.new_state(self.context)

    def forward(self, state: KVState, ids: np.ndarray, keep: np.ndarray | None = None,
                capture: list | None = None, soft: SoftTokens | None = None) -> np.ndarray:
        """Run ``ids`` after what ``state`` holds; final hidden states of the ``keep`` rows (all by
        default), in ``PREFILL_CHUNK``-token graph calls (one call with ``capture``, for debugging).
        Host row lookups (``soft`` rows given, not looked up), then the graph; the ids (``soft``'s
        keys for its rows) are recorded in ``state.tokens``."""
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        n = len(ids)
        if capture is not None or n <= PREFILL_CHUNK:
            return self._forward(state, ids, keep, capture, soft)
        if state.length + n > state.context:
            raise ContextError(f"sequence of {state.length + n} tokens exceeds the context of {state.context}")
        want = np.arange(n) if keep is None else np.asarray(keep, dtype=np.int64).reshape(-1) % n
        rows = np.unique(want)  # sorted: each chunk keeps a contiguous run of them
        parts = []
        for c0 in range(0, n, PREFILL_CHUNK):
            c1 = min(n, c0 + PREFILL_CHUNK)
            mine = rows[(rows >= c0) & (rows < c1)] - c0
            # a chunk with no wanted row still keeps one (the last), so KV-shared layers run one row
            h = self._forward(state, ids[c0:c1], mine if mine.size else np.array([c1 - c0 - 1]), None,
                              soft.after(c0, c1) if soft is not None else None)
            if mine.size:
                parts.append(h)
        return np.concatenate(parts)[np.searchsorted(rows, want)]

    def _forward(self, state: KVState, ids: np.ndarray, keep: np.ndarray | None, capture: list | None,
                 soft: SoftTokens | None) -> np.ndarray:
        look = ids
        if soft is not None:
            look = ids.copy()
            look[soft.rows] = self.pad_id
        with compute(self.threads):
            x0 = self.embed.rows(look) * self.embed_scale
            if soft is not None:
                x0[soft.rows] = soft.vectors
            ple = self.ple_table.rows(look) * self.ple_scale if self.ple_table is not None else None
            h = self.graph.forward(state, x0, ple, keep=keep, capture=capture)
        state.tokens.extend(soft.keyed(ids) if soft is not None else (int(i) for i in ids))
        return h

    def prefill(self, state: KVState, ids: np.ndarray, soft: SoftTokens | None = None) -> np.ndarray:
        """Run a prompt (or the new part of one); the final hidden state of its last position ``[1, H]``."""
        return self.forward(state, ids, keep=np.array([len(ids) - 1]), soft=soft)

    def prefill_many(self, states: list[KVState], prompts: list) -> np.ndarray:
        """Prefill several sequences together: the final hidden state of each one's last position
        ``[B, H]``, row ``b`` bit for bit ``prefill(states[b], prompts[b])``'s. Prompts of up to
        ``PREFILL_CHUNK`` tokens in all go through the layers as one stack of rows, so each weight
        is read once for all of them (attention per sequence); a longer prompt runs alone.
        Take the logits with ``logits(h, each=True)`` (each row as a one-row product)."""
        ids = [np.asarray(p, dtype=np.int64).reshape(-1) for p in prompts]
        out = np.empty((len(ids), self.embed.shape[1]), dtype=np.float32)
        batch: list[int] = []

        def flush() -> None:
            if batch:
                out[batch] = self._forward_many([states[b] for b in batch], [ids[b] for b in batch])
                batch.clear()

        for b, i in enumerate(ids):
            if len(i) > PREFILL_CHUNK or len(i) == 0:
                out[b] = self.prefill(states[b], i)[0]
                continue
            if sum(len(ids[j]) for j in batch) + len(i) > PREFILL_CHUNK:
                flush()
            batch.append(b)
        flush()
        return out

    def _forward_many(self, states: list[KVState], ids: list[np.ndarray]) -> np.ndarray:
        flat = np.concatenate(ids)
        with compute(self.threads):
            x0 = self.embed.rows(flat) * self.embed_scale
            ple = self.ple_table.rows(flat) * self.ple_scale if self.ple_table is not None else None
            h = self.graph.forward_many(states, x0, ple, [len(i) for i in ids])
        for state, i in zip(states, ids):
            state.tokens.extend(int(t) for t in i)
        return h

    def logits(self, h: np.ndarray, each: bool = False) -> np.ndarray:
        """float32 logits ``[n, vocab]`` of final hidden states ``[n, H]`` (LM head, then softcap);
        ``each``: each row computed as alone (`Matrix.matmul_each`)."""
        with compute(self.threads):
            return softcap(self.lm_head.matmul_each(h) if each else self.lm_head.matmul(h), self.softcap)

    def decode_step(self, state: KVState, token: int) -> np.ndarray:
        """Append one token to ``state``; the logits ``[vocab]`` of the next position."""
        return self.logits(self.forward(state, np.array([token], dtype=np.int64)))[0]

    def decode_rows(self, state: KVState, tokens) -> np.ndarray:
        """Append a few tokens (at most FEW_ROWS) to ``state`` in one step (weights read once):
        logits ``[T, vocab]``, row ``i`` exactly what ``decode_step`` gives after ``tokens[:i]``
        (prompt-lookup verification: every product row is computed as in a one-token step)."""
        return self.decode_batch([state], [tokens])

    def decode_batch(self, states: list[KVState], tokens) -> np.ndarray:
        """One step for B sequences in one pass over the weights (continuous batching):
        ``tokens[b]`` is a token, or a short list of them (the current token and prompt-lookup
        drafts, at most FEW_ROWS). Returns logits ``[R, vocab]``, one row per token in order:
        a single token's row is exactly ``decode_step(states[b], tokens[b])``'s, a list's rows
        exactly ``decode_rows(states[b], tokens[b])``'s."""
        return self.decode_hidden(states, tokens)[0]

    def decode_hidden(self, states: list[KVState], tokens) -> tuple[np.ndarray, np.ndarray]:
        """`decode_batch`, also returning each row's final-normed hidden state ``[R, H]`` (what an
        MTP drafter continues from)."""
        runs = [np.asarray(t, dtype=np.int64).reshape(-1) for t in tokens]
        ids = np.concatenate(runs) if runs else np.zeros(0, np.int64)
        with compute(self.threads):
            x0 = self.embed.rows(ids) * self.embed_scale
            ple = self.ple_table.rows(ids) * self.ple_scale if self.ple_table is not None else None
            h = self.graph.forward_batch(states, x0, ple, [len(r) for r in runs])
            logits = softcap(self.lm_head.matmul_each(h), self.softcap)
        for state, r in zip(states, runs):
            state.tokens.extend(int(i) for i in r)
        return logits, h
