"""The safetensors writer: files the official reader reads back value for value, with every
tensor whose size allows it on a cache-line boundary once memory-mapped (the SIMD tiles' loads then
never straddle two lines)."""
from __future__ import annotations

import struct

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import load_file

from gemmalite.formats.safetensors import read_safetensors, save_arrays
from gemmalite.kernels.common import ALIGN


def _arrays(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {  # sizes in bytes that are and are not multiples of ALIGN, in an order that mixes them
        "a.scale": rng.standard_normal(7).astype(np.float32),          # 28 bytes
        "b.q": rng.integers(-127, 128, (24, 256), dtype=np.int8),       # 6144
        "c.bias": rng.standard_normal(3).astype(np.float16),            # 6
        "d.w": rng.standard_normal((16, 40)).astype(np.float32),        # 2560
        "e.empty": np.zeros((0, 4), np.float32),
        "f.ids": rng.integers(0, 9, 5, dtype=np.int64),                 # 40
        "g.packed": rng.integers(0, 256, (8, 128), dtype=np.uint8),     # 1024
    }


@pytest.mark.parametrize("shard_bytes", [2 << 30, 4000])  # one file; several shards
def test_written_tensors_read_back_and_sit_on_cache_lines(tmp_path, shard_bytes):
    arrays = _arrays()
    files = save_arrays(tmp_path, arrays, shard_bytes=shard_bytes)
    assert (len(files) > 1) == (shard_bytes < 2 << 30)
    ours, theirs = {}, {}
    for f in files:
        head = f.read_bytes()[:8]
        assert (8 + struct.unpack("<Q", head)[0]) % ALIGN == 0  # the data starts on a boundary
        ours.update(read_safetensors(f))
        theirs.update(load_file(str(f)))
    assert set(ours) == set(theirs) == set(arrays)
    for name, a in arrays.items():
        for got in (ours[name], theirs[name]):
            assert got.dtype == a.dtype and got.shape == a.shape
            np.testing.assert_array_equal(got, a)
        if a.nbytes % ALIGN == 0 and a.nbytes:
            assert ours[name].ctypes.data % ALIGN == 0, name


def test_bfloat16_tensors_keep_their_bits(tmp_path):
    w = np.random.default_rng(1).standard_normal((4, 32)).astype(ml_dtypes.bfloat16)
    save_arrays(tmp_path, {"odd": np.ones(3, np.float32), "w": w})
    got = read_safetensors(tmp_path / "model.safetensors")["w"]
    assert got.dtype == w.dtype and got.ctypes.data % ALIGN == 0
    np.testing.assert_array_equal(got.view(np.uint16), w.view(np.uint16))


def test_tensors_are_produced_in_the_given_order(tmp_path):
    """The file's layout puts aligned sizes first, but ``produce`` is called in the order given (a
    generator of random weights draws them in that order: the same seed, the same weights)."""
    from gemmalite.formats.safetensors import write_safetensors

    arrays = _arrays(3)
    calls = []

    def produce(name):
        calls.append(name)
        data = arrays[name].tobytes()
        return [data[:5], data[5:]]  # in pieces

    write_safetensors(tmp_path, {n: (a.shape, a.dtype) for n, a in arrays.items()}, produce)
    assert calls == list(arrays)
    got = load_file(str(tmp_path / "model.safetensors"))
    for name, a in arrays.items():
        np.testing.assert_array_equal(got[name], a)
