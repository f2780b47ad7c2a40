"""`Model.chat` / `ChatSession.chat` with tools and thinking. The tiny random checkpoint (real
Gemma 4 tokenizer and chat template) runs on a scripted engine that writes what a real model
would (a thought, tool calls), so the replies are known; plain chat on the real engine keeps
returning the text it always did."""
from __future__ import annotations

import json

import pytest
from scripted_engine import scripted_model

from gemmalite.chat import ChatReply, Reasoning, ToolCallArgs, ToolCallStart, TurnEnd
from gemmalite.errors import InputError

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather now.", "parameters": {
    "type": "object", "properties": {"location": {"type": "string"}, "days": {"type": "integer"}},
    "required": ["location"]}}}]
USER = [{"role": "user", "content": "Weather in Paris?"}]
REPLY = ('<|channel>thought\nThe user wants the weather, "now".\n<channel|>'
         '<|tool_call>call:get_weather{days:2,location:<|"|>Paris, {FR}<|"|>}<tool_call|><|tool_response>')


@pytest.fixture(scope="module")
def real(tmp_path_factory, gl):
    from gemmalite.tools.synth import synth

    return gl.load(synth("tiny", tmp_path_factory.mktemp("tiny"), progress=False), context=256)


@pytest.fixture()
def model(real):
    return scripted_model(real)


def script(model, messages, reply: str, **kw):
    from gemmalite.chat import chat_ids, check_tools

    tok = model.tokenizer
    tools = kw.pop("tools", None)
    prompt = chat_ids(tok, messages, tools=check_tools(tools) if tools else None, **kw)
    model.engine.script(prompt, tok.encode(reply, add_special_tokens=False))
    return prompt


def test_tool_call_reply(model):
    script(model, USER, REPLY, tools=TOOLS, thinking=True)
    r = model.chat(USER, tools=TOOLS, thinking=True, temperature=0)
    assert isinstance(r, ChatReply)
    assert r.reasoning == 'The user wants the weather, "now".' and r.content == ""
    assert [(c.name, json.loads(c.arguments)) for c in r.tool_calls] == [("get_weather", {"days": 2, "location": "Paris, {FR}"})]
    assert r.finish_reason == "tool_calls" and r.stats.finish_reason == "tool_calls"
    assert r.tool_calls[0].id.startswith("call_") and r.logprobs is None
    # the reply as the next turn's history, then the tool's result: the model continues its turn
    follow = USER + [r.message(), {"role": "tool", "tool_call_id": r.tool_calls[0].id, "content": '{"temp": 18}'}]
    prompt = script(model, follow, "It is 18 degrees.", tools=TOOLS, thinking=True)
    assert model.tokenizer.decode(prompt).endswith("<tool_response|>")
    again = model.chat(follow, tools=TOOLS, thinking=True)
    assert (again.content, again.tool_calls, again.finish_reason) == ("It is 18 degrees.", [], "stop")


def test_streamed_events_join_to_the_reply(model):
    script(model, USER, REPLY, tools=TOOLS, thinking=True)
    whole = model.chat(USER, tools=TOOLS, thinking=True, seed=1)
    events = list(model.session().chat(USER, tools=TOOLS, thinking=True, seed=1, stream=True))
    assert isinstance(events[-1], TurnEnd) and events[-1].finish_reason == "tool_calls"
    assert "".join(e.text for e in events if isinstance(e, Reasoning)) == whole.reasoning
    assert "".join(e.text for e in events if isinstance(e, ToolCallArgs)) == whole.tool_calls[0].arguments
    assert [e.name for e in events if isinstance(e, ToolCallStart)] == ["get_weather"]
    got = ChatReply.of(events)
    assert (got.content, got.reasoning, got.finish_reason) == (whole.content, whole.reasoning, whole.finish_reason)


def test_thinking_off_by_default_and_stop_strings_on_content_only(model):
    reply = "<|channel>thought\nSTOP here\n<channel|>Answer STOP more"
    prompt = model.tokenizer.decode(script(model, USER, reply))
    r = model.chat(USER, structured=True, stop=["STOP"])
    assert (r.reasoning, r.content, r.finish_reason) == ("STOP here", "Answer ", "stop")
    assert "<|think|>" not in prompt and prompt.endswith("<|channel>thought\n<channel|>")


def test_tool_choice_none_declares_nothing_and_parses_no_calls(model):
    reply = '<|tool_call>call:get_weather{location:<|"|>x<|"|>}<tool_call|>'
    script(model, USER, reply)  # the prompt without declarations
    r = model.chat(USER, tools=TOOLS, tool_choice="none")
    assert r.tool_calls == [] and r.content == reply and r.finish_reason == "stop"


def test_cut_by_max_new_tokens(model):
    script(model, USER, REPLY, tools=TOOLS, thinking=True)
    n = len(model.tokenizer.encode(REPLY, add_special_tokens=False))
    r = model.chat(USER, tools=TOOLS, thinking=True, max_new_tokens=n - 4)
    assert r.finish_reason == "length" and not r.tool_calls[0].complete
    assert '{"days":2,"location":"Paris, {FR}"}'.startswith(r.tool_calls[0].arguments)


def test_plain_chat_still_returns_text(model):
    script(model, USER, "Hello <b>there</b>")
    assert model.chat(USER, temperature=0) == "Hello <b>there</b>"
    assert "".join(model.chat(USER, stream=True)) == "Hello <b>there</b>"


def test_structured_on_real_weights_equals_plain_text(real):
    real.reset_chat()
    text = real.chat(USER, max_new_tokens=12, temperature=0)
    ids = real.tokenizer.encode(text, add_special_tokens=False)
    assert not {100, 101} & set(ids)  # (the precondition: random weights wrote no channel markup here)
    real.reset_chat()
    r = real.chat(USER, max_new_tokens=12, temperature=0, structured=True)
    assert r.content == text and r.reasoning is None and r.finish_reason in ("stop", "length")


@pytest.mark.parametrize("kw, match", [
    ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools\\[0\\].function.name"),
    ({"tools": TOOLS, "json_schema": {"type": "object"}}, "do not go with tools"),
    ({"tools": TOOLS, "parallel_tool_calls": 0}, "parallel_tool_calls must be True or False"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "not among"),
    ({"thinking": "yes"}, "thinking must be True or False"),
])
def test_bad_arguments(model, kw, match):
    with pytest.raises(InputError, match=match):
        model.chat(USER, **kw)


def test_parallel_tool_calls_false_ends_the_turn_after_one_call(model):
    two = REPLY.replace("<|tool_response>", "") + '<|tool_call>call:get_weather{location:<|"|>Rome<|"|>}<tool_call|>'
    script(model, USER, two, tools=TOOLS, thinking=True)
    calls = model.chat(USER, tools=TOOLS, thinking=True).tool_calls
    assert [json.loads(c.arguments)["location"] for c in calls] == ["Paris, {FR}", "Rome"]
    one = model.chat(USER, tools=TOOLS, thinking=True, parallel_tool_calls=False)
    assert [c.name for c in one.tool_calls] == ["get_weather"] and one.finish_reason == "tool_calls"
    assert one.stats.new_tokens < len(model.tokenizer.encode(two, add_special_tokens=False))


# -- constrained calls on the real (random) weights: the tools' grammar (chat.tool_grammar) --------
SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                           "days": {"type": "integer", "minimum": 1, "maximum": 7},
                                           "unit": {"type": "string", "enum": ["c", "f"]}, "hourly": {"type": "boolean"}},
          "required": ["city", "days"], "additionalProperties": False}
FORCED = [{"type": "function", "function": {"name": "get_weather", "description": "Weather.", "parameters": SCHEMA}},
          {"type": "function", "function": {"name": "ping", "parameters": {"type": "object", "properties": {}}}}]


@pytest.mark.parametrize("choice, parallel", [("required", True), ("required", False),
                                              ({"type": "function", "function": {"name": "get_weather"}}, False),
                                              ({"type": "function", "function": {"name": "get_weather"}}, True)])
def test_required_and_named_calls_validate(real, choice, parallel):
    import jsonschema

    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in FORCED}
    for seed in range(3):
        s = real.session()
        r = s.chat(USER, tools=FORCED, tool_choice=choice, parallel_tool_calls=parallel, max_new_tokens=160,
                   temperature=1.0, seed=seed)
        assert r.finish_reason == "tool_calls" and r.content == "" and r.reasoning is None, r
        assert len(r.tool_calls) >= 1 and (parallel or len(r.tool_calls) == 1)
        for c in r.tool_calls:
            assert c.complete and (isinstance(choice, str) or c.name == "get_weather")
            jsonschema.validate(json.loads(c.arguments), schemas[c.name])
        events = list(real.session().chat(USER, tools=FORCED, tool_choice=choice, parallel_tool_calls=parallel,
                                          max_new_tokens=160, temperature=1.0, seed=seed, stream=True))
        got = ChatReply.of(events)
        assert [(c.name, c.arguments) for c in got.tool_calls] == [(c.name, c.arguments) for c in r.tool_calls]


def test_auto_with_the_grammar_and_logprobs(real):
    """``auto`` on random weights: free text or valid calls, the same for the same seed; logprobs ride along."""
    import jsonschema

    a = real.session().chat(USER, tools=FORCED, max_new_tokens=24, temperature=1.0, seed=5, logprobs=2)
    b = real.session().chat(USER, tools=FORCED, max_new_tokens=24, temperature=1.0, seed=5)
    assert (a.content, [c.arguments for c in a.tool_calls]) == (b.content, [c.arguments for c in b.tool_calls])
    assert len(a.logprobs) == a.stats.new_tokens and b.logprobs is None
    for c in a.tool_calls:
        if c.complete:
            jsonschema.validate(json.loads(c.arguments), SCHEMA if c.name == "get_weather" else {"type": "object"})


def test_response_format_beside_tools(real):
    """``auto`` with a response_format: the reply is that JSON, or calls; with ``required`` it is refused."""
    import jsonschema

    fmt = {"type": "json_schema", "json_schema": {"name": "a", "strict": True, "schema": {
        "type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": False}}}
    r = real.session().chat(USER, tools=FORCED, response_format=fmt, max_new_tokens=64, temperature=1.0, seed=3)
    assert r.finish_reason in ("stop", "tool_calls")
    if r.tool_calls:
        for c in r.tool_calls:
            jsonschema.validate(json.loads(c.arguments), SCHEMA if c.name == "get_weather" else {"type": "object"})
    else:
        jsonschema.validate(json.loads(r.content), fmt["json_schema"]["schema"])
    with pytest.raises(InputError, match="response_format"):
        real.chat(USER, tools=FORCED, tool_choice="required", response_format=fmt)
