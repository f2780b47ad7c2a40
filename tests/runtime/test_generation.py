"""Generation behaviour of `Model`: sampling (seeds, top-k/top-p/min-p), stop rules, streaming,
chat cache reuse, context limits and error handling (bad ids, malformed checkpoints)."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import hf_oracle as H
from conftest import random_ids

VOCAB = 512
BOS, EOS = 2, 1

# E2B-like text stack in the multimodal layout: PLE, KV sharing (layers 4, 5 reuse 3 and 2),
# attention_k_eq_v on full layers, window 8 (shorter than every prompt below)
GEN_CONFIG = dict(layout="conditional", seed=15, sliding_window=8, num_kv_shared_layers=2, attention_k_eq_v=True,
                  num_global_key_value_heads=1)

PROMPT = random_ids(24, VOCAB, seed=42)
TEXT_PROMPT = "Once upon a time there was a little model"


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("gen_ckpt")
    H.make_gemma4_checkpoint(path, tokenizer=True, **GEN_CONFIG)
    return path


@pytest.fixture(scope="module")
def model(folder, gl):
    return gl.load(folder)


@pytest.fixture(scope="module")
def greedy(model):
    return model.generate_tokens(PROMPT, max_new_tokens=32, temperature=0.0)


def _as_list(x):
    return list(x) if not isinstance(x, list) else x


# --------------------------------------------------------------------------------------------
# greedy / seeds
# --------------------------------------------------------------------------------------------

def test_greedy_is_long_and_deterministic(model, greedy):
    assert len(greedy) == 32, "the fixture model should not hit eos in 32 greedy steps (change the seed)"
    assert len(set(greedy)) >= 8
    assert model.generate_tokens(PROMPT, max_new_tokens=32, temperature=0.0) == greedy
    assert model.generate_tokens(PROMPT, max_new_tokens=5, temperature=0.0) == greedy[:5]


def test_seeded_sampling_reproduces(model):
    a = model.generate_tokens(PROMPT, max_new_tokens=24, temperature=1.0, seed=1234)
    b = model.generate_tokens(PROMPT, max_new_tokens=24, temperature=1.0, seed=1234)
    assert a == b
    c = _as_list(model.generate_tokens(PROMPT, max_new_tokens=24, temperature=1.0, seed=1234, stream=True))
    assert c == a


def test_different_seeds_differ(model, greedy):
    runs = [model.generate_tokens(PROMPT, max_new_tokens=24, temperature=1.0, seed=s) for s in range(5)]
    assert len({tuple(r) for r in runs}) > 1, "five seeds gave the same sample"
    assert any(r != greedy[:len(r)] for r in runs), "sampling at temperature 1 always returned the greedy tokens"


def test_top_k_1_is_greedy(model, greedy):
    for seed in (0, 1):
        assert model.generate_tokens(PROMPT, max_new_tokens=32, temperature=1.0, top_k=1, seed=seed) == greedy


def _allowed(row: np.ndarray, temperature: float, top_k=None, top_p=None, min_p=None) -> np.ndarray:
    """Tokens a sampler may emit: temperature, then top-k, top-p, min-p (each on the renormalised
    survivors). Boundaries are lenient by ~1e-4 (decode-path vs prefill logits rounding)."""
    z = row.astype(np.float64) / temperature
    keep = np.ones(z.shape, bool)

    def probs():
        e = np.where(keep, np.exp(z - z[keep].max()), 0.0)
        return e / e.sum()

    if top_k:
        kth = np.sort(z)[-top_k]
        keep &= z >= kth - 1e-4 / temperature
    if top_p is not None:
        p = probs()
        order = np.argsort(-p, kind="stable")
        before = np.cumsum(p[order]) - p[order]
        nucleus = np.zeros_like(keep)
        nucleus[order[before < top_p + 1e-4]] = True
        keep &= nucleus
    if min_p is not None:
        p = probs()
        keep &= p >= min_p * p.max() * np.exp(-2e-4 / temperature)
    return keep


FILTERS = {
    "top_k5_t1.5": dict(temperature=1.5, top_k=5),
    "top_p0.6_t0.8": dict(temperature=0.8, top_p=0.6),
    "min_p0.2_t1.2": dict(temperature=1.2, min_p=0.2),
    "all_three_t1": dict(temperature=1.0, top_k=20, top_p=0.9, min_p=0.05),
}


@pytest.mark.parametrize("name", list(FILTERS))
def test_filters_never_emit_excluded_tokens(model, name):
    kw = FILTERS[name]
    steps = 16
    streamed = []
    for tok in model.generate_tokens(PROMPT, max_new_tokens=steps, seed=99, stream=True, **kw):
        streamed.append(int(tok))
    assert streamed == model.generate_tokens(PROMPT, max_new_tokens=steps, seed=99, **kw)
    assert len(streamed) == steps
    excluded_some = False
    for i, tok in enumerate(streamed):
        row = model.logits(PROMPT + streamed[:i])[-1]
        keep = _allowed(row, **kw)
        excluded_some |= not keep.all()
        assert keep[tok], (f"{name}: step {i} emitted token {tok}, outside the allowed set "
                           f"{np.flatnonzero(keep).tolist()[:30]}")
    assert excluded_some


# --------------------------------------------------------------------------------------------
# stop rules and streaming
# --------------------------------------------------------------------------------------------

def test_stop_token_ids(model, greedy):
    k = 6
    stop = greedy[k]
    first = greedy.index(stop)
    assert model.generate_tokens(PROMPT, max_new_tokens=32, temperature=0.0, stop=[stop]) == greedy[:first]


def test_generation_stops_on_config_eos(folder, gl, greedy, tmp_path):
    """An eos id from the checkpoint's config/generation_config ends generation (not returned)."""
    stop = greedy[9]
    path = H.copy_checkpoint(folder, tmp_path / "eos")
    for name in ("config.json", "generation_config.json"):
        cfg = json.loads((path / name).read_text())
        target = cfg["text_config"] if "text_config" in cfg else cfg
        target["eos_token_id"] = [EOS, stop]
        if name == "generation_config.json":
            cfg["eos_token_id"] = [EOS, stop]
        (path / name).write_text(json.dumps(cfg))
    m = gl.load(path)
    assert m.generate_tokens(PROMPT, max_new_tokens=32, temperature=0.0) == greedy[:greedy.index(stop)]


@pytest.fixture(scope="module")
def text_greedy(model):
    text = model.generate(TEXT_PROMPT, max_new_tokens=40, temperature=0.0)
    assert isinstance(text, str)
    assert len(text) >= 12, f"greedy text too short for the stop-string tests: {text!r}"
    return text


def _stop_string(text: str) -> str:
    i = len(text) // 2
    return text[i:i + 3]


def test_generate_text_is_decoded_greedy_tokens(model, text_greedy):
    ids = model.tokenizer.encode(TEXT_PROMPT)
    assert ids.count(BOS) == 1 and ids[0] == BOS
    toks = model.generate_tokens(ids, max_new_tokens=40, temperature=0.0)
    decoded = model.tokenizer.decode(toks)
    assert text_greedy in (decoded, model.tokenizer.decode(toks, skip_special_tokens=True)), (
        f"generate() text is not the decoded new tokens (transformers' decode gives the same as "
        f"tokenizer.decode); first difference at char "
        f"{next((i for i, (a, b) in enumerate(zip(text_greedy, decoded)) if a != b), min(len(text_greedy), len(decoded)))}"
        f": generate {text_greedy[:60]!r} vs decode {decoded[:60]!r}; tokens {toks[:12]}")


def test_stop_string_cuts_text(model, text_greedy):
    s = _stop_string(text_greedy)
    expected = text_greedy[:text_greedy.find(s)]
    assert model.generate(TEXT_PROMPT, max_new_tokens=40, temperature=0.0, stop=[s]) == expected
    assert model.generate(TEXT_PROMPT, max_new_tokens=40, temperature=0.0, stop=[s, "\x00never\x00"]) == expected
    assert model.generate(TEXT_PROMPT, max_new_tokens=40, temperature=0.0, stop=["\x00never\x00"]) == text_greedy


def test_streamed_text_concatenates(model, text_greedy):
    pieces = list(model.generate(TEXT_PROMPT, max_new_tokens=40, temperature=0.0, stream=True))
    assert all(isinstance(p, str) for p in pieces)
    assert len(pieces) > 1
    assert "".join(pieces) == text_greedy
    s = _stop_string(text_greedy)
    pieces = list(model.generate(TEXT_PROMPT, max_new_tokens=40, temperature=0.0, stream=True, stop=[s]))
    assert "".join(pieces) == text_greedy[:text_greedy.find(s)], "streaming leaked (part of) the stop string"


def test_streamed_sampled_text_concatenates(model):
    kw = dict(max_new_tokens=30, temperature=1.0, top_p=0.95, seed=5)
    assert "".join(model.generate(TEXT_PROMPT, stream=True, **kw)) == model.generate(TEXT_PROMPT, **kw)


# --------------------------------------------------------------------------------------------
# chat
# --------------------------------------------------------------------------------------------

TURN1 = [{"role": "system", "content": "You answer questions about the old town."},
         {"role": "user", "content": "Tell me a story about a cat and a dog who were friends."}]


def test_chat_follow_up_equals_fresh_full_history(folder, gl):
    """Second turn on a model that cached the first equals a fresh model's answer (greedy)."""
    m = gl.load(folder)
    r1 = m.chat(TURN1, max_new_tokens=16, temperature=0.0)
    assert isinstance(r1, str)
    history = TURN1 + [{"role": "assistant", "content": r1},
                       {"role": "user", "content": "What is the capital of France? Please answer the question."}]
    r2 = m.chat(history, max_new_tokens=16, temperature=0.0)
    fresh = gl.load(folder)
    assert fresh.chat(history, max_new_tokens=16, temperature=0.0) == r2
    # a third turn, and a conversation that edits an earlier message (cache prefix diverges early)
    history3 = history + [{"role": "assistant", "content": r2}, {"role": "user", "content": "Thank you."}]
    r3 = m.chat(history3, max_new_tokens=12, temperature=0.0)
    assert gl.load(folder).chat(history3, max_new_tokens=12, temperature=0.0) == r3
    edited = [TURN1[0], {"role": "user", "content": "Tell me a story about a fox."}]
    assert m.chat(edited, max_new_tokens=12, temperature=0.0) == gl.load(folder).chat(
        edited, max_new_tokens=12, temperature=0.0)


def test_chat_streaming_equals_non_streaming(folder, gl):
    a = gl.load(folder).chat(TURN1, max_new_tokens=16, temperature=0.0)
    b = "".join(gl.load(folder).chat(TURN1, max_new_tokens=16, temperature=0.0, stream=True))
    assert a == b


# --------------------------------------------------------------------------------------------
# context limits
# --------------------------------------------------------------------------------------------

CONTEXT = 32


@pytest.fixture(scope="module")
def small(folder, gl):
    return gl.load(folder, context=CONTEXT)


def test_prompt_longer_than_context_raises(small, gl):
    long_ids = random_ids(CONTEXT + 8, VOCAB, seed=3)
    for call in (lambda: small.logits(long_ids), lambda: small.hidden_states(long_ids),
                 lambda: small.generate_tokens(long_ids, max_new_tokens=4, temperature=0.0)):
        with pytest.raises(gl.ContextError):
            call()
    long_text = " ".join(["the quick brown fox jumps over the lazy dog"] * 8)
    assert len(small.tokenizer.encode(long_text)) > CONTEXT
    with pytest.raises(gl.ContextError):
        small.generate(long_text, max_new_tokens=4, temperature=0.0)
    with pytest.raises(gl.ContextError):
        small.chat([{"role": "user", "content": long_text}], max_new_tokens=4, temperature=0.0)
    # exactly the context still works
    assert small.logits(long_ids[:CONTEXT]).shape == (CONTEXT, VOCAB)


def test_truncate_keeps_a_suffix(small, model):
    long_ids = random_ids(CONTEXT + 8, VOCAB, seed=3)
    out = small.generate_tokens(long_ids, max_new_tokens=4, temperature=0.0, truncate=True)
    assert 1 <= len(out) <= 4 and all(0 <= t < VOCAB for t in out)
    # the engine kept the most recent tokens (at least half the context): the output is greedy
    # generation from such a suffix
    assert any(model.generate_tokens(long_ids[-k:], max_new_tokens=len(out), temperature=0.0) == out
               for k in range(CONTEXT, CONTEXT // 2 - 1, -1)), "truncate=True did not continue a suffix of the prompt"
    short = PROMPT[:20]
    assert small.generate_tokens(short, max_new_tokens=4, temperature=0.0, truncate=True) == \
        small.generate_tokens(short, max_new_tokens=4, temperature=0.0)


def test_generation_stays_within_context(small, model):
    prompt = PROMPT[:CONTEXT - 4]
    out = small.generate_tokens(prompt, max_new_tokens=20, temperature=0.0)
    assert 1 <= len(out) <= CONTEXT - len(prompt) + 1
    assert out == model.generate_tokens(prompt, max_new_tokens=len(out), temperature=0.0)


# --------------------------------------------------------------------------------------------
# errors
# --------------------------------------------------------------------------------------------

def test_error_classes(gl):
    assert issubclass(gl.CheckpointError, ValueError)
    assert issubclass(gl.ContextError, ValueError)


@pytest.mark.parametrize("bad", [[5, VOCAB], [-1, 5], [VOCAB + 100]])
def test_token_id_out_of_range(model, bad):
    with pytest.raises(ValueError):
        model.logits(bad)
    with pytest.raises(ValueError):
        model.hidden_states(bad)
    with pytest.raises(ValueError):
        model.generate_tokens(bad, max_new_tokens=2, temperature=0.0)


def _tensor_key(path: Path, suffix: str) -> str:
    keys = load_file(str(path / "model.safetensors")).keys()
    (key,) = [k for k in keys if k.endswith(suffix) and "language_model" in k]
    return key


def _edit_tensors(path: Path, fn) -> None:
    f = path / "model.safetensors"
    t = load_file(str(f))
    fn(t)
    save_file(t, str(f), metadata={"format": "pt"})


def _drop(suffix):
    def edit(path):
        key = _tensor_key(path, suffix)
        _edit_tensors(path, lambda t: t.pop(key))
    return edit


def _reshape(suffix):
    def edit(path):
        key = _tensor_key(path, suffix)

        def fn(t):
            t[key] = np.ascontiguousarray(t[key][:-1])
        _edit_tensors(path, fn)
    return edit


def _config(field, value):
    def edit(path):
        cfg = json.loads((path / "config.json").read_text())
        cfg["text_config"][field] = value
        (path / "config.json").write_text(json.dumps(cfg))
    return edit


def _no_config(path):
    (path / "config.json").unlink()


BROKEN = {
    # name: (edit, a string the error message must contain)
    "missing_q_norm": (_drop("layers.1.self_attn.q_norm.weight"), "layers.1.self_attn.q_norm.weight"),
    "missing_ple_table": (_drop("embed_tokens_per_layer.weight"), "embed_tokens_per_layer.weight"),
    "misshaped_up_proj": (_reshape("layers.0.mlp.up_proj.weight"), "layers.0.mlp.up_proj.weight"),
    "misshaped_k_proj": (_reshape("layers.2.self_attn.k_proj.weight"), "layers.2.self_attn.k_proj.weight"),
    "moe_config": (_config("enable_moe_block", True), "enable_moe_block"),
    "missing_config": (_no_config, "config.json"),
}


@pytest.mark.parametrize("name", list(BROKEN))
def test_malformed_checkpoint_raises_checkpoint_error(folder, gl, tmp_path, name):
    edit, needle = BROKEN[name]
    path = H.copy_checkpoint(folder, tmp_path / name)
    edit(path)
    with pytest.raises(gl.CheckpointError) as e:
        gl.load(path)
    assert needle in str(e.value), f"the error does not name {needle!r}: {e.value}"


def test_state_intact_after_errors(folder, gl, tmp_path):
    m = gl.load(folder, context=CONTEXT)
    conv = [{"role": "user", "content": "Hello there!"}]
    logits0 = m.logits(PROMPT)
    greedy0 = m.generate_tokens(PROMPT, max_new_tokens=6, temperature=0.0)
    chat0 = m.chat(conv, max_new_tokens=6, temperature=0.0)

    long_ids = random_ids(CONTEXT + 1, VOCAB, seed=9)
    with pytest.raises(gl.ContextError):
        m.generate_tokens(long_ids, max_new_tokens=2, temperature=0.0)
    with pytest.raises(gl.ContextError):
        m.chat([{"role": "user", "content": "the quick brown fox " * 20}], max_new_tokens=2, temperature=0.0)
    with pytest.raises(ValueError):
        m.generate_tokens([3, VOCAB], max_new_tokens=2, temperature=0.0)
    with pytest.raises(ValueError):
        m.logits([VOCAB])
    for name in ("missing_q_norm", "missing_config"):
        path = H.copy_checkpoint(folder, tmp_path / name)
        BROKEN[name][0](path)
        with pytest.raises(gl.CheckpointError):
            gl.load(path)

    np.testing.assert_allclose(m.logits(PROMPT), logits0, rtol=0, atol=1e-6)
    assert m.generate_tokens(PROMPT, max_new_tokens=6, temperature=0.0) == greedy0
    assert m.chat(conv, max_new_tokens=6, temperature=0.0) == chat0
