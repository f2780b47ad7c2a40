"""Constrained decoding (`runtime.constrain` through `Model.generate`): outputs validate against
their JSON schema (jsonschema as the oracle) or match their regex on random weights, where only
the constraint gives them structure; every token is the sampler's pick among the allowed ones
(a step-by-step reference loop gives the same tokens as the drafted, forced-token decoding);
a reply cut by max_new_tokens says ``length``; bad constraints are `InputError`s naming them."""
from __future__ import annotations

import json
import re

import jsonschema
import numpy as np
import pytest

from gemmalite.errors import InputError
from gemmalite.runtime.constrain import Grammar, fill_masks
from gemmalite.runtime.sampling import Sampler

PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 8},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
    "pet": {"anyOf": [{"type": "null"}, {"type": "object", "properties": {"kind": {"enum": ["cat", "dog"]},
                                                                           "good": {"type": "boolean"}},
                                         "required": ["kind", "good"], "additionalProperties": False}]}},
    "required": ["name", "age", "tags", "pet"], "additionalProperties": False}
POINT = {"type": "object", "properties": {"x": {"type": "integer", "minimum": -9, "maximum": 9},
                                          "y": {"type": "number", "minimum": 0, "maximum": 1}},
         "required": ["x", "y"], "additionalProperties": False}


@pytest.fixture(scope="module")
def model(tmp_path_factory, gl):
    from gemmalite.tools.synth import synth

    return gl.load(synth("tiny", tmp_path_factory.mktemp("tiny"), progress=False), context=512)


@pytest.mark.parametrize("schema", [PERSON, POINT])
def test_json_schema_outputs_validate(model, schema):
    for seed, temp in [(0, 0.0), (1, 1.0), (2, 1.0), (3, 0.7)]:
        s = model.generate("Give JSON:", json_schema=schema, max_new_tokens=120, temperature=temp, seed=seed,
                           top_k=None, top_p=None, stream=True)
        text = "".join(s)
        assert s.stats.finish_reason == "stop", text
        jsonschema.validate(json.loads(text), schema)


def test_regex_and_lark(model):
    for seed in range(3):
        out = model.generate("Code:", regex=r"[A-Z]{2}-[0-9]{3}", max_new_tokens=20, temperature=1.0, seed=seed)
        assert re.fullmatch(r"[A-Z]{2}-[0-9]{3}", out), out
    lark = 'start: "yes" | "no" | "maybe " NUM\nNUM: /[0-9]/'
    out = model.chat([{"role": "user", "content": "?"}], grammar=lark, max_new_tokens=10, temperature=1.0, seed=4)
    assert re.fullmatch(r"yes|no|maybe [0-9]", out), out


def test_cut_reply_says_length(model):
    s = model.generate("Give JSON:", json_schema=PERSON, max_new_tokens=5, temperature=0, stream=True)
    text = "".join(s)
    assert s.stats.finish_reason == "length"
    with pytest.raises(ValueError):
        json.loads(text)


def _reference(model, prompt_ids, grammar, n, params, stop_ids):
    """Plain decoding, one token per step: the mask of each step from a fresh matcher, the sampler
    on the allowed tokens, no drafts."""
    eng = model.engine
    state = eng.new_state()
    logits = eng.logits(eng.prefill(state, np.asarray(prompt_ids)))[0]
    m, sampler, hist, out = grammar.matcher(stop_ids), Sampler(params), list(prompt_ids), []
    for _ in range(n):
        allowed = fill_masks([(m, [])], logits.shape[0])[0][0]
        tok = sampler(logits, hist, allowed)
        if tok in stop_ids:
            break
        m.consume(tok)
        out.append(tok)
        hist.append(tok)
        if m.stopped:
            break
        logits = eng.decode_step(state, tok)
    return out


@pytest.mark.parametrize("lookup", [0, 3])
def test_drafted_decoding_equals_plain(model, lookup):
    tok = model.tokenizer
    ids = tok.encode('Example: {"x":3,"y":0.25} and {"x":3,"y":0.5}. Now:')
    g = Grammar.json_schema(tok, POINT)
    for seed, temp in [(0, 0.0), (5, 1.0)]:
        params = model.defaults.params(temperature=temp, seed=seed, top_k=40, repetition_penalty=1.3)
        s = model.generate_tokens(ids, grammar=g, max_new_tokens=40, temperature=temp, seed=seed, top_k=40,
                                  repetition_penalty=1.3, prompt_lookup=lookup, stream=True)
        got = list(s)
        assert got == _reference(model, ids, g, 40, params, set(model.defaults.stop_ids))
        assert s.stats.accepted_tokens > 0  # the forced tokens ('"y":' ...) rode along as drafts


def test_mask_rows_follow_the_drafts(model):
    tok = model.tokenizer
    g = Grammar.json_schema(tok, POINT)
    m = g.matcher([106])
    ids = tok.encode('{"x":-3,"y":1}', add_special_tokens=False)
    rows = m.masks(ids)
    assert rows.shape == (len(ids) + 1, tok.vocab_size)
    for i, t in enumerate(ids):
        assert rows[i, t]
        ref = g.matcher([106])
        ref.ll.consume_tokens(ids[:i])
        assert (rows[i] == ref.masks()[0]).all()
    assert rows[-1, 106] and rows[-1].sum() == 1  # complete: only the stop id
    assert m.consumed == 0  # masks consume nothing


def test_bad_constraints(model):
    with pytest.raises(InputError, match="json_schema"):
        model.generate("x", json_schema={"type": "array", "items": {"type": "string"}, "uniqueItems": True})
    with pytest.raises(InputError, match="json_schema"):
        model.generate("x", json_schema={"type": "nope"})
    with pytest.raises(InputError, match="json_schema"):
        model.generate("x", json_schema="{not json")
    with pytest.raises(InputError, match="regex"):
        model.generate("x", regex="((")
    with pytest.raises(InputError, match="grammar"):
        model.generate("x", grammar="start: undefined_rule")
    with pytest.raises(InputError, match="at most one"):
        model.generate("x", regex="a", json_schema={"type": "object"})
    assert model.generate("Hi", max_new_tokens=3, temperature=0) == model.generate("Hi", max_new_tokens=3, temperature=0)
