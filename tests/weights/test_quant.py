"""Int8 / Int4 weight-only quantized matrices: error bounds, kernels vs dense, round-trips."""
import numpy as np
import pytest

ml_dtypes = pytest.importorskip("ml_dtypes")

import gemmalite.weights.quant as quant  # noqa: E402
from gemmalite.formats.converted import QUANT_METHOD, assemble  # noqa: E402
from gemmalite.kernels import blas, common  # noqa: E402
from gemmalite.kernels.simd import TILE_BLOCK, U8_BLOCK  # noqa: E402
from gemmalite.weights.quant import Int4Matrix, Int8Matrix  # noqa: E402

TS = (1, 2, 3, 4, 5, 17, 64)


def from_converted(t: dict, fmt: str):
    """A matrix rebuilt from its tensors the way a converted checkpoint is loaded."""
    return assemble({f"w.{k}": v for k, v in t.items()}, {"quant_method": QUANT_METHOD, "formats": {"w": fmt}})["w"]


def _w(rows, cols, seed=0, dist="normal"):
    rng = np.random.default_rng(seed)
    if dist == "t":
        w = rng.standard_t(3, size=(rows, cols))
    else:
        w = rng.standard_normal((rows, cols))
    w = (0.02 * w).astype(np.float32)
    w[3] = 0.0  # an all-zero row
    w[5, :7] = 0.5  # a few large outliers in one group
    w[7] += 0.01  # a row with an offset (asymmetric groups)
    return w


def _int8_activations(m, x) -> bool:
    """Does this product round x to int8 (int8 prefill on VNNI) rather than int16 or not at all?"""
    return (isinstance(m, Int8Matrix) and common.HAVE_VNNI and common.HAVE_AVX2
            and x.shape[0] > common.FEW_ROWS and x.shape[1] % TILE_BLOCK == 0)


def _activation_step(m, x):
    """Half the rounding step of each activation where the kernel quantizes them (with
    AVX2: decode rows, T <= FEW_ROWS, per group of the int4 grid, for int8 per TILE_BLOCK (or 32
    where the width is not a multiple of it); int4 up to
    INT4_SHORT_ROWS rows per group; int8 prefill per TILE_BLOCK values; step = max|x| / 32767,
    or max|x| / 127 per U8_BLOCK for int8 prefill on VNNI), else 0: the kernel's only error
    beyond float32."""
    t, k = x.shape
    if not common.HAVE_AVX2:
        return np.zeros_like(x)
    if isinstance(m, Int4Matrix):
        group = m.group if t <= quant.INT4_SHORT_ROWS else 0
    elif t <= common.FEW_ROWS:  # int8 decode rows: per TILE_BLOCK values where the width allows
        group = TILE_BLOCK if k % TILE_BLOCK == 0 else 32
    else:
        group = U8_BLOCK if _int8_activations(m, x) else TILE_BLOCK
    if not group or k % group:
        return np.zeros_like(x)
    amax = np.abs(x.reshape(t, k // group, group)).max(2) / (127 if _int8_activations(m, x) else 32767)
    return np.repeat(amax / 2, group, axis=1)


def _check_matmul(m, seed=1, ts=TS):
    d = m.dense()
    rng = np.random.default_rng(seed)
    for t in ts:
        x = rng.standard_normal((t, m.shape[1])).astype(np.float32)
        x[:, :5] *= 30  # outliers, as in real activations
        y = m.matmul(x)
        assert y.shape == (t, m.shape[0]) and y.dtype == np.float32
        ref = x.astype(np.float64) @ d.T.astype(np.float64)
        # forward error bound of a float32 dot product, relative to sum |x||w|, plus the
        # activation rounding where there is one (sum |w| * step / 2)
        # (int4: the rounded x meets the scaled nibbles, scale * n = w - min, not w itself)
        wq = np.abs(d - np.repeat(m.mins.astype(np.float32), m.group, axis=1)) if isinstance(m, Int4Matrix) else np.abs(d)
        bound = 1e-5 * (np.abs(x) @ np.abs(d).T) + _activation_step(m, x) @ wq.T + 1e-30
        err = np.abs(y - ref)
        assert np.all(err <= bound), (t, float((err / bound).max()))
        if not _int8_activations(m, x):  # (W8A8: the bound above is the whole claim)
            np.testing.assert_allclose(y, x @ d.T, rtol=1e-4, atol=1e-4 * np.abs(ref).max())


# ----------------------------------------------------------------------------- int8


@pytest.mark.parametrize("src", ["f32", "bf16"])
def test_int8_error_bound(src):
    w = _w(96, 160)
    if src == "bf16":
        w = w.astype(ml_dtypes.bfloat16)
    m = Int8Matrix.quantize(w)
    wf = w.astype(np.float32)
    assert m.q.dtype == np.int8 and m.scale.dtype == np.float32 and m.shape == w.shape
    np.testing.assert_allclose(m.scale, np.abs(wf).max(1) / 127, rtol=1e-6)
    err = np.abs(m.dense() - wf)
    assert np.all(err <= m.scale[:, None] * (0.5 + 1e-5) + 1e-12)
    assert np.all(m.dense()[3] == 0)
    assert np.abs(m.q).max() == 127


@pytest.mark.parametrize("simd", [True, False])
@pytest.mark.parametrize("long_rows", [True, False])
def test_int8_matmul_and_rows(simd, long_rows, monkeypatch):
    if simd and not common.HAVE_AVX2:
        pytest.skip("no AVX2 on this CPU")
    monkeypatch.setattr(common, "HAVE_AVX2", simd)  # False: the portable float kernels
    monkeypatch.setattr(quant, "LONG_ROW_SIMD", 0 if long_rows else 1 << 30)  # 4 rows per task or 1
    m = Int8Matrix.quantize(_w(203, 96))
    _check_matmul(m)
    _check_matmul(Int8Matrix.quantize(_w(37, 2 * TILE_BLOCK, seed=4)))  # decode rows per TILE_BLOCK values
    d = m.dense()
    ids = np.array([0, 202, 5, 5, 3, -1])
    np.testing.assert_array_equal(m.rows(ids), d[ids])
    np.testing.assert_array_equal(d, m.scale[:, None] * m.q.astype(np.float32))
    assert m.rows(np.array([], dtype=np.int64)).shape == (0, 96)
    assert m.nbytes == 203 * 96 + 203 * 4


def test_int8_blocked_quantize_and_large_prefill(monkeypatch):
    import gemmalite.weights.quant as quant

    monkeypatch.setattr(quant, "QUANT_BLOCK", 64)  # several row blocks, ragged last
    monkeypatch.setattr(blas, "TILE_BYTES", 4 * 64 * 96)  # tiles of 64 rows, ragged last
    w = _w(300, 96, seed=3).astype(ml_dtypes.bfloat16)
    m = Int8Matrix.quantize(w)
    ref = Int8Matrix.quantize(w.astype(np.float32))
    np.testing.assert_array_equal(m.q, ref.q)
    np.testing.assert_array_equal(m.scale, ref.scale)
    _check_matmul(m)


@pytest.mark.parametrize("path", ["vnni", "int16", "blas"])
def test_int8_prefill_kernel(path, monkeypatch):
    """Prefill products: the int8-activation VNNI tiles (8x2, row / token tails), the
    int16-activation tile kernel (4x2 tiles, row / token tails), both over several token chunks,
    and the dequantize + BLAS path, each within its error bound."""
    if path != "blas" and not common.HAVE_AVX2:
        pytest.skip("no AVX2 on this CPU")
    if path == "vnni" and not common.HAVE_VNNI:
        pytest.skip("no VNNI on this CPU (or GEMMALITE_VNNI=0)")
    monkeypatch.setattr(common, "HAVE_AVX2", path != "blas")
    monkeypatch.setattr(common, "HAVE_VNNI", path == "vnni")
    monkeypatch.setattr(quant, "TOKEN_CHUNK", 16)
    _check_matmul(Int8Matrix.quantize(_w(203, 2 * TILE_BLOCK, seed=6)), ts=(5, 17, 40))


def test_token_chunks():
    """int8 prefill passes: every token once, in order, as many passes as TOKEN_CHUNK-token ones
    would take, none longer, all but the last in whole 3-token tiles."""
    for t in range(0, 1100):
        chunks = quant._token_chunks(t)
        assert [a for a, _ in chunks] == [0, *(b for _, b in chunks)][:len(chunks)]
        assert (chunks[-1][1] if chunks else 0) == t
        assert len(chunks) == -(-t // quant.TOKEN_CHUNK)
        assert all(0 < b - a <= quant.TOKEN_CHUNK for a, b in chunks)
        assert all((b - a) % 3 == 0 for a, b in chunks[:-1]) or chunks[0][1] - chunks[0][0] == quant.TOKEN_CHUNK
    assert quant._token_chunks(272) == [(0, 93), (93, 186), (186, 272)]


@pytest.mark.parametrize("path", ["vnni", "planes", "int16"])
def test_int8_prefill_same_bits_in_any_chunking(path, monkeypatch):
    """A token's products do not depend on the pass it falls in (3-token tiles, single-token
    tails), and the tiles' operands (weights, rounded activations) start on cache lines."""
    if not common.HAVE_AVX2 or (path != "int16" and not common.HAVE_VNNI):
        pytest.skip("no AVX2 / VNNI on this CPU")
    monkeypatch.setattr(common, "HAVE_VNNI", path != "int16")
    m = Int8Matrix.quantize(_w(37, 2 * TILE_BLOCK, seed=8))
    assert m.q.ctypes.data % common.ALIGN == 0
    x = np.random.default_rng(9).standard_normal((272, m.shape[1])).astype(np.float32)
    run = m._matmul_w8a16 if path == "planes" else m.matmul
    if path == "planes":
        monkeypatch.setattr(m, "_planes", lambda: True)
        assert all(a.ctypes.data % common.ALIGN == 0 for a in quant._round_planes(x)[:2])
    elif path == "vnni":
        assert quant._round_u8(x)[0].ctypes.data % common.ALIGN == 0
    else:
        assert quant._round_tiles(x)[0].ctypes.data % common.ALIGN == 0
    y = run(x)
    for chunk in (16, 100, 272):
        monkeypatch.setattr(quant, "TOKEN_CHUNK", chunk)
        np.testing.assert_array_equal(run(x), y)


def test_int8_tensors_roundtrip_no_copy():
    m = Int8Matrix.quantize(_w(40, 64))
    t = m.tensors()
    assert set(t) == {"q", "scale"}
    m2 = Int8Matrix.from_tensors(t)
    assert m2.q is m.q or np.shares_memory(m2.q, m.q)
    m3 = from_converted({k: v.copy() for k, v in t.items()}, "int8")
    assert isinstance(m3, Int8Matrix)
    np.testing.assert_array_equal(m3.dense(), m.dense())
    with pytest.raises(ValueError):
        Int8Matrix(m.q.astype(np.int16), m.scale)


def test_int8_readonly_memmap(tmp_path):
    m = Int8Matrix.quantize(_w(64, 32))
    np.save(tmp_path / "q.npy", m.q)
    np.save(tmp_path / "s.npy", m.scale)
    mm = Int8Matrix(np.load(tmp_path / "q.npy", mmap_mode="r"), np.load(tmp_path / "s.npy", mmap_mode="r"))
    x = np.random.default_rng(0).standard_normal((1, 32)).astype(np.float32)
    np.testing.assert_array_equal(mm.matmul(x), m.matmul(x))
    np.testing.assert_array_equal(mm.rows([1, 2]), m.rows([1, 2]))


# ----------------------------------------------------------------------------- int4


def _check_int4_bound(m, w):
    """Every weight inside its group's grid is within scale/2; outside it clips to the edge."""
    wf = w.astype(np.float32)
    n, k = wf.shape
    g = m.group
    d = np.repeat(m.scales.astype(np.float32), g, axis=1)
    mn = np.repeat(m.mins.astype(np.float32), g, axis=1)
    deq = m.dense()
    err = np.abs(deq - wf)
    lo_edge, hi_edge = mn, mn + 15 * d
    inside = (wf >= lo_edge - d / 2) & (wf <= hi_edge + d / 2)
    tol = d * (0.5 + 1e-4) + np.abs(mn) * 1e-6 + 1e-9
    assert np.all(err[inside] <= tol[inside])
    # clipped values (the fit may clip outliers) dequantize exactly to the nearer grid edge
    out = ~inside
    edge = np.where(wf > hi_edge, hi_edge, lo_edge)
    np.testing.assert_allclose(deq[out], edge[out], rtol=1e-6, atol=1e-9)
    return err


@pytest.mark.parametrize("group", [32, 64])
@pytest.mark.parametrize("src", ["f32", "bf16"])
def test_int4_error_bound(group, src):
    w = _w(64, 256, dist="t")
    if src == "bf16":
        w = w.astype(ml_dtypes.bfloat16)
    m = Int4Matrix.quantize(w, group=group)
    assert m.group == group and m.shape == w.shape
    assert m.packed.dtype == np.uint8 and m.packed.shape == (64, 128)
    assert m.scales.dtype == np.float16 and m.scales.shape == (64, 256 // group)
    _check_int4_bound(m, w)
    assert np.all(m.dense()[3] == 0)
    # without the search the grid spans [min, max], so nothing is clipped
    m0 = Int4Matrix.quantize(w, group=group, search=False)
    err0 = _check_int4_bound(m0, w)
    assert np.all(err0 <= np.repeat(m0.scales.astype(np.float32), group, 1) * 0.5001 + 1e-9)


def test_int4_search_lowers_error():
    w = _w(128, 256, seed=4)
    wf = w.astype(np.float32)
    e_search = np.sqrt(((Int4Matrix.quantize(w).dense() - wf) ** 2).mean())
    e_plain = np.sqrt(((Int4Matrix.quantize(w, search=False).dense() - wf) ** 2).mean())
    assert e_search < e_plain
    assert e_search < 0.085 * wf.std()  # ~0.071 sigma on Gaussian weights


def test_int4_layout():
    """Byte j of a group: value j in the low nibble, value j + G/2 in the high nibble."""
    n, k, g = 2, 64, 32
    w = np.tile(np.arange(32, dtype=np.float32) % 16, (n, k // 32))  # exact on a 0..15 grid
    m = Int4Matrix.quantize(w, group=g, search=False)
    np.testing.assert_array_equal(m.dense(), w)
    np.testing.assert_array_equal(m.packed[0, :16], np.arange(16, dtype=np.uint8) * 17)


@pytest.mark.parametrize("simd", [True, False])
@pytest.mark.parametrize("group", [32, 64])
def test_int4_matmul_and_rows(group, simd, monkeypatch):
    if simd and not common.HAVE_AVX2:
        pytest.skip("no AVX2 on this CPU")
    monkeypatch.setattr(common, "HAVE_AVX2", simd)  # False: the portable float kernel
    m = Int4Matrix.quantize(_w(200, 192, seed=2), group=group)
    _check_matmul(m)
    d = m.dense()
    ids = np.array([0, 199, 5, 5, 3, -2])
    np.testing.assert_array_equal(m.rows(ids), d[ids])
    ng = 192 // group
    assert m.nbytes == 200 * 96 + 2 * 200 * ng * 2


@pytest.mark.parametrize("group", [32, 64])
def test_int4_four_rows_per_task_kernel(group, monkeypatch):
    """The long-row decode kernel (four rows share each load of x), with a ragged tail."""
    monkeypatch.setattr(quant, "LONG_ROW_SIMD", 0)
    _check_matmul(Int4Matrix.quantize(_w(203, 256, seed=4), group=group))


def test_int4_prefill_blocks(monkeypatch):
    import gemmalite.weights.quant as quant

    monkeypatch.setattr(quant, "QUANT_BLOCK", 50)
    monkeypatch.setattr(blas, "TILE_BYTES", 4 * 64 * 128)
    w = _w(333, 128, seed=5).astype(ml_dtypes.bfloat16)
    m = Int4Matrix.quantize(w)
    _check_int4_bound(m, w)
    _check_matmul(m)


def test_int4_tensors_roundtrip():
    m = Int4Matrix.quantize(_w(48, 128), group=64)
    t = m.tensors()
    assert set(t) == {"packed", "scales", "mins"}
    m2 = Int4Matrix.from_tensors({k: v.copy() for k, v in t.items()})
    assert m2.group == 64 and m2.shape == (48, 128)
    np.testing.assert_array_equal(m2.dense(), m.dense())
    m3 = from_converted(t, "int4")
    assert isinstance(m3, Int4Matrix) and np.shares_memory(m3.packed, m.packed)
    m4 = Int4Matrix(t["packed"], t["scales"], t["mins"], (48, 128), 64)
    np.testing.assert_array_equal(m4.dense(), m.dense())


def test_int4_bad_group():
    w = _w(8, 96)
    with pytest.raises(ValueError):
        Int4Matrix.quantize(w, group=64)  # 96 not divisible by 64
    with pytest.raises(ValueError):
        Int4Matrix.quantize(w, group=48)  # unsupported group size
    m = Int4Matrix.quantize(w, group=32)
    t = m.tensors()
    with pytest.raises(ValueError):
        Int4Matrix(t["packed"], t["scales"], t["mins"], group=64)
    with pytest.raises(ValueError):
        Int4Matrix(t["packed"], t["scales"], t["mins"], shape=(8, 64))


def test_bad_x_shape():
    m = Int8Matrix.quantize(_w(16, 32))
    with pytest.raises(ValueError):
        m.matmul(np.zeros((1, 31), np.float32))


def test_int8_long_rows_use_the_four_row_kernel_exactly():
    """Long rows in the float decode kernel (4 rows per task; a width that is not a multiple of 32
    takes it even with AVX2); a row count that is not a multiple of 4 exercises its tail."""
    k = 4096 + 8
    rng = np.random.default_rng(7)
    m = Int8Matrix.quantize(rng.standard_normal((11, k), dtype=np.float32))
    x = rng.standard_normal((1, k), dtype=np.float32)
    ref = x.astype(np.float64) @ m.dense().astype(np.float64).T
    got = m.matmul(x)
    assert np.abs(got - ref).max() <= 1e-5 * (np.abs(x) @ np.abs(m.dense()).T).max()


@pytest.mark.parametrize("t", [1, 18])
def test_matmul_all_shares_the_rounding_to_the_bit(t):
    """q/k/v-style products of one input (`matmul_all`): each result is the matrix's own
    `matmul` to the bit, whatever the mix of formats (a float32 one takes ``x`` as it is)."""
    from gemmalite.weights.matrix import F32Matrix, matmul_all

    rng = np.random.default_rng(t)
    ws = [rng.standard_normal((n, 512)).astype(np.float32) for n in (64, 32, 48)]
    mats = [Int8Matrix.quantize(ws[0]), Int8Matrix.quantize(ws[1]), F32Matrix(ws[2])]
    x = rng.standard_normal((t, 512)).astype(np.float32)
    for m, y in zip(mats, matmul_all(mats, x)):
        assert np.array_equal(y, m.matmul(x))


@pytest.mark.parametrize("t", [1, 18])
def test_matmul_alike_all_rounds_once_to_the_bit(t, monkeypatch):
    """The encoder's q/k/v-style products (`matmul_alike_all`): each result is the matrix's own
    `matmul_alike` to the bit, whatever the mix of formats, with the input rounded once."""
    from gemmalite.weights import quant as quant_mod
    from gemmalite.weights.matrix import F32Matrix, matmul_alike_all

    rng = np.random.default_rng(t)
    ws = [rng.standard_normal((n, 512)).astype(np.float32) for n in (64, 32, 48)]
    mats = [Int8Matrix.quantize(ws[0]), Int8Matrix.quantize(ws[1]), F32Matrix(ws[2])]
    x = rng.standard_normal((t, 512)).astype(np.float32)
    want = [m.matmul_alike(x) for m in mats]
    calls = []
    monkeypatch.setattr(quant_mod, "_round_planes", lambda v, f=quant_mod._round_planes: calls.append(1) or f(v))
    for w, y in zip(want, matmul_alike_all(mats, x)):
        assert np.array_equal(y, w)
    assert len(calls) == (1 if Int8Matrix._planes() else 0)


@pytest.mark.parametrize("fmt", ["int8", "int8-512", "int4-32", "int4-64", "int4s", "Q8_0", "Q5_0"])
@pytest.mark.parametrize("long_rows", [True, False])
def test_matmul_each_row_is_its_one_row_product_to_the_bit(fmt, long_rows, monkeypatch):
    """The few-row kernels widen each weight chunk once for up to four activation rows (and, for
    long rows, share each x load between four weight rows): every row of any T must still be bit
    for bit its own one-row product (decode batches and prompt-lookup verification rely on it),
    and close to the float64 product."""
    if not common.HAVE_AVX2:
        pytest.skip("no AVX2 on this CPU: the portable path computes each row alone")
    from gguf import GGMLQuantizationType, quants

    from gemmalite.weights.ggml import GGMLMatrix

    monkeypatch.setattr(quant, "LONG_ROW_SIMD", 0 if long_rows else 1 << 30)
    k = 512 if fmt == "int8-512" else 320  # int8: x per 32 values, or per TILE_BLOCK (512)
    w = _w(203, k, seed=11)
    if fmt.startswith("int8"):
        m = Int8Matrix.quantize(w)
    elif fmt == "int4s":
        m = Int4Matrix.quantize(w, symmetric=True)
    elif fmt.startswith("int4"):
        m = Int4Matrix.quantize(w, group=int(fmt[5:]))
    else:
        raw = np.ascontiguousarray(quants.quantize(w, GGMLQuantizationType[fmt])).view(np.uint8).reshape(203, -1)
        m = GGMLMatrix(raw, fmt, (203, k))
    rng = np.random.default_rng(3)
    x = rng.standard_normal((11, k)).astype(np.float32)
    x[:, :5] *= 30
    alone = np.concatenate([m.matmul(x[i : i + 1]) for i in range(11)])
    ref = x.astype(np.float64) @ m.dense().astype(np.float64).T
    scale = np.abs(x).astype(np.float64) @ np.abs(m.dense()).astype(np.float64).T
    act = _int8_step(x) / 2 @ np.abs(m.dense()).T if fmt == "int4s" else 0  # W4A8: x in int8 per 32
    assert np.all(np.abs(alone - ref) <= 1e-3 * scale + act + 1e-30)
    for t in (2, 3, 4, 5, 7, 8, 11):
        np.testing.assert_array_equal(m.matmul_each(x[:t]), alone[:t], err_msg=f"T={t}")


# ----------------------------------------------------------------------------- symmetric int4


def _int8_step(x):
    """The activation step of the symmetric int4 decode kernel, per value: max|x| / 127 per 32."""
    t, k = x.shape
    return np.repeat(np.abs(x.reshape(t, k // 32, 32)).max(2).astype(np.float64) / 127, 32, axis=1)


@pytest.mark.parametrize("src", ["f32", "bf16"])
def test_int4_symmetric_format(src):
    """4.5 bits per weight: ``scales * (n - 8)``, every weight inside the grid within |scale|/2,
    the rest clipped to the nearer edge; stored and rebuilt as a converted checkpoint is."""
    w = _w(64, 256, dist="t")
    if src == "bf16":
        w = w.astype(ml_dtypes.bfloat16)
    m = Int4Matrix.quantize(w, symmetric=True)
    wf = w.astype(np.float32).astype(np.float64)
    assert m.symmetric and m.mins is None and m.group == 32 and m.shape == (64, 256)
    assert m.nbytes == 64 * 128 + 64 * 8 * 2  # 4.5 bits per weight
    n = np.concatenate([(m.packed & 15).reshape(64, 8, 16), (m.packed >> 4).reshape(64, 8, 16)], 2).reshape(64, 256)
    d = np.repeat(m.scales.astype(np.float64), 32, axis=1)
    deq = d * (n.astype(np.float64) - 8)
    np.testing.assert_array_equal(m.dense(), deq.astype(np.float32))
    np.testing.assert_array_equal(m.rows([5, 0, -1]), m.dense()[[5, 0, -1]])
    ad = np.abs(d)
    lo, hi = np.minimum(-8 * d, 7 * d), np.maximum(-8 * d, 7 * d)  # the grid's edges (d may be negative)
    inside = (wf >= lo - ad / 2) & (wf <= hi + ad / 2)
    assert np.all(np.abs(deq - wf)[inside] <= ad[inside] * 0.5001 + 1e-12)
    np.testing.assert_allclose(deq[~inside], np.clip(wf, lo, hi)[~inside], rtol=1e-6, atol=1e-9)
    assert np.all(m.dense()[3] == 0)
    t = m.tensors()
    assert set(t) == {"packed", "scales"}
    m2 = from_converted(t, "int4")
    assert m2.symmetric and np.shares_memory(m2.packed, m.packed)
    np.testing.assert_array_equal(m2.dense(), m.dense())
    with pytest.raises(ValueError):
        Int4Matrix.quantize(w, group=64, symmetric=True)
    with pytest.raises(ValueError):  # scales of groups of 64: symmetric takes 32 only
        Int4Matrix(m.packed, m.scales[:, :4].copy(), None)


def test_int4_symmetric_beats_q4_0_rounding():
    """The searched scale has a lower (weighted) weight error than Q4_0's rule (``search=False``) on the same
    weights; the plain rule is llama.cpp's Q4_0 (the largest magnitude maps to -8) and agrees with
    the `gguf` package's Q4_0 quantizer."""
    from gguf import GGMLQuantizationType, quants

    w = _w(128, 256, seed=4)
    wf = w.astype(np.float64)
    e = (wf ** 2 * (Int4Matrix.quantize(w, symmetric=True).dense() - wf) ** 2).mean()  # the fit's criterion
    m0 = Int4Matrix.quantize(w, symmetric=True, search=False)
    e0 = (wf ** 2 * (m0.dense() - wf) ** 2).mean()
    assert e < 0.9 * e0
    q40 = quants.dequantize(quants.quantize(w, GGMLQuantizationType.Q4_0), GGMLQuantizationType.Q4_0)
    close = np.isclose(m0.dense(), q40, rtol=0, atol=1e-7)
    assert close.mean() > 0.999  # (rounding of exact halves differs: rint against floor(x + 0.5))


@pytest.mark.parametrize("path", ["vnni", "avx2", "portable"])
def test_int4_symmetric_matmul(path, monkeypatch):
    """Every product path against float64 math on the dequantized weights: decode rows and prefill
    tiles (W4A8: x in int8 per 32, by vpdpbusd or by AVX2's 8-bit multiply-add) within the activation
    rounding, longer inputs of an odd number of blocks (dequantize + BLAS) and the portable kernels to
    float32 rounding; the two SIMD paths equal."""
    if path != "portable" and not common.HAVE_AVX2:
        pytest.skip("no AVX2 on this CPU")
    monkeypatch.setattr(common, "HAVE_AVX2", path != "portable")
    monkeypatch.setattr(common, "HAVE_VNNI", path == "vnni")
    for k in (96, 320):  # an odd number of blocks, and an even one
        m = Int4Matrix.quantize(_w(203, k, seed=2), symmetric=True)
        d = m.dense().astype(np.float64)
        rng = np.random.default_rng(1)
        for t in TS:
            x = rng.standard_normal((t, k)).astype(np.float32)
            x[:, :5] *= 30
            y = m.matmul(x)
            assert y.shape == (t, 203) and y.dtype == np.float32
            ref = x.astype(np.float64) @ d.T
            # (rounded: decode rows, and every T > FEW_ROWS where the prefill tiles apply: an even number of blocks)
            rounded = path != "portable" and (t <= quant.INT4_SHORT_ROWS or k % 64 == 0)
            act = _int8_step(x) / 2 @ np.abs(d).T if rounded else 0
            bound = 1e-5 * (np.abs(x) @ np.abs(d).T) + act + 1e-30
            assert np.all(np.abs(y - ref) <= bound), (k, t, float((np.abs(y - ref) / bound).max()))
            if rounded:
                monkeypatch.setattr(common, "HAVE_VNNI", path != "vnni")
                np.testing.assert_array_equal(m.matmul(x), y)
                monkeypatch.setattr(common, "HAVE_VNNI", path == "vnni")
            if t <= 11:
                np.testing.assert_array_equal(m.matmul_each(x), np.concatenate([m.matmul(x[i:i + 1]) for i in range(t)]))


@pytest.mark.parametrize("fmt", ["int4s", "int4s-odd", "int4", "int4s-portable", "int8", "int8-odd"])
def test_uses_blas_says_whether_a_prompt_calls_blas(fmt, monkeypatch):
    """``uses_blas`` must be true exactly when a many-row product goes to BLAS: the symmetric int4
    tiles never do (the attribute was once left at Matrix's True, and since the decoder then chose
    its prompts' attention by it, every int4 prompt took the slower BLAS attention)."""
    if not common.HAVE_AVX2:
        pytest.skip("no AVX2 on this CPU: every quantized prompt goes to BLAS")
    odd = fmt.endswith("-odd")  # int4: an odd number of blocks of 32; int8: not whole TILE_BLOCKs (no tiles)
    if fmt.startswith("int8"):
        m = Int8Matrix.quantize(_w(24, TILE_BLOCK + 32 if odd else 2 * TILE_BLOCK, seed=3))
    else:
        m = Int4Matrix.quantize(_w(24, 96 if odd else 320, seed=3), symmetric=fmt.startswith("int4s"))
    if fmt.endswith("-portable"):
        monkeypatch.setattr(common, "HAVE_AVX2", False)
    calls = []
    real = blas.products
    monkeypatch.setattr(blas, "products", lambda *a: calls.append(1) or real(*a))
    x = np.random.default_rng(0).standard_normal((quant.INT4_SHORT_ROWS + 9, m.shape[1])).astype(np.float32)
    m.matmul(x)
    assert m.uses_blas == m.uses_blas_for(x.shape[0]) == bool(calls), (fmt, m.uses_blas, len(calls))
    assert m.uses_blas == (fmt not in ("int4s", "int8"))
