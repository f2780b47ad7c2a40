"""The prefix cache across the turns of tool-calling conversations through the Responses API
(with ``previous_response_id``, and with the full input sent back) and Anthropic's Messages
API, each driven by its official SDK against a live server on the tiny random Gemma 4 (sliding
window 16), two conversations interleaved (one thinking) within the cache's byte budget. Each
turn after the first is served from its conversation's cached state at least up to where the
re-rendered history leaves the previous prompt; each reply is a fresh `Model.session().chat`'s,
computed before serving (tests/tool_loop.py's conversation, as tests/server/test_server_cache.py)."""
from __future__ import annotations

import json

import anthropic
import pytest
from live_server import KEY, LiveServer
from tool_loop import CONVERSATIONS, TOOLS, TURNS, fresh_turns, options

from gemmalite.runtime.generate import common_prefix

MODEL_ID = "tiny-gemma"
RESPONSES_TOOLS = [{"type": "function", **t["function"]} for t in TOOLS]
ANTHROPIC_TOOLS = [{"name": t["function"]["name"], "description": t["function"]["description"],
                    "input_schema": t["function"]["parameters"]} for t in TOOLS]


@pytest.fixture(scope="module")
def model(tmp_path_factory, gl):
    from gemmalite.tools.synth import synth

    return gl.load(synth("tiny", tmp_path_factory.mktemp("tiny"), progress=False), context=512)


@pytest.fixture(scope="module")
def oracle(model):
    """Each conversation's turns: (messages, prompt ids, the fresh session's reply)."""
    return fresh_turns(model)


@pytest.fixture
def live(model, oracle):
    """A server per test: each API's conversations start on an empty prefix cache."""
    from gemmalite.server import build_app

    state = model.new_state()
    s = LiveServer(build_app(model, model_id=MODEL_ID, api_key=KEY, max_concurrency=2,
                             prefix_cache=2 * (state.nbytes + state.checkpoint_budget)))
    yield s
    s.stop()


def after_reply(oracle, name: str, turn: int) -> tuple[list[dict], list[dict]]:
    """What the next turn adds to the conversation after the reply: (the calls a test gives a reply
    that only thought, the messages after the assistant turn: tool results or a user message)."""
    messages, _, reply = oracle[name][turn]
    following = oracle[name][turn + 1][0]
    injected = following[len(messages)].get("tool_calls", []) if not reply.tool_calls else []
    return injected, following[len(messages) + 1:]


def check_turn(live, api: str, name: str, turn: int, oracle, got: tuple, prompt_tokens: int, cached: int) -> None:
    """The reply (text, reasoning, [(name, arguments)], output tokens) is the oracle's; the prompt
    is the oracle's, served from cache at least up to its common prefix with the previous one; the
    cache holds no more than its budget."""
    _, ids, want = oracle[name][turn]
    assert got == (want.content or "", want.reasoning or "", [(c.name, json.loads(c.arguments)) for c in want.tool_calls],
                   want.stats.new_tokens), (api, name, turn)
    assert prompt_tokens == len(ids), (api, name, turn)
    if turn:
        common = common_prefix(oracle[name][turn - 1][1], ids)
        print(f"{api}: {name} turn {turn}: {cached} cached of {prompt_tokens} (common prefix {common})")
        assert cached >= common > 0, (api, name, turn, cached, common)
    assert 0 < live.metric("gemmalite_prefix_cache_bytes") <= live.srv.scheduler.cache.budget


# -- the Responses API ---------------------------------------------------------------------------
def responses_items(messages: list[dict], ids: dict[str, str]) -> list[dict]:
    """Chat messages as Responses input items (call ids renamed by ``ids``: the oracle's to the server's)."""
    out: list[dict] = []
    for m in messages:
        if m["role"] == "tool":
            out.append({"type": "function_call_output", "call_id": ids.get(m["tool_call_id"], m["tool_call_id"]),
                        "output": m["content"]})
        elif m["role"] == "assistant":  # (only the calls a test gives a reply that only thought)
            out += [{"type": "function_call", "call_id": c["id"], "name": c["function"]["name"],
                     "arguments": c["function"]["arguments"]} for c in m.get("tool_calls", [])]
        else:
            out.append({"type": "message", "role": m["role"], "content": m["content"]})
    return out


def response_parts(r) -> tuple:
    text = "".join(c.text for i in r.output if i.type == "message" for c in i.content)
    thought = "".join(c.text for i in r.output if i.type == "reasoning" for c in i.content or [])
    calls = [(i.name, json.loads(i.arguments)) for i in r.output if i.type == "function_call"]
    return text, thought, calls, r.usage.output_tokens


@pytest.mark.parametrize("mode", ["previous_response_id", "full input"])
def test_responses_tool_loop_hits_the_cache(live, oracle, mode):
    client = live.client()
    state = {name: {"previous": None, "input": responses_items(msgs, {})} for name, (msgs, _) in CONVERSATIONS.items()}
    for turn in range(TURNS):
        for name, (_, thinking) in CONVERSATIONS.items():
            s, o = state[name], options(turn, thinking)
            r = client.responses.create(
                model=MODEL_ID, input=s["input"], previous_response_id=s["previous"], tools=RESPONSES_TOOLS,
                tool_choice=o["tool_choice"], max_output_tokens=o["max_new_tokens"], temperature=o["temperature"],
                reasoning={"effort": "high" if thinking else "none"})
            check_turn(live, f"responses ({mode})", name, turn, oracle, response_parts(r), r.usage.input_tokens,
                       r.usage.input_tokens_details.cached_tokens)
            if turn + 1 == TURNS:
                continue
            injected, following = after_reply(oracle, name, turn)
            ids = {c.id: i.call_id for c, i in zip(oracle[name][turn][2].tool_calls,
                                                   [i for i in r.output if i.type == "function_call"])}
            new = responses_items([{"role": "assistant", "tool_calls": injected}] + following, ids)
            if mode == "previous_response_id":
                s["previous"], s["input"] = r.id, new
            else:
                s["input"] = s["input"] + [i.model_dump(exclude_none=True) for i in r.output] + new


# -- Anthropic's Messages API --------------------------------------------------------------------
def anthropic_turns(messages: list[dict], ids: dict[str, str]) -> list[dict]:
    """Chat messages after the assistant turn as Anthropic messages: tool results in one user turn."""
    out: list[dict] = []
    for m in messages:
        if m["role"] == "tool":
            block = {"type": "tool_result", "tool_use_id": ids.get(m["tool_call_id"], m["tool_call_id"]),
                     "content": m["content"]}
            if out and out[-1]["role"] == "user" and isinstance(out[-1]["content"], list):
                out[-1]["content"].append(block)
            else:
                out.append({"role": "user", "content": [block]})
        else:
            out.append({"role": m["role"], "content": m["content"]})
    return out


def test_anthropic_tool_loop_hits_the_cache(live, oracle):
    client = anthropic.Anthropic(base_url=f"http://127.0.0.1:{live.port}", api_key=KEY, max_retries=0, timeout=60)
    state = {name: (msgs[0]["content"], anthropic_turns(msgs[1:], {})) for name, (msgs, _) in CONVERSATIONS.items()}
    for turn in range(TURNS):
        for name, (_, thinking) in CONVERSATIONS.items():
            o = options(turn, thinking)
            system, messages = state[name]
            msg = client.messages.create(
                model=MODEL_ID, system=system, messages=messages, tools=ANTHROPIC_TOOLS,
                tool_choice={"type": "any" if o["tool_choice"] == "required" else "auto"},
                max_tokens=o["max_new_tokens"], extra_body={"temperature": o["temperature"]},
                thinking={"type": "adaptive" if thinking else "disabled"})
            text = "".join(b.text for b in msg.content if b.type == "text")
            thought = "".join(b.thinking for b in msg.content if b.type == "thinking")
            calls = [(b.name, b.input) for b in msg.content if b.type == "tool_use"]
            u = msg.usage
            check_turn(live, "anthropic", name, turn, oracle, (text, thought, calls, u.output_tokens),
                       u.input_tokens + u.cache_read_input_tokens, u.cache_read_input_tokens)
            if turn + 1 == TURNS:
                continue
            injected, following = after_reply(oracle, name, turn)
            blocks = [b.model_dump(exclude_none=True) for b in msg.content]
            blocks += [{"type": "tool_use", "id": c["id"], "name": c["function"]["name"],
                        "input": json.loads(c["function"]["arguments"])} for c in injected]
            ids = {c.id: b.id for c, b in zip(oracle[name][turn][2].tool_calls,
                                              [b for b in msg.content if b.type == "tool_use"])}
            state[name] = (system, messages + [{"role": "assistant", "content": blocks}] + anthropic_turns(following, ids))

