"""Reasoning effort as a thinking budget (`chat_format.REASONING_EFFORTS`): the Responses API's
``reasoning.effort`` and chat completions' ``reasoning_effort``, through the official `openai`
client against a live server on the scripted engine (tests/scripted_engine.py) over the tiny
checkpoint's real tokenizer and template. Oracles: the script (the tokens a cut thought keeps)
and `Model.chat(thinking_budget=...)` / `Model.chat(thinking=True)` solo runs."""
from __future__ import annotations

import pytest
from live_server import KEY, LiveServer
from scripted_engine import scripted_model

from gemmalite.chat import chat_ids
from gemmalite.server.chat_format import REASONING_EFFORTS

MODEL_ID = "tiny-gemma"
USER = [{"role": "user", "content": "What is the answer?"}]
LOW = REASONING_EFFORTS["low"][1]
ANSWER = "The answer is 42."
# a thought longer than the low budget, shorter than the medium one
LONG_THOUGHT = "<|channel>thought\n" + "one two three four, " * 60 + "done.<channel|>"


@pytest.fixture(scope="module")
def model(tmp_path_factory, gl):
    from gemmalite.tools.synth import synth

    return scripted_model(gl.load(synth("tiny", tmp_path_factory.mktemp("tiny"), progress=False), context=512))


@pytest.fixture(scope="module")
def live(model):
    from gemmalite.server import build_app

    s = LiveServer(build_app(model, model_id=MODEL_ID, api_key=KEY, max_concurrency=2))
    yield s
    s.stop()


def script(model, reply: str, thinking: bool, after: list[int] = ()) -> list[int]:
    tok = model.tokenizer
    ids = tok.encode(reply, add_special_tokens=False)
    model.engine.script(chat_ids(tok, USER, thinking=thinking) + list(after), ids)
    return ids


def solo(model, **kw):
    model.reset_chat()
    r = model.chat(USER, max_new_tokens=400, temperature=0, structured=True, **kw)
    return r.reasoning, r.content, r.stats.new_tokens


def respond(client, effort: str | None):
    """(text, reasoning, usage) of the response, non-streamed and streamed (which must agree)."""
    kw = dict(model=MODEL_ID, input=USER[0]["content"], max_output_tokens=400, temperature=0,
              **({"reasoning": {"effort": effort}} if effort else {}))
    with client.responses.stream(**kw) as stream:
        final = stream.get_final_response()
    out = []
    for r in (client.responses.create(**kw), final):
        text = "".join(c.text for i in r.output if i.type == "message" for c in i.content)
        thought = "".join(c.text for i in r.output if i.type == "reasoning" for c in i.content)
        out.append((text, thought, r.usage.output_tokens, r.usage.output_tokens_details.reasoning_tokens))
    assert out[0] == out[1]
    return out[0]


def test_effort_low_cuts_the_thought_at_its_budget(live, model):
    tok = model.tokenizer
    ids = script(model, LONG_THOUGHT + ANSWER, thinking=True)
    n = ids.index(tok.token_id("<channel|>")) - 1  # the thought's tokens (its name, thought\n, included)
    assert n > LOW
    head = ids[: 1 + LOW] + [tok.token_id("<channel|>")]  # <|channel>, LOW thought tokens, the forced end
    after = script(model, ANSWER, thinking=True, after=head)
    thought = tok.decode(ids[3: 1 + LOW])  # (the text after thought\n: its 2 tokens)
    want = solo(model, thinking_budget=LOW)
    assert want == (thought, ANSWER, len(head + after))
    c = live.client()
    text, reasoning, out_tokens, reasoning_tokens = respond(c, "low")
    assert (reasoning, text, out_tokens) == want
    assert reasoning_tokens == LOW + 2  # <|channel>, the budget's tokens, <channel|>
    chat = c.chat.completions.create(model=MODEL_ID, messages=USER, max_tokens=400, temperature=0, reasoning_effort="low")
    msg = chat.choices[0].message
    assert (msg.reasoning_content, msg.content, chat.usage.completion_tokens) == want
    for markup in ("<|channel>", "<channel|>", "thought\n"):
        assert markup not in text and markup not in msg.content


def test_a_thought_within_the_budget_is_the_unbudgeted_reply(live, model):
    ids = script(model, LONG_THOUGHT + ANSWER, thinking=True)
    assert ids.index(model.tokenizer.token_id("<channel|>")) - 1 <= REASONING_EFFORTS["medium"][1]
    want = solo(model, thinking=True)
    assert want[:2] == (model.tokenizer.decode(ids[3: ids.index(model.tokenizer.token_id("<channel|>"))]), ANSWER)
    c = live.client()
    for effort in ("medium", "high", "xhigh", "max"):
        text, reasoning, out_tokens, _ = respond(c, effort)
        assert (reasoning, text, out_tokens) == want, effort
        chat = c.chat.completions.create(model=MODEL_ID, messages=USER, max_tokens=400, temperature=0,
                                         reasoning_effort=effort)
        msg = chat.choices[0].message
        assert (msg.reasoning_content, msg.content, chat.usage.completion_tokens) == want, effort


def test_efforts_none_and_minimal_do_not_think(live, model):
    script(model, LONG_THOUGHT + ANSWER, thinking=True)
    script(model, ANSWER, thinking=False)
    want = solo(model)
    assert not want[0] and want[1] == ANSWER
    c = live.client()
    for effort in (None, "none", "minimal"):
        text, reasoning, out_tokens, reasoning_tokens = respond(c, effort)
        assert (text, reasoning, out_tokens, reasoning_tokens) == (ANSWER, "", want[2], 0), effort
