"""The server's constrained outputs, logprobs and ``n``, through the official `openai` client on
a live server (tiny random checkpoint, real Gemma 4 tokenizer): ``parse(response_format=Model)``
validates, logprobs equal `Model.chat`'s (themselves log_softmax of `Model.logits`, see
tests/runtime/test_logprobs.py) streamed or not, ``n`` choices equal their seeded solo runs,
free requests beside constrained ones equal their solo runs, bad input is a 400 naming
``param`` and the server keeps serving."""
from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import pydantic
import pytest
from live_server import KEY, LiveServer

MODEL_ID = "tiny-gemma"
MSG = [{"role": "user", "content": "Describe a person."}]


class Person(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=8)
    age: int = pydantic.Field(ge=0, le=99)
    kind: str = pydantic.Field(json_schema_extra={"enum": ["a", "b"]})


SCHEMA_A = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0,
                                                                           "maximum": 9}},
            "required": ["ok", "n"], "additionalProperties": False}
SCHEMA_B = {"type": "object", "properties": {"color": {"enum": ["red", "green"]}, "tags": {
    "type": "array", "items": {"type": "string", "maxLength": 3}, "maxItems": 2}},
            "required": ["color", "tags"], "additionalProperties": False}


def _rf(schema):
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}}


@pytest.fixture(scope="module")
def model(tmp_path_factory, gl):
    from gemmalite.tools.synth import synth

    return gl.load(synth("tiny", tmp_path_factory.mktemp("tiny"), progress=False), context=256)


@pytest.fixture(scope="module")
def refs(model):
    """Solo runs through Model, before any serving."""
    out = {}
    for i, p in enumerate(["Hello there", "Once upon a time"]):
        model.reset_chat()
        out[p] = model.chat([{"role": "user", "content": p}], max_new_tokens=10, temperature=0.8, seed=i)
    for seed in (5, 6, 7):
        model.reset_chat()
        out[("n", seed)] = model.chat(MSG, max_new_tokens=8, temperature=1.0, seed=seed)
    model.reset_chat()
    out["lp"] = model.chat(MSG, max_new_tokens=6, temperature=0, logprobs=3)
    model.reset_chat()
    return out


@pytest.fixture(scope="module")
def live(model, refs):
    from gemmalite.server import build_app

    s = LiveServer(build_app(model, model_id=MODEL_ID, api_key=KEY, max_concurrency=8, max_queue=16))
    yield s
    s.stop()


def test_parse_pydantic(live):
    c = live.client()
    for seed in (0, 1):
        r = c.chat.completions.parse(model=MODEL_ID, messages=MSG, response_format=Person, max_tokens=60,
                                     temperature=1.0, seed=seed)
        assert r.choices[0].finish_reason == "stop"
        p = r.choices[0].message.parsed
        assert isinstance(p, Person) and p.kind in ("a", "b")


def test_logprobs_equal_model(live, refs):
    c = live.client()
    want = refs["lp"]
    r = c.chat.completions.create(model=MODEL_ID, messages=MSG, max_tokens=6, temperature=0, logprobs=True,
                                  top_logprobs=3)
    got = r.choices[0].logprobs.content
    assert r.choices[0].message.content == want.output and len(got) == len(want.logprobs)
    for g, w in zip(got, want.logprobs):
        assert abs(g.logprob - w.logprob) < 1e-9 and len(g.top_logprobs) == 3
        assert [t.logprob for t in g.top_logprobs] == pytest.approx([v for _, v in w.top], abs=1e-9)
        assert g.top_logprobs[0].token == g.token  # greedy: the chosen token ranks first
    joined = []
    for ch in c.chat.completions.create(model=MODEL_ID, messages=MSG, max_tokens=6, temperature=0, logprobs=True,
                                        top_logprobs=3, stream=True):
        if ch.choices and ch.choices[0].logprobs is not None:
            joined += ch.choices[0].logprobs.content
    assert [(t.token, t.logprob) for t in joined] == [(t.token, t.logprob) for t in got]
    legacy = c.completions.create(model=MODEL_ID, prompt="Hello", max_tokens=4, temperature=0, logprobs=2)
    lp = legacy.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 4
    assert "".join(lp.tokens) == legacy.choices[0].text and all(len(d) == 2 for d in lp.top_logprobs)


def test_n_choices_share_the_prompt(live, refs):
    c = live.client()
    before = live.metric("gemmalite_cached_prompt_tokens_total")
    r = c.chat.completions.create(model=MODEL_ID, messages=MSG, max_tokens=8, temperature=1.0, seed=5, n=3)
    assert [ch.index for ch in r.choices] == [0, 1, 2]
    assert [ch.message.content for ch in r.choices] == [refs[("n", s)] for s in (5, 6, 7)]
    n_prompt = r.usage.prompt_tokens
    assert live.metric("gemmalite_cached_prompt_tokens_total") - before >= 2 * (n_prompt - 1)  # one prefill
    texts = {i: "" for i in range(3)}
    for ch in c.chat.completions.create(model=MODEL_ID, messages=MSG, max_tokens=8, temperature=1.0, seed=5, n=3,
                                        stream=True):
        for x in ch.choices:
            texts[x.index] += x.delta.content or ""
    assert [texts[i] for i in range(3)] == [ch.message.content for ch in r.choices]


def test_constrained_beside_free(live, refs):
    c = live.client()

    def one(job):
        kind, arg = job
        if kind == "free":
            r = c.chat.completions.create(model=MODEL_ID, messages=[{"role": "user", "content": arg}], max_tokens=10,
                                          temperature=0.8, seed=["Hello there", "Once upon a time"].index(arg))
            return r.choices[0].message.content
        r = c.chat.completions.create(model=MODEL_ID, messages=MSG, max_tokens=60, temperature=1.0, seed=3,
                                      response_format=_rf(arg))
        return r.choices[0].message.content, r.choices[0].finish_reason

    jobs = [("json", SCHEMA_A), ("free", "Hello there"), ("json", SCHEMA_B), ("free", "Once upon a time")]
    for _ in range(2):
        with ThreadPoolExecutor(4) as pool:
            out = list(pool.map(one, jobs))
        assert out[1] == refs["Hello there"] and out[3] == refs["Once upon a time"]
        for (text, finish), schema in ((out[0], SCHEMA_A), (out[2], SCHEMA_B)):
            assert finish == "stop"
            jsonschema.validate(json.loads(text), schema)
    r = c.chat.completions.create(model=MODEL_ID, messages=MSG, max_tokens=3, temperature=0,
                                  response_format={"type": "json_object"})
    assert r.choices[0].finish_reason == "length"  # cut: never claimed complete


BAD = [
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"logprobs": 3}, "logprobs"),
    ({"n": 0}, "n"),
    ({"response_format": {"type": "yaml"}}, "response_format"),
    ({"response_format": _rf({"type": "array", "uniqueItems": True})}, "response_format.json_schema.schema"),
    ({"response_format": _rf({"type": "wat"})}, "response_format.json_schema.schema"),
]


@pytest.mark.parametrize("extra,param", BAD)
def test_bad_input_names_param(live, extra, param):
    status, _, body = live.raw("POST", "/v1/chat/completions", {"model": MODEL_ID, "messages": MSG, **extra})
    assert status == 400 and body["error"]["param"] == param, body
    status, _, body = live.raw("POST", "/v1/chat/completions", {"model": MODEL_ID, "messages": MSG, "max_tokens": 2})
    assert status == 200  # still serving
