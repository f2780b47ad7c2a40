"""The chat reply parser on real Gemma 4 token ids. Replies are written the way the real chat
template writes a model turn (its call syntax, its thought channel), tokenized by the real
tokenizer; the parser must give back the parts, however the text is split into tokens."""
from __future__ import annotations

import json
import re

import pytest
from chat_data import ARGUMENTS, gemma_text, tok  # noqa: F401 (tok: a fixture)

from gemmalite.chat import (ChatReply, ChatTokens, Content, OutputParser, Reasoning, ToolCallArgs, ToolCallEnd,
                            ToolCallStart, TurnEnd)

MARKUP = re.compile(r'<\|tool_call>|<tool_call\|>|<\|"\|>|<\|channel>|<channel\|>')


def call_text(tok, name: str, args: dict) -> str:
    return f"<|tool_call>call:{name}{gemma_text(tok, args)}<tool_call|>"


def parse(tok, ids, *, tools=True, stops=(), reason="stop"):
    p = OutputParser(tok, tools=tools, stops=stops, call_id=iter(f"call_{i}" for i in range(99)).__next__)
    events = []
    for t in ids:
        if p.stopped:
            break
        events += p.push(t)
    events += p.finish(reason)
    return ChatReply.of(events), events


def enc(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def cut_points(text: str) -> list[int]:
    """Every position not inside a markup token's text."""
    inside = {m.start() + k for m in MARKUP.finditer(text) for k in range(1, m.end() - m.start())}
    return [i for i in range(len(text) + 1) if i not in inside]


def test_markup_ids(tok):
    """The ids the parser keys on, as the issue names them (48-52, 100, 101, 105, 106)."""
    t = ChatTokens.of(tok)
    assert (t.tool_call, t.tool_call_end, t.tool_response, t.string, t.channel, t.channel_end) == (48, 49, 50, 52, 100, 101)
    assert [tok.token_id(s) for s in ("<|turn>", "<turn|>", "<tool_response|>", "<|tool>", "<tool|>")] == [105, 106, 51, 46, 47]


def test_every_split_point(tok):
    """A thought, content and two parallel calls: the same parts for the text tokenized whole, in
    two pieces cut at every position, and one character at a time."""
    args0, args1 = ARGUMENTS[1], ARGUMENTS[4]
    text = ("<|channel>thought\nThe user wants {code}, \"quoted\".\n<channel|>Sure, here: ü\n"
            + call_text(tok, "write_file", args0) + call_text(tok, "lookup", args1))
    want, _ = parse(tok, enc(tok, text))
    assert want.reasoning == 'The user wants {code}, "quoted".'
    assert want.content == "Sure, here: ü\n"
    assert [(c.name, json.loads(c.arguments), c.complete) for c in want.tool_calls] == [
        ("write_file", args0, True), ("lookup", args1, True)]
    assert want.finish_reason == "tool_calls"
    for i in cut_points(text):
        got, events = parse(tok, enc(tok, text[:i]) + enc(tok, text[i:]))
        assert got == want, i
    ids = []  # each character on its own (some as byte tokens), the markup tokens between
    for part, m in zip(MARKUP.split(text), [*MARKUP.findall(text), None]):
        ids += [t for c in part for t in enc(tok, c)] + (enc(tok, m) if m else [])
    assert len(ids) > 2 * len(enc(tok, text))
    assert parse(tok, ids)[0] == want


def test_streamed_pieces_join_to_the_reply(tok):
    text = "<|channel>thought\nhmm\n<channel|>Ok" + call_text(tok, "f", ARGUMENTS[3])
    got, events = parse(tok, enc(tok, text))
    args = "".join(e.text for e in events if isinstance(e, ToolCallArgs))
    assert args == got.tool_calls[0].arguments and json.loads(args) == ARGUMENTS[3]
    assert "".join(e.text for e in events if isinstance(e, Reasoning)) == "hmm"
    kinds = [type(e) for e in events]
    assert kinds.index(ToolCallStart) < kinds.index(ToolCallArgs) < kinds.index(ToolCallEnd) < kinds.index(TurnEnd)
    assert isinstance(events[-1], TurnEnd) and events[-1].finish_reason == "tool_calls"


def test_cut_calls_end_with_length(tok):
    """A reply cut by the token budget anywhere: what was streamed is a prefix of the whole
    reply's parts, a cut call is never complete, and the finish reason is "length"."""
    text = "Let me check." + call_text(tok, "get", ARGUMENTS[0]) + call_text(tok, "get", ARGUMENTS[2])
    ids = enc(tok, text)
    full, _ = parse(tok, ids)
    for n in range(len(ids)):
        got, _ = parse(tok, ids[:n], reason="length")
        assert got.finish_reason == "length"
        assert full.content.startswith(got.content)
        for c, f in zip(got.tool_calls, full.tool_calls):
            assert f.arguments.startswith(c.arguments) and c.name == f.name
        if got.tool_calls and got.tool_calls[-1].arguments != full.tool_calls[len(got.tool_calls) - 1].arguments:
            assert not got.tool_calls[-1].complete


def test_forced_thought_is_reasoning_not_content(tok):
    text = "<|channel>thought\nStep 1: <b>add</b>.\nStep 2: done.\n<channel|>The answer is 4."
    got, _ = parse(tok, enc(tok, text), tools=False)
    assert got.reasoning == "Step 1: <b>add</b>.\nStep 2: done."
    assert got.content == "The answer is 4." and got.finish_reason == "stop"
    empty, _ = parse(tok, enc(tok, "<|channel>thought\n<channel|>Hi"), tools=False)  # the empty channel
    assert (empty.reasoning, empty.content) == (None, "Hi")


def test_stop_strings_apply_to_content_only(tok):
    text = "<|channel>thought\nsay STOP now\n<channel|>" + call_text(tok, "f", {"s": "STOP"}) + "before STOP after"
    got, _ = parse(tok, enc(tok, text), stops=["STOP"])
    assert got.reasoning == "say STOP now"
    assert json.loads(got.tool_calls[0].arguments) == {"s": "STOP"}
    assert got.content == "before " and got.finish_reason == "tool_calls"  # (the turn ended with complete calls)
    got, _ = parse(tok, enc(tok, "before STOP after"), stops=["STOP"])
    assert got.content == "before " and got.finish_reason == "stop"


def test_without_tools_call_markup_is_text(tok):
    text = call_text(tok, "f", {"a": 1})
    got, _ = parse(tok, enc(tok, text), tools=False)
    assert got.content == text and not got.tool_calls and got.finish_reason == "stop"


@pytest.mark.parametrize("text, content, calls", [
    ("<|tool_call>hello world", "<|tool_call>hello world", []),  # not a call header
    ("<|tool_call>call:bad name{a:1}<tool_call|>x", "<|tool_call>call:bad name{a:1}<tool_call|>x", []),
    ('<|tool_call>call:f{a:<|"|>x<|"|> b:2}<tool_call|>', "b:2}<tool_call|>", [('{"a":"x"', False)]),
    ("<|tool_call>call:f{a:1}junk<tool_call|>", "junk<tool_call|>", [('{"a":1}', True)]),
    ("<|tool_call>call:f{a:1<|channel>thought\nx<channel|>y", "y", [('{"a":', False)]),
    ("<|tool_call>call:f{a:1}<tool_call|>tail", "tail", [('{"a":1}', True)]),
    ("a<channel|>b", "ab", []),  # a stray channel end is markup, never content
])
def test_malformed_output_falls_back_to_content(tok, text, content, calls):
    got, _ = parse(tok, enc(tok, text))
    assert got.content == content
    assert [(c.arguments, c.complete) for c in got.tool_calls] == calls
    assert got.finish_reason == ("tool_calls" if calls and all(c for _, c in calls) else "stop")


def test_call_ids_and_names(tok):
    p = OutputParser(tok, tools=True)
    events = [e for t in enc(tok, call_text(tok, "get_weather", {"q": 1}) * 2) for e in p.push(t)]
    starts = [e for e in events if isinstance(e, ToolCallStart)]
    assert [s.name for s in starts] == ["get_weather"] * 2 and [s.index for s in starts] == [0, 1]
    assert all(re.fullmatch(r"call_[0-9a-f]{24}", s.id) for s in starts) and starts[0].id != starts[1].id


def test_unicode_split_across_byte_tokens(tok):
    """Characters the vocabulary spells in byte tokens stay whole, in content, thought and arguments."""
    rare = "\U0001f9ec\u2f9f\U00010348"
    text = f"<|channel>thought\n{rare}\n<channel|>{rare}" + call_text(tok, "f", {"s": rare})
    got, events = parse(tok, enc(tok, text))
    assert (got.reasoning, got.content, json.loads(got.tool_calls[0].arguments)) == (rare, rare, {"s": rare})
    assert not any("\ufffd" in getattr(e, "text", "") for e in events)


def test_content_events_are_content(tok):
    got, events = parse(tok, enc(tok, "plain text"), tools=True)
    assert all(isinstance(e, (Content, TurnEnd)) for e in events) and got.content == "plain text"
