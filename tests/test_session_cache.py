"""A conversation's KV cache across turns (`ChatSession`): the tiny random Gemma 4 (sliding window
16, far shorter than a turn) with the real tokenizer and both revisions of the chat template
(the GGUF's, tests/data's), four-turn tool loops with and without thinking. Each turn after the
first is served from the previous turn's state at least up to where the re-rendered history
leaves the previous prompt, and every reply is a fresh session's, token for token."""
from __future__ import annotations

import copy

import pytest
from chat_data import CURRENT_TEMPLATE
from tool_loop import START, TOOLS, TURNS, next_messages, options

from gemmalite.chat import chat_ids, check_tools
from gemmalite.runtime.checkpoints import marker_ids, split_points
from gemmalite.runtime.generate import common_prefix


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, gl):
    from gemmalite.tools.synth import synth

    return gl.load(synth("tiny", tmp_path_factory.mktemp("tiny"), progress=False), context=512)


def templated(model, template: str):
    """``model`` with the GGUF's chat template (its own) or the current revision (tests/data)."""
    if template == "gguf":
        return model
    m, tok = copy.copy(model), copy.copy(model.tokenizer)
    tok.chat_template, tok._template = CURRENT_TEMPLATE.read_text(), None
    m._tokenizer = tok
    return m


def reply_tokens(reply) -> tuple:
    return (reply.content, reply.reasoning, [(c.name, c.arguments) for c in reply.tool_calls], reply.finish_reason,
            reply.stats.new_tokens)


@pytest.mark.parametrize("template", ["gguf", "current"])
@pytest.mark.parametrize("thinking", [False, True])
def test_tool_loop_turns_are_served_from_the_cache(tiny, template, thinking):
    m = templated(tiny, template)
    session = m.session()
    messages, prev, calls = list(START), None, 0
    for turn in range(TURNS):
        ids = chat_ids(m.tokenizer, messages, tools=check_tools(TOOLS), thinking=thinking)
        want = m.session().chat(messages, **options(turn, thinking))  # a fresh session: the oracle
        got = session.chat(messages, **options(turn, thinking))
        assert reply_tokens(got) == reply_tokens(want)
        assert got.stats.prompt_tokens == len(ids)
        if prev is not None:  # all of the previous prompt that the new one keeps
            assert got.stats.cached_tokens >= common_prefix(prev, ids) > 0
        state = session.state
        assert state.checkpoints and state.checkpoint_nbytes <= state.checkpoint_budget
        calls += bool(got.tool_calls)
        prev, messages = ids, next_messages(messages, got, turn)
    assert calls or thinking  # the loop went through the model's own calls


def test_a_checkpoint_lies_at_or_before_where_the_history_leaves_the_prompt(tiny):
    """On the real template, for generated replies of each kind (text, a call, with a thought):
    the common prefix of the state's tokens (prompt and reply) with the next prompt ends at a split
    point of the prompt, or past the prompt's end (a checkpoint too)."""
    tok = templated(tiny, "current").tokenizer
    markers = marker_ids(tok)
    for thinking in (False, True):
        thought = "<|channel>thought\nhmm\n<channel|>" if thinking else ""
        reasoning = "hmm" if thinking else None  # (the second turn's thought, "ok", is another)
        tools = check_tools(TOOLS)
        first = chat_ids(tok, START, tools=tools, thinking=thinking)
        call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
        history = START + [{"role": "assistant", "content": "", "tool_calls": [call], "reasoning_content": reasoning},
                           {"role": "tool", "tool_call_id": "c1", "content": '{"temp": 18}'}]
        second = chat_ids(tok, history, tools=tools, thinking=thinking)
        answer = {"role": "assistant", "content": "It is 18.", "reasoning_content": reasoning and "ok"}
        third = chat_ids(tok, history + [answer, {"role": "user", "content": "And Rome?"}], tools=tools,
                         thinking=thinking)
        generated = [(first, thought + '<|tool_call>call:get_weather{city:<|"|>Paris<|"|>}<tool_call|>', second),
                     (second, thought.replace("hmm", "ok") + "It is 18.", third)]
        for prompt, reply, following in generated:
            state = prompt + tok.encode(reply, add_special_tokens=False)
            shared = common_prefix(state, following)
            points = split_points(prompt, markers)
            assert shared in points or shared >= len(prompt), (thinking, tok.decode(state[:shared][-12:]))
