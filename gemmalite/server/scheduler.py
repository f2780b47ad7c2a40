"""Continuous batching: one thread owns the engine and steps every active sequence together.

Requests wait in a bounded queue. Between two decode steps the scheduler admits waiting
requests (up to ``max_concurrency`` active), prefills their new tokens together
(`Engine.prefill_many`: a burst of requests shares each weight read, and nobody waits behind
the others' prefills one after another) and samples each one's first token; then one batched
decode step computes the next token of every active sequence
(`Engine.decode_batch`: each weight is read once for all of them). A sequence whose client
went away (``cancel(cause)``) is dropped at the next step (a waiting one leaves the queue,
unstarted) and its KV state goes back to a prefix
cache (a byte budget, least recently used out first): a later request that starts with the same
tokens (a multi-turn chat resent whole) takes that state and runs only its new tokens. A prompt
is prefilled in pieces that end where its last turn starts (`runtime.checkpoints`; new prompts
run their pieces together, round by round), each state keeping checkpoints of its sliding rings
there and at the prompt's end, so the next turn of a conversation, whose template re-renders the
last reply, rolls back to one (`KVState.rollback`) instead of starting over. Requests that start
alike at the same time share too: a new request whose first SHARE_MIN+ tokens match a running
sequence's, or another new request's, copies that state (`KVState.clone`) after it is computed
and runs only the rest; the same prompt again takes the other's first logits as well, so a
burst of one prompt costs one prefill. An idle scheduler woken by a request waits a few
milliseconds while more arrive (`_gather`), so that clients who start together start in one
prefill.

A sequence may decode by prompt lookup (``lookup`` drafts per step, from the n-grams of its
prompt and reply and of a predicted reply): its drafts join the batched step as extra rows,
each computed as a one-token step would be, and the tokens kept are exactly plain decoding's
(as in `generate_ids`); drafts stop where a step would exceed STEP_ROWS rows. With an MTP
``drafter`` (`serve --drafter`), a sequence whose prompt lookup finds nothing drafts with it
instead, as many as its own `DraftPolicy` finds pay at the acceptance it has measured (the
step costs stay the policy's priors: a batched step's time is not one sequence's).

A constrained sequence (``matcher``: a grammar's, see `runtime.constrain`) samples each row
among the tokens its grammar allows: the masks of every constrained sequence of a step (one
row per draft too) are computed in one llguidance batch call, with the GIL released, in a
worker thread while the engine runs the step; its drafts are the tokens the grammar forces,
else its prompt-lookup drafts cut where the grammar refuses them. An unconstrained sequence
is sampled exactly as before. ``logprobs``: each token's `TokenLogprob` rides on the `Piece`
that carries its text (those not yet sent, on the `Finish`). ``thinking_budget``: once the
sequence's thoughts have spent it, the open thought's end is the only token allowed
(`runtime.budget`), row by row like a grammar's mask.

``drain(grace)`` (a graceful shutdown) refuses new sequences (`ShuttingDown`) and cancels what
still runs or waits once ``grace`` seconds have passed.

Results leave through each sequence's ``sink`` callable, called on the scheduler thread with
`Piece` / `Finish` events; detokenization and stop strings (`TextCutter`, as in
`Model.generate`) are applied here, so a stop string ends the sequence at once. A sequence may
bring its own reader of the tokens instead (``output``: a chat reply's `OutputParser`), whose
events go to the sink as `Part`s (with the logprobs of the tokens since the last one).
"""
from __future__ import annotations

import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from ..kernels.common import FEW_ROWS
from ..runtime.budget import ThoughtBudget
from ..runtime.checkpoints import marker_ids, prefill_heads
from ..runtime.drafting import DraftPolicy
from ..runtime.engine import SoftTokens
from ..runtime.constrain import Matcher, fill_masks
from ..runtime.generate import TextCutter, common_prefix, next_drafts
from ..runtime.logprobs import TokenLogprob, token_logprob
from ..runtime.sampling import Sampler, SamplingParams
from .metrics import Metrics


GATHER_S = 0.005  # an idle scheduler woken by a request waits this long for more, again while more come,
GATHER_MAX = 0.03  # up to this long: a burst of clients then starts in one prefill, not the first one alone
SHARE_MIN = 16  # prompt tokens another request must share with a new one to copy its state (a
# shorter match, such as the chat template's first tokens, is cheaper to recompute in the batch)
PREFIX_CACHE_BYTES = 1 << 30  # the prefix cache's default budget (`KVState.held_bytes` of its states)
STEP_ROWS = 8  # prompt-lookup drafts stop where a decode step would exceed this many rows: a rejected
# draft's row costs the whole batch once a step is bound by multiply-adds (from ~4 rows on). Through
# the server on Gemma 3 270M (BENCHMARKS.md), 16 made 4 streams slower than plain decoding; 8 did not


class Overloaded(RuntimeError):
    """The waiting queue is full: the caller answers 429 with Retry-After."""


class ShuttingDown(RuntimeError):
    """The scheduler is draining (`Scheduler.drain`) and admits nothing new: the caller answers 503."""


@dataclass
class Piece:
    text: str
    logprobs: list[TokenLogprob] = field(default_factory=list)  # of the tokens since the last piece


@dataclass
class Part:
    """An event of a sequence's own reader (``Sequence.output``: a chat reply's parts)."""

    event: Any
    logprobs: list[TokenLogprob] = field(default_factory=list)  # of the tokens since the last piece or part


@dataclass
class Finish:
    reason: str  # "stop" | "length" | "tool_calls" (a chat reply's reader says) | "cancelled" | "error"
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    error: str | None = None
    drafted: int = 0  # prompt-lookup draft tokens run, and how many of them were kept
    accepted: int = 0
    logprobs: list[TokenLogprob] = field(default_factory=list)  # of tokens no piece carried


@dataclass(eq=False)
class Sequence:
    """One generation request as the scheduler sees it (compared by identity: two requests are
    never the same one, however alike)."""

    ids: list[int]
    max_tokens: int
    params: SamplingParams
    stop_ids: set[int]
    stop_strings: list[str]
    sink: Callable[[Any], None]
    cancelled: bool = False
    cancel_cause: str | None = None  # why it was cancelled ("client_gone", "shutdown", ...): /metrics counts them
    soft: SoftTokens | None = None  # rows of ``ids`` given as embeddings (pictures)
    lookup: int = 0  # prompt-lookup drafts per step (0: plain decoding; at most FEW_ROWS - 1 are used)
    prediction: list[int] = field(default_factory=list)  # a predicted reply's tokens: more text to draft from
    matcher: Matcher | None = None  # a grammar's (constrained decoding); one per sequence
    logprobs: int | None = None  # report each token's logprob and this many top ones (None: off)
    output: Callable[[], Any] | None = None  # makes the reader of the tokens (default: `TextReader`)
    thinking_budget: int | None = None  # thought tokens allowed before <channel|> is forced (`runtime.budget`)
    # filled in by the scheduler
    state: Any = None
    sampler: Sampler | None = None
    reader: Any = None
    thought: ThoughtBudget | None = None
    history: list[int] = field(default_factory=list)
    next_token: int = -1
    generated: int = 0
    cached: int = 0
    submitted: float = field(default_factory=time.perf_counter)
    first_logits: np.ndarray | None = None  # after the prompt (a request with the same prompt takes them)
    donor: "Sequence | None" = None  # whose state this one copies (its first ``share`` tokens)
    share: int = 0
    drafted: int = 0
    accepted: int = 0
    pending_logprobs: list[TokenLogprob] = field(default_factory=list)
    hidden: np.ndarray | None = None  # the final hidden state of the row ``next_token`` came from (MTP drafts)
    first_hidden: np.ndarray | None = None
    policy: DraftPolicy | None = None  # MTP drafts per step (with a drafter)
    modeled: bool = False  # whether the drafts of the step under way are the drafter's

    def cancel(self, cause: str = "abandoned") -> None:
        """Called from any thread; the scheduler frees the sequence at its next step (a waiting one
        is never started). ``cause``: the first one given is kept, for the cancellation metrics."""
        if self.cancel_cause is None:
            self.cancel_cause = cause
        self.cancelled = True


class TextReader:
    """The default reader of a sequence's tokens: text pieces cut at the stop strings. A reader
    has ``push(token) -> events``, ``stopped`` and ``finish(reason) -> (events, reason)``."""

    def __init__(self, tokenizer, stops: list[str]):
        self.cutter = TextCutter(tokenizer, stops)

    @property
    def stopped(self) -> bool:
        return self.cutter.stopped

    def push(self, token: int) -> list[Piece]:
        text = self.cutter.push(token)
        return [Piece(text)] if text else []

    def finish(self, reason: str) -> tuple[list[Piece], str]:
        text = "" if self.cutter.stopped else self.cutter.finish()
        return ([Piece(text)] if text else []), reason


class PrefixCache:
    """Finished KV states (with their checkpoints) within ``budget`` bytes (`KVState.held_bytes`),
    least recently used out first; `take` hands out the one that serves most of a prompt."""

    def __init__(self, engine, budget: int, metrics: Metrics | None = None):
        self.engine = engine
        self.budget = budget
        self.metrics = metrics or Metrics()
        self.states: list[Any] = []  # least recently used first

    @property
    def held(self) -> int:
        """Bytes the cached states hold."""
        return sum(s.held_bytes for s in list(self.states))

    def take(self, ids: list[int]) -> tuple[Any, int]:
        """A state whose first ``reuse`` tokens equal ``ids``' (reuse < len(ids)), rolled back to
        them (to its newest checkpoint within the common prefix where its sliding rings cannot
        roll back so far), and ``reuse``; else a new state and 0. Picture rows are compared by
        their keys (`SoftTokens.keyed`): a changed picture ends the match."""
        best, reuse = None, 0
        for s in self.states:
            n = s.reach(min(common_prefix(s.tokens, ids), len(ids) - 1))
            if n > reuse:
                best, reuse = s, n
        if best is None:
            return self.engine.new_state(), 0
        self.states.remove(best)
        self.metrics.inc("gemmalite_prefix_cache_hits_total")
        return best, best.rollback(reuse)

    def put(self, state: Any) -> None:
        if self.budget <= 0 or state is None or not state.tokens or state.held_bytes > self.budget:
            return
        self.states.append(state)
        while self.held > self.budget:
            del self.states[0]


class Scheduler:
    """Owns ``engine`` on its own thread. ``submit`` enqueues (raises `Overloaded` when full)."""

    def __init__(self, engine, tokenizer, *, max_concurrency: int = 8, max_queue: int = 64,
                 prefix_cache: int = PREFIX_CACHE_BYTES, metrics: Metrics | None = None, drafter=None):
        self.engine = engine
        self.drafter = drafter  # an MTP drafter (`runtime.drafting.Drafter`) or None
        self.tokenizer = tokenizer
        self.max_concurrency = max(1, max_concurrency)
        self.waiting: queue.Queue[Sequence] = queue.Queue(maxsize=max(1, max_queue))
        self.active: list[Sequence] = []
        self.metrics = metrics or Metrics()
        self.cache = PrefixCache(engine, prefix_cache, self.metrics)  # ``prefix_cache``: its budget in bytes
        self.metrics.gauge("gemmalite_prefix_cache_bytes", lambda: self.cache.held)
        self.markers = marker_ids(tokenizer)  # where a prompt's prefill stops for a checkpoint
        self._wake = threading.Event()
        self._stop = False
        self._start_lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="gemmalite-scheduler", daemon=True)
        self._turn = 0  # the sequence whose drafts come first in the next step (they take turns)
        self._masker = ThreadPoolExecutor(1, thread_name_prefix="gemmalite-masks")  # grammar masks beside the step
        self._drain_at: float | None = None  # (monotonic) when what still runs is cancelled (`drain`)

    # -- any thread -------------------------------------------------------------------
    def start(self) -> "Scheduler":
        """Start the thread (idempotent; `submit` calls it, for hosts that run no ASGI lifespan)."""
        with self._start_lock:
            if self._thread.ident is None and not self._stop:
                self._thread.start()
        return self

    @property
    def alive(self) -> bool:
        """Running, or not started yet (it starts with the first request)."""
        return self._thread.is_alive() or (self._thread.ident is None and not self._stop)

    def close(self) -> None:
        self._stop = True
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout=30)
        self._masker.shutdown(wait=False)

    def drain(self, grace: float) -> None:
        """Admit nothing new (`submit` raises `ShuttingDown`); what is running or waiting may finish
        for ``grace`` seconds, then it is cancelled (cause "shutdown": each gets its `Finish`).
        Callable from any thread (not from a signal handler: it takes a lock); a second call keeps
        the earlier deadline."""
        at = time.monotonic() + max(0.0, grace)
        if self._drain_at is None or at < self._drain_at:
            self._drain_at = at
        self._wake.set()

    @property
    def draining(self) -> bool:
        return self._drain_at is not None

    def submit(self, seq: Sequence) -> None:
        if self._drain_at is not None:
            raise ShuttingDown("the server is shutting down")
        self.start()
        try:
            self.waiting.put_nowait(seq)
        except queue.Full:
            self.metrics.inc("gemmalite_rejected_total")
            raise Overloaded(f"{self.waiting.maxsize} requests are already waiting") from None
        self._wake.set()

    @property
    def queue_depth(self) -> int:
        return self.waiting.qsize()

    # -- the scheduler thread ------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop:
            self._wake.clear()  # before looking: a submit from now on wakes the wait below
            try:
                if self._drain_at is not None and time.monotonic() >= self._drain_at:
                    self._cancel_all("shutdown")
                self._drop_cancelled()  # first: a slot freed here is taken by a waiting request now
                self._admit()
                if not self.active:
                    left = 0.5 if self._drain_at is None else self._drain_at - time.monotonic()
                    self._wake.wait(timeout=min(0.5, left) if left > 0 else 0.5)
                    continue
                self._decode()
            except Exception as e:  # a failure ends the running batch, never the scheduler
                for seq in list(self.active):
                    self._finish(seq, "error", error=f"{type(e).__name__}: {e}")
        self._cancel_all("shutdown")  # shutting down: everyone still here gets an answer
        self._drop_cancelled()
        while True:
            try:
                self._finish(self.waiting.get_nowait(), "cancelled")
            except queue.Empty:
                break

    def _cancel_all(self, cause: str) -> None:
        """Cancel every running and waiting sequence (the waiting ones end when `_admit` takes them)."""
        with self.waiting.mutex:
            waiting = list(self.waiting.queue)
        for seq in list(self.active) + waiting:
            seq.cancel(cause)

    def _admit(self) -> None:
        """Take the waiting requests (while there is room) and prefill them together."""
        if not self.active and not self.waiting.empty():
            self._gather()
        new: list[Sequence] = []
        while len(self.active) + len(new) < self.max_concurrency:
            try:
                seq = self.waiting.get_nowait()
            except queue.Empty:
                break
            if seq.cancelled:
                self._finish(seq, "cancelled")
                continue
            try:
                if self._start(seq):
                    new.append(seq)
            except Exception as e:  # a request the engine refuses must not stop the others
                self._finish(seq, "error", error=f"{type(e).__name__}: {e}")
        if new:
            self._prefill(new)

    def _gather(self) -> None:
        """Wait GATHER_S at a time while requests keep arriving (up to GATHER_MAX, or until the
        batch is full): clients that start together arrive a few milliseconds apart."""
        seen, deadline = self.waiting.qsize(), time.perf_counter() + GATHER_MAX
        while seen < self.max_concurrency and time.perf_counter() < deadline:
            time.sleep(GATHER_S)
            now = self.waiting.qsize()
            if now == seen:
                return
            seen = now

    def _start(self, seq: Sequence) -> bool:
        """Give ``seq`` its state (a cached prefix where one matches), sampler and text cutter;
        False if it is already done."""
        soft = seq.soft
        seq.state, seq.cached = self.cache.take(soft.keyed(seq.ids) if soft is not None else seq.ids)
        seq.sampler = Sampler(seq.params)
        seq.reader = seq.output() if seq.output is not None else TextReader(self.tokenizer, seq.stop_strings)
        seq.history = list(seq.ids)
        seq.thought = ThoughtBudget.of(self.tokenizer, seq.thinking_budget) if seq.thinking_budget is not None else None
        seq.policy = DraftPolicy(timed=False) if self.drafter is not None else None
        if seq.max_tokens <= 0:
            self._finish(seq, "length")
            return False
        return True

    def _prefill(self, seqs: list[Sequence]) -> None:
        """Run the new prompt tokens of ``seqs`` and sample each one's first token: first those
        that share nothing, then those that copy a prefix from a running sequence or from one of
        the first group (`_pick_donors`)."""
        later = self._pick_donors(seqs)
        self._prefill_group([s for s in seqs if s not in later])
        rest = []
        for seq in later:
            try:
                if self._copy_prefix(seq):
                    rest.append(seq)
            except Exception as e:
                self._finish(seq, "error", error=f"{type(e).__name__}: {e}")
        self._prefill_group(rest)

    def _pick_donors(self, seqs: list[Sequence]) -> list[Sequence]:
        """For each plain-token request, the running sequence or earlier new request whose tokens
        it shares most (at least SHARE_MIN beyond its cached prefix): it becomes ``seq.donor``.
        Returns the requests that got one, in order."""
        # (a sequence, the tokens its state holds or will hold once prefilled)
        donors = [(s, s.state.tokens) for s in self.active if s.soft is None and s.state is not None]
        later: list[Sequence] = []
        for seq in seqs:
            if seq.soft is not None:
                continue
            best, share = None, seq.cached + SHARE_MIN - 1
            for other, tokens in donors:
                n = common_prefix(tokens, seq.ids)
                if n > share or (n == len(seq.ids) == len(other.ids) > max(share, seq.cached)):  # the same prompt
                    best, share = other, n  # (the choices of one request with n > 1: a prompt of any length)
            if best is not None:
                seq.donor, seq.share = best, share
                later.append(seq)
            else:
                donors.append((seq, seq.ids))
        return later

    def _copy_prefix(self, seq: Sequence) -> bool:
        """Give ``seq`` a copy of its donor's state (its own stays with the prefix cache). The same
        prompt as the donor's starts at once with the donor's first logits (False: nothing left to
        run), however far the donor has gone since; otherwise the copy stops before the last
        prompt token, which must run. A donor that failed,
        or whose state cannot roll back, leaves ``seq`` as it was."""
        donor, n = seq.donor, seq.share
        seq.donor = None
        if donor.state is None:
            return True
        same = n == len(seq.ids) == len(donor.ids) and donor.first_logits is not None
        state = donor.state.clone(n if same else min(n, len(seq.ids) - 1))
        if state is None:
            return True
        self.cache.put(seq.state)
        seq.state, seq.cached = state, state.length
        if same:
            self._started(seq, donor.first_logits, donor.first_hidden)
            return False
        return True

    def _prefill_group(self, seqs: list[Sequence]) -> None:
        """Prefill ``seqs``' new tokens and sample each one's first token. Plain-token prompts that
        fit go through the engine together (`Engine.prefill_many`: each weight read once for all
        of them, each result its solo one), first up to each one's last split point (checkpoints,
        `runtime.checkpoints.prefill_heads`), then the rest; pictures, and prompts that would not
        fit (the engine's error then ends only that request), run alone."""
        fit = [s for s in seqs if len(s.ids) <= s.state.context]
        try:  # each prompt up to its last split point, checkpointed (pieces together, round by round)
            prefill_heads(self.engine, [s.state for s in fit], [np.asarray(s.ids, dtype=np.int64) for s in fit],
                          self.markers, [s.soft for s in fit])
        except Exception as e:  # their states may be half written: none goes back to the cache
            for seq in fit:
                self._finish(seq, "error", error=f"{type(e).__name__}: {e}")
            seqs = [s for s in seqs if s not in fit]
        together = [s for s in seqs if s.soft is None and len(s.ids) <= s.state.context]
        if len(together) > 1:
            try:
                h = self.engine.prefill_many([s.state for s in together], [self._new_ids(s) for s in together])
                logits = self.engine.logits(h, each=True)
            except Exception as e:  # their states may be half written: none goes back to the cache
                for seq in together:
                    self._finish(seq, "error", error=f"{type(e).__name__}: {e}")
            else:
                for seq, row, hrow in zip(together, logits, h):
                    try:
                        self._started(seq, row, hrow)
                    except Exception as e:
                        self._finish(seq, "error", error=f"{type(e).__name__}: {e}")
        else:
            together = []
        for seq in seqs:
            if seq in together:
                continue
            try:
                soft = seq.soft
                h = self.engine.prefill(seq.state, self._new_ids(seq),
                                        soft.after(seq.state.length) if soft is not None else None)
                self._started(seq, self.engine.logits(h)[0], h[0])
            except Exception as e:  # a request the engine refuses must not stop the others
                self._finish(seq, "error", error=f"{type(e).__name__}: {e}")

    @staticmethod
    def _new_ids(seq: Sequence) -> np.ndarray:
        return np.asarray(seq.ids[seq.state.length:], dtype=np.int64)

    def _started(self, seq: Sequence, logits: np.ndarray, hidden: np.ndarray | None = None) -> None:
        """``seq``'s prompt is in its state: checkpoint it there, count it, let it join the batch,
        sample its first token."""
        seq.state.checkpoint()
        self.metrics.observe("gemmalite_time_to_first_token_seconds", time.perf_counter() - seq.submitted)
        self.metrics.inc("gemmalite_prompt_tokens_total", len(seq.ids))
        self.metrics.inc("gemmalite_cached_prompt_tokens_total", seq.cached)
        self.active.append(seq)
        seq.first_logits, seq.first_hidden = logits, hidden
        seq.hidden = hidden
        allowed = fill_masks([(seq.matcher, [])], logits.shape[0])[0][0] if seq.matcher is not None else None
        self._accept(seq, logits, allowed=allowed)

    def _drop_cancelled(self) -> None:
        """End the cancelled sequences: running ones leave the batch, waiting ones the queue (unstarted)."""
        gone = [s for s in self.active if s.cancelled]
        with self.waiting.mutex:  # (queue.Queue's own lock: a cancelled request frees its place at once)
            q = self.waiting.queue
            if any(s.cancelled for s in q):
                gone += [s for s in q if s.cancelled]
                keep = [s for s in q if not s.cancelled]
                q.clear()
                q.extend(keep)
                self.waiting.not_full.notify_all()
        for seq in gone:
            self._finish(seq, "cancelled")

    def _decode(self) -> None:
        batch = list(self.active)
        runs = self._runs(batch)
        jobs = [(s.matcher, run[1:]) for s, run in zip(batch, runs) if s.matcher is not None]
        vocab = self.engine.vocab_size if jobs else 0
        masks = self._masker.submit(fill_masks, jobs, vocab) if jobs else None  # runs while the step does
        t0 = time.perf_counter()
        if self.drafter is not None:
            logits, hidden = self.engine.decode_hidden([s.state for s in batch], runs)
        else:
            logits, hidden = self.engine.decode_batch([s.state for s in batch], runs), None
        self.metrics.inc("gemmalite_decode_steps_total")
        self.metrics.inc("gemmalite_decode_step_sequences_total", len(batch))
        self.metrics.inc("gemmalite_decode_seconds_total", time.perf_counter() - t0)
        mask_rows = iter(masks.result() if masks is not None else [])
        r = 0
        for seq, run in zip(batch, runs):
            allowed = next(mask_rows) if seq.matcher is not None else None
            self._accept_run(seq, logits[r : r + len(run)], run[1:], allowed,
                             None if hidden is None else hidden[r : r + len(run)])
            r += len(run)

    def _runs(self, batch: list[Sequence]) -> list[list[int]]:
        """Each sequence's tokens for the next step: its next token, then its prompt-lookup drafts
        while the step stays within STEP_ROWS rows (a different sequence's drafts first each step).
        The drafts fit the sequence's remaining tokens and context, as in `generate_ids`."""
        runs = [[s.next_token] for s in batch]
        room = STEP_ROWS - len(batch)
        self._turn = (self._turn + 1) % max(1, len(batch))
        for i in range(len(batch)):
            b = (self._turn + i) % len(batch)
            seq = batch[b]
            k = min(FEW_ROWS - 1, room, seq.max_tokens - seq.generated - 1, seq.state.context - seq.state.length - 1)
            # a grammar's forced tokens, or prompt-lookup drafts (those the grammar allows); else the drafter's
            drafts = next_drafts(seq.history, seq.lookup, k, seq.matcher, source=seq.prediction) if k > 0 else []
            seq.modeled = seq.policy is not None and not drafts
            if seq.modeled and k > 0 and (n := seq.policy.choose(k)):
                drafts = self.drafter.draft(seq.state, seq.next_token, seq.hidden, n)[:k]
                if seq.matcher is not None and drafts:
                    drafts = drafts[: seq.matcher.valid_prefix(drafts)]
            runs[b] += drafts
            room -= len(drafts)
        return runs

    def _accept_run(self, seq: Sequence, rows: np.ndarray, drafts: list[int], allowed: np.ndarray | None = None,
                    hidden: np.ndarray | None = None) -> None:
        """Sample ``seq``'s tokens from its rows of a step: the first, then each next one while the
        token sampled equals the draft that row was fed (plain decoding would have fed it the
        same token); the KV entries of the rejected drafts are dropped. ``allowed``: the grammar's
        mask of each row (row i: after the first i drafts); ``hidden``: the rows' final hidden states
        (a drafter's next input)."""
        kept = seq.state.length - len(drafts)  # the state's length with the first row's token only
        seq.drafted += len(drafts)
        self.metrics.inc("gemmalite_draft_tokens_total", len(drafts))
        for i, row in enumerate(rows):
            if not self._accept(seq, row, kept + i, None if allowed is None else allowed[i]):
                return
            if i == len(drafts) or seq.next_token != drafts[i]:
                break
            seq.accepted += 1
            self.metrics.inc("gemmalite_accepted_draft_tokens_total")
        if hidden is not None:
            seq.hidden = hidden[i]
        if seq.modeled:
            seq.policy.update(len(drafts), i)
        if drafts and not seq.state.truncate(kept + i):
            raise RuntimeError("KV cache could not roll back a prompt-lookup step")  # SPARE_SLOTS too small

    def _accept(self, seq: Sequence, logits: np.ndarray, length: int | None = None,
                allowed: np.ndarray | None = None) -> bool:
        """Sample the next token from ``logits``; emit its text or finish the sequence. ``length``:
        the tokens the state holds before this one (default all: no drafts after it). False when
        the sequence is done. ``allowed``: the grammar's mask (a constrained sequence); a spent
        thinking budget narrows it to the thought's end."""
        if seq.thought is not None:
            allowed = seq.thought.mask(allowed, logits.shape[0])
        tok = seq.sampler(logits, seq.history, allowed)
        if seq.thought is not None:
            seq.thought.push(tok)
        if tok in seq.stop_ids:
            self._finish(seq, "stop")
            return False
        if seq.matcher is not None:
            seq.matcher.consume(tok)
        if seq.logprobs is not None:
            seq.pending_logprobs.append(token_logprob(logits, tok, seq.logprobs))
        seq.generated += 1
        self.metrics.inc("gemmalite_completion_tokens_total")
        seq.history.append(tok)
        self._emit_all(seq, seq.reader.push(tok))
        if seq.reader.stopped or (seq.matcher is not None and seq.matcher.stopped):
            self._finish(seq, "stop")
        elif seq.generated >= seq.max_tokens or (seq.state.length if length is None else length) >= seq.state.context:
            self._finish(seq, "length")
        else:
            seq.next_token = tok
            return True
        return False

    @staticmethod
    def _take_logprobs(seq: Sequence) -> list[TokenLogprob]:
        out, seq.pending_logprobs = seq.pending_logprobs, []
        return out

    def _emit_all(self, seq: Sequence, events: list) -> None:
        """A reader's events: `Piece`s as they are, other events as `Part`s; the first carries the
        logprobs of the tokens since the last event."""
        for k, ev in enumerate(events):
            lps = self._take_logprobs(seq) if k == 0 else []
            self._emit(seq, Piece(ev.text, lps) if isinstance(ev, Piece) else Part(ev, lps))

    def _emit(self, seq: Sequence, event: Any) -> None:
        try:
            seq.sink(event)
        except Exception:  # the client's event loop is gone: nobody will read the rest
            seq.cancel("client_gone")

    def _finish(self, seq: Sequence, reason: str, error: str | None = None) -> None:
        if seq in self.active:
            self.active.remove(seq)
        if reason in ("stop", "length") and seq.reader is not None:
            events, reason = seq.reader.finish(reason)
            self._emit_all(seq, events)
        if reason != "error":  # a failed step may have left the state half written
            self.cache.put(seq.state)
        seq.state = seq.first_logits = None
        self.metrics.inc("gemmalite_finished_total", labels={"reason": reason})
        if reason == "cancelled":
            self.metrics.inc("gemmalite_cancelled_total", labels={"cause": seq.cancel_cause or "abandoned"})
        self._emit(seq, Finish(reason, len(seq.ids), seq.generated, seq.cached, error, seq.drafted, seq.accepted,
                               self._take_logprobs(seq)))
