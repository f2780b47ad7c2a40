"""Ollama's API (`gemmalite.server.ollama`), driven by the official `ollama` client against a live
server on a tiny synthetic checkpoint. The oracle of every reply is `Model.chat` / `Model.generate`
(greedy or seeded) on the same model, computed before the server serves; tool calls and thoughts
come from the scripted engine (tests/scripted_engine.py), whose script is their oracle; embeddings
are the embedder's own vectors."""
from __future__ import annotations

import json

import httpx
import jsonschema
import numpy as np
import pytest
from live_server import KEY, LiveServer
from scripted_engine import scripted_model

ollama = pytest.importorskip("ollama")

MODEL_ID = "tiny-gemma"
EMB_ID = "eg2-tiny"
HEADERS = {"Authorization": f"Bearer {KEY}"}
GREEDY = {"temperature": 0, "num_predict": 10}
SAMPLED = {"temperature": 0.9, "top_p": 0.9, "top_k": 40, "min_p": 0.05, "repeat_penalty": 1.1, "seed": 7,
           "num_predict": 10}
SCHEMA = {"type": "object", "properties": {"color": {"enum": ["red", "blue"]}, "ok": {"type": "boolean"}},
          "required": ["color", "ok"], "additionalProperties": False}
WEATHER = {"type": "object", "properties": {"location": {"type": "string"}}, "required": ["location"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather.", "parameters": WEATHER}}]
ASK = [{"role": "user", "content": "Weather in Paris?"}]
THOUGHT = "<|channel>thought\nThe weather tool.\n<channel|>"
CALL = '<|tool_call>call:get_weather{location:<|"|>Paris<|"|>}<tool_call|><|tool_response>'


@pytest.fixture(scope="module")
def model(tmp_path_factory, gl):
    from gemmalite.tools.synth import synth

    return gl.load(synth("tiny", tmp_path_factory.mktemp("tiny"), progress=False), context=256)


@pytest.fixture(scope="module")
def embedder(tmp_path_factory, gl):
    from gemmalite.tools.synth_eg2 import synth_eg2

    return gl.load_embedder(synth_eg2("eg2-tiny", tmp_path_factory.mktemp("eg2"), progress=False))


def _chat(model, messages, **kw):
    model.reset_chat()
    return model.chat(messages, **kw)


@pytest.fixture(scope="module")
def refs(model):
    """Solo runs through `Model`, before any serving."""
    hi = [{"role": "user", "content": "Hello there"}]
    sys_hi = [{"role": "system", "content": "Be brief."}] + hi
    fmt = {"type": "json_schema", "json_schema": {"name": "format", "schema": SCHEMA, "strict": True}}
    out = {"chat": _chat(model, hi, max_new_tokens=10, temperature=0),
           "sampled": _chat(model, hi, max_new_tokens=10, temperature=0.9, top_p=0.9, top_k=40, min_p=0.05,
                            repetition_penalty=1.1, seed=7),
           "system": _chat(model, sys_hi, max_new_tokens=10, temperature=0),
           "raw": model.generate("Once upon a time", max_new_tokens=10, temperature=0),
           "format": _chat(model, hi, max_new_tokens=40, temperature=0, response_format=fmt).content,
           "json": _chat(model, hi, max_new_tokens=40, temperature=0, response_format={"type": "json_object"}).content}
    out["stop"] = _chat(model, hi, max_new_tokens=10, temperature=0, stop=[out["chat"][4:6]])
    model.reset_chat()
    return out


@pytest.fixture(scope="module")
def live(model, refs, embedder):
    from gemmalite.server import build_app

    s = LiveServer(build_app(model, embedder, model_id=MODEL_ID, embedder_id=EMB_ID, api_key=KEY, max_concurrency=4))
    yield s
    s.stop()


@pytest.fixture(scope="module")
def scripted(model):
    return scripted_model(model)


@pytest.fixture(scope="module")
def live_scripted(scripted):
    from gemmalite.server import build_app

    s = LiveServer(build_app(scripted, model_id=MODEL_ID, api_key=KEY))
    yield s
    s.stop()


def client(live):
    return ollama.Client(host=f"http://127.0.0.1:{live.port}", headers=HEADERS, timeout=60)


def joined(parts, key="message"):
    """A streamed reply's chunks joined: (text, thinking, tool calls, the last chunk)."""
    text, thinking, calls, last = "", "", [], None
    for p in parts:
        assert last is None or not last.done
        if key == "message":
            text += p.message.content or ""
            thinking += p.message.thinking or ""
            calls += p.message.tool_calls or []
        else:
            text += p.response or ""
            thinking += p.thinking or ""
        last = p
    return text, thinking, calls, last


def _timings(r, max_eval: int) -> None:
    assert r.done and r.done_reason in ("stop", "length")
    for k in ("total_duration", "load_duration", "prompt_eval_duration", "eval_duration"):
        assert isinstance(r[k], int) and r[k] >= 0, k
    assert r.prompt_eval_count > 0 and 0 < r.eval_count <= max_eval


def test_chat_equals_model(live, refs):
    c = client(live)
    hi = [{"role": "user", "content": "Hello there"}]
    r = c.chat(MODEL_ID, messages=hi, options=GREEDY)
    assert r.message.content == refs["chat"] and r.message.role == "assistant" and r.model == MODEL_ID
    _timings(r, 10)
    text, _, _, last = joined(c.chat(MODEL_ID, messages=hi, options=GREEDY, stream=True))
    assert text == refs["chat"]
    assert (last.done_reason, last.eval_count, last.prompt_eval_count) == (r.done_reason, r.eval_count,
                                                                           r.prompt_eval_count)
    r = c.chat(f"{MODEL_ID}:latest", messages=hi, options=SAMPLED)
    assert r.message.content == refs["sampled"]
    r = c.chat(MODEL_ID, messages=hi, options={**GREEDY, "stop": [refs["chat"][4:6]]})
    assert r.message.content == refs["stop"] and r.done_reason == "stop"


def test_generate_equals_model(live, refs):
    c = client(live)
    r = c.generate(MODEL_ID, "Hello there", system="Be brief.", options=GREEDY)
    assert r.response == refs["system"]
    _timings(r, 10)
    text, _, _, last = joined(c.generate(MODEL_ID, "Hello there", system="Be brief.", options=GREEDY, stream=True),
                              "response")
    assert text == refs["system"] and last.done
    r = c.generate(MODEL_ID, "Once upon a time", raw=True, options=GREEDY)
    assert r.response == refs["raw"]
    assert joined(c.generate(MODEL_ID, "Once upon a time", raw=True, options=GREEDY, stream=True), "response")[0] \
        == refs["raw"]
    r = c.generate(MODEL_ID, "Hello there", options={**GREEDY, "num_ctx": 64})
    assert r.response == refs["chat"]
    r = c.generate(MODEL_ID)  # no prompt: ollama's "load the model" request
    assert r.done and r.done_reason == "load" and r.response == ""


def test_format_gives_json_that_validates(live, refs):
    c = client(live)
    hi = [{"role": "user", "content": "Hello there"}]
    r = c.chat(MODEL_ID, messages=hi, format=SCHEMA, options={"temperature": 0, "num_predict": 40})
    assert r.message.content == refs["format"]
    jsonschema.validate(json.loads(r.message.content), SCHEMA)
    r = c.generate(MODEL_ID, "Hello there", format="json", options={"temperature": 0, "num_predict": 40})
    assert r.response == refs["json"]
    if r.done_reason == "stop":  # (not cut by num_predict)
        assert isinstance(json.loads(r.response), dict)


def script(model, messages, reply: str, tools=None, thinking=False):
    from gemmalite.chat import chat_ids, check_tools

    tok = model.tokenizer
    prompt = chat_ids(tok, messages, tools=check_tools(tools) if tools else None, thinking=thinking)
    model.engine.script(prompt, tok.encode(reply, add_special_tokens=False))


def test_tool_calls_and_thinking(live_scripted, scripted):
    script(scripted, ASK, THOUGHT + CALL, TOOLS, thinking=True)
    c = client(live_scripted)
    r = c.chat(MODEL_ID, messages=ASK, tools=TOOLS, think=True)
    assert r.message.thinking == "The weather tool."
    assert [(t.function.name, dict(t.function.arguments)) for t in r.message.tool_calls] == \
        [("get_weather", {"location": "Paris"})]
    assert r.message.content == "" and r.done_reason == "stop"
    _, thinking, calls, last = joined(c.chat(MODEL_ID, messages=ASK, tools=TOOLS, think="high", stream=True))
    assert thinking == r.message.thinking and last.done
    assert [(t.function.name, dict(t.function.arguments)) for t in calls] == [("get_weather", {"location": "Paris"})]
    # the round trip: the call and its result (role tool, tool_name) render as the OpenAI-shaped history does
    history = [*ASK, {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c0", "type": "function", "function": {"name": "get_weather", "arguments": '{"location": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "c0", "name": "get_weather", "content": '{"c": 18}'}]
    script(scripted, history, "It is 18 degrees.", TOOLS)
    back = [*ASK, {"role": "assistant", "content": "", "tool_calls": [
        {"function": {"name": "get_weather", "arguments": {"location": "Paris"}}}]},
        {"role": "tool", "tool_name": "get_weather", "content": '{"c": 18}'}]
    r = c.chat(MODEL_ID, messages=back, tools=TOOLS)
    assert r.message.content == "It is 18 degrees." and not r.message.tool_calls


def test_generate_thinking(live_scripted, scripted):
    """/api/generate renders the prompt as a user turn; the thought comes apart as ``thinking``."""
    script(scripted, ASK, THOUGHT + "Sunny.", thinking=True)
    c = client(live_scripted)
    r = c.generate(MODEL_ID, ASK[0]["content"], think=True)
    assert (r.thinking, r.response, r.done_reason) == ("The weather tool.", "Sunny.", "stop")
    text, thinking, _, last = joined(c.generate(MODEL_ID, ASK[0]["content"], think=True, stream=True), "response")
    assert (thinking, text) == (r.thinking, r.response) and last.done
    with pytest.raises(ollama.ResponseError) as e:
        c.generate(MODEL_ID, "x", think=True, raw=True)
    assert e.value.status_code == 400 and "think" in e.value.error


def test_embed_equals_embedder(live, embedder):
    c = client(live)
    texts = ["a cat", "a dog sleeps on the mat"]
    r = c.embed(EMB_ID, texts)
    np.testing.assert_array_equal(np.array(r.embeddings, np.float32), embedder.embed(texts, truncate=True))
    prompt = embedder.resolve_prompt(None, None)
    assert r.prompt_eval_count == sum(len(x) for x in embedder.tokenize(texts, prompt=prompt))
    r = c.embed(EMB_ID, texts[0], dimensions=16, truncate=False)
    np.testing.assert_array_equal(np.array(r.embeddings, np.float32), embedder.embed(texts[:1], dimensions=16))
    r = c.embeddings(EMB_ID, texts[1])
    np.testing.assert_array_equal(np.array(r.embedding, np.float32), embedder.embed(texts[1:])[0])
    with pytest.raises(ollama.ResponseError) as e:
        c.embed(EMB_ID, "x", dimensions=10**6)
    assert e.value.status_code == 400 and "dimensions" in e.value.error


def test_tags_show_ps_version(live, model, embedder):
    c = client(live)
    tags = c.list()
    assert [m.model for m in tags.models] == [MODEL_ID, EMB_ID]
    assert tags.models[0].size > 0 and tags.models[0].details.family == model.config.family
    show = c.show(MODEL_ID)
    assert "completion" in show.capabilities and "embedding" not in show.capabilities
    assert show.modelinfo[f"{model.config.family}.context_length"] == model.context
    assert show.template == (model.tokenizer.chat_template or "")
    assert c.show(EMB_ID).capabilities == ["embedding"]
    ps = c.ps()
    assert [m.model for m in ps.models] == [MODEL_ID, EMB_ID] and ps.models[0].context_length == model.context
    v = httpx.get(f"http://127.0.0.1:{live.port}/api/version", headers=HEADERS).json()
    assert [int(x) for x in v["version"].split(".")] >= [0, 5, 0]


@pytest.mark.parametrize("call, status, name", [
    (lambda c: c.chat(MODEL_ID, messages=[{"role": "user", "content": "x"}], options={"mirostat": 2}), 400, "mirostat"),
    (lambda c: c.chat(MODEL_ID, messages=[{"role": "user", "content": "x"}], options={"num_thread": 2}), 400,
     "num_thread"),
    (lambda c: c.chat(MODEL_ID, messages=[{"role": "user", "content": "x"}], options={"temperature": -1}), 400,
     "temperature"),
    (lambda c: c.chat(MODEL_ID, messages=[{"role": "user", "content": "x"}], options={"num_predict": 0}), 400,
     "num_predict"),
    (lambda c: c.chat(MODEL_ID, messages=[{"role": "user", "content": "x"}], keep_alive="soon"), 400, "keep_alive"),
    (lambda c: c.chat(MODEL_ID, messages=[{"role": "user", "content": "x", "images": ["aGVsbG8="]}]), 400, "vision"),
    (lambda c: c.chat(MODEL_ID, messages=[{"role": "wizard", "content": "x"}]), 400, "role"),
    (lambda c: c.chat("nope", messages=[{"role": "user", "content": "x"}]), 404, "nope"),
    (lambda c: c.generate(MODEL_ID, "x", suffix="y"), 400, "suffix"),
    (lambda c: c.generate(MODEL_ID, "x", context=[1, 2]), 400, "context"),
    (lambda c: c.generate(MODEL_ID, "x", raw=True, system="s"), 400, "system"),
    (lambda c: c.generate(MODEL_ID, "x", options={"num_ctx": 2}), 400, "num_ctx"),
    (lambda c: c._request_raw("POST", "/api/generate", json={"model": MODEL_ID, "prompt": "x", "format": "yaml"}), 400,
     "format"),  # (the client refuses to send it)
    (lambda c: c.embed(MODEL_ID, "x"), 404, MODEL_ID),
])
def test_bad_requests_answer_ollama_errors(live, refs, call, status, name):
    c = client(live)
    with pytest.raises(ollama.ResponseError) as e:
        call(c)
    assert e.value.status_code == status and name in e.value.error, e.value.error
    assert live.raw("GET", "/health", key=None)[0] == 200
    r = c.chat(MODEL_ID, messages=[{"role": "user", "content": "Hello there"}], options=GREEDY)
    assert r.message.content == refs["chat"]


def test_keep_alive_is_checked_and_said_to_have_no_effect(live, refs):
    status, headers, body = live.raw("POST", "/api/chat", {"model": MODEL_ID, "stream": False, "keep_alive": "5m",
                                                           "options": GREEDY,
                                                           "messages": [{"role": "user", "content": "Hello there"}]})
    assert status == 200 and body["message"]["content"] == refs["chat"]
    assert "keep_alive has no effect" in headers["x-gemmalite-warning"]
    status, headers, _ = live.raw("POST", "/api/chat", {"model": MODEL_ID, "stream": False, "options": GREEDY,
                                                        "messages": [{"role": "user", "content": "Hello there"}]})
    assert status == 200 and "x-gemmalite-warning" not in headers


def test_dropped_stream_frees_slot(live):
    """A client that leaves an NDJSON stream frees its sequence (the metric counts it cancelled)."""

    before = live.metric("gemmalite_finished_total", '{reason="cancelled"}')
    live.drop_stream("/api/generate", {"model": MODEL_ID, "prompt": "Once", "raw": True,
                                       "options": {"num_predict": 240, "temperature": 1.0, "seed": 1}},
                     b'"done": false', 3)
    live.wait_cancelled(before)
