"""Gemma 4's chat format for agents: conversations with tool calls, tool results and thoughts in
(`history`), a reply's content, thought and tool calls out (`parser`), by token id, and the
grammars that constrain a reply to the declared tools (`tool_grammar`)."""
from .history import chat_ids, check_tool_choice, check_tools, prepare, template_kind
from .parser import (ChatReply, ChatTokens, Content, Event, OutputParser, Reasoning, ToolCall, ToolCallArgs,
                     ToolCallEnd, ToolCallStart, TurnEnd)

__all__ = ["ChatReply", "ChatTokens", "Content", "Event", "OutputParser", "Reasoning", "ToolCall", "ToolCallArgs",
           "ToolCallEnd", "ToolCallStart", "TurnEnd", "chat_ids", "check_tool_choice", "check_tools", "prepare",
           "template_kind"]
