"""Property-based fuzzing of the readers and of config parsing: whatever the bytes, the result is
a value or the project's error -- never another exception, never more than a few MiB allocated
(tracemalloc peak per example, under an address-space limit), in bounded time (~30 s in all).
safetensors inputs are also checked against the official reader: what it rejects, we reject."""
from __future__ import annotations

import json
import resource
import struct
import tracemalloc
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.numpy import load_file, save_file

from gemmalite.errors import CheckpointError, ConfigError
from gemmalite.formats.gguf import GGUFError, read_gguf
from gemmalite.formats.gguf_gemma import config_from_gguf
from gemmalite.formats.safetensors import read_safetensors
from gemmalite.models.gemma.config import MAX_LAYERS, ModelConfig
from gemmalite.tools.synth import text_config

from test_strict_readers import ARCH, STR, U32, gguf_bytes, gs, kv

PEAK_BYTES = 16 << 20  # per example; the inputs are a few KiB
FUZZ = settings(max_examples=150, derandomize=True, database=None)  # no deadline: tests/conftest.py


@pytest.fixture(scope="module", autouse=True)
def address_space_limit():
    """An allocation gone wild fails fast (MemoryError, a test failure) instead of swapping the machine:
    the soft RLIMIT_AS is set 2 GiB above what the process maps now, and restored afterwards."""
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    with open("/proc/self/statm") as f:
        mapped = int(f.read().split()[0]) * resource.getpagesize()
    limit = mapped + (2 << 30)
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    yield
    resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


@contextmanager
def bounded_allocation():
    tracemalloc.start()
    try:
        yield
    finally:
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        assert peak < PEAK_BYTES, f"a {peak}-byte allocation for a tiny input"


def mutate(data: bytes, edits: list[tuple[int, int]], cut: int | None) -> bytes:
    b = bytearray(data)
    for pos, val in edits:
        b[pos % len(b)] = val
    return bytes(b[:cut] if cut is not None else b)


edits = st.lists(st.tuples(st.integers(0, 1 << 16), st.integers(0, 255)), max_size=6)
cuts = st.none() | st.integers(0, 400)


# --------------------------------------------------------------------------------------------
# safetensors
# --------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def st_seed(tmp_path_factory) -> bytes:
    path = tmp_path_factory.mktemp("fuzz") / "seed.safetensors"
    save_file({"w": np.arange(12, dtype=np.float32).reshape(3, 4), "b": np.arange(5, dtype=np.int8),
               "h": np.ones(3, np.float16)}, str(path), metadata={"format": "pt"})
    return path.read_bytes()


def _check_safetensors(path: Path) -> None:
    with bounded_allocation():
        try:
            ours = read_safetensors(path)
        except CheckpointError:
            return
    try:
        load_file(str(path))
    except Exception as e:  # noqa: BLE001 - the oracle's errors are of several kinds
        if "dtype" not in str(e):  # numpy cannot hold some dtypes the format names: not a layout verdict
            pytest.fail(f"the official reader rejects a file we accept ({e}); we read {list(ours)}")
    for a in ours.values():
        np.asarray(a).sum()  # every accepted tensor's bytes are really in the file


@FUZZ
@given(edits=edits, cut=cuts)
def test_fuzz_safetensors_bytes(st_seed, tmp_path, edits, cut):
    path = tmp_path / "x.safetensors"
    path.write_bytes(mutate(st_seed, edits, cut))
    _check_safetensors(path)


json_scalars = st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats() | st.text(max_size=8)
json_values = st.recursive(json_scalars, lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=4), c, max_size=3),
                           max_leaves=8)


@FUZZ
@given(name=st.sampled_from(["w", "b", "h", "__metadata__", "new"]),
       field=st.sampled_from(["dtype", "shape", "data_offsets", None]), value=json_values)
def test_fuzz_safetensors_header_fields(st_seed, tmp_path, name, field, value):
    (n,) = struct.unpack("<Q", st_seed[:8])
    header = json.loads(st_seed[8:8 + n])
    if field is None or not isinstance(header.get(name), dict):
        header[name] = value
    else:
        header[name][field] = value
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    path = tmp_path / "x.safetensors"
    path.write_bytes(struct.pack("<Q", len(h)) + h + st_seed[8 + n:])
    _check_safetensors(path)


# --------------------------------------------------------------------------------------------
# GGUF
# --------------------------------------------------------------------------------------------

GGUF_SEED = gguf_bytes(
    [ARCH, kv("general.alignment", U32, struct.pack("<I", 32)), kv("general.name", STR, gs("fuzz")),
     kv("tokenizer.ggml.tokens", 9, struct.pack("<IQ", STR, 3) + gs("<pad>") + gs("<eos>") + gs("<bos>")),
     kv("gemma3.block_count", U32, struct.pack("<I", 2)),
     kv("scores", 9, struct.pack("<IQ", 6, 3) + np.zeros(3, np.float32).tobytes())],
    [("a", [32, 2], 0, 0), ("b", [32], 8, 256)],  # F32 [2, 32] and one Q8_0 block
    np.arange(64, dtype=np.float32).tobytes() + bytes(34) + bytes(30))


@pytest.fixture(scope="module")
def gguf_warm(tmp_path_factory):
    """Compile the dequantization kernels once, outside the allocation bound."""
    path = tmp_path_factory.mktemp("fuzz") / "seed.gguf"
    path.write_bytes(GGUF_SEED)
    read_gguf(path)


@FUZZ
@given(edits=edits, cut=cuts)
def test_fuzz_gguf_bytes(gguf_warm, tmp_path, edits, cut):
    path = tmp_path / "x.gguf"
    path.write_bytes(mutate(GGUF_SEED, edits, cut))
    with bounded_allocation():
        try:
            gf = read_gguf(path)
        except GGUFError:
            return
    for info in gf.tensor_info.values():  # what was accepted lies inside the file, in order
        assert 0 < info.offset and info.offset + info.nbytes <= len(path.read_bytes())


def test_gguf_seed_is_valid(tmp_path):
    path = tmp_path / "x.gguf"
    path.write_bytes(GGUF_SEED)
    assert set(read_gguf(path).tensors) == {"a", "b"}


# --------------------------------------------------------------------------------------------
# configuration
# --------------------------------------------------------------------------------------------

TINY = text_config("tiny", vocab_size=512)
numbers = st.integers(-2**40, 2**40) | st.floats(allow_nan=True, allow_infinity=True) | st.sampled_from([0, 1, 2, 10**8, -1])


@FUZZ
@given(changes=st.dictionaries(st.sampled_from(sorted(TINY)), json_values | numbers, min_size=1, max_size=3))
def test_fuzz_config_fields(changes):
    with bounded_allocation():
        try:
            cfg = ModelConfig.from_hf({**TINY, **changes})
        except ConfigError:
            return
    assert 1 <= cfg.num_hidden_layers <= MAX_LAYERS and len(cfg.layers) == cfg.num_hidden_layers
    assert all(s.head_dim >= 2 and cfg.num_attention_heads % s.num_kv_heads == 0 for s in cfg.layers)


@FUZZ
@given(top=json_values)
def test_fuzz_config_top_level(top):
    try:
        ModelConfig.from_hf(top)
    except ConfigError:
        pass


GGUF_META = {"general.architecture": "gemma3", "gemma3.block_count": 2, "gemma3.embedding_length": 64,
             "gemma3.feed_forward_length": 128, "gemma3.attention.head_count": 2,
             "gemma3.attention.head_count_kv": 1, "gemma3.context_length": 1024,
             "gemma3.attention.sliding_window": 16, "gemma3.attention.key_length": 32,
             "tokenizer.ggml.tokens": ["<pad>", "<eos>", "<bos>"], "tokenizer.ggml.bos_token_id": 2}


@FUZZ
@given(changes=st.dictionaries(st.sampled_from(sorted(GGUF_META) + ["gemma3.attention.sliding_window_pattern",
                                                                    "gemma3.rope.scaling.factor",
                                                                    "gemma3.final_logit_softcapping"]),
                               json_values | numbers | st.builds(np.array, st.lists(st.integers(-5, 300), max_size=4)),
                               min_size=1, max_size=3))
def test_fuzz_gguf_metadata_to_config(changes):
    with bounded_allocation():
        try:
            ModelConfig.from_hf(config_from_gguf({**GGUF_META, **changes}))
        except (GGUFError, ConfigError):
            pass
