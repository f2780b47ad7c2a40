"""Strict readers, case by case: files the official readers (the `safetensors` package,
llama.cpp's gguf.cpp rules) reject are rejected here too, with the project's error naming the
file and the problem; impossible configurations name the field."""
from __future__ import annotations

import json
import math
import struct
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

from gemmalite.errors import CheckpointError, ConfigError, TokenizerError
from gemmalite.formats.folder import load_folder
from gemmalite.formats.gguf import GGUFError, read_gguf
from gemmalite.formats.gguf_gemma import config_from_gguf
from gemmalite.formats.safetensors import read_safetensors
from gemmalite.models.gemma.config import ModelConfig
from gemmalite.tools.synth import text_config

# --------------------------------------------------------------------------------------------
# safetensors
# --------------------------------------------------------------------------------------------


def st_file(path: Path, header, data: bytes, raw: bytes | None = None) -> Path:
    h = raw if raw is not None else json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    path.write_bytes(struct.pack("<Q", len(h)) + h + data)
    return path


def f32(start: int, n: int = 2) -> dict:
    return {"dtype": "F32", "shape": [n], "data_offsets": [start, start + 4 * n]}


ST_BAD = {
    "gap": ({"a": f32(0), "b": f32(16)}, bytes(24)),
    "overlap": ({"a": f32(0, 4), "b": f32(8)}, bytes(16)),
    "alias": ({"a": f32(0), "b": f32(0)}, bytes(8)),
    "trailing_bytes": ({"a": f32(0)}, bytes(16)),
    "truncated": ({"a": f32(0, 4)}, bytes(8)),
    "negative_shape": ({"a": {"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}}, bytes(8)),
    "negative_offset": ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [-8, 0]}}, bytes(8)),
    "float_shape": ({"a": {"dtype": "F32", "shape": [2.0], "data_offsets": [0, 8]}}, bytes(8)),
    "wrong_size_for_dtype": ({"a": {"dtype": "F16", "shape": [2], "data_offsets": [0, 8]}}, bytes(8)),
    "header_is_a_list": ([1, 2], bytes(8)),
    "metadata_not_strings": ({"__metadata__": {"x": 1}, "a": f32(0)}, bytes(8)),
    "entry_not_an_object": ({"a": [1, 2]}, bytes(8)),
    "offsets_reversed": ({"a": {"dtype": "F32", "shape": [0], "data_offsets": [8, 0]}}, bytes(8)),
}


@pytest.mark.parametrize("case", list(ST_BAD))
def test_safetensors_rejected_like_the_official_reader(tmp_path, case):
    path = st_file(tmp_path / "x.safetensors", *ST_BAD[case])
    with pytest.raises(Exception):
        load_file(str(path))  # the oracle rejects it ...
    with pytest.raises(CheckpointError, match="x.safetensors"):
        read_safetensors(path)  # ... and so do we, with our error naming the file


def test_safetensors_deep_nesting_and_bad_headers(tmp_path):
    deep = b'{"a": ' + b"[" * 5000 + b"]" * 5000 + b"}"
    for raw in (deep, b'{"a": 1, "a": 2}', b"\xff\xfe{}", b" {}", b"{" + b" " * 10):
        with pytest.raises(CheckpointError, match="corrupt safetensors header"):
            read_safetensors(st_file(tmp_path / "x.safetensors", None, b"", raw=raw))
    big = tmp_path / "big.safetensors"
    big.write_bytes(struct.pack("<Q", 2**63) + b"{}")
    with pytest.raises(CheckpointError, match="corrupt safetensors header"):
        read_safetensors(big)


def test_safetensors_valid_files_agree_with_the_official_reader(tmp_path):
    from safetensors.numpy import save_file

    arrays = {"b": np.arange(6, dtype=np.float32).reshape(2, 3), "a": np.arange(4, dtype=np.int8),
              "empty": np.zeros((0, 3), np.float16)}
    save_file(arrays, str(tmp_path / "ok.safetensors"))
    ours = read_safetensors(tmp_path / "ok.safetensors")
    theirs = load_file(str(tmp_path / "ok.safetensors"))
    assert ours.keys() == theirs.keys()
    for k in theirs:
        np.testing.assert_array_equal(ours[k], theirs[k])
    # tensors listed out of offset order are fine (the official reader sorts them too)
    path = st_file(tmp_path / "unordered.safetensors", {"b": f32(8), "a": f32(0)}, bytes(16))
    assert set(read_safetensors(path)) == set(load_file(str(path))) == {"a", "b"}


# --------------------------------------------------------------------------------------------
# GGUF: a hand-built file whose every field is under the test's control
# --------------------------------------------------------------------------------------------

U32, STR, ARR, F32T = 4, 8, 9, 6


def gs(s: str | bytes) -> bytes:
    b = s.encode() if isinstance(s, str) else s
    return struct.pack("<Q", len(b)) + b


def kv(key: str, vtype: int, payload: bytes) -> bytes:
    return gs(key) + struct.pack("<I", vtype) + payload


def gguf_bytes(kvs: list[bytes], tensors: list[tuple[str, list[int], int, int]], data: bytes, *,
               align: int = 32, n_tensors: int | None = None, n_kv: int | None = None) -> bytes:
    out = b"GGUF" + struct.pack("<IQQ", 3, len(tensors) if n_tensors is None else n_tensors,
                                len(kvs) if n_kv is None else n_kv)
    out += b"".join(kvs)
    for name, ne, ttype, off in tensors:
        out += gs(name) + struct.pack("<I", len(ne)) + b"".join(struct.pack("<Q", d % 2**64) for d in ne)
        out += struct.pack("<IQ", ttype, off)
    out += b"\0" * (-len(out) % align)
    return out + data


ARCH = kv("general.architecture", STR, gs("gemma3"))
TWO = [("a", [8], 0, 0), ("b", [8], 0, 32)]  # two F32 tensors of 8 values, 32 bytes each


def nested(depth: int) -> bytes:
    """An array of arrays ``depth`` deep (the innermost empty)."""
    return struct.pack("<IQ", ARR, 1) * depth + struct.pack("<IQ", U32, 0)


GGUF_BAD = {
    "alias": ([ARCH], [("a", [8], 0, 0), ("b", [8], 0, 0)], bytes(64), "offset"),
    "overlap": ([ARCH], [("a", [16], 0, 0), ("b", [8], 0, 32)], bytes(96), "offset"),
    "gap": ([ARCH], [("a", [8], 0, 0), ("b", [8], 0, 64)], bytes(96), "offset"),
    "out_of_order": ([ARCH], [("a", [8], 0, 32), ("b", [8], 0, 0)], bytes(64), "offset"),
    "unaligned": ([ARCH], [("a", [8], 0, 0), ("b", [8], 0, 33)], bytes(96), "alignment"),
    "past_the_end": ([ARCH], TWO, bytes(40), "past the end"),
    "negative_dim": ([ARCH], [("a", [-8], 0, 0)], bytes(64), "dimensions"),
    "huge_dims": ([ARCH], [("a", [2**40, 2**40], 0, 0)], bytes(64), "dimensions"),
    "unknown_type": ([ARCH], [("a", [8], 99, 0)], bytes(64), "type"),
    "long_name": ([ARCH], [("n" * 64, [8], 0, 0)], bytes(64), "name"),
    "duplicate_tensor": ([ARCH], [("a", [8], 0, 0), ("a", [8], 0, 32)], bytes(64), "duplicate"),
    "duplicate_key": ([ARCH, ARCH], TWO, bytes(64), "duplicate"),
    "nested_5000": ([ARCH, kv("x", ARR, nested(5000))], TWO, bytes(64), "array of arrays"),
    "alignment_not_u32": ([ARCH, kv("general.alignment", STR, gs("32"))], TWO, bytes(64), "alignment"),
    "alignment_zero": ([ARCH, kv("general.alignment", U32, struct.pack("<I", 0))], TWO, bytes(64), "alignment"),
    "alignment_3": ([ARCH, kv("general.alignment", U32, struct.pack("<I", 3))], TWO, bytes(64), "alignment"),
    "string_array_count": ([ARCH, kv("x", ARR, struct.pack("<IQ", STR, 2**62))], TWO, bytes(64), "x"),
    "u32_array_count": ([ARCH, kv("x", ARR, struct.pack("<IQ", U32, 2**62))], TWO, bytes(64), "x"),
    "string_length": ([ARCH, kv("x", STR, struct.pack("<Q", 2**62))], TWO, bytes(64), "x"),
}


@pytest.mark.parametrize("case", list(GGUF_BAD))
def test_gguf_rejected_as_llama_cpp_rejects(tmp_path, case):
    kvs, tensors, data, needle = GGUF_BAD[case]
    path = tmp_path / "x.gguf"
    path.write_bytes(gguf_bytes(kvs, tensors, data))
    with pytest.raises(GGUFError, match="x.gguf") as e:
        read_gguf(path)
    assert needle in str(e.value), str(e.value)


def test_gguf_absurd_counts_fail_before_allocating(tmp_path):
    for n_tensors, n_kv in ((2**40, 0), (0, 2**40), (2**64 - 1, 1)):
        path = tmp_path / "x.gguf"
        path.write_bytes(gguf_bytes([ARCH], [], b"", n_tensors=n_tensors, n_kv=n_kv))
        with pytest.raises(GGUFError, match="corrupted header"):
            read_gguf(path)


def test_gguf_valid_layout_reads_and_agrees_with_gguf_py(tmp_path):
    from gguf import GGUFReader

    data = np.arange(8, dtype=np.float32).tobytes() + np.arange(8, 16, dtype=np.float32).tobytes()
    path = tmp_path / "ok.gguf"
    path.write_bytes(gguf_bytes([ARCH, kv("general.alignment", U32, struct.pack("<I", 32))], TWO, data))
    gf = read_gguf(path)
    ref = {t.name: np.asarray(t.data) for t in GGUFReader(str(path)).tensors}
    for name in ("a", "b"):
        np.testing.assert_array_equal(gf.tensors[name], ref[name])


# --------------------------------------------------------------------------------------------
# configuration: config.json and GGUF metadata
# --------------------------------------------------------------------------------------------

def tiny() -> dict:
    return text_config("tiny", vocab_size=512)


CONFIG_BAD = {
    "hidden_size_string": ("hidden_size", "abc"),
    "hidden_size_float": ("hidden_size", 127.5),
    "hidden_size_bool": ("hidden_size", True),
    "zero_heads": ("num_attention_heads", 0),
    "layers_1e8": ("num_hidden_layers", 10**8),
    "negative_vocab": ("vocab_size", -1),
    "eps_nan": ("rms_norm_eps", math.nan),
    "eps_string": ("rms_norm_eps", "1e-6"),
    "odd_head_dim": ("head_dim", 33),
    "layer_types_string": ("layer_types", "sliding_attention"),
    "layer_types_numbers": ("layer_types", [1, 2, 3, 4, 5, 6]),
    "tie_string": ("tie_word_embeddings", "false"),
    "eos_float": ("eos_token_id", 1.5),
    "eos_out_of_vocab": ("eos_token_id", 10**6),
    "shared_too_many": ("num_kv_shared_layers", 99),
    "kv_heads_zero": ("num_key_value_heads", -2),
    "rope_theta_string": ("rope_parameters", {"sliding_attention": {"rope_type": "default", "rope_theta": "x"},
                                              "full_attention": {"rope_type": "default", "rope_theta": 1.0}}),
    "rope_entry_list": ("rope_parameters", {"sliding_attention": [1], "full_attention": {}}),
    "softcap_inf": ("final_logit_softcapping", math.inf),
    "ple_negative": ("hidden_size_per_layer_input", -16),
    "per_layer_config_list": ("per_layer_config", [1]),
    "global_head_dim_string": ("global_head_dim", "64"),
}


@pytest.mark.parametrize("case", list(CONFIG_BAD))
def test_config_fields_are_type_and_range_checked(case):
    field, value = CONFIG_BAD[case]
    with pytest.raises(ConfigError) as e:
        ModelConfig.from_hf({**tiny(), field: value})
    assert field in str(e.value) or "layer" in str(e.value), str(e.value)


def test_gemma3_pattern_zero_is_refused():
    cfg = {"model_type": "gemma3_text", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
           "intermediate_size": 64, "vocab_size": 16, "sliding_window_pattern": 0}
    with pytest.raises(ConfigError, match="sliding_window_pattern"):
        ModelConfig.from_hf(cfg)


@pytest.mark.parametrize("text", ["[1, 2]", '"gemma"', "null", "[" * 5000 + "]" * 5000,
                                  '{"model_type": "gemma4", "text_config": [1]}', "{not json"])
def test_config_json_that_is_not_a_config(tmp_path, text):
    (tmp_path / "config.json").write_text(text)
    with pytest.raises(CheckpointError, match="config.json"):
        load_folder(tmp_path)


def test_config_error_names_file_and_field(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({**tiny(), "hidden_size": "abc"}))
    with pytest.raises(CheckpointError, match=r"config\.json.*hidden_size.*'abc'"):
        load_folder(tmp_path)


def gguf_meta(**over) -> dict:
    meta = {"general.architecture": "gemma3", "gemma3.block_count": 2, "gemma3.embedding_length": 64,
            "gemma3.feed_forward_length": 128, "gemma3.attention.head_count": 2, "gemma3.attention.head_count_kv": 1,
            "gemma3.context_length": 1024, "tokenizer.ggml.tokens": ["<pad>", "<eos>", "<bos>"]}
    meta.update(over)
    return {k: v for k, v in meta.items() if v is not None}


@pytest.mark.parametrize("over, needle", [
    ({"gemma3.block_count": None}, "block_count is missing"),
    ({"gemma3.block_count": 2**31}, "block_count"),
    ({"gemma3.block_count": "2"}, "block_count"),
    ({"gemma3.attention.head_count": 0}, "head_count"),
    ({"gemma3.embedding_length": "abc"}, "embedding_length"),
    ({"gemma3.embedding_length": None}, "embedding_length is missing"),
    ({"gemma3.attention.sliding_window_pattern": "6"}, "sliding_window_pattern"),
    ({"gemma3.feed_forward_length": np.array([128, 128, 128])}, "3 entries for 2 layers"),
])
def test_gguf_metadata_problems_name_the_key(over, needle):
    with pytest.raises((GGUFError, ConfigError), match=needle):
        ModelConfig.from_hf(config_from_gguf(gguf_meta(**over)))


@pytest.mark.parametrize("over, needle", [
    ({"tokenizer.ggml.tokens": None}, "no tokenizer.ggml.tokens"),
    ({"tokenizer.ggml.tokens": [1, 2]}, "no tokenizer.ggml.tokens"),
    ({"tokenizer.ggml.bos_token_id": 99}, "bos_token_id"),
    ({"tokenizer.ggml.scores": np.zeros(2, np.float32)}, "scores"),
    ({"tokenizer.ggml.model": None}, "tokenizer model"),
])
def test_gguf_tokenizer_problems_are_tokenizer_errors(over, needle):
    from gemmalite.formats.gguf_tokenizer import tokenizer_from_gguf_metadata

    meta = gguf_meta(**{"tokenizer.ggml.model": "llama", **over})
    with pytest.raises(TokenizerError, match=needle):
        tokenizer_from_gguf_metadata(meta)


def test_gguf_without_a_vocabulary_loads_for_token_ids(tmp_path, monkeypatch):
    import test_gguf

    import gemmalite

    monkeypatch.setattr(test_gguf, "_tokens", lambda w: None)
    test_gguf.write_gemma3(tmp_path / "novocab.gguf")
    m = gemmalite.load(tmp_path / "novocab.gguf", context=16)
    assert len(m.generate_tokens([2, 4, 5], max_new_tokens=3, temperature=0)) == 3
    with pytest.raises(TokenizerError, match="no tokenizer"):
        m.generate("hi")
