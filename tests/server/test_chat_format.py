"""Tool calls and thoughts through the OpenAI-compatible server, with the official `openai`
client against a live server. The tiny random checkpoint (real Gemma 4 tokenizer and template)
runs on a scripted engine (tests/scripted_engine.py) that writes what a real model writes after
a given prompt (a thought, calls), since random weights call no tools by themselves; the
oracle for each reply is the script, and each streamed reply must join to the non-streamed one."""
from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from live_server import KEY, LiveServer
from scripted_engine import scripted_model

MODEL_ID = "tiny-gemma"
WEATHER = {"type": "object", "properties": {"location": {"type": "string"}, "days": {"type": "integer", "minimum": 1},
                                            "units": {"type": "string", "enum": ["c", "f"]}},
           "required": ["location"], "additionalProperties": False}
RUN = {"type": "object", "properties": {"code": {"type": "string"}, "args": {"type": "array", "items": {"type": "number"}}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather.", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "run", "description": "Run code.", "parameters": RUN}}]
SCHEMAS = {"get_weather": WEATHER, "run": RUN}
USER = [{"role": "user", "content": "Weather in Paris, and run my code?"}]
THOUGHT = '<|channel>thought\nTwo tools: {weather} and "run".\n<channel|>'
CALLS = ('<|tool_call>call:get_weather{days:3,location:<|"|>Paris, "FR"<|"|>,units:<|"|>c<|"|>}<tool_call|>'
         '<|tool_call>call:run{args:[1,2.5,-3],code:<|"|>print({"a": 1})\nx = [1, 2]<|"|>}<tool_call|><|tool_response>')
WANT_ARGS = [{"days": 3, "location": 'Paris, "FR"', "units": "c"}, {"args": [1, 2.5, -3], "code": 'print({"a": 1})\nx = [1, 2]'}]


@pytest.fixture(scope="module")
def real(tmp_path_factory, gl):
    from gemmalite.tools.synth import synth

    return gl.load(synth("tiny", tmp_path_factory.mktemp("tiny"), progress=False), context=512)


@pytest.fixture(scope="module")
def model(real):
    return scripted_model(real)


@pytest.fixture(scope="module")
def live(model):
    from gemmalite.server import build_app

    s = LiveServer(build_app(model, model_id=MODEL_ID, api_key=KEY, max_concurrency=4))
    yield s
    s.stop()


@pytest.fixture(scope="module")
def live_real(real):
    """The same checkpoint on its own (random) weights: calls only where the grammar forces them."""
    from gemmalite.server import build_app

    s = LiveServer(build_app(real, model_id=MODEL_ID, api_key=KEY, max_concurrency=4))
    yield s
    s.stop()


def script(model, messages, reply: str, tools=TOOLS, thinking=False):
    from gemmalite.chat import chat_ids, check_tools

    tok = model.tokenizer
    prompt = chat_ids(tok, messages, tools=check_tools(tools) if tools else None, thinking=thinking)
    model.engine.script(prompt, tok.encode(reply, add_special_tokens=False))
    return tok.decode(prompt)


def joined(stream):
    """A streamed reply, its deltas joined: (content, reasoning, calls by index, finish reason)."""
    content, reasoning, calls, finish = "", "", {}, None
    for ch in stream:
        for c in ch.choices:
            d = c.delta
            content += d.content or ""
            reasoning += (d.model_extra or {}).get("reasoning_content") or ""
            for t in d.tool_calls or []:
                call = calls.setdefault(t.index, {"id": None, "name": "", "arguments": ""})
                call["id"] = t.id or call["id"]
                call["name"] += (t.function.name or "") if t.function else ""
                call["arguments"] += (t.function.arguments or "") if t.function else ""
            finish = c.finish_reason or finish
    return content, reasoning, [calls[i] for i in sorted(calls)], finish


def test_tool_calls_with_a_thought(live, model):
    script(model, USER, THOUGHT + CALLS, thinking=True)
    c = live.client()
    r = c.chat.completions.create(model=MODEL_ID, messages=USER, tools=TOOLS, reasoning_effort="high")
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    msg = choice.message
    assert msg.content is None
    assert msg.model_extra["reasoning_content"] == 'Two tools: {weather} and "run".'
    assert [t.function.name for t in msg.tool_calls] == ["get_weather", "run"]
    for t, want in zip(msg.tool_calls, WANT_ARGS):
        args = json.loads(t.function.arguments)
        assert args == want and t.type == "function" and t.id.startswith("call_")
        jsonschema.validate(args, SCHEMAS[t.function.name])
    # the same, streamed: the deltas join to the reply
    s = c.chat.completions.create(model=MODEL_ID, messages=USER, tools=TOOLS, reasoning_effort="high", stream=True)
    content, reasoning, calls, finish = joined(s)
    assert (content, reasoning, finish) == ("", msg.model_extra["reasoning_content"], "tool_calls")
    assert [(x["name"], x["arguments"]) for x in calls] == [(t.function.name, t.function.arguments) for t in msg.tool_calls]
    assert all(x["id"].startswith("call_") for x in calls)
    # chat_template_kwargs asks for the same prompt
    r2 = c.chat.completions.create(model=MODEL_ID, messages=USER, tools=TOOLS,
                                   extra_body={"chat_template_kwargs": {"enable_thinking": True}})
    assert [t.function.arguments for t in r2.choices[0].message.tool_calls] == [t.function.arguments for t in msg.tool_calls]


def test_the_agent_loop_round_trip(live, model):
    """The reply's calls and the tools' results go back as history: the prompt continues the model's turn."""
    script(model, USER, CALLS)
    c = live.client()
    r = c.chat.completions.create(model=MODEL_ID, messages=USER, tools=TOOLS, temperature=0)
    msg = r.choices[0].message
    history = USER + [msg.model_dump(exclude_none=True)] + [
        {"role": "tool", "tool_call_id": t.id, "content": json.dumps({"ok": True, "n": i})} for i, t in enumerate(msg.tool_calls)]
    prompt = script(model, history, "Done: 18 degrees, and the code printed {'a': 1}.")
    assert "<|turn>tool" not in prompt  # (the checkpoint has the older template: the results are folded in)
    tail = prompt.split("<|tool_response>response:run{n:1,ok:true}<tool_response|>")[1]
    assert tail in ("", "<|channel>thought\n<channel|>")  # the model continues its own turn
    assert 'call:get_weather{days:3,location:<|"|>Paris, "FR"<|"|>,units:<|"|>c<|"|>}' in prompt
    r = c.chat.completions.create(model=MODEL_ID, messages=history, tools=TOOLS)
    assert r.choices[0].message.content == "Done: 18 degrees, and the code printed {'a': 1}."
    assert r.choices[0].finish_reason == "stop" and not r.choices[0].message.tool_calls


def test_parallel_tool_calls_false_gives_one_call(live, model):
    script(model, USER, CALLS)
    c = live.client()
    r = c.chat.completions.create(model=MODEL_ID, messages=USER, tools=TOOLS, parallel_tool_calls=False)
    calls = r.choices[0].message.tool_calls
    assert len(calls) == 1 and json.loads(calls[0].function.arguments) == WANT_ARGS[0]
    assert r.choices[0].finish_reason == "tool_calls"
    s = c.chat.completions.create(model=MODEL_ID, messages=USER, tools=TOOLS, parallel_tool_calls=False, stream=True)
    assert [x["arguments"] for x in joined(s)[2]] == [calls[0].function.arguments]


def test_thoughts_never_reach_content(live, model):
    """Without tools or thinking asked for, a thought the model writes is still reasoning_content;
    reasoning_effort "none" is thinking off; stop strings cut the content only."""
    prompt = script(model, USER, THOUGHT + "The answer, STOP, is 42.", tools=None)
    assert "<|think|>" not in prompt
    c = live.client()
    for kw in ({}, {"reasoning_effort": "none"}, {"reasoning_effort": "minimal"}):
        r = c.chat.completions.create(model=MODEL_ID, messages=USER, **kw)
        assert r.choices[0].message.content == "The answer, STOP, is 42."
        assert r.choices[0].message.model_extra["reasoning_content"] == 'Two tools: {weather} and "run".'
    r = c.chat.completions.create(model=MODEL_ID, messages=USER, stop=["STOP", "run"])
    assert (r.choices[0].message.content, r.choices[0].finish_reason) == ("The answer, ", "stop")
    content, reasoning, _, finish = joined(c.chat.completions.create(model=MODEL_ID, messages=USER, stop=["STOP"], stream=True))
    assert (content, finish) == ("The answer, ", "stop") and "run" in reasoning


def test_tool_choice_none_and_cut_calls(live, model):
    script(model, USER, CALLS, tools=None)  # "none": the tools stay out of the prompt, no call is parsed
    c = live.client()
    r = c.chat.completions.create(model=MODEL_ID, messages=USER, tools=TOOLS, tool_choice="none")
    assert not r.choices[0].message.tool_calls and r.choices[0].message.content.startswith("<|tool_call>call:get_weather{")
    script(model, USER, CALLS)
    r = c.chat.completions.create(model=MODEL_ID, messages=USER, tools=TOOLS, max_tokens=12)
    msg, finish = r.choices[0].message, r.choices[0].finish_reason
    assert finish == "length" and len(msg.tool_calls) == 1
    full = json.dumps(WANT_ARGS[0], separators=(",", ":"), ensure_ascii=False)
    assert full.startswith(msg.tool_calls[0].function.arguments) and msg.tool_calls[0].function.arguments != full
    content, _, calls, finish = joined(c.chat.completions.create(model=MODEL_ID, messages=USER, tools=TOOLS, max_tokens=12,
                                                                 stream=True))
    assert finish == "length" and [x["arguments"] for x in calls] == [msg.tool_calls[0].function.arguments]


@pytest.mark.parametrize("kw, param", [
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]}, "tools[0].function.parameters"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"s": {"type": "string", "pattern": "a+"}}}}}]},
     "tools[0].function.parameters.properties.s"),
    ({"tools": TOOLS, "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ({"reasoning_effort": "extreme"}, "reasoning_effort"),
    ({"chat_template_kwargs": {"bos_token": "x"}}, "chat_template_kwargs"),
    ({"chat_template_kwargs": {"enable_thinking": False}, "reasoning_effort": "high"}, "reasoning_effort"),
    ({"messages": [{"role": "user", "content": "x"},
                   {"role": "assistant", "tool_calls": [{"id": "a", "type": "function", "function": {"name": "run", "arguments": "{oops"}}]}]},
     "messages[1].tool_calls[0].function.arguments"),
    ({"messages": [{"role": "user", "content": "x"}, {"role": "tool", "tool_call_id": "a", "content": "r"}]}, "messages[1]"),
])
def test_bad_requests_name_the_param(live, kw, param):
    body = {"model": MODEL_ID, "messages": USER, **kw}
    status, _, out = live.raw("POST", "/v1/chat/completions", body)
    assert status == 400 and out["error"]["param"] == param and out["error"]["type"] == "invalid_request_error", out
    known = {"model", "messages", "tools", "tool_choice", "parallel_tool_calls", "reasoning_effort", "response_format"}
    with pytest.raises(openai.BadRequestError) as e:
        live.client().chat.completions.create(**{k: v for k, v in body.items() if k in known},
                                              extra_body={k: v for k, v in body.items() if k not in known})
    assert e.value.body["param"] == param


def test_completions_refuse_tools_and_the_server_keeps_serving(live, model):
    status, _, out = live.raw("POST", "/v1/completions", {"model": MODEL_ID, "prompt": "x", "tools": TOOLS})
    assert status == 400 and out["error"]["param"] == "tools"
    script(model, USER, "still here", tools=None)
    r = live.client().chat.completions.create(model=MODEL_ID, messages=USER)
    assert r.choices[0].message.content == "still here"


FORCED = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 10}, "days": {"type": "integer", "minimum": 1,
                                                                                           "maximum": 7},
                                     "unit": {"type": "string", "enum": ["c", "f"]}},
    "required": ["city", "days"], "additionalProperties": False}}},
          {"type": "function", "function": {"name": "ping", "parameters": {"type": "object", "properties": {}}}}]


@pytest.mark.parametrize("choice, parallel", [("required", True), ("required", False),
                                              ({"type": "function", "function": {"name": "get_weather"}}, True)])
def test_required_and_named_calls_validate_on_random_weights(live_real, choice, parallel):
    """Random weights call no tool by themselves: ``required`` / a named function make them, with
    arguments that validate against the tool's schema; streamed, the same calls (same seed)."""
    c = openai.OpenAI(base_url=f"http://127.0.0.1:{live_real.port}/v1", api_key=KEY, max_retries=0, timeout=900)
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in FORCED}
    kw = dict(model=MODEL_ID, messages=USER, tools=FORCED, tool_choice=choice, parallel_tool_calls=parallel,
              max_tokens=160, temperature=1.0, seed=7)
    r = c.chat.completions.create(**kw)
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls" and msg.content is None
    assert len(msg.tool_calls) >= 1 and (parallel or len(msg.tool_calls) == 1)
    for t in msg.tool_calls:
        assert isinstance(choice, str) or t.function.name == "get_weather"
        jsonschema.validate(json.loads(t.function.arguments), schemas[t.function.name])
    _, _, calls, finish = joined(c.chat.completions.create(**kw, stream=True))
    assert finish == "tool_calls"
    assert [(x["name"], x["arguments"]) for x in calls] == [(t.function.name, t.function.arguments) for t in msg.tool_calls]


def test_logprobs_ride_with_the_parts(live, model):
    """Every generated token's logprob reaches the client, streamed or not, whatever part it wrote."""
    script(model, USER, THOUGHT + CALLS, thinking=True)
    c = live.client()
    kw = dict(model=MODEL_ID, messages=USER, tools=TOOLS, reasoning_effort="high", logprobs=True, top_logprobs=2)
    r = c.chat.completions.create(**kw)
    entries = r.choices[0].logprobs.content
    assert len(entries) == r.usage.completion_tokens and all(len(e.top_logprobs) == 2 for e in entries)
    streamed = [e for ch in c.chat.completions.create(**kw, stream=True) for x in ch.choices
                if x.logprobs for e in x.logprobs.content]
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in entries]
