"""Half-precision matrices used in place (`HalfMatrix`): every product path against float64
math on the same bfloat16 / float16 values."""
from __future__ import annotations

import sys

import numpy as np
import pytest

import gemmalite.weights.matrix as matrix
from gemmalite.kernels import common
from gemmalite.weights.matrix import BF16, F32Matrix, HalfMatrix


def _half(rows, cols, dtype, seed=0):
    w = np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32)
    w[0, :3] = [0.0, -0.0, 1e-8]  # zero, negative zero, a bf16 subnormal / f16 underflow
    return w.astype(dtype)


@pytest.mark.parametrize("dtype", [BF16, np.float16], ids=["bf16", "f16"])
@pytest.mark.parametrize("t", [1, 3, common.FEW_ROWS + 1, 18, common.SHORT_ROWS, common.SHORT_ROWS + 1, 90])
def test_half_matmul_equals_float64_on_the_same_values(dtype, t, monkeypatch):
    monkeypatch.setattr(common, "BF16_DOT", False)  # float32 activations (vdpbf16ps: tests/kernels/test_half.py)
    w = _half(333, 72, dtype, seed=t)
    m = HalfMatrix(w)
    x = np.random.default_rng(100 + t).standard_normal((t, 72)).astype(np.float32)
    ref = x.astype(np.float64) @ w.astype(np.float64).T
    got = m.matmul(x)
    assert got.dtype == np.float32 and got.shape == (t, 333)
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(m.rows([5, 0, 332]), w[[5, 0, 332]].astype(np.float32))
    assert m.nbytes == 333 * 72 * 2


@pytest.mark.parametrize("t", [1, common.FEW_ROWS + 1, 18, common.SHORT_ROWS, common.SHORT_ROWS + 1])
def test_f32_matmul_equals_float64(t):
    """float32 weights: decode rows, short inputs (numba tiles, ragged rows and tokens), BLAS."""
    w = np.random.default_rng(t).standard_normal((333, 72)).astype(np.float32)
    x = np.random.default_rng(100 + t).standard_normal((t, 72)).astype(np.float32)
    got = F32Matrix(w).matmul(x)
    assert got.dtype == np.float32 and got.shape == (t, 333)
    np.testing.assert_allclose(got, x.astype(np.float64) @ w.astype(np.float64).T, rtol=1e-5, atol=1e-5)


def test_half_matrix_keeps_the_mapped_array(tmp_path):
    """A memory-mapped bf16 weight is the matrix's storage: no copy, no float32 anywhere."""
    w = _half(64, 32, BF16)
    f = tmp_path / "w.bin"
    w.view(np.uint16).tofile(f)
    mm = np.memmap(f, dtype=BF16, mode="r", shape=w.shape)
    m = HalfMatrix(mm)
    assert np.shares_memory(m.w, mm) and m.w.dtype == BF16
    np.testing.assert_allclose(m.matmul(np.ones((1, 32), np.float32))[0], w.astype(np.float64).sum(1), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shape", [(1, 15), (common.SHORT_ROWS + 1, 15), (16,), (common.SHORT_ROWS + 1, 1, 16)])
@pytest.mark.parametrize("kind", ["f32", "f16"])
def test_matmul_rejects_other_shapes_by_name(kind, shape):
    """Anything but ``[T, cols]``, on every path (decode rows, short, BLAS tiles), is refused
    with both shapes named (a 1-D row past SHORT_ROWS once reached the BLAS tiles' unpacking)."""
    w = _half(8, 16, np.float16)
    m = HalfMatrix(w) if kind == "f16" else F32Matrix(w.astype(np.float32))
    with pytest.raises(ValueError, match=r"x must be \[T, 16\], got"):
        m.matmul(np.ones(shape, np.float32))
    if kind == "f32":
        with pytest.raises(ValueError, match=r"x must be \[T, 16\], got"):
            m.matmul_alike(np.ones(shape, np.float32))


def test_bf16_projections_stay_half(tmp_path, gl):
    """A bf16 checkpoint loads with its projections as bf16 HalfMatrix: views of the mapped files
    (``huge_pages=False``), or their bytes copied into 2 MiB pages (True, `weights.pages`), with
    the same logits to the bit; the PLE table stays mapped either way."""
    import hf_oracle as H

    H.make_gemma4_checkpoint(tmp_path, seed=3, dtype="bfloat16")
    ids = np.arange(3, 40)
    logits = []
    for huge in (False, True):
        model = gl.load(tmp_path, huge_pages=huge)
        mats = [m for w in model.engine.graph.layers for m in w.matrices()]
        assert mats and all(isinstance(m, HalfMatrix) and m.w.dtype == BF16 for m in mats)
        assert {matrix._read_only_mapping(m.w) for m in mats} == {not huge}
        assert matrix._read_only_mapping(model.engine.ple_table.w)
        logits.append(model.logits(ids))
    np.testing.assert_array_equal(*logits)


def _smaps_fields(path, key: str) -> list[list[str]]:
    """The ``key:`` line's fields (after the key) of each of this process's mappings of ``path``
    (/proc/self/smaps)."""
    out, mine = [], False
    with open("/proc/self/smaps") as f:
        lines = f.readlines()
    for line in lines:
        head = line.split()
        if len(head) >= 5 and "-" in head[0] and ":" in head[3]:  # a mapping's header line
            mine = line.rstrip().endswith(str(path))
        elif mine and line.startswith(key + ":"):
            out.append(head[1:])
    return out


def _mapping_rss_kib(path) -> int:
    """Resident KiB of this process's mappings of ``path``."""
    return sum(int(f[0]) for f in _smaps_fields(path, "Rss"))


@pytest.mark.skipif(not __import__("sys").platform.startswith("linux"), reason="madvise / smaps are Linux's")
@pytest.mark.parametrize("cls,dtype", [(HalfMatrix, BF16), (F32Matrix, np.float32)], ids=["half", "f32"])
def test_rows_of_a_mapped_table_do_not_stay_resident(tmp_path, cls, dtype):
    """Row lookups from a read-only file mapping (a checkpoint's PLE table) give the rows and
    leave none of the table's pages mapped into the process (the kernel's fault-around had mapped
    ~64 KiB around each row); an in-memory table is left as it is."""
    rows, cols = 4096, 2048
    w = np.random.default_rng(0).standard_normal((rows, cols)).astype(dtype)
    path = tmp_path / "table.bin"
    w.tofile(path)
    m = cls(np.memmap(path, dtype=dtype, mode="r", shape=(rows, cols)))
    ids = np.random.default_rng(1).integers(0, rows, 300)
    np.testing.assert_array_equal(m.rows(ids), w[ids].astype(np.float32))
    assert _mapping_rss_kib(path) < 64  # without dropping: >= 300 rows x 4-8 KiB
    plain = cls(w.copy())
    np.testing.assert_array_equal(plain.rows(ids), w[ids].astype(np.float32))
    np.testing.assert_array_equal(plain.rows(ids), w[ids].astype(np.float32))  # its memory untouched


@pytest.mark.skipif(not __import__("sys").platform.startswith("linux"), reason="madvise / smaps are Linux's")
def test_rows_leave_the_rest_of_a_tied_table_resident(tmp_path):
    """The same mapping as a product's weights (the tied LM head of a bf16 checkpoint used in
    place): a lookup drops only its rows' windows, not the pages the product keeps reading.
    (Where the page cache maps 2 MiB folios, a dropped window takes its whole 2 MiB mapping.)"""
    rows, cols = 16384, 2048
    w = np.random.default_rng(0).standard_normal((rows, cols)).astype(BF16)
    path = tmp_path / "table.bin"
    w.tofile(path)
    m = HalfMatrix(np.memmap(path, dtype=BF16, mode="r", shape=(rows, cols)))
    m.matmul(np.ones((1, cols), np.float32))  # maps every page
    full = _mapping_rss_kib(path)
    assert full >= rows * cols * 2 // 1024 * 0.9
    np.testing.assert_array_equal(m.rows(np.array([7, 2000, -1])), w[[7, 2000, -1]].astype(np.float32))
    assert full - _mapping_rss_kib(path) <= 3 * (2048 + 128)  # three windows (or their huge pages) at most


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise through libc and /proc: Linux")
def test_release_pages_shrinks_the_resident_set_and_keeps_the_data(tmp_path):
    """`release_pages` (the loader's, after expanding a Q5_0 tensor): this process's pages of a view
    of a read-only np.memmap leave its resident set, and the data read the same afterwards; a plain
    array is left alone."""
    from gemmalite.weights.matrix import release_pages

    path = tmp_path / "blob"
    n = 48 << 20
    np.random.default_rng(0).integers(0, 256, n, dtype=np.uint8).tofile(path)
    data = np.memmap(path, dtype=np.uint8, mode="r")
    view = data[12345:n - 6789].reshape(-1, 2)  # unaligned ends, a reshaped view as the loader's raw
    total = int(view.sum(dtype=np.uint64))  # every page resident
    assert _mapping_rss_kib(path) > 47 << 10
    release_pages(view)
    assert _mapping_rss_kib(path) <= 2 * 64  # at most the FAULT_AROUND windows past the view's ends
    assert int(view.sum(dtype=np.uint64)) == total
    plain = np.arange(10, dtype=np.uint8)
    release_pages(plain)
    np.testing.assert_array_equal(plain, np.arange(10, dtype=np.uint8))


def _advised_random(path) -> bool:
    """Do this process's mappings of ``path`` (at least one) all carry the kernel's ``rr`` flag
    (MADV_RANDOM) among their VmFlags?"""
    flags = _smaps_fields(path, "VmFlags")
    assert flags, f"no mapping of {path}"
    return all("rr" in f for f in flags)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise through libc and /proc: Linux")
def test_lookup_tables_are_advised_random_and_a_tied_head_is_not(tmp_path):
    """`build.host_tables`: the PLE table and an embedding no product reads take MADV_RANDOM (the
    kernel's ``rr`` flag: a cold row then reads its pages, not the disk's read-ahead window); the
    embedding of a tied, unquantized head keeps the default read-ahead its products stream with;
    rows read the same either way, and an array in memory is left alone."""
    from types import SimpleNamespace

    from gemmalite.models.gemma.build import host_tables

    def mapped(name, rows, cols, seed):
        w = np.random.default_rng(seed).standard_normal((rows, cols)).astype(BF16)
        w.tofile(tmp_path / name)
        return w, np.memmap(tmp_path / name, dtype=BF16, mode="r", shape=(rows, cols))

    (e, emb), (p, ple) = mapped("embed.bin", 512, 64, 0), mapped("ple.bin", 512, 96, 1)
    embed, head, table = host_tables(SimpleNamespace(ple_dim=48), {"embed_tokens.weight": emb,
                                                                  "embed_tokens_per_layer.weight": ple}, None)
    assert head is embed
    assert not _advised_random(tmp_path / "embed.bin") and _advised_random(tmp_path / "ple.bin")
    ids = np.array([3, 511, 0, 3])
    np.testing.assert_array_equal(table.rows(ids), p[ids].astype(np.float32))
    np.testing.assert_array_equal(embed.rows(ids), e[ids].astype(np.float32))

    _, emb2 = mapped("embed2.bin", 512, 64, 0)
    embed, head, _ = host_tables(SimpleNamespace(ple_dim=0), {"embed_tokens.weight": emb2}, "int8")
    assert head is not embed and _advised_random(tmp_path / "embed2.bin")
    np.testing.assert_array_equal(embed.rows(ids), e[ids].astype(np.float32))
    assert embed.lookup_only(False) is embed and not _advised_random(tmp_path / "embed2.bin")
    plain = HalfMatrix(e.copy())
    assert plain.lookup_only() is plain
    np.testing.assert_array_equal(plain.rows(ids), e[ids].astype(np.float32))
