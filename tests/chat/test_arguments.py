"""Gemma's call-argument syntax -> JSON. The oracle: the real chat template writes each argument
object in Gemma's syntax (its ``format_argument`` macro); the transcoded text must parse back to
the same object, whatever pieces the text arrives in."""
from __future__ import annotations

import json
import re

import pytest
from chat_data import ARGUMENTS, gemma_text, tok  # noqa: F401 (tok: a fixture)

from gemmalite.chat.arguments import ArgumentsTranscoder

DELIM = '<|"|>'


def items(text: str, cuts: tuple[int, ...] = ()) -> list[str | None]:
    """``text`` as the parser feeds it: text pieces and ``None`` for each ``<|"|>`` token, with the
    text pieces cut again at the positions ``cuts`` (offsets into ``text``)."""
    out: list[str | None] = []
    pos = 0
    for j, part in enumerate(text.split(DELIM)):
        if j:
            out.append(None)
            pos += len(DELIM)
        edges = [0, *sorted(c - pos for c in cuts if pos < c < pos + len(part)), len(part)]
        out += [part[a:b] for a, b in zip(edges, edges[1:]) if b > a]
        pos += len(part)
    return out


def transcode(seq: list[str | None]) -> tuple[list[str], ArgumentsTranscoder]:
    t = ArgumentsTranscoder()
    return [t.delimiter() if x is None else t.text(x) for x in seq], t


@pytest.mark.parametrize("args", ARGUMENTS)
def test_every_split_point_gives_the_arguments(tok, args):
    text = gemma_text(tok, args)
    whole, t = transcode(items(text))
    assert t.done and not t.error
    final = "".join(whole)
    assert json.loads(final) == args
    for cut in range(len(text) + 1):
        pieces, t = transcode(items(text, (cut,)))
        assert "".join(pieces) == final, cut
        assert t.done
    if len(text) < 90:  # and every pair of cuts
        for a in range(len(text)):
            for b in range(a + 1, len(text)):
                assert "".join(transcode(items(text, (a, b)))[0]) == final


def test_each_piece_is_a_prefix_of_the_json(tok):
    text = gemma_text(tok, ARGUMENTS[4])
    pieces, _ = transcode(items(text, tuple(range(len(text)))))
    final = "".join(pieces)
    joined = ""
    for p in pieces:
        joined += p
        assert final.startswith(joined)


@pytest.mark.parametrize("text, want", [
    ("{ a : 1 , b:[ 1 , 2 ] }", {"a": 1, "b": [1, 2]}),  # whitespace between items
    ("{a:1,}", {"a": 1}),  # a trailing comma is dropped
    ("{a:[1,],b:{c:2,}}", {"a": [1], "b": {"c": 2}}),
    ('{<|"|>quoted key<|"|>:1}', {"quoted key": 1}),  # keys delimited as the template writes nested declarations
    ("{x:None,y:null,e:1e-07,f:-0.5}", {"x": None, "y": None, "e": 1e-07, "f": -0.5}),
])
def test_tolerated_forms(text, want):
    pieces, t = transcode(items(text))
    assert t.done and json.loads("".join(pieces)) == want


@pytest.mark.parametrize("text, rest", [
    ("{a:01}", "01}"),  # not a JSON number
    ("{a:True}", "True}"),
    ("{a:1 b:2}", "b:2}"),
    ("{a:}", "}"),
    ("{a:1}}", "}"),  # after the object: nothing but whitespace
    ("x{a:1}", "x{a:1}"),
    ("{a:[1}", "}"),
])
def test_malformed_stops_without_raising(text, rest):
    pieces, t = transcode(items(text))
    assert t.error and t.rest == rest
    assert not any(p is None for p in pieces)


def test_cut_arguments_are_a_prefix_never_complete(tok):
    text = gemma_text(tok, ARGUMENTS[1])
    final = "".join(transcode(items(text))[0])
    inside = {m.start() + k for m in re.finditer(re.escape(DELIM), text) for k in range(1, len(DELIM))}
    for n in range(len(text)):
        if n in inside:  # (the delimiter is one token: never cut)
            continue
        pieces, t = transcode(items(text[:n]))
        assert final.startswith("".join(pieces)) and not t.done and not t.error
