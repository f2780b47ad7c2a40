"""The generation loop over the engine step: prompt-prefix reuse, sampling, stop tokens and
stop strings, and text streaming. Everything here belongs to one call: its `KVState`, its
sampler, its `GenerationStats` (which come back on the returned stream)."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import numpy as np

from ..errors import ContextError, InputError, NumericalError
from ..kernels import common
from ..tokenizer import Tokenizer
from . import inputs
from .budget import ThoughtBudget
from .cache import KVState
from .checkpoints import Markers, prefill_heads
from .constrain import Matcher
from .drafting import DraftPolicy, Drafter
from .engine import Engine, SoftTokens
from .logprobs import TokenLogprob, token_logprob
from .sampling import Sampler, SamplingParams

END_OF_TURN_TOKENS = ("<turn|>", "<end_of_turn>", "<|tool_response>")  # a call ends the turn at <|tool_response>
DEFAULT_MAX_NEW_TOKENS = 256
PROMPT_LOOKUP_DRAFTS = 3  # draft tokens per prompt-lookup step: with the current token, FEW_ROWS rows


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
        """Defaults from a generation_config.json dict; a malformed value is an `InputError` naming it."""
        gc = gc or {}
        if not isinstance(gc, dict):
            raise InputError(f"generation config must be a JSON object, got {type(gc).__name__}")
        eos = gc.get("eos_token_id", [])
        stop = [*eos_token_ids, *(eos if isinstance(eos, list) else [eos])]
        stop_ids = list(dict.fromkeys(inputs.integer(s, "eos_token_id", 0) for s in stop if s is not None))
        if not gc.get("do_sample", False):
            return cls(stop_ids=stop_ids)
        d = cls(temperature=gc.get("temperature", 1.0), top_k=gc.get("top_k"), top_p=gc.get("top_p"),
                min_p=gc.get("min_p"), repetition_penalty=gc.get("repetition_penalty"), stop_ids=stop_ids)
        p = d.params()  # checks every value
        return cls(temperature=p.temperature, top_k=p.top_k, top_p=p.top_p, min_p=p.min_p,
                   repetition_penalty=p.repetition_penalty, stop_ids=stop_ids)

    def params(self, temperature=None, top_k=None, top_p=None, min_p=None, repetition_penalty=None,
               seed=None) -> SamplingParams:
        """`SamplingParams` from a call's options, these defaults filling what it leaves out
        (`SamplingParams` checks each option's type and range)."""
        return SamplingParams(
            temperature=self.temperature if temperature is None else temperature,
            top_k=self.top_k if top_k is None else top_k,
            top_p=self.top_p if top_p is None else top_p,
            min_p=self.min_p if min_p is None else min_p,
            repetition_penalty=self.repetition_penalty if repetition_penalty is None else repetition_penalty,
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
    draft_tokens: int = 0  # prompt lookup: tokens drafted, and how many of them were right
    accepted_tokens: int = 0
    logprobs: list[TokenLogprob] | None = None  # one per new token, when the call asked for logprobs


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


def fit_prompt(ids: np.ndarray, context: int, max_new_tokens: int, truncate: bool,
               bos_id: int | None = None) -> np.ndarray:
    """The prompt as it will run: as is when it fits in the context, else (``truncate``) its end,
    leaving ``max_new_tokens`` of room and keeping a leading ``bos_id``."""
    if len(ids) <= context:
        return ids
    if not truncate:
        raise ContextError(f"{len(ids)} tokens do not fit in the context of {context} tokens "
                           f"(a larger context: context= / --context; or keep the prompt's end: truncate=True / --truncate)")
    keep_bos = bos_id is not None and int(ids[0]) == bos_id
    room = context - max_new_tokens - keep_bos
    if room < 1:
        raise ContextError(f"truncate=True: max_new_tokens={max_new_tokens} leaves no room for any of the prompt "
                           f"in the context of {context} tokens (ask for fewer new tokens or load a larger context=)")
    tail = ids[len(ids) - room:]
    return np.concatenate([ids[:1], tail]) if keep_bos else tail


def generate_ids(engine: Engine, state: KVState, ids: np.ndarray, *, max_new_tokens: int, params: SamplingParams,
                 stop_ids: set[int], stats: GenerationStats, soft: SoftTokens | None = None,
                 prompt_lookup: int = 0, matcher: Matcher | None = None, logprobs: int | None = None,
                 drafter: Drafter | None = None, policy: DraftPolicy | None = None,
                 budget: ThoughtBudget | None = None, checkpoints: Markers | None = None) -> Iterator[int]:
    """Prefill what ``state`` does not already hold of ``ids`` (it keeps the longest common
    prefix, or the prefix up to its newest checkpoint before that where its sliding rings cannot
    roll back so far: `KVState.rollback`), then decode token by token. ``soft``: rows of ``ids``
    given as embeddings (images); they match a cached prefix only by their keys. ``checkpoints``
    (a conversation's turns; `checkpoints.marker_ids`): the prefill stops where the prompt's last
    turn starts (`checkpoints.split_points`) and at its end for a `KVState.checkpoint` (None: none).

    ``prompt_lookup`` > 0: prompt-lookup decoding with up to that many draft tokens per step
    (at most ``FEW_ROWS - 1``, so a step reads each weight once): the tokens that followed the
    latest earlier occurrence of the text's last n-gram are run in one step after the current
    token, and the sampler walks the step's rows in order, keeping drafts while they equal
    what it picks. Each kept row saw exactly the tokens plain decoding would have fed it, and
    `Engine.decode_rows` computes each row bit for bit as a one-token step, so the tokens (and a
    seeded sampler's draws) are those of plain decoding; the KV entries of rejected drafts are
    rolled back (`KVState.truncate`).

    ``matcher`` (a `constrain.Grammar`'s, fresh): each row's token is sampled among the tokens the
    grammar allows after the tokens before it; drafts are cut where the grammar refuses them, and
    the tokens the grammar forces are drafted (they are kept like any draft: when sampled). The
    reply ends ("stop") once the grammar is complete; ``max_new_tokens`` cuts it ("length").
    ``logprobs`` (top count >= 0): ``stats.logprobs`` gets each new token's `TokenLogprob`.

    ``drafter`` (an MTP drafter, `runtime.drafting.Drafter`): where prompt lookup finds no
    drafts, the drafter's are verified the same way, as many as `DraftPolicy` finds pay under
    the acceptance and step costs measured in this call (none, with a rare probe, where they
    do not; ``policy``: another `DraftPolicy`).

    ``budget`` (a fresh `ThoughtBudget`): once the reply's thoughts have spent it, the open
    thought's end is the only token allowed."""
    keys = soft.keyed(ids) if soft is not None else ids.tolist()
    reuse = state.rollback(min(common_prefix(state.tokens, keys), len(ids) - 1))  # the last token must run
    sampler = Sampler(params)
    history = ids.tolist()
    stats.prompt_tokens, stats.cached_tokens = len(ids), reuse
    if max_new_tokens == 0:
        stats.finish_reason = "length"
        return
    t0 = time.perf_counter()
    if checkpoints is not None:
        prefill_heads(engine, [state], [ids], checkpoints, [soft])
    start = state.length
    hidden = engine.prefill(state, ids[start:], soft.after(start) if soft is not None else None)
    if checkpoints is not None:
        state.checkpoint()
    rows = engine.logits(hidden)
    stats.prefill_s = time.perf_counter() - t0
    if logprobs is not None:
        stats.logprobs = []
    drafts: list[int] = []
    policy = (policy or DraftPolicy()) if drafter is not None else None
    step_s = draft_s = 0.0
    modeled = False  # whether the last step's drafts were the drafter's
    while True:
        masks = matcher.masks(drafts, rows.shape[1]) if matcher is not None else None
        for i, logits in enumerate(rows):
            _check_finite(logits, stats.new_tokens)
            allowed = None if masks is None else masks[i]
            if budget is not None:
                allowed = budget.mask(allowed, logits.shape[0])
            tok = sampler(logits, history, allowed)
            if budget is not None:
                budget.push(tok)
            if tok in stop_ids:
                stats.finish_reason = "stop"
                return
            if matcher is not None:
                matcher.consume(tok)
            if logprobs is not None:
                stats.logprobs.append(token_logprob(logits, tok, logprobs))
            stats.new_tokens += 1
            yield tok
            history.append(tok)
            if matcher is not None and matcher.stopped:
                stats.finish_reason = "stop"
                return
            if stats.new_tokens == max_new_tokens or state.length - len(drafts) + i >= engine.context:  # (rows kept so far)
                stats.finish_reason = "length"
                return
            if i == len(drafts) or tok != drafts[i]:
                break
            stats.accepted_tokens += 1
        if len(rows) > 1 and not state.truncate(state.length - len(drafts) + i):  # drop the rejected drafts
            raise RuntimeError("KV cache could not roll back a prompt-lookup step")  # SPARE_SLOTS too small
        if modeled:
            policy.update(len(drafts), i, step_s, draft_s)
        room = min(common.FEW_ROWS - 1, engine.context - state.length - 1, max_new_tokens - stats.new_tokens - 1)
        drafts = next_drafts(history, prompt_lookup, room, matcher)
        modeled, draft_s = policy is not None and not drafts, 0.0
        if modeled and room > 0 and (k := policy.choose(room)):
            t0 = time.perf_counter()
            drafts = drafter.draft(state, tok, hidden[i], k)[:room]
            if matcher is not None and drafts:  # the grammar cuts the drafter's drafts as it cuts lookup's
                drafts = drafts[: matcher.valid_prefix(drafts)]
            draft_s = time.perf_counter() - t0
        stats.draft_tokens += len(drafts)
        t0 = time.perf_counter()
        if drafter is not None and drafts:
            rows, hidden = engine.decode_hidden([state], [[tok, *drafts]])
        elif drafter is not None:  # exactly `decode_step`, keeping the hidden state
            hidden = engine.forward(state, np.array([tok], dtype=np.int64))
            rows = engine.logits(hidden)
        elif drafts:
            rows = engine.decode_rows(state, [tok, *drafts])
        else:
            rows = engine.decode_step(state, tok)[None]
        step_s = time.perf_counter() - t0
        stats.decode_s += step_s + draft_s


def next_drafts(history: list[int], lookup: int, room: int, matcher: Matcher | None = None,
                source: list[int] | None = None) -> list[int]:
    """The drafts of the next step (at most ``room`` and ``FEW_ROWS - 1``): with a grammar, the
    tokens it forces when there are any, else the prompt-lookup drafts (``lookup`` of them) up to
    the first one the grammar refuses; without one, the prompt-lookup drafts."""
    room = min(room, common.FEW_ROWS - 1)
    if room <= 0:
        return []
    if matcher is not None:
        forced = matcher.forced()[:room]
        if forced:
            return forced
    drafts = lookup_drafts(history, min(lookup, room), source=source) if lookup > 0 else []
    if matcher is not None and drafts:
        drafts = drafts[: matcher.valid_prefix(drafts)]
    return drafts


def prompt_lookup_drafts(v) -> int:
    """Draft tokens per step for a call's ``prompt_lookup`` option: True = `PROMPT_LOOKUP_DRAFTS`,
    False or None = 0, or a count >= 0 (at most ``FEW_ROWS - 1`` are used)."""
    if v is None:
        return 0
    if isinstance(v, (bool, np.bool_)):
        return PROMPT_LOOKUP_DRAFTS if v else 0
    return inputs.integer(v, "prompt_lookup", 0)


def lookup_drafts(history: list[int], k: int, ngrams: tuple[int, ...] = (3, 2, 1),
                  source: list[int] | None = None) -> list[int]:
    """Up to ``k`` draft tokens: those that followed the latest earlier occurrence of the last
    n-gram of ``history`` (the longest n of ``ngrams`` that occurs), [] when none does.
    ``source`` (a predicted reply's tokens) is searched too, after ``history`` for each n."""
    h = np.asarray(history, dtype=np.int64)
    src = np.asarray(source if source is not None else [], dtype=np.int64)
    for n in ngrams:
        if len(h) < n:
            continue
        tail = h[-n:]
        for text, end in ((h, len(h) - n), (src, len(src) - n)):  # earlier starts only (not the tail itself)
            starts = np.flatnonzero(text[: max(end, 0)] == tail[0])
            for j in range(1, n):
                starts = starts[text[starts + j] == tail[j]]
            if starts.size:
                s = int(starts[-1]) + n
                return text[s : s + k].tolist()
    return []


def _check_finite(logits: np.ndarray, step: int) -> None:
    if not np.isfinite(logits).all():
        where = "after the prompt" if step == 0 else f"after {step} generated token{'s' * (step > 1)}"
        raise NumericalError(f"generation step {step}: the logits {where} are not finite (NaN or inf): the "
                             "weights hold NaN/inf values or the activations overflowed")


def stop_sets(stop, defaults: GenerationDefaults, tokenizer: Tokenizer | None, chat: bool,
              vocab_size: int | None = None) -> tuple[set[int], list[str]]:
    """Stop token ids (the checkpoint's, end-of-turn in chat, ids given: only without ``chat``
    and when ``vocab_size`` is known) and stop strings; checked as `inputs.stop` does."""
    ids = set(defaults.stop_ids)
    if chat and tokenizer is not None:
        ids |= {t for s in END_OF_TURN_TOKENS if (t := tokenizer.token_id(s)) is not None}
    extra, strings = inputs.stop(stop, vocab_size or 0, ids=vocab_size is not None)
    return ids | extra, strings


def cut_tokens_at_strings(tokens: Iterator[int], tokenizer: Tokenizer, stops: list[str],
                          stats: GenerationStats) -> Iterator[int]:
    """Token ids up to (not including) the one whose text completes a stop string."""
    out: list[int] = []
    for t in tokens:
        if any(s in tokenizer.decode_generated(out + [t]) for s in stops):
            stats.finish_reason = "stop"
            return
        out.append(t)
        yield t


def text_pieces(tokens: Iterator[int], tokenizer: Tokenizer, stops: list[str], stats: GenerationStats) -> Iterator[str]:
    """Token ids to text pieces; cut at the first stop string, holding back text that may start one."""
    cutter = TextCutter(tokenizer, stops)
    for t in tokens:
        piece = cutter.push(t)
        if piece:
            yield piece
        if cutter.stopped:
            stats.finish_reason = "stop"
            return
    piece = cutter.finish()
    if cutter.stopped:
        stats.finish_reason = "stop"
    if piece:
        yield piece


class TextCutter:
    """Push-style detokenizer with stop strings (`text_pieces`, and the server's scheduler, which
    feeds many sequences one token at a time): text that may begin a stop string is held back
    until it cannot; ``stopped`` once a stop string appeared (the text before it is returned)."""

    def __init__(self, tokenizer: Tokenizer, stops: list[str]):
        self.stream = tokenizer.stream()
        self.stops = stops
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.pending = ""
        self.stopped = False
        self.matched: str | None = None  # the stop string that stopped it

    def push(self, token: int) -> str:
        return self.feed(self.stream.push(token))

    def feed(self, text: str) -> str:
        """Text decoded elsewhere (the chat output parser's content): the same holding back."""
        self.pending += text
        return self._emit(final=False)

    def finish(self) -> str:
        """What is still held back, at the end of the tokens."""
        self.pending += self.stream.flush()
        return self._emit(final=True)

    def _emit(self, final: bool) -> str:
        cut = _first_stop(self.pending, self.stops)
        if cut >= 0:
            self.matched = next(s for s in self.stops if self.pending.startswith(s, cut))
            out, self.pending, self.stopped = self.pending[:cut], "", True
            return out
        n = len(self.pending) - (0 if final else self.hold)
        if n <= 0:
            return ""
        out, self.pending = self.pending[:n], self.pending[n:]
        return out


def _first_stop(text: str, stops: list[str]) -> int:
    """Index of the earliest stop string in ``text``, -1 if none."""
    return min((i for s in stops if (i := text.find(s)) >= 0), default=-1)


def common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix of two token lists (what a cached state can reuse)."""
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n
