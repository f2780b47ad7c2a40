"""A tool-calling conversation for the KV-cache tests (tests/test_session_cache.py and the
server's): a tool with an enumerated argument (a random model's forced call ends quickly),
each turn's options, and the history a reply leads to."""
from __future__ import annotations

import json

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather now.", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}}, "required": ["city"]}}}]
START = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"}]
TURNS = 4


def options(turn: int, thinking: bool) -> dict:
    return dict(tools=TOOLS, tool_choice="required" if turn % 2 == 0 else "auto", thinking=thinking,
                max_new_tokens=16, temperature=0)


def next_messages(messages: list[dict], reply, turn: int) -> list[dict]:
    """The history for the next turn: the reply, then the tools' results when it called any (a
    thinking reply that only thought is given a call on even turns, so both modes loop through
    tools), else a new user message."""
    msg = reply.message()
    if not reply.tool_calls and turn % 2 == 0:
        msg["tool_calls"] = [{"id": f"c{turn}", "type": "function",
                              "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]
    out = messages + [msg]
    if msg.get("tool_calls"):
        return out + [{"role": "tool", "tool_call_id": c["id"], "content": json.dumps({"temp": 18 + turn})}
                      for c in msg["tool_calls"]]
    return out + [{"role": "user", "content": f"And on day {turn}?"}]


CONVERSATIONS = {  # name: (first messages, thinking): the server tests interleave these two
    "plain": (START, False),
    "thinking": ([{"role": "system", "content": "Answer in French."}, {"role": "user", "content": "Weather in Rome?"}],
                 True),
}


def fresh_turns(model) -> dict[str, list[tuple[list[dict], list[int], object]]]:
    """Each of CONVERSATIONS' turns: (messages, prompt ids, a fresh session's reply): the oracle."""
    from gemmalite.chat import chat_ids, check_tools

    out = {}
    for name, (messages, thinking) in CONVERSATIONS.items():
        turns = []
        for turn in range(TURNS):
            ids = chat_ids(model.tokenizer, messages, tools=check_tools(TOOLS), thinking=thinking)
            turns.append((messages, ids, model.session().chat(messages, **options(turn, thinking))))
            messages = next_messages(messages, turns[-1][2], turn)
        out[name] = turns
    return out
