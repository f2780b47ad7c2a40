"""Conversations with tool calls, tool results and thoughts, rendered for both revisions of Gemma
4's chat template. Oracles: transformers' own renderer (`render_jinja_template`) on the real
templates, given the messages as those templates read them; and the round trip: what the
template writes for a call or a result, read back by gemmalite's parser, is what went in."""
from __future__ import annotations

import json
import re

import pytest
from chat_data import ARGUMENTS, current_tok, tok  # noqa: F401 (tok, current_tok: fixtures)

from gemmalite.chat import ChatReply, OutputParser, chat_ids, check_tool_choice, check_tools, prepare, template_kind
from gemmalite.chat.arguments import ArgumentsTranscoder
from gemmalite.errors import InputError

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather now.", "parameters": {
    "type": "object", "properties": {"location": {"type": "string", "description": "a city"},
                                     "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
    "required": ["location"]}}},
         {"type": "function", "function": {"name": "run", "description": "Run code.", "parameters": {
             "type": "object", "properties": {"code": {"type": "string"}}}}}]


def conversation(args0=ARGUMENTS[0], args1=ARGUMENTS[1]):
    """An agent loop in OpenAI's shape: arguments as JSON text, results by tool_call_id."""
    return [
        {"role": "system", "content": "You are a helpful agent."},
        {"role": "user", "content": "Earlier question"},
        {"role": "assistant", "content": "<|channel>thought\nold thinking<channel|>Earlier answer",
         "reasoning_content": "old reasoning (before the last user turn)"},
        {"role": "user", "content": "Weather in Paris, and run this?"},
        {"role": "assistant", "content": None, "reasoning_content": "I need two tools.",
         "tool_calls": [{"id": "call_a", "type": "function", "function": {"name": "get_weather", "arguments": json.dumps(args0)}},
                        {"id": "call_b", "type": "function", "function": {"name": "run", "arguments": json.dumps(args1)}}]},
        {"role": "tool", "tool_call_id": "call_b", "content": '{"stdout": "ok, {done}\\n", "code": 0}'},
        {"role": "tool", "tool_call_id": "call_a", "content": "18 degrees, \"sunny\""},
        {"role": "assistant", "content": "It is 18 degrees; the code ran."},
        {"role": "user", "content": "Thanks!"},
    ]


def as_template_reads(msgs):
    """The oracle's input: the same conversation with each call's arguments as an object."""
    out = []
    for m in msgs:
        m = dict(m)
        if m.get("tool_calls"):
            m["tool_calls"] = [{**c, "function": {**c["function"], "arguments": json.loads(c["function"]["arguments"])}}
                               for c in m["tool_calls"]]
        out.append(m)
    return out


def hf_render(tok, msgs, **kw) -> str:
    from transformers.utils.chat_template_utils import render_jinja_template

    return render_jinja_template([msgs], chat_template=tok.chat_template, add_generation_prompt=True,
                                 **{**tok.special_tokens, **kw})[0][0]


def text_of(tok, ids) -> str:
    return tok.decode(ids)


def test_template_kinds(tok, current_tok):
    assert template_kind(tok.chat_template) == "legacy" and template_kind(current_tok.chat_template) == "current"
    assert template_kind(None) == "none" and template_kind(tok.fallback_template) == "none"


@pytest.mark.parametrize("thinking", [False, True])
def test_current_template_equals_transformers(current_tok, thinking):
    msgs = conversation()
    got = text_of(current_tok, chat_ids(current_tok, msgs, tools=check_tools(TOOLS), thinking=thinking))
    want = hf_render(current_tok, as_template_reads(msgs), tools=TOOLS, **({"enable_thinking": True} if thinking else {}))
    assert got == want
    assert "<|turn>tool" not in got and "{{" not in got  # results inside the model turn; arguments not pasted as JSON
    assert "old thinking" not in got and "old reasoning" not in got  # earlier thoughts stripped
    assert ("<|think|>" in got) == thinking and got.endswith("<|turn>model\n" if thinking else "<|channel>thought\n<channel|>")
    # the calls' thought is shown only with the calls of the current turn: here a later user turn follows
    assert "I need two tools." not in got
    live = msgs[:7]  # the turn still running: after the tool results
    got = text_of(current_tok, chat_ids(current_tok, live, tools=check_tools(TOOLS)))
    assert got == hf_render(current_tok, as_template_reads(live), tools=TOOLS)
    assert "<|channel>thought\nI need two tools.\n<channel|><|tool_call>call:get_weather{" in got
    assert got.endswith("<tool_response|>")  # the model continues its own turn


def test_legacy_template_folds_tool_results(tok):
    """The GGUF's revision renders role: tool as a turn of its own; folded (as llama.cpp does), the
    results go inside the model turn with the answer after them."""
    msgs = conversation()
    folded = prepare(msgs, "legacy")
    assert [m["role"] for m in folded] == ["system", "user", "assistant", "user", "assistant", "user"]
    turn = folded[4]
    assert turn["tool_responses"] == [{"name": "run", "response": {"stdout": "ok, {done}\n", "code": 0}},
                                      {"name": "get_weather", "response": '18 degrees, "sunny"'}]
    assert turn["content"] == "It is 18 degrees; the code ran."
    assert turn["tool_calls"][0]["function"]["arguments"] == ARGUMENTS[0]
    got = text_of(tok, chat_ids(tok, msgs, tools=check_tools(TOOLS)))
    assert got == hf_render(tok, folded, tools=TOOLS)
    assert "<|turn>tool" not in got
    assert ("<|turn>model\n<|tool_call>call:get_weather{location:<|\"|>Paris, France<|\"|>,unit:<|\"|>celsius<|\"|>}"
            "<tool_call|><|tool_call>call:run{") in got
    assert ("<|tool_response>response:run{code:0,stdout:<|\"|>ok, {done}\n<|\"|>}<tool_response|>"
            "<|tool_response>response:get_weather{value:<|\"|>18 degrees, \"sunny\"<|\"|>}<tool_response|>"
            "It is 18 degrees; the code ran.<turn|>") in got
    unfolded = hf_render(tok, as_template_reads(msgs), tools=TOOLS)
    assert "<|turn>tool" in unfolded  # what the fold is for


@pytest.mark.parametrize("args", ARGUMENTS)
@pytest.mark.parametrize("which", ["legacy", "current"])
def test_round_trip_of_arguments_and_results(tok, current_tok, which, args):
    """String arguments -> template -> tokens -> parser: the same arguments; a result the template
    wrote, read back with the same transcoder: the same value."""
    t = tok if which == "legacy" else current_tok
    result = {"echo": args, "note": 'a "quoted", {braced}\nline'}
    msgs = [{"role": "user", "content": "go"},
            {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function",
                                                  "function": {"name": "run", "arguments": json.dumps(args)}}]},
            {"role": "tool", "tool_call_id": "c1", "content": json.dumps(result)}]
    text = text_of(t, chat_ids(t, msgs, tools=check_tools(TOOLS)))
    call = re.search(r"<\|tool_call>.*?<tool_call\|>", text, re.S).group(0)
    p = OutputParser(t, tools=True)
    events = [e for i in t.encode(call, add_special_tokens=False) for e in p.push(i)] + p.finish("stop")
    reply = ChatReply.of(events)
    assert [(c.name, json.loads(c.arguments)) for c in reply.tool_calls] == [("run", args)]
    body = re.search(r"<\|tool_response>response:run(.*?)<tool_response\|>", text, re.S).group(1)
    tr = ArgumentsTranscoder()
    out = "".join((tr.delimiter() if k else "") + tr.text(part) for k, part in enumerate(body.split('<|"|>')))
    # the current revision shows the result's text as a string, the folded older one its JSON
    assert json.loads(out) == ({"value": json.dumps(result)} if which == "current" else result)


def test_plain_conversations_are_untouched(current_tok):
    msgs = [{"role": "user", "content": "hi"}]
    assert prepare(msgs, "current") is msgs and prepare(msgs, "legacy") is msgs
    assert chat_ids(current_tok, msgs) == current_tok.chat_ids(msgs)


@pytest.mark.parametrize("msgs, param", [
    ([{"role": "user", "content": "x"}, {"role": "tool", "content": "r"}], "messages[1]"),
    ([{"role": "assistant", "tool_calls": [{"id": "a", "function": {"name": "f", "arguments": "{bad"}}]}],
     "messages[0].tool_calls[0].function.arguments"),
    ([{"role": "assistant", "tool_calls": [{"id": "a", "function": {"name": "f", "arguments": "[1]"}}]}],
     "messages[0].tool_calls[0].function.arguments"),
    ([{"role": "assistant", "tool_calls": [{"id": "a", "function": {"name": "f", "arguments": "{}"}}]},
      {"role": "tool", "tool_call_id": "zzz", "content": "r"}], "messages[1].tool_call_id"),
    ([{"role": "user", "tool_calls": [{"function": {"name": "f", "arguments": "{}"}}]}], "messages[0].tool_calls"),
    ([{"role": "assistant", "tool_calls": [{"function": {"arguments": "{}"}}]}], "messages[0].tool_calls[0]"),
])
def test_bad_history_names_the_field(msgs, param):
    with pytest.raises(InputError) as e:
        prepare(msgs, "current")
    assert e.value.param == param and param in str(e.value)


@pytest.mark.parametrize("tools, param", [
    ({"a": 1}, "tools"),
    ([{"type": "function"}], "tools[0]"),
    ([{"type": "function", "function": {"name": "has space"}}], "tools[0].function.name"),
    ([{"type": "function", "function": {"name": "f"}}, {"type": "function", "function": {"name": "f"}}], "tools[1].function.name"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}], "tools[0].function.parameters"),
    ([{"type": "retrieval", "function": {"name": "f"}}], "tools[0]"),
])
def test_bad_tools_name_the_field(tools, param):
    with pytest.raises(InputError) as e:
        check_tools(tools)
    assert e.value.param == param


def test_tool_choice():
    tools = check_tools(TOOLS)
    assert check_tool_choice("auto", tools) == "auto" and check_tool_choice("none", []) == "none"
    named = {"type": "function", "function": {"name": "run"}}
    assert check_tool_choice(named, tools) == named
    for bad, why in [("sometimes", "must be one of"), ({"type": "function", "function": {"name": "nope"}}, "not among"),
                     ("required", None)]:
        with pytest.raises(InputError, match=why or "needs tools"):
            check_tool_choice(bad, tools if why else [])


def test_tools_need_a_template_that_declares_them(tok):
    import copy

    t = copy.copy(tok)
    t.chat_template, t._template = None, None  # the generic fallback template
    with pytest.raises(InputError, match="cannot declare tools"):
        chat_ids(t, [{"role": "user", "content": "x"}], tools=check_tools(TOOLS))
    with pytest.raises(InputError, match="no thinking switch"):
        chat_ids(t, [{"role": "user", "content": "x"}], thinking=True)
