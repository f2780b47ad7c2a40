"""BPE merging (the `tokenizers` library's ``Word::merge_all``) as a numba kernel over token ids.

A word starts as one symbol per character (or per byte, byte fallback); then, over and over,
the adjacent pair with the lowest merge rank (ties: the leftmost) becomes the merged token. A
queued pair whose symbols have changed since is skipped, as there: it is merged only if the
current pair still merges into the same token. Merges are looked up in a sorted array of pair
keys (``a << 32 | b``), so a tokenizer loads as a few arrays instead of a 500k-entry hash map.
"""
from __future__ import annotations

import numpy as np
from numba import njit

from .common import EXACT


@njit(inline="always", **EXACT)
def _rank(keys, ranks, a, b):  # pragma: no cover - compiled
    """The merge rank of the pair (a, b), or -1."""
    k = (np.int64(a) << 32) | np.int64(b)
    i = np.searchsorted(keys, k)
    if i < keys.shape[0] and keys[i] == k:
        return np.int64(ranks[i])
    return np.int64(-1)


@njit(inline="always", **EXACT)
def _push(heap, n, v):  # pragma: no cover - compiled
    i = n
    heap[i] = v
    while i > 0:
        p = (i - 1) // 2
        if heap[p] <= heap[i]:
            break
        heap[p], heap[i] = heap[i], heap[p]
        i = p
    return n + 1


@njit(inline="always", **EXACT)
def _pop(heap, n):  # pragma: no cover - compiled
    top = heap[0]
    n -= 1
    heap[0] = heap[n]
    i = 0
    while True:
        l = 2 * i + 1
        if l >= n:
            break
        m = l + 1 if l + 1 < n and heap[l + 1] < heap[l] else l
        if heap[i] <= heap[m]:
            break
        heap[i], heap[m] = heap[m], heap[i]
        i = m
    return top, n


@njit(**EXACT)
def bpe_merge(syms, starts, keys, ranks, new_ids, out):  # pragma: no cover - compiled
    """Merge each word ``syms[starts[w]:starts[w + 1]]`` (int32 token ids) and write the resulting
    ids, word after word, into ``out``; returns how many. ``keys`` sorted int64 pair keys,
    ``ranks`` their merge ranks, ``new_ids[rank]`` the merged token. A heap entry is
    ``rank << 32 | position``: the smallest is the lowest rank, then the leftmost."""
    n_out = 0
    for w in range(starts.shape[0] - 1):
        a0 = starts[w]
        n = starts[w + 1] - a0
        if n == 0:
            continue
        c = syms[a0:a0 + n].copy()
        nxt = np.arange(1, n + 1)
        nxt[n - 1] = -1
        prv = np.arange(-1, n - 1)
        alive = np.ones(n, np.bool_)
        heap = np.empty(3 * n + 1, np.int64)
        hn = 0
        for i in range(n - 1):
            r = _rank(keys, ranks, c[i], c[i + 1])
            if r >= 0:
                hn = _push(heap, hn, (r << 32) | i)
        while hn > 0:
            top, hn = _pop(heap, hn)
            rank = top >> 32
            pos = top & 0xFFFFFFFF
            if not alive[pos] or nxt[pos] < 0:
                continue
            q = nxt[pos]
            r = _rank(keys, ranks, c[pos], c[q])
            if r < 0 or new_ids[r] != new_ids[rank]:
                continue  # expired: the pair changed since it was queued
            c[pos] = new_ids[rank]
            alive[q] = False
            nxt[pos] = nxt[q]
            if nxt[q] >= 0:
                prv[nxt[q]] = pos
            if prv[pos] >= 0:
                r = _rank(keys, ranks, c[prv[pos]], c[pos])
                if r >= 0:
                    hn = _push(heap, hn, (r << 32) | prv[pos])
            if nxt[pos] >= 0:
                r = _rank(keys, ranks, c[pos], c[nxt[pos]])
                if r >= 0:
                    hn = _push(heap, hn, (r << 32) | pos)
        i = 0
        while i >= 0:
            out[n_out] = c[i]
            n_out += 1
            i = nxt[i]
    return n_out
