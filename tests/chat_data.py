"""The real Gemma 4 tokenizer and both revisions of its chat template, for the chat-format tests
(imported by them: a conftest.py of their own would shadow tests/conftest.py's helpers)."""
from __future__ import annotations

import copy
import re
from pathlib import Path

import pytest

CURRENT_TEMPLATE = Path(__file__).resolve().parent / "data" / "gemma4-it-chat-template.jinja"

#: argument objects the template renders into Gemma's call syntax: strings holding the syntax's
#: own characters, newlines and unicode, numbers, literals, nesting, empty containers
ARGUMENTS = [
    {"location": "Paris, France", "unit": "celsius"},
    {"code": 'def f(x):\n    return {"a": [x, 1]}  # {, } "quotes"\n', "path": "C:\\dir\\file.txt"},
    {"text": "日本語 ü ñ — emoji 😀 \t tab", "empty": ""},
    {"n": 2, "neg": -17, "x": 3.25, "big": 12345678901234, "flag": True, "off": False, "none": None},
    {"list": [1, "two", [3, [4]], {"k": "v"}, True, None], "obj": {"inner": {"deep": [{"a": "<b>"}]}}},
    {"empty_list": [], "empty_obj": {}, "s": "a,b:c{d}[e]"},
    {},
]


@pytest.fixture(scope="session")
def tok():
    """The real Gemma 4 tokenizer (the vocabulary bundled with gemmalite), with the GGUF's template."""
    import gemmalite
    from gemmalite.formats.gguf_tokenizer import gemma4_tokenizer_gguf_path

    return gemmalite.load_tokenizer(gemma4_tokenizer_gguf_path())


@pytest.fixture(scope="session")
def current_tok(tok):
    """The same vocabulary with the current template revision (tests/data)."""
    t = copy.copy(tok)
    t.chat_template = CURRENT_TEMPLATE.read_text()
    t._template = None
    return t


def gemma_text(tok, args: dict) -> str:
    """The template's rendering of a call with ``args``: the text between ``call:f`` and ``<tool_call|>``."""
    text = tok.apply_chat_template([{"role": "user", "content": "hi"},
                                    {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": args}}]}],
                                   add_generation_prompt=False)
    return re.search(r"<\|tool_call>call:f(.*?)<tool_call\|>", text, re.S).group(1)
