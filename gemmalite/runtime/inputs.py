"""Checks of what an API call is given, made at the call before any work. A value of the wrong
type or outside its range is an `InputError` naming the argument: nothing is silently coerced
(a float token id, ``stop=b"x"``, ``top_k=1.9`` and a NaN penalty are refused, not rounded)."""
from __future__ import annotations

import math
from typing import Any, Iterable

import numpy as np

from ..errors import InputError


def _is_int(v: Any) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))


def _show(v: Any) -> str:
    return f"{type(v).__name__} {v!r:.40}"


def integer(v: Any, name: str, lo: int | None = None, hi: int | None = None) -> int:
    """``v`` as an int (numpy integers welcome) in ``[lo, hi]``."""
    if not _is_int(v):
        raise InputError(f"{name} must be an integer, got {_show(v)}")
    v = int(v)
    if lo is not None and v < lo or hi is not None and v > hi:
        bounds = f">= {lo}" if hi is None else f"between {lo} and {hi}"
        raise InputError(f"{name} must be {bounds}, got {v}")
    return v


def number(v: Any, name: str, lo: float, hi: float = math.inf, *, open_low: bool = False) -> float:
    """``v`` as a finite float in ``[lo, hi]`` (``(lo, hi]`` with ``open_low``)."""
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, float, np.integer, np.floating)):
        raise InputError(f"{name} must be a number, got {_show(v)}")
    v = float(v)
    if not math.isfinite(v) or (v <= lo if open_low else v < lo) or v > hi:
        rng = f"{'(' if open_low else '['}{lo}, {hi}{']' if math.isfinite(hi) else ')'}"
        raise InputError(f"{name} must be a finite number in {rng}, got {v}")
    return v


def flag(v: Any, name: str) -> bool:
    if not isinstance(v, (bool, np.bool_)):
        raise InputError(f"{name} must be True or False, got {_show(v)}")
    return bool(v)


def text(v: Any, name: str, *, empty: bool = True) -> str:
    """A ``str`` that encodes to UTF-8 (a lone surrogate, e.g. from a bad decode, does not)."""
    if not isinstance(v, str):
        raise InputError(f"{name} must be a str, got {_show(v)}")
    if not empty and not v:
        raise InputError(f"{name} must not be empty")
    try:
        v.encode("utf-8")
    except UnicodeEncodeError as e:
        raise InputError(f"{name} contains a lone surrogate {v[e.start]!r} at position {e.start}, which is not "
                         "text (decode bytes with errors='replace' or fix the source)") from None
    return v


def token_ids(ids: Any, vocab_size: int, name: str = "ids") -> np.ndarray:
    """Token ids as a non-empty int64 array, each an integer in ``[0, vocab_size)``."""
    if isinstance(ids, (str, bytes, bytearray, dict)) or not isinstance(ids, (Iterable, np.ndarray)):
        raise InputError(f"{name} must be a list of token ids (integers), got {_show(ids)}")
    if isinstance(ids, np.ndarray):
        if ids.ndim != 1 or ids.dtype.kind not in "iu":
            raise InputError(f"{name} must be a 1-D array of integers, got {ids.ndim}-D {ids.dtype}")
        if ids.dtype.kind == "u" and ids.size and int(ids.max()) >= vocab_size:  # before a wrap-around cast
            raise InputError(f"token id {int(ids.max())} is outside the vocabulary [0, {vocab_size})")
        arr = ids.astype(np.int64)
    else:
        items = list(ids)
        bad = next((x for x in items if not _is_int(x)), None)
        if bad is not None:
            raise InputError(f"{name} must hold integers, got {_show(bad)}")
        try:
            arr = np.array([int(x) for x in items], dtype=np.int64)
        except OverflowError:
            raise InputError(f"{name} holds an integer outside the vocabulary [0, {vocab_size})") from None
    if arr.size == 0:
        raise InputError(f"{name} must not be empty")
    out = arr[(arr < 0) | (arr >= vocab_size)]
    if out.size:
        raise InputError(f"token id {int(out[0])} is outside the vocabulary [0, {vocab_size})")
    return arr


def stop(v: Any, vocab_size: int, *, ids: bool) -> tuple[set[int], list[str]]:
    """``stop``: a string or a list of strings, and (``ids``: for `generate_tokens`) token ids."""
    if v is None:
        return set(), []
    items = [v] if isinstance(v, str) or _is_int(v) else v
    if isinstance(items, (bytes, bytearray, dict)) or not isinstance(items, (list, tuple)):
        raise InputError(f"stop must be a string or a list of strings{' or token ids' if ids else ''}, "
                         f"got {_show(v)}")
    out_ids: set[int] = set()
    strings: list[str] = []
    for s in items:
        if isinstance(s, str):
            strings.append(text(s, "a stop string", empty=False))
        elif ids and _is_int(s):
            out_ids.add(integer(s, "a stop token id", 0, vocab_size - 1))
        else:
            raise InputError(f"stop entries must be {'strings or token ids' if ids else 'strings'}, got {_show(s)}")
    return out_ids, strings


def messages(msgs: Any) -> list[dict[str, Any]]:
    """A chat: a non-empty list of ``{"role": str, "content": str | [content parts]}`` dicts."""
    if not isinstance(msgs, (list, tuple)):
        raise InputError(f"messages must be a list of {{'role': ..., 'content': ...}} dicts, got {_show(msgs)}")
    if not msgs:
        raise InputError("messages is empty: a chat needs at least one message")
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            raise InputError(f"messages[{i}] must be a dict with 'role' and 'content', got {_show(m)}")
        text(m.get("role"), f"messages[{i}]['role']", empty=False)
        c = m.get("content")
        if c is None and m.get("tool_calls"):
            continue
        if isinstance(c, str):
            text(c, f"messages[{i}]['content']")
        elif isinstance(c, list):
            for j, part in enumerate(c):
                where = f"messages[{i}]['content'][{j}]"
                if not isinstance(part, dict) or not isinstance(part.get("type"), str):
                    raise InputError(f"{where} must be a content part {{'type': ..., ...}}, got {_show(part)}")
                if part["type"] == "text":
                    text(part.get("text"), where + "['text']")
        else:
            raise InputError(f"messages[{i}]['content'] must be a str or a list of content parts, got {_show(c)}")
    return list(msgs)
