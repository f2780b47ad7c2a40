"""OpenAI's Responses API (``/v1/responses``) through the official `openai` client (and the
`openai-agents` SDK) against a live server on the tiny checkpoint (real Gemma 4 tokenizer and
template). Oracles: `Model.chat` solo runs and the chat-completions reply for the same
conversation (random weights, greedy); for thoughts and tool calls, which random weights never
write, the scripted engine (tests/scripted_engine.py): a reply comes only after exactly the
prompt the script names, so a conversation rebuilt wrong (from ``previous_response_id`` or from
full input) gets no reply."""
from __future__ import annotations

import asyncio
import json

import jsonschema
import openai
import pydantic
import pytest
from live_server import KEY, LiveServer
from scripted_engine import scripted_model

MODEL_ID = "tiny-gemma"
WEATHER = {"type": "object", "properties": {"location": {"type": "string"}, "days": {"type": "integer", "minimum": 1},
                                            "units": {"type": "string", "enum": ["c", "f"]}},
           "required": ["location"], "additionalProperties": False}
RUN = {"type": "object", "properties": {"code": {"type": "string"}, "args": {"type": "array", "items": {"type": "number"}}}}
TOOLS = [{"type": "function", "name": "get_weather", "description": "Weather.", "parameters": WEATHER, "strict": True},
         {"type": "function", "name": "run", "description": "Run code.", "parameters": RUN, "strict": False}]
CHAT_TOOLS = [{"type": "function", "function": {k: t[k] for k in ("name", "description", "parameters")}} for t in TOOLS]
ASK = "Weather in Paris, and run my code?"
USER = [{"role": "user", "content": ASK}]
THOUGHT = '<|channel>thought\nTwo tools: {weather} and "run".\n<channel|>'
CALLS = ('<|tool_call>call:get_weather{days:3,location:<|"|>Paris, "FR"<|"|>,units:<|"|>c<|"|>}<tool_call|>'
         '<|tool_call>call:run{args:[1,2.5,-3],code:<|"|>print({"a": 1})\nx = [1, 2]<|"|>}<tool_call|><|tool_response>')
WANT_ARGS = [{"days": 3, "location": 'Paris, "FR"', "units": "c"}, {"args": [1, 2.5, -3], "code": 'print({"a": 1})\nx = [1, 2]'}]
PROMPTS = ["Hello there", "Once upon a time"]
SYSTEM = "Answer in one word."


class Person(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=8)
    age: int = pydantic.Field(ge=0, le=99)


@pytest.fixture(scope="module")
def real(tmp_path_factory, gl):
    from gemmalite.tools.synth import synth

    return gl.load(synth("tiny", tmp_path_factory.mktemp("tiny"), progress=False), context=512)


@pytest.fixture(scope="module")
def refs(real):
    """Greedy solo replies through `Model.chat`, before any serving."""
    out = {}
    convs = {p: [{"role": "user", "content": p}] for p in PROMPTS}
    convs["system"] = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": PROMPTS[0]}]
    for key, msgs in convs.items():
        real.reset_chat()
        out[key] = real.chat(msgs, max_new_tokens=12, temperature=0, structured=True)
    real.reset_chat()
    return out


def _serve(model):
    from gemmalite.server import build_app

    return LiveServer(build_app(model, model_id=MODEL_ID, api_key=KEY, max_concurrency=4))


@pytest.fixture(scope="module")
def live_real(real, refs):
    s = _serve(real)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def model(real):
    return scripted_model(real)


@pytest.fixture(scope="module")
def live(model):
    s = _serve(model)
    yield s
    s.stop()


def script(model, messages, reply: str, tools=CHAT_TOOLS, thinking=False) -> None:
    from gemmalite.chat import chat_ids, check_tools

    tok = model.tokenizer
    prompt = chat_ids(tok, messages, tools=check_tools(tools) if tools else None, thinking=thinking)
    model.engine.script(prompt, tok.encode(reply, add_special_tokens=False))


def parts(r) -> tuple[str, str, list[tuple[str, str]]]:
    """A response's (text, reasoning, [(name, arguments)]) from its output items."""
    text, reasoning, calls = "", "", []
    for item in r.output:
        if item.type == "message":
            text += "".join(c.text for c in item.content)
        elif item.type == "reasoning":
            reasoning += "".join(c.text for c in item.content or [])
        elif item.type == "function_call":
            calls.append((item.name, item.arguments))
    return text, reasoning, calls


def streamed(client, **kw):
    """A streamed response: its events, joined deltas (text, reasoning, arguments by item) and the final response."""
    with client.responses.stream(**kw) as s:
        events = list(s)
        # (the SDK's final response needs response.completed; one cut short ends with response.incomplete, as OpenAI's)
        final = events[-1].response if events[-1].type == "response.incomplete" else s.get_final_response()
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].type == "response.created" and events[1].type == "response.in_progress"
    assert events[-1].type in ("response.completed", "response.incomplete")
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    reasoning = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    args: dict[str, str] = {}
    for e in events:
        if e.type == "response.function_call_arguments.delta":
            args[e.item_id] = args.get(e.item_id, "") + e.delta
    done = {e.item_id: e.arguments for e in events if e.type == "response.function_call_arguments.done"}
    assert args == done
    return events, (text, reasoning, list(args.values())), final


def test_plain_text_is_the_chat_reply(live_real, refs):
    """The same tokens whichever API asks: Model.chat, chat completions and Responses agree (greedy)."""
    c = live_real.client()
    for p in PROMPTS:
        ref = refs[p]
        r = c.responses.create(model=MODEL_ID, input=p, max_output_tokens=12, temperature=0)
        text, reasoning, calls = parts(r)
        assert (text, reasoning or None, calls) == (ref.content, ref.reasoning, [])
        assert r.output_text == ref.content and r.object == "response" and r.id.startswith("resp_")
        chat = c.chat.completions.create(model=MODEL_ID, messages=[{"role": "user", "content": p}], max_tokens=12,
                                         temperature=0)
        assert chat.choices[0].message.content == text
        cut = chat.choices[0].finish_reason == "length"
        assert r.status == ("incomplete" if cut else "completed")
        assert (r.incomplete_details.reason if cut else r.incomplete_details) == ("max_output_tokens" if cut else None)
        u = r.usage
        assert (u.input_tokens, u.output_tokens) == (chat.usage.prompt_tokens, chat.usage.completion_tokens)
        assert u.total_tokens == u.input_tokens + u.output_tokens and u.input_tokens_details.cached_tokens >= 0
    # instructions are the system message; a message list is the conversation
    r = c.responses.create(model=MODEL_ID, instructions=SYSTEM, input=[{"role": "user", "content": PROMPTS[0]}],
                           max_output_tokens=12, temperature=0)
    assert r.output_text == refs["system"].content and r.instructions == SYSTEM


def test_stream_joins_to_the_response(live_real, refs):
    c = live_real.client()
    kw = dict(model=MODEL_ID, input=PROMPTS[1], max_output_tokens=12, temperature=0)
    r = c.responses.create(**kw)
    events, (text, _, _), final = streamed(c, **kw)
    assert text == r.output_text == final.output_text == refs[PROMPTS[1]].content
    assert final.status == r.status  # (usage alike but for cached_tokens: the second run may reuse the first's prefix)
    assert [(x.usage.input_tokens, x.usage.output_tokens, x.usage.total_tokens) for x in (final, r)] == \
        [(r.usage.input_tokens, r.usage.output_tokens, r.usage.total_tokens)] * 2
    assert [(i.type, i.status) for i in final.output] == [(i.type, i.status) for i in r.output]
    if final.output[-1].type == "message":
        assert [e.type for e in events][-4:-1] == ["response.output_text.done", "response.content_part.done",
                                                   "response.output_item.done"]


def test_thought_and_calls_streamed_and_not(live, model):
    script(model, USER, THOUGHT + CALLS, thinking=True)
    c = live.client()
    kw = dict(model=MODEL_ID, input=ASK, tools=TOOLS, reasoning={"effort": "high"})
    r = c.responses.create(**kw)
    assert [i.type for i in r.output] == ["reasoning", "function_call", "function_call"]
    text, reasoning, calls = parts(r)
    assert (text, reasoning) == ("", 'Two tools: {weather} and "run".')
    assert [(n, json.loads(a)) for n, a in calls] == [("get_weather", WANT_ARGS[0]), ("run", WANT_ARGS[1])]
    assert all(i.call_id.startswith("call_") and i.id.startswith("fc_") and i.status == "completed"
               for i in r.output[1:])
    assert r.usage.output_tokens_details.reasoning_tokens == len(model.tokenizer.encode(THOUGHT, add_special_tokens=False))
    events, joined, final = streamed(c, **kw)
    assert joined == (text, reasoning, [a for _, a in calls])
    assert [(i.type, getattr(i, "name", None)) for i in final.output] == [(i.type, getattr(i, "name", None))
                                                                          for i in r.output]
    kinds = [e.type for e in events]
    for k in ("response.output_item.added", "response.content_part.added", "response.reasoning_text.done",
              "response.content_part.done", "response.function_call_arguments.done", "response.output_item.done",
              "response.completed"):
        assert k in kinds
    # cut by max_output_tokens: incomplete, the cut call incomplete
    script(model, USER, CALLS)
    r = c.responses.create(model=MODEL_ID, input=ASK, tools=TOOLS, max_output_tokens=12)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert [(i.type, i.status) for i in r.output] == [("function_call", "incomplete")]


def _tool_results(calls) -> list[dict]:
    return [{"type": "function_call_output", "call_id": cid, "output": json.dumps({"ok": True, "n": i})}
            for i, cid in enumerate(calls)]


def test_the_tool_loop(live, model):
    """function_call then function_call_output: by previous_response_id, by full input, and as chat completions."""
    script(model, USER, THOUGHT + CALLS, thinking=True)
    c = live.client()
    kw = dict(model=MODEL_ID, tools=TOOLS, reasoning={"effort": "high"})
    r = c.responses.create(input=ASK, **kw)
    calls = [i for i in r.output if i.type == "function_call"]
    chat_turn = {"role": "assistant", "content": None, "reasoning_content": parts(r)[1],
                 "tool_calls": [{"id": i.call_id, "type": "function",
                                 "function": {"name": i.name, "arguments": i.arguments}} for i in calls]}
    results = _tool_results([i.call_id for i in calls])
    history = USER + [chat_turn] + [{"role": "tool", "tool_call_id": x["call_id"], "content": x["output"]}
                                    for x in results]
    answer = "Done: 18 degrees, and the code printed {'a': 1}."
    script(model, history, answer, thinking=True)
    follow = c.responses.create(previous_response_id=r.id, input=results, **kw)
    assert follow.output_text == answer and follow.status == "completed" and follow.previous_response_id == r.id
    # the same conversation sent whole (the output items as the SDK gives them back), not stored
    whole = [{"role": "user", "content": ASK}] + [i.model_dump(exclude_none=True) for i in r.output] + results
    again = c.responses.create(input=whole, store=False, **kw)
    assert again.output_text == answer
    with pytest.raises(openai.NotFoundError):
        c.responses.retrieve(again.id)
    chat = c.chat.completions.create(model=MODEL_ID, messages=history, tools=CHAT_TOOLS, reasoning_effort="high")
    assert chat.choices[0].message.content == answer
    # a third turn on the second: the whole chain is kept
    history2 = history + [{"role": "assistant", "content": answer}, {"role": "user", "content": "Thanks!"}]
    script(model, history2, "You are welcome.", thinking=True)
    third = c.responses.create(previous_response_id=follow.id, input="Thanks!", **kw)
    assert third.output_text == "You are welcome."


def test_structured_output_validates(live_real):
    c = live_real.client()
    for seed in (0, 1):
        r = c.responses.parse(model=MODEL_ID, input="Describe a person.", text_format=Person, max_output_tokens=60,
                              temperature=1.0, extra_body={"seed": seed})
        assert r.status == "completed" and isinstance(r.output_parsed, Person)
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0,
                                                                               "maximum": 9}},
              "required": ["ok", "n"], "additionalProperties": False}
    fmt = {"format": {"type": "json_schema", "name": "x", "schema": schema, "strict": True}}
    r = c.responses.create(model=MODEL_ID, input="Answer.", text=fmt, max_output_tokens=40, temperature=1.0,
                           extra_body={"seed": 3})
    jsonschema.validate(json.loads(r.output_text), schema)
    assert r.text.format.type == "json_schema"
    # the chat path's reply for the same request (the same seed): the same JSON
    chat = c.chat.completions.create(model=MODEL_ID, messages=[{"role": "user", "content": "Answer."}], max_tokens=40,
                                     temperature=1.0, seed=3, response_format={
                                         "type": "json_schema", "json_schema": {"name": "x", "schema": schema,
                                                                                "strict": True}})
    assert chat.choices[0].message.content == r.output_text
    r = c.responses.create(model=MODEL_ID, input="JSON.", text={"format": {"type": "json_object"}},
                           max_output_tokens=40, temperature=1.0, extra_body={"seed": 4})
    chat = c.chat.completions.create(model=MODEL_ID, messages=[{"role": "user", "content": "JSON."}], max_tokens=40,
                                     temperature=1.0, seed=4, response_format={"type": "json_object"})
    assert r.output_text == chat.choices[0].message.content and r.output_text.startswith("{")
    assert r.status == ("incomplete" if chat.choices[0].finish_reason == "length" else "completed")
    if r.status == "completed":  # (random weights may write a string longer than the budget)
        assert isinstance(json.loads(r.output_text), dict)


def test_store_retrieve_delete(live_real, refs):
    c = live_real.client()
    r = c.responses.create(model=MODEL_ID, input=PROMPTS[0], max_output_tokens=12, temperature=0,
                           metadata={"k": "v"})
    got = c.responses.retrieve(r.id)
    assert got.model_dump() == r.model_dump() and got.metadata == {"k": "v"} and got.store is True
    c.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError) as e:
        c.responses.retrieve(r.id)
    assert r.id in e.value.body["message"]
    with pytest.raises(openai.NotFoundError) as e:
        c.responses.create(model=MODEL_ID, previous_response_id=r.id, input="more")
    assert e.value.body["param"] == "previous_response_id" and e.value.body["code"] == "response_not_found"
    with pytest.raises(openai.NotFoundError):
        c.responses.delete("resp_unknown")
    r = c.responses.create(model=MODEL_ID, input=PROMPTS[0], max_output_tokens=12, temperature=0, store=False)
    assert r.output_text == refs[PROMPTS[0]].content
    with pytest.raises(openai.NotFoundError):
        c.responses.retrieve(r.id)


def test_the_store_evicts_oldest_first():
    from gemmalite.server.responses import ResponseStore

    item = {"type": "message", "role": "user", "content": "x" * 100}
    store = ResponseStore(max_responses=3, max_bytes=10_000)
    for i in range(5):
        store.put({"id": f"r{i}"}, [item])
    assert list(store.entries) == ["r2", "r3", "r4"]
    size = store.entries["r4"].nbytes  # (each entry the same size)
    store = ResponseStore(max_responses=100, max_bytes=3 * size + 1)
    for i in range(5):
        store.put({"id": f"r{i}"}, [item])
    assert list(store.entries) == ["r2", "r3", "r4"] and store.nbytes == 3 * size
    store.put({"id": "big"}, [item] * 10)  # larger than the whole bound: not kept, nothing evicted for it
    assert list(store.entries) == ["r2", "r3", "r4"]
    store.delete("r3")
    assert list(store.entries) == ["r2", "r4"] and store.nbytes == sum(s.nbytes for s in store.entries.values())


@pytest.mark.parametrize("kw, param", [
    ({"frequency_penalty": 0.5}, "frequency_penalty"),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"tools": [{"type": "function", "name": "bad name", "parameters": {}}]}, "tools[0].name"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "allowed_tools", "mode": "auto", "tools": []}}, "tool_choice"),
    ({"text": {"format": {"type": "yaml"}}}, "text.format"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "strict": True, "schema": {
        "type": "array", "uniqueItems": True}}}}, "text.format.schema"),
    ({"tools": [{"type": "function", "name": "f", "strict": True, "parameters": {
        "type": "object", "properties": {"s": {"type": "string", "pattern": "a+"}}}}]}, "tools[0].parameters.properties.s"),
    ({"reasoning": {"effort": "extreme"}}, "reasoning.effort"),
    ({"reasoning": {"summary": "detailed"}}, "reasoning.summary"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"temperature": 5}, "temperature"),
    ({"include": ["message.output_text.logprobs"]}, "include"),
    ({"truncation": "auto"}, "truncation"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "input[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]}, "input[0].content[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "file_id": "f", "detail": "auto"}]}]},
     "input[0].content[0].file_id"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "https://x/y.png", "detail": "auto"}]}]},
     "input[0].content[0]"),
    ({"input": [{"role": "user", "content": "x"}, {"type": "function_call", "call_id": "a", "name": "run",
                                                   "arguments": "{oops"}]}, "input[1].arguments"),
    ({"input": [{"role": "user", "content": "x"}, {"type": "function_call_output", "call_id": "a", "output": "r"}]},
     "input[1]"),
    ({"input": []}, "input"),
    ({"input": "hi", "stream": "yes"}, "stream"),
])
def test_bad_requests_are_400_naming_the_field(live_real, kw, param):
    body = {"model": MODEL_ID, "input": "hi", **kw}
    status, _, out = live_real.raw("POST", "/v1/responses", body)
    assert status == 400 and out["error"]["param"] == param and out["error"]["type"] == "invalid_request_error", out
    known = {"model", "input", "tools", "tool_choice", "text", "reasoning", "max_output_tokens", "temperature",
             "include", "truncation", "stream"}
    with pytest.raises(openai.BadRequestError) as e:
        live_real.client().responses.create(**{k: v for k, v in body.items() if k in known},
                                            extra_body={k: v for k, v in body.items() if k not in known})
    assert e.value.body["param"] == param


def test_errors_leave_the_server_serving(live_real, refs):
    status, _, out = live_real.raw("POST", "/v1/responses", {"model": "other", "input": "hi"})
    assert status == 404 and out["error"]["code"] == "model_not_found"
    status, _, out = live_real.raw("POST", "/v1/responses", b"{not json")
    assert status == 400 and "error" in out
    status, _, out = live_real.raw("GET", "/v1/responses/resp_x?include=reasoning.encrypted_content")
    assert status == 400 and out["error"]["param"] == "include"
    assert live_real.raw("GET", "/health")[2] == {"status": "ok"}
    r = live_real.client().responses.create(model=MODEL_ID, input=PROMPTS[0], max_output_tokens=12, temperature=0)
    assert r.output_text == refs[PROMPTS[0]].content


def test_an_openai_agents_run(live, model):
    """The openai-agents SDK's default model (OpenAIResponsesModel) runs a tool loop on this server, offline."""
    agents = pytest.importorskip("agents")
    from agents.models.openai_responses import OpenAIResponsesModel

    agents.set_tracing_disabled(True)
    seen = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        seen.append(city)
        return "sunny"

    instructions, question = "You are a weather bot.", "Weather in Oslo?"
    tool = {"type": "function", "function": {"name": get_weather.name, "description": get_weather.description,
                                             "parameters": get_weather.params_json_schema}}
    first = [{"role": "system", "content": instructions}, {"role": "user", "content": question}]
    script(model, first, '<|tool_call>call:get_weather{city:<|"|>Oslo<|"|>}<tool_call|><|tool_response>', tools=[tool])
    # what the run sends next: the call and its output, rebuilt here as chat messages
    turn = {"role": "assistant", "content": None, "tool_calls": [{"id": "c", "type": "function", "function": {
        "name": "get_weather", "arguments": json.dumps({"city": "Oslo"})}}]}
    script(model, first + [turn, {"role": "tool", "tool_call_id": "c", "content": "sunny"}], "It is sunny in Oslo.",
           tools=[tool])
    client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{live.port}/v1", api_key=KEY, max_retries=0, timeout=60)
    agent = agents.Agent(name="weather", instructions=instructions, tools=[get_weather],
                         model=OpenAIResponsesModel(model=MODEL_ID, openai_client=client))

    async def runs():  # a run, then the same run on the typed event stream (one event loop: one client)
        result = await agents.Runner.run(agent, question, max_turns=3)
        streamed = agents.Runner.run_streamed(agent, question, max_turns=3)
        kinds = [ev.type async for ev in streamed.stream_events()]
        return result.final_output, streamed.final_output, kinds

    final, final_streamed, kinds = asyncio.run(runs())
    assert final == final_streamed == "It is sunny in Oslo." and seen == ["Oslo", "Oslo"]
    assert "raw_response_event" in kinds


def _wav() -> bytes:
    import io
    import wave

    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(16000)
        w.writeframes(b"\0\0" * 160)
    return buf.getvalue()


def test_pictures_and_clips_read_as_the_chat_path_reads_them(live_real):
    """input_image / input_audio parts become the chat path's image_url / input_audio parts (its own
    reading, which the vision and audio server tests hold to the model); a model without the tower
    refuses them as chat does."""
    import base64

    from gemmalite.server.protocol import Limits, chat_messages
    from gemmalite.server.responses_input import conversation_messages, input_items

    url = "data:image/png;base64," + base64.b64encode(b"\x89PNG\r\n\x1a\nnot really").decode()
    clip = {"data": base64.b64encode(_wav()).decode(), "format": "wav"}
    items = input_items([{"role": "user", "content": [{"type": "input_text", "text": "What is this?"},
                                                      {"type": "input_image", "image_url": url, "detail": "auto"},
                                                      {"type": "input_audio", "input_audio": clip}]}])
    msgs, _ = conversation_messages([(f"input[{i}]", x) for i, x in enumerate(items)], "Be brief.")
    chat = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "What is this?"},
                                         {"type": "image_url", "image_url": {"url": url}},
                                         {"type": "input_audio", "input_audio": clip}]}]
    assert chat_messages({"messages": msgs}, Limits()) == chat_messages({"messages": chat}, Limits())
    status, _, out = live_real.raw("POST", "/v1/responses", {"model": MODEL_ID, "input": items})
    assert status == 400 and out["error"]["code"] == "images_not_supported" and out["error"]["param"] == "input", out


def test_a_dropped_stream_frees_its_slot(live_real):

    before = live_real.metric("gemmalite_finished_total", '{reason="cancelled"}')
    live_real.drop_stream("/v1/responses", {"model": MODEL_ID, "input": "Once", "max_output_tokens": 450,
                                            "temperature": 1.0, "seed": 1, "stream": True},
                          b"response.output_text.delta", 3)
    live_real.wait_cancelled(before)


def test_a_follow_up_is_the_chat_conversation(live_real):
    """previous_response_id rebuilds the conversation (instructions given again, as OpenAI's are not
    carried over): the reply is chat completions' for the whole history."""
    c = live_real.client()
    first = c.responses.create(model=MODEL_ID, input=PROMPTS[0], instructions=SYSTEM, max_output_tokens=12,
                               temperature=0)
    follow = c.responses.create(model=MODEL_ID, previous_response_id=first.id, input="And then?", instructions=SYSTEM,
                                max_output_tokens=12, temperature=0)
    history = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": PROMPTS[0]},
               {"role": "assistant", "content": first.output_text}, {"role": "user", "content": "And then?"}]
    chat = c.chat.completions.create(model=MODEL_ID, messages=history, max_tokens=12, temperature=0)
    assert follow.output_text == chat.choices[0].message.content
    assert follow.usage.input_tokens == chat.usage.prompt_tokens
    bare = c.responses.create(model=MODEL_ID, previous_response_id=first.id, input="And then?", max_output_tokens=12,
                              temperature=0)
    chat = c.chat.completions.create(model=MODEL_ID, messages=history[1:], max_tokens=12, temperature=0)
    assert bare.output_text == chat.choices[0].message.content and bare.usage.input_tokens == chat.usage.prompt_tokens
