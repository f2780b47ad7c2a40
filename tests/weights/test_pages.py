"""Streamed weights moved into 2 MiB pages (`weights.pages`): every matrix format gives the same
bits after the move as before it, the arrays live in the arena (views as views, read-only as
read-only), a file mapping's pages leave the resident set, and the kernel gives the arena huge
pages where it offers them."""
from __future__ import annotations

import sys

import numpy as np
import pytest

from gemmalite.kernels import common
from gemmalite.weights import pages
from gemmalite.weights.ggml import GGMLMatrix
from gemmalite.weights.matrix import BF16, F32Matrix, HalfMatrix
from gemmalite.weights.quant import Int4Matrix, Int8Matrix
from test_ggml import make_raw
from test_matrix import _mapping_rss_kib

ROWS, COLS = 96, 512
LINUX = sys.platform.startswith("linux")


def _weights(kind: str, tmp_path):
    """A matrix of ``kind``, read-only file-mapped where a checkpoint's would be."""
    w = np.random.default_rng(1).standard_normal((ROWS, COLS)).astype(np.float32)
    if kind == "f32":
        return F32Matrix(w)
    if kind in ("bf16", "f16"):
        path = tmp_path / kind
        (w.astype(BF16).view(np.uint16) if kind == "bf16" else w.astype(np.float16)).tofile(path)
        return HalfMatrix(np.memmap(path, dtype=BF16 if kind == "bf16" else np.float16, mode="r", shape=w.shape))
    if kind == "int8":
        return Int8Matrix.quantize(w)
    if kind in ("int4", "int4-sym"):
        return Int4Matrix.quantize(w, symmetric=kind == "int4-sym")
    raw = make_raw(kind, ROWS, COLS, seed=2)  # a GGML type: its blocks in a read-only file mapping
    raw.tofile(tmp_path / kind)
    return GGMLMatrix(np.memmap(tmp_path / kind, dtype=np.uint8, mode="r"), kind, (ROWS, COLS))


KINDS = ["f32", "bf16", "f16", "int8", "int4", "int4-sym", "Q8_0", "Q5_0", "Q4_K", "Q6_K", "F16", "BF16"]


def _results(m, x):
    ids = np.array([0, 95, 7, 7])
    return [m.matmul(x[:1]), m.matmul(x[:3]), m.matmul(x), m.matmul_each(x[:3]), m.rows(ids)]


def _arrays(m) -> list[np.ndarray]:
    return [a for v in vars(m).values() for a in ([v] if isinstance(v, np.ndarray) else _arrays(v) if
                                                  hasattr(v, "matmul") else [])]


@pytest.mark.parametrize("kind", KINDS)
def test_every_format_computes_the_same_bits_from_the_arena(kind, tmp_path):
    """Products of one row, a few and a prompt's worth, the batched decode rows and row lookups:
    the same bits before and after `pages.move`; afterwards no array of the matrix shares memory
    with one before, views of one array (a bfloat16 matrix's bits, int4 scales' bits) still view
    one array, and each array keeps its writeable flag (numba compiles for the same types)."""
    m = _weights(kind, tmp_path)
    x = np.random.default_rng(3).standard_normal((common.SHORT_ROWS + 3, COLS)).astype(np.float32)
    before, old = _results(m, x), _arrays(m)
    flags = [a.flags.writeable for a in old]
    moved = pages.move([m, m])  # a matrix named twice moves once
    assert moved == sum({(a.ctypes.data, a.nbytes): a.nbytes for a in old}.values())
    new = _arrays(m)
    assert [a.flags.writeable for a in new] == flags
    assert not any(np.shares_memory(a, b) for a in new for b in old)
    for a, b in zip(old, new):  # the same sharing among the new arrays as among the old
        for c, d in zip(old, new):
            assert np.shares_memory(a, c) == np.shares_memory(b, d)
    for got, ref in zip(_results(m, x), before):
        np.testing.assert_array_equal(got, ref)


def test_an_array_that_overlaps_another_in_part_stays_where_it_is():
    """Two arrays over overlapping bytes (neither the other's whole bytes) cannot both move and
    keep sharing them: both stay, and the products are unchanged; the rest moves."""
    base = np.random.default_rng(0).standard_normal((40, 64)).astype(np.float32)
    a, b, c = F32Matrix(base[:30]), F32Matrix(base[10:]), F32Matrix(base.copy())
    x = np.ones((1, 64), np.float32)
    ref = [m.matmul(x) for m in (a, b, c)]
    assert pages.move([a, b, c]) == c.w.nbytes
    assert np.shares_memory(a.w, base) and np.shares_memory(b.w, base) and not np.shares_memory(c.w, base)
    for m, r in zip((a, b, c), ref):
        np.testing.assert_array_equal(m.matmul(x), r)


@pytest.mark.skipif(not LINUX, reason="madvise / smaps are Linux's")
def test_the_file_pages_leave_and_the_arena_gets_huge_pages(tmp_path):
    """After the move the file mapping holds no resident pages; the arena holds 2 MiB pages when
    the kernel offers them (``pages.offered``), and its values are the file's either way."""
    rows, cols = 2048, 4096  # 8 MiB of int8
    q = np.random.default_rng(0).integers(-127, 128, (rows, cols), dtype=np.int8)
    q.tofile(tmp_path / "q")
    m = Int8Matrix(np.memmap(tmp_path / "q", dtype=np.int8, mode="r", shape=(rows, cols)), np.ones(rows, np.float32))
    x = np.ones((1, cols), np.float32)
    ref = m.matmul(x)  # every page of the file mapped
    assert _mapping_rss_kib(tmp_path / "q") > 7 << 10
    pages.move([m])
    assert _mapping_rss_kib(tmp_path / "q") == 0
    np.testing.assert_array_equal(m.q, q)
    np.testing.assert_array_equal(m.matmul(x), ref)
    start, huge = m.q.ctypes.data, 0
    with open("/proc/self/smaps") as f:
        mine = False
        for line in f:
            head = line.split()
            if len(head) >= 5 and "-" in head[0] and ":" in head[3]:
                lo, hi = (int(v, 16) for v in head[0].split("-"))
                mine = lo <= start < hi
            elif mine and line.startswith("AnonHugePages:"):
                huge = int(head[1])
    assert (huge >= 4096) == pages.offered(), (huge, pages.offered())


def test_offered_reads_the_kernel_setting(tmp_path, monkeypatch):
    for text, want in (("always [madvise] never", True), ("[always] madvise never", True),
                       ("always madvise [never]", False)):
        (tmp_path / "enabled").write_text(text + "\n")
        monkeypatch.setattr(pages, "THP_SETTING", str(tmp_path / "enabled"))
        assert pages.offered() is want
    monkeypatch.setattr(pages, "THP_SETTING", str(tmp_path / "missing"))
    assert pages.offered() is False


def test_the_default_moves_only_what_half_the_available_memory_holds(tmp_path, monkeypatch):
    """`pages.worth_it` (the loader's ``huge_pages=None``): 2 MiB pages offered and the copies
    (each array once: a matrix named twice, a view of another array) within ROOM of MemAvailable."""
    m = Int8Matrix.quantize(np.ones((256, 1024), np.float32))  # 256 KiB + 1 KiB of scales
    assert pages.streamed_bytes([m, m]) == 256 * 1024 + 256 * 4
    (tmp_path / "thp").write_text("always [madvise] never\n")
    monkeypatch.setattr(pages, "THP_SETTING", str(tmp_path / "thp"))
    monkeypatch.setattr(pages, "MEMINFO", str(tmp_path / "meminfo"))
    for kib, want in ((1024, True), (514, True), (513, False), (100, False)):  # 257 KiB: 514 KiB at least
        (tmp_path / "meminfo").write_text(f"MemTotal: 99999999 kB\nMemFree: 1 kB\nMemAvailable: {kib} kB\n")
        assert pages.worth_it([m]) is want, kib
    (tmp_path / "meminfo").write_text("MemTotal: 99999999 kB\n")
    assert pages.available() is None and pages.worth_it([m]) is False
    (tmp_path / "meminfo").write_text("MemAvailable: 1048576 kB\n")
    (tmp_path / "thp").write_text("always madvise [never]\n")
    assert pages.available() == 1 << 30 and pages.worth_it([m]) is False


def test_tangled_names_every_range_that_overlaps_another():
    keys = [(0, 10), (5, 10), (20, 5), (25, 5), (30, 2), (31, 1), (40, 100), (50, 1)]
    assert pages._tangled(keys) == {(0, 10), (5, 10), (30, 2), (31, 1), (40, 100), (50, 1)}
    assert pages._tangled([(0, 4), (4, 4)]) == set()
