"""Constrained decoding over llguidance (the grammar engine of vLLM, SGLang and llama.cpp; a
Rust wheel, no torch): a `Grammar` is compiled once against a tokenizer and shared read-only;
each request takes its own `Matcher`, which gives the mask of the tokens allowed next
(`Matcher.masks`, or `fill_masks` for a batch with the GIL released), consumes the sampled
token, checks prompt-lookup drafts (`Matcher.valid_prefix`) and offers the tokens the grammar
forces (`Matcher.forced`), which ride along as drafts of the next step.

Special tokens (the tokenizer's added tokens: ``<|tool_call>``, ``<|"|>``, ``<turn|>``, ...)
are whole tokens to the engine, never text: a grammar names them (``<|tool_call>`` or by id,
``<[48]>``) and free text can never produce one. The request's stop ids are allowed exactly
when the grammar is complete (its end-of-sequence), so a constrained reply ends only when its
grammar is satisfied; a reply cut by ``max_new_tokens`` ends with ``length``.

JSON is compact (no whitespace between tokens): a model cannot wander into endless blanks.
"""
from __future__ import annotations

import json
import threading
import weakref
from typing import Any, Iterable

import numpy as np

from ..errors import InputError
from ..tokenizer import Tokenizer

JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}

_bridges: "weakref.WeakKeyDictionary[Tokenizer, Any]" = weakref.WeakKeyDictionary()
_bridge_lock = threading.Lock()
_executor: Any = None


def _llg():
    import llguidance

    return llguidance


def special_ids(tokenizer: Tokenizer) -> set[int]:
    """The tokenizer's added tokens (whole tokens: control tokens and Gemma's structure tokens)."""
    tk = tokenizer.tk
    if hasattr(tk, "added_ids"):
        return set(tk.added_ids())
    if hasattr(tk, "get_added_tokens_decoder"):  # tokenizers.Tokenizer
        return set(tk.get_added_tokens_decoder())
    return set()


def piece_bytes(tokenizer: Tokenizer, tid: int, specials: set[int]) -> bytes:
    """One token's bytes as llguidance reads them: SentencePiece pieces with ``'▁'`` as a space,
    ``<0xNN>`` byte tokens as their byte, added tokens (``specials``) marked by a leading 0xFF
    (not UTF-8, so no text ever spells one)."""
    piece = tokenizer.tk.id_to_token(tid) or ""
    if tid in specials:
        return b"\xff" + piece.encode("utf-8")
    if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
        return bytes([int(piece[3:5], 16)])
    return piece.replace("\u2581", " ").encode("utf-8")


def token_bytes(tokenizer: Tokenizer) -> list[bytes]:
    """Every token's `piece_bytes`."""
    specials = special_ids(tokenizer)
    return [piece_bytes(tokenizer, i, specials) for i in range(tokenizer.vocab_size)]


class _Vocabulary:
    """What llguidance's `TokenizerWrapper` reads of a tokenizer."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.tokens = token_bytes(tokenizer)
        self.special_token_ids = sorted(special_ids(tokenizer))
        eos = tokenizer.token_id(tokenizer.special_tokens.get("eos_token", "<eos>") or "<eos>")
        self.eos_token_id = 1 if eos is None else eos
        self.bos_token_id = tokenizer.bos_id

    def __call__(self, text: str) -> list[int]:
        if not isinstance(text, str):  # llguidance then hands over text, tokenizing any broken tail itself
            raise TypeError("text only")
        return self.tokenizer.encode(text, add_special_tokens=False)


def ll_tokenizer(tokenizer: Tokenizer):
    """The llguidance tokenizer of ``tokenizer`` (built once per tokenizer, ~1 s for 262k tokens)."""
    with _bridge_lock:
        ll = _bridges.get(tokenizer)
        if ll is None:
            llg = _llg()
            ll = llg.LLTokenizer(llg.TokenizerWrapper(_Vocabulary(tokenizer)))
            _bridges[tokenizer] = ll
        return ll


class Grammar:
    """A compiled grammar: immutable, shared by any number of requests and threads (each takes
    its own `matcher()`). Build one with `json_schema`, `json_object`, `regex` or `lark`; an
    llguidance grammar (JSON text) is taken as is. A grammar the engine cannot compile is an
    `InputError` naming ``what`` (the argument it came from)."""

    def __init__(self, tokenizer: Tokenizer, text: str, what: str = "grammar"):
        llg = _llg()
        self.tokenizer = tokenizer
        self.text = text
        self.what = what
        self.ll_tokenizer = ll_tokenizer(tokenizer)
        self.eos_id = self.ll_tokenizer.eos_token
        is_error, msgs = llg.LLMatcher.validate_grammar_with_warnings(text, self.ll_tokenizer)
        if is_error:
            raise InputError(f"{what}: the grammar engine cannot compile it: {msgs[0] if msgs else 'invalid'}")
        self._template = llg.LLMatcher(self.ll_tokenizer, text, log_level=0)
        if self._template.is_error():
            raise InputError(f"{what}: the grammar engine cannot compile it: {self._template.get_error()}")

    @classmethod
    def json_schema(cls, tokenizer: Tokenizer, schema: dict | str, *, strict: bool = True,
                    what: str = "json_schema") -> "Grammar":
        """JSON validating against ``schema`` (a dict or its JSON text). ``strict``: every keyword
        must be enforced (an unsupported one such as ``uniqueItems`` is an `InputError`); without
        it, keywords the engine cannot enforce are ignored."""
        return cls(tokenizer, cls._json_text(schema, strict, what), what)

    @classmethod
    def json_object(cls, tokenizer: Tokenizer, what: str = "response_format") -> "Grammar":
        """Any JSON object (OpenAI's ``json_object`` response format)."""
        return cls.json_schema(tokenizer, {"type": "object"}, strict=False, what=what)

    @classmethod
    def regex(cls, tokenizer: Tokenizer, pattern: str, what: str = "regex") -> "Grammar":
        """Text matching ``pattern`` (Rust regex syntax) as a whole."""
        if not isinstance(pattern, str):
            raise InputError(f"{what} must be a str, got {type(pattern).__name__}")
        return cls(tokenizer, _llg().LLMatcher.grammar_from_regex(pattern), what)

    @classmethod
    def lark(cls, tokenizer: Tokenizer, text: str, what: str = "grammar") -> "Grammar":
        """A Lark grammar in llguidance's dialect (``%json {...}`` embeds a JSON schema, ``<[id]>``
        or ``<|name|>`` a special token), or an llguidance grammar object's JSON text."""
        if not isinstance(text, str) or not text.strip():
            raise InputError(f"{what} must be a non-empty str (a Lark grammar)")
        if text.lstrip().startswith("{"):
            return cls(tokenizer, text, what)
        return cls(tokenizer, _llg().LLMatcher.grammar_from_lark(text), what)

    @staticmethod
    def _json_text(schema: dict | str, strict: bool, what: str) -> str:
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as e:
                raise InputError(f"{what} is not valid JSON: {e}") from None
        if not isinstance(schema, dict):
            raise InputError(f"{what} must be a JSON schema object (dict), got {type(schema).__name__}")
        try:
            return _llg().LLMatcher.grammar_from_json_schema(schema, defaults={**JSON_OPTIONS, "lenient": not strict})
        except (ValueError, TypeError) as e:
            raise InputError(f"{what}: {e}") from None

    def matcher(self, stop_ids: Iterable[int] = ()) -> "Matcher":
        """A fresh matcher for one request; ``stop_ids`` are allowed once the grammar is complete."""
        return Matcher(self, self._template.deep_copy(), stop_ids)


class Matcher:
    """One request's position in a `Grammar`. Not shared: one per sequence."""

    def __init__(self, grammar: Grammar, ll: Any, stop_ids: Iterable[int]):
        self.grammar = grammar
        self.ll = ll
        self.stop_ids = np.array(sorted(set(stop_ids)), dtype=np.int64)
        self.consumed = 0

    @property
    def stopped(self) -> bool:
        """The grammar takes no more tokens (it is complete)."""
        return self.ll.is_stopped()

    @property
    def accepting(self) -> bool:
        """What was consumed so far is a complete match (it may also go on)."""
        return self.ll.is_accepting()

    def consume(self, token: int) -> None:
        """Advance by ``token``; a token the mask did not allow is an error of the caller."""
        if not self.ll.consume_token(int(token)):
            raise RuntimeError(f"{self.grammar.what}: token {token} is not allowed here ({self.ll.get_error()})")
        self.consumed += 1

    def rollback(self, n: int) -> None:
        """Undo the last ``n`` consumed tokens."""
        if n and not self.ll.rollback(n):
            raise RuntimeError(f"{self.grammar.what}: cannot roll back {n} tokens ({self.ll.get_error()})")
        self.consumed -= n

    def valid_prefix(self, tokens: list[int]) -> int:
        """How many of ``tokens`` (prompt-lookup drafts) the grammar allows from here, in order."""
        return int(self.ll.validate_tokens([int(t) for t in tokens])) if tokens else 0

    def forced(self) -> list[int]:
        """Tokens the grammar forces from here (the canonical tokens of its forced text)."""
        return [] if self.stopped else list(self.ll.compute_ff_tokens())

    def masks(self, drafts: list[int] = (), vocab: int | None = None) -> np.ndarray:
        """bool ``[1 + len(drafts), vocab]``: the tokens allowed now, and after each draft."""
        return fill_masks([(self, list(drafts))], vocab)[0]


def _executor_instance():
    global _executor
    if _executor is None:
        _executor = _llg().LLExecutor()
    return _executor


def fill_masks(jobs: list[tuple[Matcher, list[int]]], vocab: int | None = None) -> list[np.ndarray]:
    """The masks of several matchers at once (one llguidance batch call each for those with and
    without drafts; the GIL is released while they run): for each (matcher, drafts), a bool
    array ``[1 + len(drafts), vocab]`` whose row i allows the tokens valid after ``drafts[:i]``
    (the drafts must be valid: `Matcher.valid_prefix`). The grammar's end-of-sequence becomes
    the matcher's stop ids; ids past the tokenizer's vocabulary are never allowed."""
    if not jobs:
        return []
    from llguidance import numpy as lln

    ll_vocab = jobs[0][0].grammar.ll_tokenizer.vocab_size
    vocab = ll_vocab if vocab is None else vocab
    starts = np.cumsum([0] + [1 + len(d) for _, d in jobs])
    bits = lln.allocate_token_bitmask(int(starts[-1]), ll_vocab)
    plain = [(m.ll, int(s)) for (m, d), s in zip(jobs, starts) if not d]
    drafted = [(m.ll, int(s), [int(t) for t in d]) for (m, d), s in zip(jobs, starts) if d]
    if plain:
        lln.fill_next_token_bitmask_par(_executor_instance(), plain, bits)
    if drafted:
        lln.fill_next_token_bitmask_par_with_draft_tokens(_executor_instance(), drafted, bits)
    allowed = np.unpackbits(bits.view(np.uint8), axis=1, bitorder="little")[:, :ll_vocab].astype(bool)
    if vocab != ll_vocab:
        wide = np.zeros((allowed.shape[0], vocab), dtype=bool)
        wide[:, : min(vocab, ll_vocab)] = allowed[:, :vocab]
        allowed = wide
    out = []
    for (m, _), s, e in zip(jobs, starts[:-1], starts[1:]):
        rows = allowed[s:e]
        eos = m.grammar.eos_id
        done = rows[:, eos].copy() if eos < vocab else np.zeros(len(rows), bool)
        stops = m.stop_ids[m.stop_ids < vocab]
        rows[:, stops] = False  # stop ids (text-like ones too) only where the grammar may end
        rows[np.ix_(done, stops)] = True
        if eos < vocab and eos not in stops:
            rows[:, eos] = False
        out.append(rows)
    return out


def constraint(tokenizer: Tokenizer | None, *, json_schema: Any = None, regex: Any = None,
               grammar: Any = None) -> Grammar | None:
    """The `Grammar` of a generation call's ``json_schema`` / ``regex`` / ``grammar`` options (at
    most one; ``grammar`` may be a compiled `Grammar` or Lark text), None without any."""
    given = [(k, v) for k, v in (("json_schema", json_schema), ("regex", regex), ("grammar", grammar)) if v is not None]
    if not given:
        return None
    if len(given) > 1:
        raise InputError(f"give at most one of json_schema, regex and grammar, got {', '.join(k for k, _ in given)}")
    key, value = given[0]
    if isinstance(value, Grammar):
        if key != "grammar":
            raise InputError(f"a compiled Grammar goes in grammar=, not {key}=")
        return value
    if tokenizer is None:
        from ..errors import TokenizerError

        raise TokenizerError(f"{key} needs the model's tokenizer, and this model has none")
    if key == "json_schema":
        return Grammar.json_schema(tokenizer, value)
    if key == "regex":
        return Grammar.regex(tokenizer, value)
    return Grammar.lark(tokenizer, value)
