"""The tool-call grammar in Gemma 4's syntax: calls the real chat template renders are accepted
(strings holding braces, commas, quotes, newlines, unicode; nested objects, arrays, bools,
parallel calls), calls generated on random weights (forced with ``required`` / a named
function) parse and validate against the tool's schema (jsonschema as the oracle), and what
the grammar cannot enforce is refused naming the place."""
from __future__ import annotations

import jsonschema
import pytest

from gemmalite.chat.tool_grammar import response_format_grammar, tool_grammar
from gemmalite.errors import InputError

WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 12},
    "days": {"type": "integer", "minimum": 1, "maximum": 14},
    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    "opts": {"type": "object", "properties": {"x": {"type": "boolean"},
                                              "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}},
                                              "ratio": {"anyOf": [{"type": "number", "minimum": 0, "maximum": 1},
                                                                  {"type": "null"}]}},
             "required": ["x"], "additionalProperties": False}},
    "required": ["city", "days"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "ping", "parameters": {"type": "object", "properties": {}}}}]
STOP = [106, 50]  # <turn|>, <|tool_response>


@pytest.fixture(scope="module")
def model(tmp_path_factory, gl):
    from gemmalite.tools.synth import synth

    return gl.load(synth("tiny", tmp_path_factory.mktemp("tiny"), progress=False), context=512)


def parse_calls(tok, ids):
    """Reference reader of Gemma 4 calls, by token id: [(name, arguments as Python values)]."""
    call, end, quote = (tok.token_id(t) for t in ("<|tool_call>", "<tool_call|>", '<|"|>'))
    out, i = [], 0
    while i < len(ids):
        assert ids[i] == call, f"expected a call at {i}: {tok.decode(ids[i:])!r}"
        j = ids.index(end, i)
        segs, cur = [], []
        for t in ids[i + 1 : j]:
            if t == quote:
                segs.append(tok.decode(cur))
                cur = []
            else:
                cur.append(t)
        segs.append(tok.decode(cur))
        items = [("raw", s) if k % 2 == 0 else ("str", s) for k, s in enumerate(segs)]
        chars = [(kind, c) for kind, s in items for c in ([s] if kind == "str" else s)]
        head = "".join(c for _, c in chars[: next(k for k, (_, c) in enumerate(chars) if c == "{")])
        assert head.startswith("call:")
        pos = len(head)
        value, pos = _value(chars, pos)
        assert pos == len(chars), "trailing text in a call"
        out.append((head[5:], value))
        i = j + 1
    return out


def _value(chars, pos):
    kind, c = chars[pos]
    if kind == "str":
        return c, pos + 1
    if c == "{":
        obj, pos = {}, pos + 1
        while chars[pos][1] != "}":
            k0 = pos
            while chars[pos][1] != ":":
                pos += 1
            key = "".join(c for _, c in chars[k0:pos])
            obj[key], pos = _value(chars, pos + 1)
            if chars[pos][1] == ",":
                pos += 1
        return obj, pos + 1
    if c == "[":
        arr, pos = [], pos + 1
        while chars[pos][1] != "]":
            v, pos = _value(chars, pos)
            arr.append(v)
            if chars[pos][1] == ",":
                pos += 1
        return arr, pos + 1
    k0 = pos
    while pos < len(chars) and chars[pos][0] == "raw" and chars[pos][1] not in ",}]":
        pos += 1
    word = "".join(c for _, c in chars[k0:pos])
    return {"true": True, "false": False, "null": None}.get(word, None) if word in ("true", "false", "null") \
        else (int(word) if word.lstrip("-").isdigit() else float(word)), pos


def test_template_calls_are_accepted(model):
    tok = model.tokenizer
    args = [{"city": 'Pa{r,i"s\n', "days": 2, "opts": {"x": True, "tags": ["a", "ü,}"], "ratio": 0.5}},
            {"city": "東京", "days": 14, "unit": "celsius"}]
    calls = [{"type": "function", "function": {"name": "get_weather", "arguments": a}} for a in args]
    calls.append({"type": "function", "function": {"name": "ping", "arguments": {}}})
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": calls}],
                                   add_generation_prompt=False)
    rendered = text[text.index("<|tool_call>") : text.rindex("<tool_call|>") + len("<tool_call|>")]
    ids = tok.encode(rendered, add_special_tokens=False)
    for choice, parallel, ok in [("required", True, True), ("auto", True, True), ("required", False, False)]:
        m = tool_grammar(tok, TOOLS, choice, parallel).matcher(STOP)
        n = m.valid_prefix(ids)
        assert (n == len(ids) and m.ll.consume_tokens(ids) and m.accepting) == ok, (choice, parallel, n)
    assert [a for _, a in parse_calls(tok, ids)][:2] == args  # the reference reader reads the template's form
    first = ids[: ids.index(tok.token_id("<tool_call|>")) + 1]
    named = tool_grammar(tok, TOOLS, {"type": "function", "function": {"name": "ping"}}).matcher(STOP)
    assert named.valid_prefix(first) < len(first)  # get_weather is not the named function


@pytest.mark.parametrize("choice,parallel", [("required", True), ("required", False),
                                             ({"type": "function", "function": {"name": "get_weather"}}, False)])
def test_forced_calls_parse_and_validate(model, choice, parallel):
    tok = model.tokenizer
    g = tool_grammar(tok, TOOLS, choice, parallel)
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    counts = []
    for seed in range(4):
        s = model.generate_tokens(tok.encode("Call a tool."), grammar=g, max_new_tokens=200, temperature=1.0,
                                  seed=seed, stop=STOP, stream=True)
        ids = list(s)
        assert s.stats.finish_reason == "stop", tok.decode(ids)
        calls = parse_calls(tok, ids)  # every id inside a call: the count is the reply's
        counts.append(len(calls))
        for name, args in calls:
            assert isinstance(choice, str) or name == "get_weather"
            jsonschema.validate(args, schemas[name])
    # one call each without parallel calls; with them, at least one, and a second one does happen
    # (seed 1 makes two): a grammar that closed the reply after one call would fail here
    assert min(counts) >= 1 and (max(counts) > 1 if parallel else max(counts) == 1), counts


def test_auto_allows_text_then_calls(model):
    import numpy as np

    tok = model.tokenizer
    m = tool_grammar(tok, TOOLS, "auto").matcher(STOP)
    added = sorted(tok.tk.added_ids())
    expected = np.ones(tok.vocab_size, dtype=bool)  # any text token, a call, or the end: nothing else
    expected[added] = False
    expected[[tok.token_id(f"<0x{b:02X}>") for b in [*range(0x80, 0xC2), *range(0xF5, 0x100)]]] = False  # no UTF-8 start
    expected[[tok.token_id("<|tool_call>"), *STOP]] = True
    assert (m.masks()[0] == expected).all()
    text = tok.encode("Let me check.", add_special_tokens=False)
    call = tok.encode('<|tool_call>call:ping{}<tool_call|>', add_special_tokens=False)
    assert m.valid_prefix(text + call) == len(text + call)


def test_thinking_comes_first(model):
    tok = model.tokenizer
    g = tool_grammar(tok, TOOLS, "required", thinking=True)
    ids = tok.encode('<|channel>thought\nhmm {x}<channel|><|tool_call>call:ping{}<tool_call|>', add_special_tokens=False)
    assert g.matcher(STOP).valid_prefix(ids) == len(ids)
    assert tool_grammar(tok, TOOLS, "required").matcher(STOP).valid_prefix(ids) == 0
    rf = {"type": "json_schema", "json_schema": {"name": "a", "strict": True, "schema": {
        "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"], "additionalProperties": False}}}
    ids = tok.encode('<|channel>thought\n...<channel|>{"a":12}', add_special_tokens=False)
    m = response_format_grammar(tok, rf, thinking=True).matcher(STOP)
    assert m.valid_prefix(ids) == len(ids)
    assert response_format_grammar(tok, rf).matcher(STOP).valid_prefix(ids) == 0
    assert response_format_grammar(tok, {"type": "text"}) is None
    assert tool_grammar(tok, TOOLS, "none") is None


@pytest.mark.parametrize("tools,choice,param", [
    ([{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"s": {"type": "string", "pattern": "^a+$"}}}}}], "auto",
     "tools[0].function.parameters.properties.s"),
    ([{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"s": {"oneOf": [{"type": "string"}]}}}}}], "auto",
     "tools[0].function.parameters.properties.s"),
    ([{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {}, "required": ["x"]}}}], "auto", "tools[0].function.parameters.required"),
    ([{"type": "function", "function": {"name": "f"}}], {"type": "function", "function": {"name": "g"}}, "tool_choice"),
    ([{"type": "function", "function": {"name": "f"}}, {"type": "function", "function": {"name": "f"}}], "auto",
     "tools[1].function.name"),
    ([{"type": "retrieval"}], "auto", "tools[0]"),
    ("nope", "auto", "tools"),
])
def test_refused_naming_the_param(model, tools, choice, param):
    with pytest.raises(InputError) as e:
        tool_grammar(model.tokenizer, tools, choice)
    assert e.value.param == param, str(e.value)


def test_response_format_refusals(model):
    tok = model.tokenizer
    with pytest.raises(InputError) as e:
        response_format_grammar(tok, {"type": "json_schema", "json_schema": {"name": "a", "strict": True, "schema": {
            "type": "array", "items": {"type": "string"}, "uniqueItems": True}}})
    assert e.value.param == "response_format.json_schema.schema" and "uniqueItems" in str(e.value)
    # not strict: what cannot be enforced is ignored
    assert response_format_grammar(tok, {"type": "json_schema", "json_schema": {"name": "a", "schema": {
        "type": "array", "items": {"type": "string"}, "uniqueItems": True}}}) is not None
    with pytest.raises(InputError) as e:
        response_format_grammar(tok, {"type": "xml"})
    assert e.value.param == "response_format"


def test_tools_with_response_format(model):
    tok = model.tokenizer
    rf = {"type": "json_schema", "json_schema": {"name": "a", "strict": True, "schema": {
        "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"], "additionalProperties": False}}}
    g = tool_grammar(tok, TOOLS, "auto", response_format=rf)
    for text, ok in [('{"a":3}', True), ('<|tool_call>call:ping{}<tool_call|>', True), ("hello", False)]:
        ids = tok.encode(text, add_special_tokens=False)
        m = g.matcher(STOP)
        assert (m.valid_prefix(ids) == len(ids) and (m.ll.consume_tokens(ids) and m.accepting)) == ok, text
    assert tool_grammar(tok, TOOLS, "none", response_format=rf) is not None
    with pytest.raises(InputError) as e:
        tool_grammar(tok, TOOLS, "required", response_format=rf)
    assert e.value.param == "response_format"
