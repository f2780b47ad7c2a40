"""The server's reading of ``n``, ``logprobs`` / ``top_logprobs`` and ``response_format``, and
the OpenAI shapes of logprobs (chat's ``{"content": [...]}``, the legacy completions' lists).

Every bad value is a 400 naming its ``param``; a schema the grammar engine cannot compile too.
"""
from __future__ import annotations

from typing import Any

from ..chat.tool_grammar import response_format_grammar
from ..runtime.constrain import Grammar, piece_bytes, special_ids
from ..runtime.logprobs import MAX_TOP_LOGPROBS, TokenLogprob
from .protocol import bad

MAX_N = 8  # choices per request (they share one prefill)


def read_n(body: dict) -> int:
    v = body.get("n")
    if v is None:
        return 1
    if not isinstance(v, int) or isinstance(v, bool) or not 1 <= v <= MAX_N:
        raise bad(f"'n' must be an integer in [1, {MAX_N}], got {v!r}", "n")
    return v


def read_logprobs(body: dict, chat: bool) -> int | None:
    """The top-token count to report (0: the chosen token only), None without logprobs. Chat:
    ``logprobs`` (bool) and ``top_logprobs`` (0-20, needs ``logprobs``); completions: ``logprobs``
    (an integer 0-20, the legacy form)."""
    lp = body.get("logprobs")
    if not chat:
        if lp is None:
            return None
        if not isinstance(lp, int) or isinstance(lp, bool) or not 0 <= lp <= MAX_TOP_LOGPROBS:
            raise bad(f"'logprobs' must be an integer in [0, {MAX_TOP_LOGPROBS}], got {lp!r}", "logprobs")
        return lp
    if lp is not None and not isinstance(lp, bool):
        raise bad(f"'logprobs' must be a boolean, got {lp!r}", "logprobs")
    top = body.get("top_logprobs")
    if top is not None:
        if not isinstance(top, int) or isinstance(top, bool) or not 0 <= top <= MAX_TOP_LOGPROBS:
            raise bad(f"'top_logprobs' must be an integer in [0, {MAX_TOP_LOGPROBS}], got {top!r}", "top_logprobs")
        if not lp:
            raise bad("'top_logprobs' needs 'logprobs': true", "top_logprobs")
    return (top or 0) if lp else None


def read_response_format(body: dict, tokenizer, thinking: bool = False) -> Grammar | None:
    """The grammar of ``response_format`` (None for text or absent); a 400 naming the param when
    it is malformed or its schema does not compile."""
    rf = body.get("response_format")
    if rf is None:
        return None
    try:
        return response_format_grammar(tokenizer, rf, thinking=thinking)
    except ValueError as e:
        raise bad(str(e), getattr(e, "param", "response_format")) from None


class LogprobFormat:
    """OpenAI's logprobs shapes for one tokenizer (token text and UTF-8 bytes per id)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.specials = special_ids(tokenizer)

    def _text(self, tid: int) -> tuple[str, list[int]]:
        raw = piece_bytes(self.tokenizer, tid, self.specials).removeprefix(b"\xff")
        return raw.decode("utf-8", errors="replace"), list(raw)

    def chat(self, entries: list[TokenLogprob]) -> dict[str, Any]:
        """``{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}, ...]}``."""
        def one(tid: int, lp: float) -> dict[str, Any]:
            text, raw = self._text(tid)
            return {"token": text, "logprob": lp, "bytes": raw}

        return {"content": [{**one(e.token, e.logprob), "top_logprobs": [one(t, v) for t, v in e.top]}
                            for e in entries], "refusal": None}

    def completion(self, entries: list[TokenLogprob], offset: int = 0) -> dict[str, Any]:
        """The legacy shape: ``tokens``, ``token_logprobs``, ``top_logprobs`` (dicts), ``text_offset``."""
        tokens, offsets, pos = [], [], offset
        for e in entries:
            text, _ = self._text(e.token)
            tokens.append(text)
            offsets.append(pos)
            pos += len(text)
        return {"tokens": tokens, "token_logprobs": [e.logprob for e in entries],
                "top_logprobs": [{self._text(t)[0]: v for t, v in e.top} for e in entries], "text_offset": offsets}
