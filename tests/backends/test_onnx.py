"""The ONNX export of the decoder graph on ONNX Runtime's CPU provider (`gemmalite.backends.onnx`).

Tiny random float32 checkpoints built by transformers (`hf_oracle`, every weight random), with
the seeds of the Gemma 4 parity variants (their float32 conditioning is checked there), and a
Gemma 3 one. Per variant, over a 100-token prompt (the prefill graph: a chunk of 64, then 36 rows
padded to 64) and 64 decode steps (164 positions: sliding windows of 8, 4 and 3, so the rings
wrap within each chunk and every few steps; KV-shared layers of both types read their sources'
caches) the ONNX graph's logits are within 1e-4 of gemmalite's own
graph and of transformers at every step, and greedy decoding gives the same tokens and text.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

import hf_oracle as H
from conftest import random_ids

pytest.importorskip("onnxruntime")

from gemmalite.backends.onnx.export import (DATA_FILE, GRAPH_FILE, PREFILL_CHUNK, PREFILL_FILE,  # noqa: E402
                                           check_folder, export_graphs)
from gemmalite.errors import ConfigError, ContextError, InputError  # noqa: E402

S, F = "sliding_attention", "full_attention"
CONTEXT = 256
PROMPT, STEPS = 100, 64  # the prompt: one full prefill chunk (64) and a padded one
ATOL = 1e-4

VARIANTS = {
    # window 8; consumers 5 (F), 6 (S), 7 (F) of producers 2 (F) and 4 (S); MQA
    "kv_shared": dict(seed=43, num_hidden_layers=8, layer_types=[S, S, F, S, S, F, S, F], num_kv_shared_layers=3,
                      num_key_value_heads=1),
    # window 4, E2B-like: multimodal layout, 4 consumers of layers 2 (S) and 3 (F), double-wide consumer MLPs
    "e2b_like": dict(seed=56, layout="conditional", num_hidden_layers=8, layer_types=[S, S, S, F] * 2,
                     num_kv_shared_layers=4, use_double_wide_mlp=True, num_key_value_heads=1, sliding_window=4),
    # full layers: V = raw K, one global KV head, consumed by a KV-shared full layer
    "k_eq_v": dict(seed=81, layout="conditional", hub_style=True, attention_k_eq_v=True,
                   num_global_key_value_heads=1, num_kv_shared_layers=2),
}


def _gemma3(path) -> torch.nn.Module:
    """A Gemma 3 checkpoint (window 3, query_pre_attn_scalar scale, (1 + w) norms, untied head)."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(5)
    cfg = Gemma3TextConfig(vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=40,
                           sliding_window=3, max_position_embeddings=512, tie_word_embeddings=False,
                           final_logit_softcapping=20.0, attn_implementation="eager")
    model = Gemma3ForCausalLM(cfg).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.randn_like(p) * (0.3 if "norm" in name else 0.5 / p.shape[-1] ** 0.5 if p.ndim == 2 else 0.1))
        model.model.embed_tokens.weight.mul_(4.0)
    model.save_pretrained(path)
    return model


@pytest.fixture(scope="module", params=[*VARIANTS, "gemma3"])
def case(request, tmp_path_factory, gl):
    path = tmp_path_factory.mktemp(f"onnx_{request.param}")
    if request.param == "gemma3":
        ref = _gemma3(path)
        H.write_tiny_tokenizer(path, 512)
    else:
        ref = H.make_gemma4_checkpoint(path, tokenizer=True, **VARIANTS[request.param])
    ours = gl.load(path, context=CONTEXT)
    ort = gl.load(path, context=CONTEXT, backend="onnxruntime", providers=["CPUExecutionProvider"])
    return request.param, ref, ours, ort, path


def _run(model, prompt: list[int], follow: list[int] | None = None) -> tuple[np.ndarray, list[int]]:
    """Logits of the prompt's last position and of each decode step (greedy, or feeding ``follow``)."""
    e = model.engine
    state = e.new_state()
    rows = [e.logits(e.prefill(state, np.array(prompt)))[0]]
    toks = []
    for i in range(STEPS):
        toks.append(int(np.argmax(rows[-1])) if follow is None else follow[i])
        rows.append(e.decode_step(state, toks[-1]))
    return np.stack(rows), toks


def test_logits_match_own_graph_and_transformers(case):
    name, ref, ours, ort, _ = case
    assert PREFILL_CHUNK < PROMPT < 2 * PREFILL_CHUNK and ort.engine.graph.chunk == PREFILL_CHUNK
    prompt = random_ids(PROMPT, 512, seed=7)
    got, toks = _run(ort, prompt)
    want, _ = _run(ours, prompt, toks)
    d_own = float(np.abs(got - want).max())
    assert d_own <= ATOL, f"{name}: ONNX vs gemmalite's graph max |dlogit| {d_own:.2e}"
    hf = H.hf_logits(ref, prompt + toks[:-1])[PROMPT - 1:]  # the prompt's last position, then each step
    d_hf = float(np.abs(got[:-1] - hf).max())
    assert d_hf <= ATOL, f"{name}: ONNX vs transformers max |dlogit| {d_hf:.2e}"
    assert len(set(toks)) >= 8, f"{name}: a weak test (greedy path repeats), change the seed"


def test_greedy_text_identical(case):
    name, _, ours, ort, _ = case
    prompt = random_ids(12, 512, seed=3)
    a = ours.generate_tokens(prompt, max_new_tokens=40, temperature=0.0)
    b = ort.generate_tokens(prompt, max_new_tokens=40, temperature=0.0)
    assert [int(t) for t in a] == [int(t) for t in b], name
    assert ours.tokenizer.decode(list(a)) == ort.tokenizer.decode(list(b))


def test_state_clone_and_truncate(case):
    """A clone of a prefix continues exactly as a fresh run (prefix reuse by sessions and the server)."""
    _, _, _, ort, _ = case
    e = ort.engine
    ids = random_ids(20, 512, seed=9)
    a = e.new_state()
    e.prefill(a, np.array(ids))
    b = a.clone()
    assert b is not None and b.length == 20
    x = e.decode_step(a, 5)
    np.testing.assert_array_equal(e.decode_step(b, 5), x)
    fresh = e.new_state()
    e.prefill(fresh, np.array(ids))
    np.testing.assert_array_equal(e.decode_step(fresh, 5), x)
    assert a.truncate(20) and a.length == 20  # back one token: the ring slot it frees is written next
    other = e.new_state()
    e.prefill(other, np.array(ids))
    np.testing.assert_array_equal(e.decode_step(a, 7), e.decode_step(other, 7))
    assert not a.truncate(10) and a.length == 21  # the wrapped sliding ring lost what position 10 needs
    assert a.clone(10) is None
    with pytest.raises(ContextError):
        e.prefill(e.new_state(), np.arange(CONTEXT + 1) % 500)


def test_batched_steps_equal_solo_steps(case):
    """The server's calls (`prefill_many`, `decode_batch` with a prompt-lookup run) give each sequence its solo numbers."""
    _, _, _, ort, _ = case
    e = ort.engine
    p1, p2 = random_ids(9, 512, seed=1), random_ids(5, 512, seed=2)
    a, b = e.new_state(), e.new_state()
    h = e.prefill_many([a, b], [p1, p2])
    solo = [e.new_state(), e.new_state()]
    np.testing.assert_array_equal(h, np.concatenate([e.prefill(s, np.array(p)) for s, p in zip(solo, [p1, p2])]))
    got = e.decode_batch([a, b], [11, [12, 13]])
    want = np.concatenate([e.decode_step(solo[0], 11)[None], e.decode_step(solo[1], 12)[None],
                           e.decode_step(solo[1], 13)[None]])
    np.testing.assert_array_equal(got, want)
    assert (a.length, b.length) == (10, 7)


def test_export_cli_and_checker(case, tmp_path):
    """`gemmalite export` writes the graph and its data beside it, and the checker passes on them."""
    from gemmalite.cli import main

    name, _, _, _, path = case
    out = tmp_path / "onnx"
    assert main(["export", str(path), str(out), "--format", "onnx", "--context", "64"]) == 0
    assert sorted(p.name for p in out.iterdir()) == sorted([GRAPH_FILE, PREFILL_FILE, DATA_FILE])
    check_folder(out)
    assert main(["export", str(path), str(out), "--context", "64"]) != 0  # not empty: refused, left intact
    check_folder(out)


def test_unsupported_says_what(tmp_path, gl):
    from small_checkpoint import write_small_checkpoint

    path = write_small_checkpoint(tmp_path / "ckpt")
    q = gl.load(path, context=CONTEXT, quant="int8")
    with pytest.raises(ConfigError, match="Int8Matrix"):
        export_graphs(q.engine.graph, tmp_path, CONTEXT)
    assert not (tmp_path / GRAPH_FILE).exists()  # refused before anything was written
    with pytest.raises(InputError, match="quant must be None"):
        gl.load(path, backend="onnxruntime", quant="int8")
    with pytest.raises(InputError, match="backend"):
        gl.load(path, backend="tensorrt")
    import onnxruntime

    if "CUDAExecutionProvider" not in onnxruntime.get_available_providers():
        with pytest.raises(ConfigError, match="CUDAExecutionProvider"):
            gl.load(path, context=16, backend="onnxruntime", providers=["CUDAExecutionProvider"])
