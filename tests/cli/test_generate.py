"""`gemmalite chat` / `run` write a reply's thought apart from its answer."""
from __future__ import annotations

from gemmalite.chat import Content, Reasoning, ToolCallArgs, ToolCallStart, TurnEnd
from gemmalite.cli.generate import stream_reply


def test_thoughts_go_to_stderr_the_answer_to_stdout(capsys):
    events = iter([Reasoning("Let me "), Reasoning("think."), Content("The answer"), Content(" is 4."),
                   ToolCallStart(0, "call_1", "f"), ToolCallArgs(0, "{}"), TurnEnd("stop")])
    reply, stopped = stream_reply(events)
    out = capsys.readouterr()
    assert (out.out, out.err) == ("The answer is 4.\n", "[thinking] Let me think.\n")
    assert not stopped and reply.content == "The answer is 4." and reply.reasoning == "Let me think."
    assert reply.tool_calls[0].arguments == "{}" and reply.finish_reason == "stop"


def test_think_budget_turns_thinking_on():
    import argparse

    from gemmalite.cli.generate import _think_kwargs, add_parsers

    parser = argparse.ArgumentParser()
    add_parsers(parser.add_subparsers())
    for cmd in (["chat", "M"], ["run", "M", "hi"]):
        assert _think_kwargs(parser.parse_args(cmd + ["--think-budget", "64"])) == {"thinking": True, "thinking_budget": 64}
        assert _think_kwargs(parser.parse_args(cmd + ["--think"])) == {"thinking": True, "thinking_budget": None}
        assert _think_kwargs(parser.parse_args(cmd)) == {"thinking": False, "thinking_budget": None}
