"""Anthropic's Messages API, driven by the official `anthropic` SDK against a live server.

Two servers of one tiny synthetic Gemma 4 checkpoint (real tokenizer and chat template): on its
own random weights, whose greedy replies must be `Model.chat`'s (computed before serving); and on
a scripted engine (tests/scripted_engine.py) that writes what a real model writes after a given
prompt (thoughts, calls), the script being the oracle. Each streamed message
(`messages.stream(...).get_final_message()`, the SDK's own accumulation) must equal the
non-streamed one.
"""
from __future__ import annotations

import base64
import json
import time

import anthropic
import pytest
from live_server import KEY, LiveServer
from scripted_engine import scripted_model

from gemmalite.errors import InputError

MODEL_ID = "tiny-gemma"
WEATHER = {"type": "object", "properties": {"location": {"type": "string"}, "days": {"type": "integer", "minimum": 1},
                                            "units": {"type": "string", "enum": ["c", "f"]}},
           "required": ["location"], "additionalProperties": False}
RUN = {"type": "object", "properties": {"code": {"type": "string"}, "args": {"type": "array", "items": {"type": "number"}}}}
TOOLS = [{"name": "get_weather", "description": "Weather.", "input_schema": WEATHER},
         {"name": "run", "description": "Run code.", "input_schema": RUN}]
OPENAI_TOOLS = [{"type": "function", "function": {"name": t["name"], "description": t["description"],
                                                  "parameters": t["input_schema"]}} for t in TOOLS]
USER = [{"role": "user", "content": "Weather in Paris, and run my code?"}]
THOUGHT = '<|channel>thought\nTwo tools: {weather} and "run".\n<channel|>'
CALLS = ('<|tool_call>call:get_weather{days:3,location:<|"|>Paris, "FR"<|"|>,units:<|"|>c<|"|>}<tool_call|>'
         '<|tool_call>call:run{args:[1,2.5,-3],code:<|"|>print({"a": 1})\nx = [1, 2]<|"|>}<tool_call|><|tool_response>')
WANT_ARGS = [{"days": 3, "location": 'Paris, "FR"', "units": "c"}, {"args": [1, 2.5, -3], "code": 'print({"a": 1})\nx = [1, 2]'}]
# a thought that repeats itself (prompt lookup drafts more of it where the budget cuts it)
LONG_THOUGHT = "<|channel>thought\n" + "one two three four, " * 12 + "done.<channel|>"
CONVERSATION = [{"role": "user", "content": "Hello there"}, {"role": "assistant", "content": "Hi! How can I help?"},
                {"role": "user", "content": "Tell me about the sea"}]


@pytest.fixture(scope="module")
def real(tmp_path_factory, gl):
    from gemmalite.tools.synth import synth

    return gl.load(synth("tiny", tmp_path_factory.mktemp("tiny"), progress=False), context=512)


@pytest.fixture(scope="module")
def refs(real):
    """`Model.chat`'s greedy replies, before any serving."""
    out = {}
    for name, msgs in (("one", [{"role": "system", "content": "Be brief."}, CONVERSATION[0]]),
                       ("multi", CONVERSATION)):
        real.reset_chat()
        out[name] = real.chat(msgs, max_new_tokens=10, temperature=0, structured=True)
    real.reset_chat()
    return out


@pytest.fixture(scope="module")
def live(real, refs):
    from gemmalite.server import build_app

    s = LiveServer(build_app(real, model_id=MODEL_ID, api_key=KEY, max_concurrency=4))
    yield s
    s.stop()


@pytest.fixture(scope="module")
def model(real):
    return scripted_model(real)


@pytest.fixture(scope="module")
def scripted(model):
    """The scripted model's server, prompt lookup on (drafts meet the thinking budget)."""
    from gemmalite.server import build_app

    s = LiveServer(build_app(model, model_id=MODEL_ID, api_key=KEY, max_concurrency=4, prompt_lookup=3))
    yield s
    s.stop()


def client(server, key=KEY) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=f"http://127.0.0.1:{server.port}", api_key=key, max_retries=0, timeout=120)


def prompt_of(model, messages, tools=None, thinking=False) -> list[int]:
    from gemmalite.chat import chat_ids, check_tools

    return chat_ids(model.tokenizer, messages, tools=check_tools(tools) if tools else None, thinking=thinking)


def script(model, messages, reply: str | list[int], tools=None, thinking=False, after: list[int] = ()) -> list[int]:
    """The scripted model writes ``reply`` after the prompt of ``messages`` (and ``after`` it); the reply's ids."""
    tok = model.tokenizer
    ids = tok.encode(reply, add_special_tokens=False) if isinstance(reply, str) else list(reply)
    model.engine.script(prompt_of(model, messages, tools, thinking) + list(after), ids)
    return ids


def both(c: anthropic.Anthropic, greedy: bool = True, **kw):
    """The message, non-streamed and streamed (the SDK's accumulation of the events), which must agree.
    ``greedy``: at temperature 0 (the scripted engine's flat logits make the default top-k slow)."""
    if greedy:
        kw["extra_body"] = {"temperature": 0, **kw.get("extra_body", {})}
    msg = c.messages.create(**kw)
    with c.messages.stream(**kw) as s:
        final = s.get_final_message()
    assert blocks(final) == blocks(msg)
    assert (final.stop_reason, final.stop_sequence, final.role, final.model) == \
        (msg.stop_reason, msg.stop_sequence, "assistant", MODEL_ID)
    assert final.usage.output_tokens == msg.usage.output_tokens
    assert final.usage.input_tokens + final.usage.cache_read_input_tokens == \
        msg.usage.input_tokens + msg.usage.cache_read_input_tokens
    assert msg.id.startswith("msg_") and msg.type == "message"
    return msg


def blocks(msg) -> list[dict]:
    """The content blocks as dicts, tool_use ids left out (each reply has its own)."""
    out = [{k: v for k, v in b.model_dump().items() if k not in ("parsed_output", "id")} for b in msg.content]
    assert all(b.id.startswith("toolu_") for b in msg.content if b.type == "tool_use")
    return out


def test_text_equals_model_chat(live, real, refs):
    c = client(live)
    greedy = {"extra_body": {"temperature": 0}, "max_tokens": 10, "model": MODEL_ID}
    for system in ("Be brief.", [{"type": "text", "text": "Be brief."}]):
        for content in ("Hello there", [{"type": "text", "text": "Hello there"}]):
            msg = both(c, system=system, messages=[{"role": "user", "content": content}], **greedy)
            ref = refs["one"]
            assert [b.type for b in msg.content] == ["thinking"] * bool(ref.reasoning) + ["text"] * bool(ref.content)
            assert "".join(b.text for b in msg.content if b.type == "text") == ref.content
            assert msg.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[ref.finish_reason]
            assert msg.usage.output_tokens == ref.stats.new_tokens
            n = len(prompt_of(real, [{"role": "system", "content": "Be brief."}, CONVERSATION[0]]))
            assert msg.usage.input_tokens + msg.usage.cache_read_input_tokens == n
    msg = both(c, messages=CONVERSATION, **greedy)
    assert "".join(b.text for b in msg.content if b.type == "text") == refs["multi"].content


def test_stream_events_as_anthropic_sends_them(live):
    status, headers, text = live.raw("POST", "/v1/messages", {"model": MODEL_ID, "max_tokens": 5, "stream": True,
                                                              "messages": CONVERSATION[:1]}, headers={"x-api-key": KEY})
    assert status == 200 and headers["content-type"].startswith("text/event-stream")
    events = [e for e in text.split("\n\n") if e]
    names = []
    for e in events:
        head, data = e.split("\n")
        name = head.removeprefix("event: ")
        assert json.loads(data.removeprefix("data: "))["type"] == name
        names.append(name)
    assert names[0] == "message_start" and names[-2:] == ["message_delta", "message_stop"]
    assert names[1:-2] and all(n.startswith("content_block_") for n in names[1:-2])


def test_tool_loop(scripted, model):
    """tool_use blocks (after a thought), then the results go back and the model answers."""
    ids = script(model, USER, THOUGHT + CALLS, tools=OPENAI_TOOLS, thinking=True)
    c = client(scripted)
    kw = {"model": MODEL_ID, "max_tokens": 200, "tools": TOOLS, "messages": USER,
          "thinking": {"type": "enabled", "budget_tokens": 100}}
    msg = both(c, **kw)
    assert [b.type for b in msg.content] == ["thinking", "tool_use", "tool_use"]
    assert msg.content[0].thinking == 'Two tools: {weather} and "run".' and msg.content[0].signature == ""
    assert [(b.name, b.input) for b in msg.content[1:]] == list(zip(["get_weather", "run"], WANT_ARGS))
    assert all(b.id.startswith("toolu_") for b in msg.content[1:]) and msg.stop_reason == "tool_use"
    assert msg.usage.output_tokens == len(ids) - 1  # (<|tool_response> ends the turn: a stop token, not counted)
    # the results go back: the prompt is the OpenAI-shaped conversation's
    results = [{"type": "tool_result", "tool_use_id": b.id, "content": json.dumps({"ok": True, "n": i})}
               for i, b in enumerate(msg.content[1:])]
    history = USER + [{"role": "assistant", "content": msg.content}, {"role": "user", "content": results}]
    openai_history = USER + [
        {"role": "assistant", "content": "", "reasoning_content": msg.content[0].thinking,
         "tool_calls": [{"id": b.id, "type": "function", "function": {"name": b.name, "arguments": json.dumps(b.input)}}
                        for b in msg.content[1:]]}] + [
        {"role": "tool", "tool_call_id": r["tool_use_id"], "content": r["content"]} for r in results]
    script(model, openai_history, "Done: 18 degrees.", tools=OPENAI_TOOLS, thinking=True)
    msg = both(c, **{**kw, "messages": history})
    assert blocks(msg) == [{"type": "text", "text": "Done: 18 degrees.", "citations": None}]
    assert msg.stop_reason == "end_turn"
    # a cut call: max_tokens, its input what the SDK reads of the cut stream
    script(model, USER, CALLS, tools=OPENAI_TOOLS)
    msg = both(c, **{**kw, "thinking": {"type": "disabled"}, "max_tokens": 12})
    assert msg.stop_reason == "max_tokens" and msg.content[-1].type == "tool_use"
    assert msg.content[-1].input == {"days": 3}  # (the 12 tokens end at `,location`: one argument is complete)


ONE_CALL = CALLS.split("<tool_call|>")[0] + "<tool_call|><|tool_response>"


@pytest.mark.parametrize("choice, reply, calls", [({"type": "any", "disable_parallel_tool_use": True}, CALLS, 1),
                                                  ({"type": "tool", "name": "get_weather"}, ONE_CALL, 1),
                                                  ({"type": "auto"}, CALLS, 2)])
def test_tool_choice(scripted, model, choice, reply, calls):
    script(model, USER, reply, tools=OPENAI_TOOLS)
    msg = both(client(scripted), model=MODEL_ID, max_tokens=200, tools=TOOLS, messages=USER, tool_choice=choice)
    assert [b.input for b in msg.content] == WANT_ARGS[:calls] and msg.stop_reason == "tool_use"


def test_tool_choice_none_leaves_the_tools_out(scripted, model):
    script(model, USER, "No tools here.")
    msg = both(client(scripted), model=MODEL_ID, max_tokens=20, tools=TOOLS, messages=USER, tool_choice={"type": "none"})
    assert blocks(msg) == [{"type": "text", "text": "No tools here.", "citations": None}]


def test_stop_sequences(scripted, model):
    script(model, USER, THOUGHT + "The answer, STOP, is 42.")
    c = client(scripted)
    msg = both(c, model=MODEL_ID, max_tokens=50, messages=USER, stop_sequences=["never", "STOP"])
    assert [b.type for b in msg.content] == ["thinking", "text"] and msg.content[1].text == "The answer, "
    assert (msg.stop_reason, msg.stop_sequence) == ("stop_sequence", "STOP")
    msg = both(c, model=MODEL_ID, max_tokens=50, messages=USER)
    assert (msg.content[1].text, msg.stop_reason, msg.stop_sequence) == ("The answer, STOP, is 42.", "end_turn", None)


def cut_reply(model, thought: str, k: int, rest: str, messages=USER, tools=None) -> tuple[list[int], str]:
    """Script ``thought`` (then ``rest``) and, after its first ``k`` thought tokens and a forced
    ``<channel|>``, ``rest``; (the tokens a budget of k gives, the thought's text they hold)."""
    tok = model.tokenizer
    ids = script(model, messages, thought + rest, tools=tools, thinking=True)
    close = tok.token_id("<channel|>")
    head = ids[: 1 + k] + [close]  # <|channel>, k thought tokens, the forced end
    after = script(model, messages, rest, tools=tools, thinking=True, after=head)
    return head + after, tok.decode(ids[1 + 2 : 1 + k])  # (after the channel's name, thought\n: 2 tokens)


def test_thinking_budget_closes_the_thought(scripted, model):
    """With a budget of k, the thought has k tokens, then <channel|> and the answer; the same
    reply through `Model.chat(thinking_budget=k)`."""
    c = client(scripted)
    for k, greedy in ((5, False), (17, True)):  # (sampled: the forced token is drawn like any other)
        ids, thought = cut_reply(model, LONG_THOUGHT, k, "The answer is 42.")
        msg = both(c, greedy, model=MODEL_ID, max_tokens=100, messages=USER,
                   thinking={"type": "enabled", "budget_tokens": k})
        assert blocks(msg) == [{"type": "thinking", "thinking": thought, "signature": ""},
                               {"type": "text", "text": "The answer is 42.", "citations": None}]
        assert msg.usage.output_tokens == len(ids) and msg.stop_reason == "end_turn"
        model.reset_chat()
        reply = model.chat(USER, thinking_budget=k, max_new_tokens=100, prompt_lookup=True,
                           temperature=0 if greedy else None)
        assert (reply.reasoning, reply.content, reply.stats.new_tokens) == (thought, "The answer is 42.", len(ids))
    for bad in (-1, 2.5, "10"):
        with pytest.raises(InputError, match="thinking_budget"):
            model.chat(USER, thinking_budget=bad)


def test_thinking_budget_in_the_tools_grammar(scripted, model):
    ids, thought = cut_reply(model, LONG_THOUGHT, 9, CALLS, tools=OPENAI_TOOLS)
    msg = both(client(scripted), model=MODEL_ID, max_tokens=200, messages=USER, tools=TOOLS,
               thinking={"type": "enabled", "budget_tokens": 9})
    assert msg.content[0].thinking == thought and [b.input for b in msg.content[1:]] == WANT_ARGS
    assert msg.usage.output_tokens == len(ids) - 1


def test_a_thought_within_the_budget_is_untouched(scripted, model):
    ids = script(model, USER, LONG_THOUGHT + "The answer.", thinking=True)
    n = ids.index(model.tokenizer.token_id("<channel|>")) - 1  # the thought's tokens
    c = client(scripted)
    kw = {"model": MODEL_ID, "max_tokens": 200, "messages": USER}
    plain = both(c, **kw, thinking={"type": "adaptive"})
    for k in (n, n + 1, 150):
        assert blocks(both(c, **kw, thinking={"type": "enabled", "budget_tokens": k})) == blocks(plain)
    def solo(**kw):
        model.reset_chat()
        r = model.chat(USER, max_new_tokens=200, prompt_lookup=True, temperature=0, **kw)
        return r.reasoning, r.content, r.finish_reason, r.stats.new_tokens

    unbudgeted = solo(thinking=True)
    assert solo(thinking_budget=n) == solo(thinking_budget=n + 1) == unbudgeted
    assert unbudgeted[:2] == (plain.content[0].thinking, plain.content[1].text)


def test_count_tokens(live, real):
    c = client(live)
    n = c.messages.count_tokens(model=MODEL_ID, system="Be brief.", messages=CONVERSATION, tools=TOOLS,
                                thinking={"type": "enabled", "budget_tokens": 2000})
    want = prompt_of(real, [{"role": "system", "content": "Be brief."}] + CONVERSATION, OPENAI_TOOLS, thinking=True)
    assert n.input_tokens == len(want)
    assert c.messages.count_tokens(model=MODEL_ID, messages=CONVERSATION).input_tokens == len(prompt_of(real, CONVERSATION))


def test_api_keys(scripted):
    body = {"model": MODEL_ID, "max_tokens": 3, "messages": USER}
    with pytest.raises(anthropic.AuthenticationError) as e:
        client(scripted, key="wrong").messages.create(**body)
    assert e.value.status_code == 401 and e.value.body["type"] == "error"
    assert e.value.body["error"]["type"] == "authentication_error"
    assert scripted.raw("POST", "/v1/messages", body, key=None)[0] == 401
    assert scripted.raw("POST", "/v1/messages", body, key=None, headers={"x-api-key": KEY})[0] == 200
    assert scripted.raw("POST", "/v1/messages", body)[0] == 200  # Authorization: Bearer
    assert scripted.raw("POST", "/v1/messages", body, headers={"x-api-key": "wrong"})[0] == 401  # both, one wrong
    assert scripted.raw("GET", "/v1/models", key=None, headers={"x-api-key": KEY})[0] == 200  # every route takes it
    assert client(scripted).messages.count_tokens(model=MODEL_ID, messages=USER).input_tokens > 0


PNG = base64.b64encode(b"\x89PNG\r\n\x1a\n" + bytes(64)).decode()  # (the tiny checkpoint has no vision tower)


def _user(*blocks):
    return {"messages": [{"role": "user", "content": list(blocks)}]}


TOOL_TURN = [{"role": "user", "content": "x"},
             {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "run", "input": {}}]}]
BAD = [
    ({"max_tokens": None}, "max_tokens"),
    ({"container": "c1"}, "'container'"),
    ({"output_config": {"effort": "low"}, "speed": "fast"}, "'output_config', 'speed'"),
    (_user({"type": "document", "source": {}}), "'document'"),
    (_user({"type": "image", "source": {"type": "url", "url": "https://example.com/a.png"}}), "'url'"),
    (_user({"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "@@"}}), "base64"),
    (_user({"type": "text", "text": "x", "citations": [{"type": "char_location"}]}), "citations"),
    (_user({"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": PNG}}), "image blocks"),
    ({"messages": TOOL_TURN + [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_2"}]}]},
     "toolu_2"),
    ({"messages": TOOL_TURN + [{"role": "user", "content": [{"type": "text", "text": "x"},
                                                             {"type": "tool_result", "tool_use_id": "toolu_1"}]}]},
     "tool_result blocks come first"),
    ({"messages": TOOL_TURN}, "assistant prefill"),
    ({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": [{"type": "redacted_thinking",
                                                                                        "data": "x"}]},
                   {"role": "user", "content": "y"}]}, "'redacted_thinking'"),
    ({"messages": [{"role": "system", "content": "x"}]}, "role"),
    ({"messages": []}, "messages"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "web_search_20250305"),
    ({"tools": [{"name": "f", "input_schema": {"type": "object", "properties": {"s": {"type": "string", "pattern": "a+"}}}}]},
     "tools[0].input_schema.properties.s"),
    ({"tools": [{"name": "f"}]}, "input_schema"),
    ({"tools": TOOLS, "tool_choice": {"type": "tool", "name": "nope"}}, "nope"),
    ({"tools": TOOLS, "tool_choice": {"type": "sometimes"}}, "tool_choice"),
    ({"tool_choice": {"type": "any"}}, "tool_choice"),
    ({"thinking": {"type": "enabled", "budget_tokens": 50}}, "budget_tokens"),
    ({"thinking": {"type": "enabled"}}, "budget_tokens"),
    ({"thinking": {"type": "adaptive", "display": "omitted"}}, "omitted"),
    ({"temperature": 1.5}, "temperature"),
    ({"stop_sequences": "STOP"}, "stop_sequences"),
    ({"stop_sequences": ["a", "b", "c", "d", "e"]}, "stop_sequences"),
    ({"metadata": {"user_id": 3}}, "metadata"),
]


def test_bad_requests_answer_400_in_anthropic_shape(scripted, model):
    for kw, named in BAD:
        body = {k: v for k, v in {"model": MODEL_ID, "max_tokens": 50, "messages": USER, **kw}.items() if v is not None}
        status, _, out = scripted.raw("POST", "/v1/messages", body, headers={"x-api-key": KEY})
        assert status == 400, (kw, out)
        assert out["type"] == "error" and out["error"]["type"] == "invalid_request_error", out
        assert named in out["error"]["message"], (named, out)
    with pytest.raises(anthropic.BadRequestError, match="'document'") as e:
        client(scripted).messages.create(model=MODEL_ID, max_tokens=5, **_user({"type": "document", "source": {}}))
    assert e.value.body["error"]["type"] == "invalid_request_error"
    with pytest.raises(anthropic.NotFoundError) as e:
        client(scripted).messages.create(model="claude-opus-4", max_tokens=5, messages=USER)
    assert e.value.body["error"]["type"] == "not_found_error"
    status, _, out = scripted.raw("POST", "/v1/messages", b"{not json", headers={"x-api-key": KEY})
    assert status == 400 and out["error"]["type"] == "invalid_request_error"
    # the server is unharmed
    assert scripted.raw("GET", "/health", key=None)[0] == 200
    script(model, USER, "still here")
    assert client(scripted).messages.create(model=MODEL_ID, max_tokens=20, messages=USER).content[0].text == "still here"


def test_full_queue_answers_529_overloaded(scripted):
    with scripted.full_queue():
        with pytest.raises(anthropic.APIStatusError) as e:
            client(scripted).messages.create(model=MODEL_ID, max_tokens=5, messages=USER)
    assert e.value.status_code == 529 and e.value.body["error"]["type"] == "overloaded_error"
    assert client(scripted).messages.count_tokens(model=MODEL_ID, messages=USER).input_tokens > 0


class Paced:
    """An engine whose decode steps each take ``pace`` seconds longer: a long reply still flowing
    when its client leaves (the scripted one would end first)."""

    def __init__(self, engine, pace: float):
        self.engine, self.pace = engine, pace

    def __getattr__(self, name):
        fn = getattr(self.engine, name)
        if not name.startswith("decode"):
            return fn

        def paced(*args, **kw):
            time.sleep(self.pace)
            return fn(*args, **kw)

        return paced


def test_a_dropped_stream_frees_its_slot(scripted, model):
    """A stream's client reads one event and closes its connection: the sequence is cancelled
    (client_gone) long before its reply's end, and the server's active sequences reach 0."""
    ids = script(model, USER, "la " * 300)
    before = {name: scripted.metric(name, labels) for name, labels in (
        ("gemmalite_cancelled_total", '{cause="client_gone"}'), ("gemmalite_completion_tokens_total", ""))}
    sch = scripted.srv.scheduler
    sch.engine = Paced(sch.engine, 0.02)  # (300 tokens: 6 s)
    try:
        scripted.drop_stream("/v1/messages", {"model": MODEL_ID, "max_tokens": 400, "messages": USER, "stream": True},
                             b"event: content_block_delta", headers={"x-api-key": KEY})
        deadline = time.monotonic() + 60
        while scripted.metric("gemmalite_active_sequences") > 0:
            assert time.monotonic() < deadline, "the dropped stream's slot was never freed"
            time.sleep(0.01)
    finally:
        sch.engine = sch.engine.engine
    assert scripted.metric("gemmalite_cancelled_total", '{cause="client_gone"}') == \
        before["gemmalite_cancelled_total"] + 1
    assert scripted.metric("gemmalite_completion_tokens_total") - before["gemmalite_completion_tokens_total"] < len(ids)
    script(model, USER, "still here")
    assert client(scripted).messages.create(model=MODEL_ID, max_tokens=20, messages=USER).content[0].text == "still here"
