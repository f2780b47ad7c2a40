"""The OpenAI-compatible server, driven by the real `openai` client against a live uvicorn on
loopback, with a tiny synthetic checkpoint. The oracle is `Model.generate` / `Model.chat` on
the same model (computed before the server serves, never concurrently with it)."""
from __future__ import annotations

import base64
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import openai
import pytest
from live_server import KEY, LiveServer, stream_text

MODEL_ID = "tiny-gemma"
EMB_ID = "eg2-tiny"
PROMPTS = ["Hello there", "The capital of France is", "1, 2, 3,", "Once upon a time", "def f(x):",
           "Roses are red", "A B C", "Gemma runs on the CPU"]


@pytest.fixture(scope="module")
def model(tmp_path_factory, gl):
    from gemmalite.tools.synth import synth

    path = synth("tiny", tmp_path_factory.mktemp("tiny"), progress=False)
    return gl.load(path, context=256)


@pytest.fixture(scope="module")
def embedder(tmp_path_factory, gl):
    """A real EmbeddingGemma 2 (random weights, real tokenizer, the standard prompt table)."""
    from gemmalite.tools.synth_eg2 import synth_eg2

    return gl.load_embedder(synth_eg2("eg2-tiny", tmp_path_factory.mktemp("eg2"), progress=False))


@pytest.fixture(scope="module")
def refs(model):
    """Solo runs of every prompt through Model (greedy, and seeded sampling), before any serving."""
    out = {}
    for i, p in enumerate(PROMPTS):
        out[("gen", p)] = model.generate(p, max_new_tokens=10, temperature=0)
        out[("sample", p)] = model.generate(p, max_new_tokens=10, temperature=0.9, top_p=0.9, seed=i)
        model.reset_chat()
        out[("chat", p)] = model.chat([{"role": "user", "content": p}], max_new_tokens=10, temperature=0)
    model.reset_chat()
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    out["chat-sys"] = model.chat(msgs, max_new_tokens=12, temperature=0.7, seed=3)
    model.reset_chat()
    out["stop"] = model.generate(PROMPTS[0], max_new_tokens=20, temperature=0, stop=[out[("gen", PROMPTS[0])][3:5]])
    out["ids"] = model.generate_tokens([2, 10, 200, 3000], max_new_tokens=6, temperature=0)
    return out


@pytest.fixture(scope="module")
def live(model, refs, embedder):
    from gemmalite.server import build_app

    app = build_app(model, embedder, model_id=MODEL_ID, embedder_id=EMB_ID, api_key=KEY,
                    max_concurrency=4, max_queue=8, prefix_cache=64 << 20)
    s = LiveServer(app)
    yield s
    s.stop()


def test_chat_equals_model(live, refs):
    c = live.client()
    for p in PROMPTS[:2]:
        msgs = [{"role": "user", "content": p}]
        r = c.chat.completions.create(model=MODEL_ID, messages=msgs, max_tokens=10, temperature=0)
        assert r.choices[0].message.content == refs[("chat", p)]
        assert r.choices[0].finish_reason in ("stop", "length")
        assert r.usage.completion_tokens <= 10 and r.usage.prompt_tokens > 0
        s = c.chat.completions.create(model=MODEL_ID, messages=msgs, max_completion_tokens=10, temperature=0,
                                      stream=True, stream_options={"include_usage": True})
        text, finish, usage = stream_text(s)
        assert (text, finish) == (refs[("chat", p)], r.choices[0].finish_reason)
        assert usage.completion_tokens == r.usage.completion_tokens
    # content parts, a system message, seeded sampling
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": [{"type": "text", "text": "Hi"}]}]
    r = c.chat.completions.create(model=MODEL_ID, messages=msgs, max_tokens=12, temperature=0.7, seed=3)
    assert r.choices[0].message.content == refs["chat-sys"]


def test_completions_equal_model(live, refs):
    c = live.client()
    p = PROMPTS[0]
    r = c.completions.create(model=MODEL_ID, prompt=p, max_tokens=10, temperature=0)
    assert r.choices[0].text == refs[("gen", p)]
    text, _, _ = stream_text(c.completions.create(model=MODEL_ID, prompt=p, max_tokens=10, temperature=0, stream=True))
    assert text == refs[("gen", p)]
    stop = refs[("gen", p)][3:5]
    r = c.completions.create(model=MODEL_ID, prompt=p, max_tokens=20, temperature=0, stop=[stop])
    assert r.choices[0].text == refs["stop"] and r.choices[0].finish_reason == "stop"
    r = c.completions.create(model=MODEL_ID, prompt=[2, 10, 200, 3000], max_tokens=6, temperature=0)
    assert r.choices[0].text == live.srv.tokenizer.decode(refs["ids"])
    assert r.usage.prompt_tokens == 4


def test_prompt_lookup_and_predictions_keep_the_text(live, refs):
    """``prompt_lookup`` and OpenAI's ``prediction`` only change how fast the reply comes: the same
    text as plain decoding (greedy and seeded sampling), with the drafts counted in the usage. A
    prediction of the reply itself is mostly accepted."""
    c = live.client()
    p = PROMPTS[2]
    for kw, want in (({"temperature": 0}, refs[("gen", p)]),
                     ({"temperature": 0.9, "top_p": 0.9, "seed": 2}, refs[("sample", p)])):
        d0, a0 = live.metric("gemmalite_draft_tokens_total"), live.metric("gemmalite_accepted_draft_tokens_total")
        r = c.completions.create(model=MODEL_ID, prompt=p, max_tokens=10, extra_body={"prompt_lookup": True}, **kw)
        assert r.choices[0].text == want
        r = c.completions.create(model=MODEL_ID, prompt=p, max_tokens=10,
                                 extra_body={"prediction": {"type": "content", "content": want}}, **kw)
        assert r.choices[0].text == want
        details = r.usage.completion_tokens_details
        drafted = live.metric("gemmalite_draft_tokens_total") - d0
        accepted = live.metric("gemmalite_accepted_draft_tokens_total") - a0
        assert details.accepted_prediction_tokens > 0 and details.accepted_prediction_tokens <= accepted <= drafted
    s = c.chat.completions.create(model=MODEL_ID, messages=[{"role": "user", "content": p}], max_tokens=10,
                                  temperature=0, stream=True, prediction={"type": "content", "content": [
                                      {"type": "text", "text": refs[("chat", p)]}]})
    assert stream_text(s)[0] == refs[("chat", p)]


def test_prefix_reuse(live, model):
    """A prompt that extends a finished one (its prompt + reply + more) runs only the new tokens.
    Token ids keep the test exact: the tiny model's 16-token sliding window allows no rollback,
    and a random reply need not re-tokenize to the ids it was sampled as."""
    c = live.client()
    ids = [2, 818, 5279, 529, 7001, 563]
    first = c.completions.create(model=MODEL_ID, prompt=ids, max_tokens=8, temperature=0)
    reply = model.tokenizer.encode(first.choices[0].text, add_special_tokens=False)
    second = c.completions.create(model=MODEL_ID, prompt=ids + reply + [9, 10], max_tokens=4, temperature=0)
    cached = second.usage.prompt_tokens_details.cached_tokens
    if reply == model.generate_tokens(ids, max_new_tokens=8, temperature=0):  # round trip exact
        assert cached == len(ids) + len(reply) - 1  # the state held all but the last sampled token
    assert cached >= len(ids)
    assert live.metric("gemmalite_cached_prompt_tokens_total") >= cached


def test_concurrent_clients_no_crosstalk(live, refs):
    c = live.client()

    def one(i):
        p = PROMPTS[i]
        if i % 2:
            s = c.completions.create(model=MODEL_ID, prompt=p, max_tokens=10, temperature=0.9, top_p=0.9, seed=i,
                                     stream=True)
            return stream_text(s)[0], refs[("sample", p)]
        r = c.completions.create(model=MODEL_ID, prompt=p, max_tokens=10, temperature=0)
        return r.choices[0].text, refs[("gen", p)]

    steps0 = live.metric("gemmalite_decode_steps_total")
    seqs0 = live.metric("gemmalite_decode_step_sequences_total")
    sch = live.srv.scheduler
    sch.max_concurrency = 0  # nothing is admitted until all eight wait: batching by the test, not by arrival times
    try:
        with ThreadPoolExecutor(8) as ex:
            futures = [ex.submit(one, i) for i in range(8)]
            t0 = time.time()
            while sch.queue_depth < 8:
                assert time.time() - t0 < 60, "the requests never all arrived"
                time.sleep(0.01)
            sch.max_concurrency = 4
            sch._wake.set()
            results = [f.result() for f in futures]
    finally:
        sch.max_concurrency = 4
        sch._wake.set()
    for got, want in results:
        assert got == want
    steps = live.metric("gemmalite_decode_steps_total") - steps0
    seqs = live.metric("gemmalite_decode_step_sequences_total") - seqs0
    assert seqs / steps > 3  # two groups of four, each decoded together


def test_embeddings_equal_embedder(live, embedder):
    """/v1/embeddings gives `Embedder.embed` / `embed_ids` (the checkpoint's default prompt, as a
    caller of embed gets it): floats, base64 little-endian float32, Matryoshka dimensions."""
    c = live.client()
    texts = ["a cat", "a dog sleeps on the mat"]
    r = c.embeddings.create(model=EMB_ID, input=texts, encoding_format="float")
    got = np.array([d.embedding for d in r.data], np.float32)
    np.testing.assert_array_equal(got, embedder.embed(texts))
    assert [d.index for d in r.data] == [0, 1] and got.shape == (2, embedder.dim)
    prompt = embedder.resolve_prompt(None, None)
    assert r.usage.prompt_tokens == sum(len(x) for x in embedder.tokenize(texts, prompt=prompt))
    status, _, body = live.raw("POST", "/v1/embeddings", {"model": EMB_ID, "input": "x", "dimensions": 16,
                                                           "encoding_format": "base64"})
    assert status == 200
    v = np.frombuffer(base64.b64decode(body["data"][0]["embedding"]), "<f4")
    np.testing.assert_array_equal(v, embedder.embed(["x"], dimensions=16)[0])
    r = c.embeddings.create(model=EMB_ID, input=texts[1], dimensions=24)  # the client's own base64 default
    np.testing.assert_array_equal(np.array(r.data[0].embedding, np.float32), embedder.embed([texts[1]], dimensions=24)[0])
    ids = [[2, 818, 5279, 529, 1], [2, 9, 1]]
    r = c.embeddings.create(model=EMB_ID, input=ids, encoding_format="float")
    np.testing.assert_array_equal(np.array([d.embedding for d in r.data], np.float32), embedder.embed_ids(ids))
    assert r.usage.prompt_tokens == 8
    status, _, body = live.raw("POST", "/v1/embeddings", {"model": EMB_ID, "input": "x", "dimensions": 10**6})
    assert status == 400 and "dimensions" in body["error"]["message"] and body["error"]["param"] == "dimensions", body


def test_base_model_chat_says_so(live, monkeypatch, caplog):
    """A chat request to a model without a chat template of its own is answered (with the generic
    template) and says so in X-Gemmalite-Warning; the server logs it at start-up."""
    import logging

    from gemmalite.server import build_app

    msgs = [{"role": "user", "content": PROMPTS[0]}]
    r = live.client().chat.completions.with_raw_response.create(model=MODEL_ID, messages=msgs, max_tokens=2)
    assert "x-gemmalite-warning" not in r.headers
    monkeypatch.setattr(live.srv.tokenizer, "chat_template", None)
    r = live.client().chat.completions.with_raw_response.create(model=MODEL_ID, messages=msgs, max_tokens=2)
    assert "no chat template" in r.headers["x-gemmalite-warning"] and r.parse().choices[0].message.content is not None
    status, headers, _ = live.raw("POST", "/api/chat", {"model": MODEL_ID, "messages": msgs, "stream": False,
                                                        "options": {"num_predict": 2}})
    assert status == 200 and "no chat template" in headers["x-gemmalite-warning"]
    with caplog.at_level(logging.WARNING, logger="gemmalite.server.app"):
        build_app(live.srv.model, model_id="base-model")
    assert "'base-model' has no chat template" in caplog.text


BAD = [  # (path, body, status)
    ("/v1/chat/completions", b"{not json", 400),
    ("/v1/chat/completions", b"[1, 2]", 400),
    ("/v1/chat/completions", {"model": "nope", "messages": [{"role": "user", "content": "x"}]}, 404),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}, 400),
    ("/v1/chat/completions", {"model": MODEL_ID, "messages": []}, 400),
    ("/v1/chat/completions", {"model": MODEL_ID, "messages": "hi"}, 400),
    ("/v1/chat/completions", {"model": MODEL_ID, "messages": [{"role": "wizard", "content": "x"}]}, 400),
    ("/v1/chat/completions", {"model": MODEL_ID, "messages": [{"role": "user", "content": 5}]}, 400),
    ("/v1/chat/completions", {"model": MODEL_ID, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]}, 400),
    ("/v1/chat/completions", {"model": MODEL_ID, "messages": [{"role": "user", "content": "x"}], "max_tokens": 0}, 400),
    ("/v1/chat/completions", {"model": MODEL_ID, "messages": [{"role": "user", "content": "x"}], "max_tokens": "9"}, 400),
    ("/v1/chat/completions", {"model": MODEL_ID, "messages": [{"role": "user", "content": "x"}], "max_tokens": 10**6}, 400),
    ("/v1/chat/completions", {"model": MODEL_ID, "messages": [{"role": "user", "content": "x"}], "temperature": -1}, 400),
    ("/v1/chat/completions", {"model": MODEL_ID, "messages": [{"role": "user", "content": "x"}], "top_p": 0}, 400),
    ("/v1/chat/completions", {"model": MODEL_ID, "messages": [{"role": "user", "content": "x"}], "n": 9}, 400),
    ("/v1/chat/completions", {"model": MODEL_ID, "messages": [{"role": "user", "content": "x"}], "stop": [1]}, 400),
    ("/v1/chat/completions", {"model": MODEL_ID, "messages": [{"role": "user", "content": "x"}], "stop": ["a"] * 5}, 400),
    ("/v1/chat/completions", {"model": MODEL_ID, "messages": [{"role": "user", "content": "x"}], "stream": "yes"}, 400),
    ("/v1/chat/completions", {"model": MODEL_ID, "messages": [{"role": "user", "content": "word " * 400}]}, 400),
    ("/v1/completions", {"model": MODEL_ID, "prompt": [1, -5]}, 400),
    ("/v1/completions", {"model": MODEL_ID, "prompt": [262144]}, 400),
    ("/v1/completions", {"model": MODEL_ID, "prompt": ["a", "b"]}, 400),
    ("/v1/completions", {"model": MODEL_ID, "prompt": 42}, 400),
    ("/v1/completions", {"model": MODEL_ID, "prompt": "x", "max_tokens": 255}, 400),  # context 256
    ("/v1/completions", {"model": MODEL_ID, "prompt": "x", "logprobs": 21}, 400),
    ("/v1/completions", {"model": MODEL_ID, "prompt": "x", "prompt_lookup": -1}, 400),
    ("/v1/completions", {"model": MODEL_ID, "prompt": "x", "prompt_lookup": "yes"}, 400),
    ("/v1/completions", {"model": MODEL_ID, "prompt": "x", "prediction": "text"}, 400),
    ("/v1/completions", {"model": MODEL_ID, "prompt": "x", "prediction": {"type": "content", "content": 5}}, 400),
    ("/v1/embeddings", {"model": EMB_ID, "input": 7}, 400),
    ("/v1/embeddings", {"model": EMB_ID, "input": []}, 400),
    ("/v1/embeddings", {"model": EMB_ID, "input": ["x"] * 300}, 400),
    ("/v1/embeddings", {"model": EMB_ID, "input": "x", "encoding_format": "hex"}, 400),
    ("/v1/embeddings", {"model": EMB_ID, "input": "x", "dimensions": 0}, 400),
    ("/v1/embeddings", {"model": MODEL_ID, "input": "x"}, 404),
    ("/v1/nothing", {}, 404),
    ("/v1/chat/completions", b"x" * (5 << 20), 413),
]


def test_bad_requests_answer_4xx(live, refs):
    for path, body, want in BAD:
        status, _, resp = live.raw("POST", path, body)
        assert status == want, (path, body if len(str(body)) < 200 else "...", resp)
        assert isinstance(resp, dict) and isinstance(resp["error"]["message"], str), resp
    assert live.raw("GET", "/v1/chat/completions")[0] == 405
    assert live.raw("GET", "/health", key=None)[0] == 200
    with pytest.raises(openai.BadRequestError, match="context length"):
        live.client().completions.create(model=MODEL_ID, prompt="x", max_tokens=300)
    r = live.client().completions.create(model=MODEL_ID, prompt=PROMPTS[0], max_tokens=10, temperature=0)
    assert r.choices[0].text == refs[("gen", PROMPTS[0])]


def test_api_key(live):
    with pytest.raises(openai.AuthenticationError):
        live.client(key="wrong").models.list()
    for path in ("/v1/models", "/metrics"):
        assert live.raw("GET", path, key=None)[0] == 401
        assert live.raw("GET", path, key="wrong")[0] == 401
    assert live.raw("POST", "/v1/completions", {"model": MODEL_ID, "prompt": "x"}, key=None)[0] == 401
    assert live.raw("GET", "/health", key=None) [0] == 200
    assert [m.id for m in live.client().models.list().data] == [MODEL_ID, EMB_ID]


def test_dropped_stream_frees_slot(live):
    before = live.metric("gemmalite_finished_total", '{reason="cancelled"}')
    live.drop_stream("/v1/completions", {"model": MODEL_ID, "prompt": "Once", "max_tokens": 250, "temperature": 1.0,
                                         "seed": 1, "stream": True, "stop": ["\u0000never"]}, b"data:", 3)
    live.wait_cancelled(before)


def test_full_queue_answers_429(live):
    with live.full_queue():
        status, headers, body = live.raw("POST", "/v1/completions", {"model": MODEL_ID, "prompt": "x", "max_tokens": 2})
        assert status == 429 and headers.get("retry-after") == "1" and body["error"]["code"] == "overloaded"
    assert live.raw("POST", "/v1/completions", {"model": MODEL_ID, "prompt": "x", "max_tokens": 2})[0] == 200


def test_engine_failure_is_500_and_server_keeps_serving(live, refs):
    sch = live.srv.scheduler
    real = sch.engine

    class Failing:
        def __getattr__(self, name):
            return getattr(real, name)

        def decode_batch(self, states, tokens):
            raise RuntimeError("simulated kernel failure")

    sch.engine = Failing()
    try:
        status, _, body = live.raw("POST", "/v1/completions", {"model": MODEL_ID, "prompt": "x", "max_tokens": 5})
    finally:
        sch.engine = real
    assert status == 500 and "simulated kernel failure" in body["error"]["message"]
    r = live.client().completions.create(model=MODEL_ID, prompt=PROMPTS[0], max_tokens=10, temperature=0)
    assert r.choices[0].text == refs[("gen", PROMPTS[0])]
