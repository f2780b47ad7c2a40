"""Streamed weights in 2 MiB pages.

A decode step reads every product's weights once, gigabytes a second through 4 KiB pages of a
file mapping: one page walk per 4 KiB, each a chain of cache misses under a virtual machine's
nested page tables, and the hardware prefetcher stops at every page's end. Linux offers 2 MiB
pages (transparent huge pages) to anonymous memory that asks for them (``MADV_HUGEPAGE``), but not
to a file's page cache on common file systems (ext4, without ``CONFIG_READ_ONLY_THP_FOR_FS``). So
`move` copies the weights a decode step streams, in their stored dtype and bytes, into one
anonymous mapping that asks for 2 MiB pages (an `Arena`), and lets the file's pages go from the
resident set. Tables read a row at a time (token embeddings that are no LM head, the PLE table)
stay mapped: only their looked-up rows come into memory.

Measured on a 2-core AMD EPYC (Zen 3) VM: the real Gemma 3 270M's decode step 8-9 % faster, its
LM head 8-12 %, E2B int8 5 %, int4 3.5 % (a plain sequential sum of 2 GiB, `scripts/bandwidth_probe.py`,
runs about as fast in either page size: the products' access pattern is what pays the walks). The
values are the same bytes: every product and lookup gives the same bits. The price is the load,
which reads those weights whole into fresh memory (`gemmalite.load`'s ``huge_pages``).
"""
from __future__ import annotations

import mmap
from typing import TYPE_CHECKING, Iterable

import numpy as np

if TYPE_CHECKING:  # imported where used: the CLI reads SETTINGS before it needs the kernels
    from .matrix import Matrix

THP_SETTING = "/sys/kernel/mm/transparent_hugepage/enabled"
MEMINFO = "/proc/meminfo"
ALIGN = 64  # bytes: each array starts on a cache line
CHUNK = 32 << 20  # bytes `Arena.copy` copies before it lets the source's pages go
ROOM = 0.5  # `worth_it`: the copies may take at most this share of the memory the kernel calls available
SETTINGS = {"auto": None, "on": True, "off": False}  # the CLI's --huge-pages -> `gemmalite.load`'s huge_pages


def offered() -> bool:
    """Does this kernel give 2 MiB pages to memory that asks (THP ``always`` or ``madvise``)?"""
    try:
        with open(THP_SETTING) as f:
            mode = f.read()
    except OSError:
        return False
    return "[always]" in mode or "[madvise]" in mode


def available() -> int | None:
    """Bytes of memory the kernel could give now (``MemAvailable``: free memory and page cache it
    can drop), or None where it does not say."""
    try:
        with open(MEMINFO) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def streamed_bytes(matrices: Iterable[Matrix]) -> int:
    """Bytes of the arrays `move` would copy (each matrix and array once)."""
    return sum(n for _, n in _groups(_all(matrices)))


def worth_it(matrices: list[Matrix]) -> bool:
    """The loader's default: move where the kernel offers 2 MiB pages and the copies take at most
    ROOM of the available memory. A file mapping runs a model the memory cannot hold (pages come
    and go); copies would not: a machine that tight keeps the mapping."""
    room = available()
    return offered() and room is not None and streamed_bytes(matrices) <= ROOM * room


class Arena:
    """One anonymous private mapping of ``size`` bytes that asks for 2 MiB pages, handed out in
    cache-line-aligned pieces (`copy`). The arrays carved from it keep it alive."""

    def __init__(self, size: int):
        self._map = mmap.mmap(-1, max(size, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        if hasattr(mmap, "MADV_HUGEPAGE"):
            try:
                self._map.madvise(mmap.MADV_HUGEPAGE)
            except OSError:  # a kernel without THP: 4 KiB pages, the same values
                pass
        self._bytes = np.frombuffer(self._map, np.uint8)
        self._used = 0

    def copy(self, a: np.ndarray) -> np.ndarray:
        """A copy of the C-contiguous ``a`` in the arena, made CHUNK bytes at a time; a file
        mapping's pages of each chunk leave the resident set once it is copied (`release_pages`),
        so a big table never sits in memory twice."""
        from .matrix import release_pages

        n = a.nbytes
        if self._used + n > self._bytes.size:
            raise ValueError("arena full")
        out = self._bytes[self._used:self._used + n]
        self._used += -(-n // ALIGN) * ALIGN
        src = a.reshape(-1).view(np.uint8)
        for i in range(0, n, CHUNK):
            out[i:i + CHUNK] = src[i:i + CHUNK]
            release_pages(src[i:i + CHUNK])
        return out.view(a.dtype).reshape(a.shape)


def _matrices(m: Matrix) -> Iterable[Matrix]:
    """A matrix and the matrices it holds (a GGUF float tensor's `Matrix` view)."""
    from .matrix import Matrix

    yield m
    for v in list(vars(m).values()):
        if isinstance(v, Matrix):
            yield from _matrices(v)


def _key(a: np.ndarray) -> tuple[int, int]:
    """(first byte's address, bytes) of ``a``."""
    return a.__array_interface__["data"][0], a.nbytes


def _all(matrices: Iterable[Matrix]) -> list[Matrix]:
    """``matrices`` and the matrices they hold, each once."""
    return list({id(m): m for top in matrices for m in _matrices(top)}.values())


def _groups(mats: list[Matrix]) -> dict[tuple[int, int], list[tuple[Matrix, str]]]:
    """The C-contiguous arrays of ``mats`` by their bytes' range `_key`, with the (matrix,
    attribute) pairs that hold them; ranges that overlap another in part (`_tangled`) left out."""
    groups: dict[tuple[int, int], list[tuple[Matrix, str]]] = {}
    for m in mats:
        for name, a in list(vars(m).items()):
            if isinstance(a, np.ndarray) and a.flags.c_contiguous and a.nbytes:
                groups.setdefault(_key(a), []).append((m, name))
    for k in _tangled(list(groups)):  # part of another array (or holding one): both stay as they are
        del groups[k]
    return groups


def _tangled(keys: list[tuple[int, int]]) -> set[tuple[int, int]]:
    """The byte ranges (start, length) among ``keys`` (distinct) that overlap another one."""
    out: set[tuple[int, int]] = set()
    last, end = None, -1
    for k in sorted(keys):
        if k[0] < end:
            out.update((k, last))
        if k[0] + k[1] > end:
            last, end = k, k[0] + k[1]
    return out


def move(matrices: Iterable[Matrix]) -> int:
    """Copy the arrays of ``matrices`` (each matrix once) into one `Arena` and point the matrices
    at the copies, one array at a time: a file mapping's pages leave the resident set as soon as
    they are copied (`Arena.copy`), an array in memory is freed when its matrices let go, so the
    resident set never holds much more than the arena. An array that is another one's whole
    bytes seen otherwise (a bfloat16 matrix's uint16 bits, int4 scales' bits) follows its copy; one
    that overlaps another only in part, or is not C-contiguous, stays where it is. Cached operands
    are dropped (they held the old arrays). Returns the bytes moved."""
    mats = _all(matrices)
    for m in mats:
        m.__dict__.pop("_operand", None)
    groups = _groups(mats)
    arena = Arena(sum(-(-k[1] // ALIGN) * ALIGN for k in groups))
    moved = 0
    for key in list(groups):
        users = groups.pop(key)
        source = getattr(*users[0])
        copy = arena.copy(source)  # (a file mapping's pages leave the resident set as they are copied)
        for m, name in users:
            a = getattr(m, name)
            new = copy.view(a.dtype).reshape(a.shape)
            new.flags.writeable = a.flags.writeable  # a read-only mapping's copy too: the same array types
            setattr(m, name, new)
        moved += copy.nbytes
        del source, copy, users, a
    return moved

