"""The generation loop over the engine step: prompt-prefix reuse, sampling, stop tokens and
stop strings, and text streaming. Everything here belongs to one call: its `KVState`, its
sampler, its `GenerationStats` (which come back on the returned stream)."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import numpy as np

from ..errors import ContextError
from ..tokenizer import Tokenizer
from .cache import KVState
from .engine import Engine
from .sampling import Sampler, SamplingParams

END_OF_TURN_TOKENS = ("<turn|>", "<end_of_turn>")
DEFAULT_MAX_NEW_TOKENS = 256


@dataclass
class GenerationDefaults:
    """Sampling defaults from the checkpoint's generation_config.json (greedy without one)."""

    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    stop_ids: list[int] = field(default_factory=list)

    @classmethod
    def from_generation_config(cls, gc: dict[str, Any] | None, eos_token_ids: list[int]) -> "GenerationDefaults":
        gc = gc or {}
        eos = gc.get("eos_token_id", [])
        stop = list(dict.fromkeys([*eos_token_ids, *(eos if isinstance(eos, list) else [eos])]))
        if not gc.get("do_sample", False):
            return cls(stop_ids=[int(s) for s in stop if s is not None])
        return cls(temperature=float(gc.get("temperature", 1.0)), top_k=gc.get("top_k"), top_p=gc.get("top_p"),
                   min_p=gc.get("min_p"), repetition_penalty=gc.get("repetition_penalty"),
                   stop_ids=[int(s) for s in stop if s is not None])

    def params(self, temperature=None, top_k=None, top_p=None, min_p=None, repetition_penalty=None,
               seed=None) -> SamplingParams:
        """`SamplingParams` from a call's options, these defaults filling what it leaves out."""
        return SamplingParams(
            temperature=self.temperature if temperature is None else float(temperature),
            top_k=self.top_k if top_k is None else int(top_k),
            top_p=self.top_p if top_p is None else float(top_p),
            min_p=self.min_p if min_p is None else float(min_p),
            repetition_penalty=self.repetition_penalty if repetition_penalty is None else float(repetition_penalty),
            seed=seed,
        )


@dataclass
class GenerationStats:
    """What one call did: prompt tokens (of which ``cached_tokens`` were reused), new tokens, seconds."""

    prompt_tokens: int = 0
    cached_tokens: int = 0
    new_tokens: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    finish_reason: str | None = None  # "stop" (a stop token or string) or "length"


class Stream:
    """The iterator a streaming call returns (token ids or text pieces), with its `stats`."""

    def __init__(self, items: Callable[[GenerationStats], Iterator[Any]]):
        self.stats = GenerationStats()
        self._it = items(self.stats)

    def __iter__(self) -> "Stream":
        return self

    def __next__(self) -> Any:
        return next(self._it)

    def close(self) -> None:
        self._it.close()


def fit_prompt(ids: np.ndarray, context: int, max_new_tokens: int, truncate: bool) -> np.ndarray:
    """The prompt as it will run: as is when it fits in the context, else (``truncate``) its end."""
    if len(ids) <= context:
        return ids
    if not truncate:
        raise ContextError(f"{len(ids)} tokens do not fit in the context of {context} tokens "
                           f"(a larger context: context= / --context; or keep the prompt's end: truncate=True / --truncate)")
    return ids[len(ids) - max(1, context - max_new_tokens):]


def generate_ids(engine: Engine, state: KVState, ids: np.ndarray, *, max_new_tokens: int, params: SamplingParams,
                 stop_ids: set[int], stats: GenerationStats) -> Iterator[int]:
    """Prefill what ``state`` does not already hold of ``ids`` (it keeps the longest common
    prefix when its caches can roll back to it), then decode token by token."""
    reuse = min(_common_prefix(state.tokens, ids.tolist()), len(ids) - 1)  # the last token must run
    if not state.truncate(reuse):
        state.reset()
        reuse = 0
    sampler = Sampler(params)
    history = ids.tolist()
    stats.prompt_tokens, stats.cached_tokens = len(ids), reuse
    if max_new_tokens == 0:
        stats.finish_reason = "length"
        return
    t0 = time.perf_counter()
    logits = engine.logits(engine.prefill(state, ids[reuse:]))[0]
    stats.prefill_s = time.perf_counter() - t0
    for step in range(max_new_tokens):
        tok = sampler(logits, history)
        if tok in stop_ids:
            stats.finish_reason = "stop"
            return
        stats.new_tokens += 1
        yield tok
        history.append(tok)
        if step + 1 == max_new_tokens or state.length >= engine.context:
            stats.finish_reason = "length"
            return
        t0 = time.perf_counter()
        logits = engine.decode_step(state, tok)
        stats.decode_s += time.perf_counter() - t0


def stop_sets(stop, defaults: GenerationDefaults, tokenizer: Tokenizer | None, chat: bool) -> tuple[set[int], list[str]]:
    """Stop token ids (the checkpoint's, end-of-turn in chat, ids given) and stop strings."""
    ids = set(defaults.stop_ids)
    if chat and tokenizer is not None:
        ids |= {t for s in END_OF_TURN_TOKENS if (t := tokenizer.token_id(s)) is not None}
    strings: list[str] = []
    for s in [stop] if isinstance(stop, (str, int)) else (stop or []):
        if isinstance(s, str):
            strings.append(s)
        else:
            ids.add(int(s))
    return ids, strings


def cut_tokens_at_strings(tokens: Iterator[int], tokenizer: Tokenizer, stops: list[str],
                          stats: GenerationStats) -> Iterator[int]:
    """Token ids up to (not including) the one whose text completes a stop string."""
    out: list[int] = []
    for t in tokens:
        if any(s in tokenizer.decode(out + [t]) for s in stops):
            stats.finish_reason = "stop"
            return
        out.append(t)
        yield t


def text_pieces(tokens: Iterator[int], tokenizer: Tokenizer, stops: list[str], stats: GenerationStats) -> Iterator[str]:
    """Token ids to text pieces; cut at the first stop string, holding back text that may start one."""
    stream = tokenizer.stream()
    hold = max((len(s) for s in stops), default=1) - 1
    pending = ""
    for t in tokens:
        pending += stream.push(t)
        cut = _first_stop(pending, stops)
        if cut >= 0:
            stats.finish_reason = "stop"
            if pending[:cut]:
                yield pending[:cut]
            return
        if len(pending) > hold:
            yield pending[: len(pending) - hold]
            pending = pending[len(pending) - hold:]
    pending += stream.flush()
    cut = _first_stop(pending, stops)
    if cut >= 0:
        stats.finish_reason = "stop"
        pending = pending[:cut]
    if pending:
        yield pending


def _first_stop(text: str, stops: list[str]) -> int:
    """Index of the earliest stop string in ``text``, -1 if none."""
    return min((i for s in stops if (i := text.find(s)) >= 0), default=-1)


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n
