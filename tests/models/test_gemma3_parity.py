"""Gemma 3 text checkpoints (same engine, config-driven) against transformers, float32 eager."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import random_ids

VOCAB = 384
BASE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=6, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16, sliding_window=6, rms_norm_eps=1e-6,
            max_position_embeddings=512, pad_token_id=0, bos_token_id=2, eos_token_id=1)

VARIANTS = {
    "default": {},
    # attention scale from query_pre_attn_scalar, not head_dim; softcapped logits
    "scalar_softcap": dict(query_pre_attn_scalar=40, final_logit_softcapping=20.0),
    # linear RoPE scaling on full layers, own local base, explicit layer pattern, MQA
    "rope_linear": dict(rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 1000.0},
                                         "full_attention": {"rope_type": "linear", "factor": 4.0,
                                                            "rope_theta": 100000.0}},
                        layer_types=["sliding_attention", "full_attention"] * 3, num_key_value_heads=1),
    "untied": dict(tie_word_embeddings=False, sliding_window=3),
}


def _make(path, overrides, seed=0):
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(seed)
    cfg = Gemma3TextConfig(**{**BASE, **overrides}, attn_implementation="eager")
    model = Gemma3ForCausalLM(cfg).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:  # Gemma 3 multiplies by (1 + w): random w around 0 exercises it
                p.copy_(torch.randn_like(p) * 0.3)
            else:
                p.copy_(torch.randn_like(p) * (0.5 / p.shape[-1] ** 0.5 if p.ndim == 2 else 0.1))
        model.model.embed_tokens.weight.mul_(4.0)
    model.save_pretrained(path)
    return model


@pytest.fixture(scope="module", params=list(VARIANTS))
def pair(request, tmp_path_factory, gl):
    path = tmp_path_factory.mktemp(f"gemma3_{request.param}")
    ref = _make(path, VARIANTS[request.param])
    return ref, gl.load(path)


def test_logits_match_transformers(pair):
    ref, ours = pair
    ids = random_ids(29, VOCAB, seed=3)
    with torch.no_grad():
        expected = ref(torch.tensor([ids])).logits[0].numpy()
    got = ours.logits(ids)
    assert got.shape == expected.shape
    assert np.abs(got - expected).max() <= 1e-4, np.abs(got - expected).max()


def test_greedy_matches_transformers(pair):
    ref, ours = pair
    ids = random_ids(9, VOCAB, seed=4)
    with torch.no_grad():
        out = ref.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=40, min_new_tokens=40,
                           eos_token_id=None, pad_token_id=0)[0, len(ids):].tolist()
    ours.defaults.stop_ids = []  # transformers was told not to stop at eos either
    assert ours.generate_tokens(ids, max_new_tokens=40, temperature=0) == out
