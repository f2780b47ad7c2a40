"""The sampler against transformers on the same random checkpoint: over many seeded draws, the
token frequencies with a fixed temperature / top-k / top-p / min-p (and a grammar-like mask,
and a repetition penalty) follow transformers' processed distribution (its own logits
processors on its own logits; a chi-square test), and the repetition penalty's processed
logits equal its processor's."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import hf_oracle as H
from conftest import random_ids
from gemmalite.runtime.sampling import Sampler, SamplingParams, _softmax, _softmax_of, draw, nucleus, penalized

VOCAB = 512
PROMPT = random_ids(10, VOCAB, seed=1) * 2  # repeated: the repetition penalty has a history to act on
DRAWS = 6000


@pytest.fixture(scope="module")
def pair(tmp_path_factory, gl):
    path = tmp_path_factory.mktemp("sampling")
    H.make_gemma4_checkpoint(path, tokenizer=True, seed=4)
    hf = H.load_hf(path)
    model = gl.load(path)
    with torch.no_grad():
        hf_scores = hf(torch.tensor([PROMPT])).logits[:, -1].float()
    return hf, hf_scores, model.logits(PROMPT)[-1]


def _processed(hf, scores, allowed, **opts):
    """transformers' distribution: its logits processors for these options on its logits (the
    disallowed ones at -inf first, as a grammar's mask comes first here)."""
    from transformers import GenerationConfig

    gc = GenerationConfig(do_sample=True, top_k=opts.get("top_k") or 0, top_p=opts.get("top_p") or 1.0,
                          min_p=opts.get("min_p"), temperature=opts["temperature"],
                          repetition_penalty=opts.get("repetition_penalty") or 1.0)
    procs = hf._get_logits_processor(generation_config=gc, input_ids_seq_length=len(PROMPT), device="cpu")
    s = scores.clone()
    if allowed is not None:
        s[0, ~torch.from_numpy(allowed)] = -math.inf
    out = procs(torch.tensor([PROMPT]), s)
    return torch.softmax(out.double(), dim=-1)[0].numpy()


def _chi2_critical(df: int, z: float = 3.29) -> float:
    """Wilson-Hilferty upper quantile of chi-square(df) at the normal quantile z (p ~ 0.0005)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


OPTS = [dict(temperature=0.7), dict(temperature=1.3, top_k=20), dict(temperature=1.0, top_p=0.6),
        dict(temperature=0.9, min_p=0.05), dict(temperature=1.1, top_k=40, top_p=0.9, min_p=0.02),
        dict(temperature=1.0, top_k=30, repetition_penalty=1.5)]


@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("opts", OPTS)
def test_frequencies_follow_transformers(pair, opts, masked):
    hf, scores, logits = pair
    allowed = np.random.default_rng(7).random(VOCAB) < 0.3 if masked else None
    p = _processed(hf, scores, allowed, **opts)
    sampler = Sampler(SamplingParams(seed=11, **opts))
    counts = np.bincount([sampler(logits, PROMPT, allowed) for _ in range(DRAWS)], minlength=VOCAB)
    assert counts[p == 0].sum() == 0, "drew a token transformers' processors remove"
    expected = DRAWS * p
    big = expected >= 5
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    keep = exp > 0
    stat = float((((obs - exp) ** 2)[keep] / exp[keep]).sum())
    df = int(keep.sum()) - 1
    assert df >= 1 and stat < _chi2_critical(df), (stat, df)


def test_repetition_penalty_logits_equal_transformers(pair):
    from transformers import RepetitionPenaltyLogitsProcessor

    _, scores, _ = pair
    for penalty in (1.3, 0.7):
        want = RepetitionPenaltyLogitsProcessor(penalty)(torch.tensor([PROMPT]), scores.clone())[0].numpy()
        got = penalized(scores[0].numpy().copy(), PROMPT, penalty)
        assert np.array_equal(got, want)


def _nucleus_by_full_sort(probs, top_p):
    """The nucleus from its definition: a stable sort of the whole vocabulary (ties: lower id
    first), running sums, the shortest prefix reaching top_p (at least one id)."""
    order = np.argsort(-probs, kind="stable")
    cut = int(np.searchsorted(np.cumsum(probs[order]), top_p) + 1)
    return np.sort(order[:cut])


@pytest.mark.parametrize("n", [50, 3000, 40000])
def test_nucleus_from_the_head_equals_the_full_sort(n):
    """`sampling.nucleus` sorts only the head of a large vocabulary: the same ids as sorting it all,
    with ties at the cut (repeated logits), flat and peaked distributions, top_p near 0 and 1."""
    rng = np.random.default_rng(n)
    for trial in range(12):
        z = rng.standard_normal(n) * rng.choice([0.3, 2.0, 6.0])
        z[rng.integers(0, n, n // 10)] = z[rng.integers(0, n)]  # many ties
        probs = _softmax(z)
        for top_p in (1e-6, 0.1, 0.5, 0.9, 0.97, 0.9999):
            np.testing.assert_array_equal(nucleus(probs, top_p), _nucleus_by_full_sort(probs, top_p))


def test_kept_softmax_and_the_draw_are_numpys_to_the_bit():
    """The probabilities of the kept ids are a softmax over all ids with the others at -inf, to the
    bit; `sampling.draw` picks what ``Generator.choice(p=...)`` picks with the same seed, and the
    kept ids alone pick the token the whole vocabulary with its zeros picks."""
    rng = np.random.default_rng(1)
    z = rng.standard_normal(20000) * 3
    keep = np.flatnonzero(rng.random(20000) < 0.05)
    mask = np.zeros(20000, bool)
    mask[keep] = True
    full = _softmax(np.where(mask, z, -np.inf))
    kept = _softmax_of(z, keep)
    np.testing.assert_array_equal(kept, full[keep])
    a, b, c = (np.random.default_rng(9) for _ in range(3))
    for _ in range(300):
        want = int(a.choice(full.shape[0], p=full))
        assert draw(b, full.copy()) == want
        assert int(keep[draw(c, kept.copy())]) == want
