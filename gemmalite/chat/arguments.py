"""Gemma 4's tool-call argument syntax to JSON, as the tokens arrive.

The chat template writes a call's arguments as ``{key:<|"|>text<|"|>,n:2,flag:true,list:[...],obj:{...}}``:
bare keys, strings between ``<|"|>`` tokens (inside them every character is text: braces, commas,
quotes, newlines), numbers, ``true`` / ``false`` / ``null`` (and ``None``, which the template writes
for a null), arrays and objects. `ArgumentsTranscoder` turns that into compact JSON piece by piece,
so that the pieces it has returned always join into a prefix of the final JSON text: a key is
written once its ``:`` arrives, a literal once it ends, a ``,`` only when the next item starts (a
trailing comma is dropped), string text at once (escaped). Text that does not fit the syntax stops
it (`error`, with the text from the offending character in `rest`); it never raises.
"""
from __future__ import annotations

import json
import re

_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?")
_LITERALS = {"true": "true", "false": "false", "null": "null", "None": "null"}
_LITERAL_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789+-.")
_STRUCTURE = frozenset("{}[]:,")


def escape(text: str) -> str:
    """JSON string escaping of ``text`` (no surrounding quotes; non-ASCII kept as is)."""
    return json.dumps(text, ensure_ascii=False)[1:-1]


class ArgumentsTranscoder:
    """One call's arguments: feed `text` pieces and `delimiter` tokens, get JSON pieces back."""

    def __init__(self) -> None:
        self.stack: list[str] = []  # open containers: "{" or "["
        self.state = "open"  # open | key | keychars | keystring | colon | value | literal | string | after | end
        self.first = False  # just after "{" or "[": the container may close at once
        self.comma = False  # a "," read and not written yet (written with the next item)
        self.buf = ""  # the key or literal being read
        self.error = False
        self.rest = ""  # the text from the character that broke the syntax on (after `error`)

    @property
    def done(self) -> bool:
        """The top-level object is closed: the JSON is complete."""
        return self.state == "end"

    # -- input ---------------------------------------------------------------------------
    def text(self, s: str) -> str:
        if self.error:
            self.rest += s
            return ""
        if self.state == "string":
            return escape(s)
        if self.state == "keystring":
            self.buf += s
            return ""
        out = []
        for i, c in enumerate(s):
            if self.state == "literal" and c not in _LITERAL_CHARS:  # the literal ends here
                lit = _LITERALS.get(self.buf) or (self.buf if _NUMBER.fullmatch(self.buf) else None)
                if lit is None:
                    self.error, self.rest = True, self.buf + s[i:]
                    break
                out.append(self._pending() + lit)
                self.state = "after"
            piece = self._char(c)
            if piece is None:
                self.error, self.rest = True, s[i:]
                break
            out.append(piece)
        return "".join(out)

    def delimiter(self) -> str:
        """A ``<|"|>`` token: a string (value or key) opens or closes."""
        if self.error:
            self.rest += '<|"|>'
            return ""
        if self.state == "string":
            self.state = "after"
            return '"'
        if self.state == "value":
            self.state = "string"
            return self._pending() + '"'
        if self.state == "key":
            self.state, self.buf = "keystring", ""
            return ""
        if self.state == "keystring":
            self.state = "colon"
            return ""
        self.error, self.rest = True, (self.buf if self.state in ("literal", "keychars") else "") + '<|"|>'
        return ""

    # -- the syntax ------------------------------------------------------------------------
    def _pending(self) -> str:
        out = "," if self.comma else ""
        self.comma = self.first = False
        return out

    def _close(self, c: str) -> str | None:
        if not self.stack or self.stack[-1] != ("{" if c == "}" else "["):
            return None
        self.stack.pop()
        self.comma = self.first = False
        self.state = "after" if self.stack else "end"
        return c

    def _key(self) -> str:
        self.state = "value"
        return self._pending() + json.dumps(self.buf, ensure_ascii=False) + ":"

    def _char(self, c: str) -> str | None:
        st = self.state
        if st == "keychars":
            if c == ":":
                return self._key()
            if c.isspace():
                self.state = "colon"
                return ""
            if c in _STRUCTURE:
                return None
            self.buf += c
            return ""
        if st == "literal":  # (its end is handled in `text`)
            self.buf += c
            return ""
        if c.isspace():
            return ""
        if st == "open":
            if c != "{":
                return None
            self.stack.append("{")
            self.state, self.first = "key", True
            return "{"
        if st == "colon":
            return self._key() if c == ":" else None
        if st == "key":
            if c == "}" and (self.first or self.comma):
                return self._close(c)
            if c in _STRUCTURE:
                return None
            self.state, self.buf = "keychars", c
            return ""
        if st == "value":
            if c in "{[":
                out = self._pending() + c
                self.stack.append(c)
                self.state, self.first = ("key" if c == "{" else "value"), True
                return out
            if c == "]" and self.stack and self.stack[-1] == "[" and (self.first or self.comma):
                return self._close(c)
            if c in _LITERAL_CHARS:
                self.state, self.buf = "literal", c
                return ""
            return None
        if st == "after":
            if c == ",":
                self.comma = True
                self.state = "key" if self.stack[-1] == "{" else "value"
                return ""
            if c in "}]":
                return self._close(c)
            return None
        return None  # "end": nothing may follow the object but whitespace
