"""The Gemma 4 GGUF mapping (`formats/gguf_gemma.py`) against llama.cpp's own converter.

A tiny random E2B-like checkpoint (transformers-built, every weight random: PLE, KV sharing
with double-wide consumer MLPs, sliding and full layers with partial rotary, the multimodal
key layout) goes through ``convert_hf_to_gguf.py --outtype f32`` from the llama.cpp tree that
llama-cpp-python's sdist vendors. `.ci/run` fetches it and sets GEMMALITE_LLAMA_CPP to that tree
(its ``gguf-py`` is the one the converter imports). The GGUF then loads in gemmalite to the
folder's tensors bit for bit, its config and tokenizer, and the folder's logits.
"""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import hf_oracle as H
from conftest import random_ids

S, F = "sliding_attention", "full_attention"
#: E2B-like, as in the parity suite's "kv_shared_double_wide_e2b_like": layers 4..7 reuse the KV
#: of layers 2 (sliding) and 3 (full) and have twice the MLP width
CHECKPOINT = dict(layout="conditional", seed=56, num_hidden_layers=8, layer_types=[S, S, S, F] * 2,
                  num_kv_shared_layers=4, use_double_wide_mlp=True, num_key_value_heads=1, sliding_window=4)


def _converter() -> Path:
    root = os.environ.get("GEMMALITE_LLAMA_CPP")
    script = Path(root or "/nonexistent") / "convert_hf_to_gguf.py"
    if not script.is_file():
        pytest.skip("llama.cpp's convert_hf_to_gguf.py is not here: .ci/run fetches it "
                    "(or set GEMMALITE_LLAMA_CPP to a llama.cpp source tree)")
    return script


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> tuple[Path, Path]:
    script = _converter()
    folder = tmp_path_factory.mktemp("e2b-like")
    H.make_gemma4_checkpoint(folder, tokenizer=True, **CHECKPOINT)
    # the hub's tokenizer_config lists Gemma 4's turn / tool / channel tokens as special: the
    # converter then types them CONTROL (USER_DEFINED the visible ones), as in published GGUFs
    cfg_path = folder / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    basic = {cfg[k] for k in ("bos_token", "eos_token", "pad_token", "unk_token", "mask_token")}
    cfg["extra_special_tokens"] = [t for _, t in sorted(H.GEMMA_SPECIAL_TOKENS.items()) if t not in basic]
    cfg_path.write_text(json.dumps(cfg, indent=2))
    out = folder.parent / "e2b-like.gguf"
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    env.pop("NO_LOCAL_GGUF", None)  # the converter's own gguf-py, not the installed one
    r = subprocess.run([sys.executable, str(script), str(folder), "--outfile", str(out), "--outtype", "f32"],
                       capture_output=True, text=True, timeout=600, env=env, cwd=folder.parent)
    assert r.returncode == 0, r.stderr[-3000:]
    return folder, out


def test_tensors_config_and_tokenizer_are_the_folders(converted, gl):
    """Every text tensor of the folder comes back from the GGUF under the name `hf_tensors` gives
    it, bit for bit, and none is missing; the config and the tokenizer are the folder's."""
    from safetensors.numpy import load_file

    from gemmalite.formats.gguf import read_gguf
    from gemmalite.formats.gguf_gemma import hf_tensors

    folder, gguf = converted
    stored = {k.removeprefix("model.language_model."): v for k, v in load_file(folder / "model.safetensors").items()
              if k.startswith("model.language_model.")}
    got = hf_tensors(read_gguf(gguf))
    assert sorted(got) == sorted(stored)
    for name, t in got.items():
        dense = t.dense() if hasattr(t, "dense") else np.asarray(t)
        np.testing.assert_array_equal(dense.reshape(stored[name].shape), stored[name], err_msg=name)
    a, b = gl.load(folder), gl.load(gguf)
    fields = [f.name for f in dataclasses.fields(a.config) if f.name != "raw"]
    assert {f: getattr(b.config, f) for f in fields} == {f: getattr(a.config, f) for f in fields}
    layers = b.config.layers  # the features are there to be mapped: KV sharing, double-wide MLPs, both kinds, PLE
    assert [s.kv_source for s in layers] == [0, 1, 2, 3, 2, 2, 2, 3]
    assert [s.intermediate_size for s in layers] == [96] * 4 + [192] * 4
    assert [s.head_dim for s in layers] == [16, 16, 16, 32] * 2 and b.config.ple_dim == 8
    assert layers[3].rope.partial_rotary_factor == 0.25
    for text in ("Hello world, the cat sat.", "  two  spaces\nand a line", "<|turn>user\nhi<turn|>", "é ü 😀",
                 "<|channel>x<channel|><bos>"):
        assert b.tokenizer.encode(text) == a.tokenizer.encode(text), text
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    assert b.tokenizer.chat_ids(msgs) == a.tokenizer.chat_ids(msgs)


def test_logits_equal_the_folders(converted, gl):
    """The same function, bit for bit: prompts of every length (the few-row and short-input numba
    products, BLAS past SHORT_ROWS rows), decode steps, and the same checkpoint quantized on load.
    The tensors are the folder's bit for bit, and a float GGUF tensor takes the products of the
    folder's matrix of its dtype (`weights.ggml.GGMLMatrix`), so nothing may differ."""
    from gemmalite.kernels.common import FEW_ROWS, SHORT_ROWS

    folder, gguf = converted
    a, b = gl.load(folder), gl.load(gguf)
    vocab = a.config.vocab_size
    for n in (1, FEW_ROWS, FEW_ROWS + 1, 40, SHORT_ROWS, SHORT_ROWS + 1, 100):
        ids = random_ids(n, vocab, seed=n)
        np.testing.assert_array_equal(b.logits(ids), a.logits(ids), err_msg=f"{n} tokens")
    sa, sb = a.new_state(), b.new_state()
    prompt = np.array(random_ids(20, vocab, seed=7))
    np.testing.assert_array_equal(b.engine.logits(b.engine.prefill(sb, prompt)),
                                  a.engine.logits(a.engine.prefill(sa, prompt)))
    for tok in random_ids(12, vocab, seed=8):
        np.testing.assert_array_equal(b.engine.decode_step(sb, tok), a.engine.decode_step(sa, tok))
    for quant in ("int8", "int4"):
        qa, qb = gl.load(folder, quant=quant), gl.load(gguf, quant=quant)
        for n in (1, 5, 40, SHORT_ROWS + 1):
            ids = random_ids(n, vocab, seed=n)
            np.testing.assert_array_equal(qb.logits(ids), qa.logits(ids), err_msg=f"{quant}, {n} tokens")
