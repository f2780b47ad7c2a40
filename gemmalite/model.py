"""The host side: token ids in, text out.

The host owns the tokenizer, the embedding and PLE row lookups, the LM head and sampling;
the `DecoderGraph` owns the layers and the KV cache. A `Model` keeps one conversation state
so that `chat` reuses the cached prefix of the conversation instead of recomputing it.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator

import numpy as np

from .cache import KVState
from .config import ModelConfig
from .errors import ContextError, TokenizerError
from .graph import DecoderGraph
from .kernels import softcap
from .matrix import Matrix
from .sampling import Sampler, SamplingParams
from .tokenizer import Tokenizer

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
    def from_generation_config(cls, gc: dict[str, Any] | None, cfg: ModelConfig) -> "GenerationDefaults":
        gc = gc or {}
        eos = gc.get("eos_token_id", [])
        stop = list(dict.fromkeys([*cfg.eos_token_ids, *(eos if isinstance(eos, list) else [eos])]))
        if not gc.get("do_sample", False):
            return cls(stop_ids=[int(s) for s in stop if s is not None])
        return cls(temperature=float(gc.get("temperature", 1.0)), top_k=gc.get("top_k"), top_p=gc.get("top_p"),
                   min_p=gc.get("min_p"), repetition_penalty=gc.get("repetition_penalty"),
                   stop_ids=[int(s) for s in stop if s is not None])


class Model:
    def __init__(self, cfg: ModelConfig, graph: DecoderGraph, embed: Matrix, lm_head: Matrix,
                 ple_table: Matrix | None, tokenizer: Tokenizer | None, context: int,
                 defaults: GenerationDefaults, source: str = ""):
        self.config = cfg
        self.graph = graph
        self.embed = embed
        self.lm_head = lm_head
        self.ple_table = ple_table
        self._tokenizer = tokenizer
        self.context = context
        self.defaults = defaults
        self.source = source
        self._chat_state: KVState | None = None
        self.stats: dict[str, float] = {}  # of the last generation: prompt/cached/new tokens, seconds

    # -- host pieces -------------------------------------------------------------------
    @property
    def tokenizer(self) -> Tokenizer:
        if self._tokenizer is None:
            raise TokenizerError(f"{self.source or 'this model'} has no tokenizer: use token ids (logits, generate_tokens)")
        return self._tokenizer

    def _check_ids(self, ids: Iterable[int]) -> np.ndarray:
        arr = np.asarray(list(ids), dtype=np.int64)
        if arr.ndim != 1 or arr.size == 0:
            raise ValueError("token ids must be a non-empty list of integers")
        bad = arr[(arr < 0) | (arr >= self.config.vocab_size)]
        if bad.size:
            raise ValueError(f"token id {int(bad[0])} is outside the vocabulary [0, {self.config.vocab_size})")
        return arr

    def _forward(self, state: KVState, ids: np.ndarray, keep: np.ndarray | None = None,
                 capture: list | None = None) -> np.ndarray:
        """Embed ``ids`` (host row lookups), run the graph, record the ids as cached."""
        cfg = self.config
        x0 = self.embed.rows(ids) * cfg.embed_scale
        ple = None
        if self.ple_table is not None:
            ple = self.ple_table.rows(ids) * np.float32(np.sqrt(cfg.ple_dim))
        h = self.graph.forward(state, x0, ple, keep=keep, capture=capture)
        state.tokens.extend(int(i) for i in ids)
        return h

    def _logits(self, h: np.ndarray) -> np.ndarray:
        return softcap(self.lm_head.matmul(h), self.config.final_logit_softcapping)

    def new_state(self) -> KVState:
        return self.graph.new_state(self.context)

    # -- numerical entry points -------------------------------------------------------
    def logits(self, ids: Iterable[int]) -> np.ndarray:
        """float32 ``[len(ids), vocab]`` logits of a fresh full prefill (after softcap); no state kept."""
        arr = self._check_ids(ids)
        self._check_fits(len(arr))
        return self._logits(self._forward(self.new_state(), arr))

    def hidden_states(self, ids: Iterable[int]) -> list[np.ndarray]:
        """Per-layer hidden states (debugging hook), transformers' ``output_hidden_states`` layout:
        the scaled embeddings, each layer's output, and the last one after the final norm."""
        arr = self._check_ids(ids)
        self._check_fits(len(arr))
        captured: list[np.ndarray] = []
        final = self._forward(self.new_state(), arr, capture=captured)
        captured[-1] = final
        return captured

    def _check_fits(self, n: int) -> None:
        if n > self.context:
            raise ContextError(f"{n} tokens do not fit in the context of {self.context} tokens "
                               f"(load with a larger context=, or pass truncate=True)")

    # -- generation ---------------------------------------------------------------------
    def _params(self, temperature, top_k, top_p, min_p, repetition_penalty, seed) -> SamplingParams:
        d = self.defaults
        return SamplingParams(
            temperature=d.temperature if temperature is None else float(temperature),
            top_k=d.top_k if top_k is None else int(top_k),
            top_p=d.top_p if top_p is None else float(top_p),
            min_p=d.min_p if min_p is None else float(min_p),
            repetition_penalty=d.repetition_penalty if repetition_penalty is None else float(repetition_penalty),
            seed=seed,
        )

    def _generate(self, state: KVState, ids: list[int], *, max_new_tokens: int, params: SamplingParams,
                  stop_ids: set[int], truncate: bool) -> Iterator[int]:
        """Prefill what ``state`` does not already hold of ``ids``, then decode token by token."""
        if max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
        arr = self._check_ids(ids)
        if len(arr) > self.context:
            if not truncate:
                self._check_fits(len(arr))
            arr = arr[len(arr) - max(1, self.context - max_new_tokens):]
        reuse = _common_prefix(state.tokens, arr.tolist())
        reuse = min(reuse, len(arr) - 1)  # the last prompt token must run to give logits
        if not state.truncate(reuse):
            state.reset()
            reuse = 0
        return self._decode_loop(state, arr, reuse, max_new_tokens, params, stop_ids)

    def _decode_loop(self, state, arr, reuse, max_new_tokens, params, stop_ids) -> Iterator[int]:
        sampler = Sampler(params)
        history = arr.tolist()
        stats = self.stats = {"prompt_tokens": len(arr), "cached_tokens": reuse, "new_tokens": 0,
                              "prefill_s": 0.0, "decode_s": 0.0}
        if max_new_tokens == 0:
            return
        t0 = time.perf_counter()
        new = arr[reuse:]
        h = self._forward(state, new, keep=np.array([len(new) - 1]))
        stats["prefill_s"] = time.perf_counter() - t0
        for step in range(max_new_tokens):
            tok = sampler(self._logits(h)[0], history)
            if tok in stop_ids:
                return
            stats["new_tokens"] += 1
            yield tok
            history.append(tok)
            if step + 1 == max_new_tokens or state.length >= self.context:
                return
            t0 = time.perf_counter()
            h = self._forward(state, np.array([tok]))
            stats["decode_s"] += time.perf_counter() - t0

    def _stop_sets(self, stop, chat: bool) -> tuple[set[int], list[str]]:
        ids = set(self.defaults.stop_ids)
        if chat and self._tokenizer is not None:
            ids |= {t for s in END_OF_TURN_TOKENS if (t := self._tokenizer.token_id(s)) is not None}
        strings: list[str] = []
        for s in [stop] if isinstance(stop, (str, int)) else (stop or []):
            if isinstance(s, str):
                strings.append(s)
            else:
                ids.add(int(s))
        return ids, strings

    def generate_tokens(self, ids: list[int], *, max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS, temperature=None,
                        top_k=None, top_p=None, min_p=None, repetition_penalty=None, seed=None, stop=None,
                        stream: bool = False, truncate: bool = False):
        """New token ids after ``ids`` (a list, or an iterator with ``stream=True``).

        ``stop``: extra stop token ids, or stop strings (needs a tokenizer); the stopping
        token is not returned. ``temperature=0`` is greedy.
        """
        params = self._params(temperature, top_k, top_p, min_p, repetition_penalty, seed)
        stop_ids, stop_strings = self._stop_sets(stop, chat=False)
        it = self._generate(self.new_state(), list(ids), max_new_tokens=max_new_tokens, params=params,
                            stop_ids=stop_ids, truncate=truncate)
        if stop_strings:
            it = self._cut_token_stream(it, stop_strings)
        return it if stream else list(it)

    def _cut_token_stream(self, it: Iterator[int], stops: list[str]) -> Iterator[int]:
        tok, out = self.tokenizer, []
        for t in it:
            if any(s in tok.decode(out + [t]) for s in stops):
                return
            out.append(t)
            yield t

    def generate(self, prompt: str, *, max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS, temperature=None, top_k=None,
                 top_p=None, min_p=None, repetition_penalty=None, seed=None, stop=None, stream: bool = False,
                 truncate: bool = False):
        """Continue ``prompt`` (plain text, ``<bos>`` added): the new text, or an iterator of pieces."""
        return self._generate_text(self.new_state(), self.tokenizer.encode(prompt), chat=False, stream=stream,
                                   max_new_tokens=max_new_tokens, stop=stop, truncate=truncate,
                                   params=self._params(temperature, top_k, top_p, min_p, repetition_penalty, seed))

    def chat(self, messages: list[dict[str, Any]], *, max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS, temperature=None,
             top_k=None, top_p=None, min_p=None, repetition_penalty=None, seed=None, stop=None, stream: bool = False,
             truncate: bool = False, **template_kwargs: Any):
        """The model's reply to a conversation. The KV cache of the previous call is reused for the
        longest common token prefix, so a follow-up turn only runs its new tokens."""
        ids = self.tokenizer.chat_ids(messages, add_generation_prompt=True, **template_kwargs)
        if self._chat_state is None:
            self._chat_state = self.new_state()
        return self._generate_text(self._chat_state, ids, chat=True, stream=stream, max_new_tokens=max_new_tokens,
                                   stop=stop, truncate=truncate,
                                   params=self._params(temperature, top_k, top_p, min_p, repetition_penalty, seed))

    def reset_chat(self) -> None:
        self._chat_state = None

    def _generate_text(self, state: KVState, ids: list[int], *, chat: bool, stream: bool, max_new_tokens: int,
                       stop, truncate: bool, params: SamplingParams):
        """The text path shared by `generate` and `chat`: tokens, then text cut at stop strings."""
        stop_ids, stop_strings = self._stop_sets(stop, chat=chat)
        it = self._text(self._generate(state, ids, max_new_tokens=max_new_tokens, params=params,
                                       stop_ids=stop_ids, truncate=truncate), stop_strings)
        return it if stream else "".join(it)

    def _text(self, tokens: Iterator[int], stops: list[str]) -> Iterator[str]:
        """Token ids to text pieces; cut at the first stop string, holding back text that may start one."""
        stream = self.tokenizer.stream()
        hold = max((len(s) for s in stops), default=1) - 1
        pending = ""
        for t in tokens:
            pending += stream.push(t)
            cut = _first_stop(pending, stops)
            if cut >= 0:
                if pending[:cut]:
                    yield pending[:cut]
                return
            if len(pending) > hold:
                yield pending[: len(pending) - hold]
                pending = pending[len(pending) - hold:]
        pending += stream.flush()
        cut = _first_stop(pending, stops)
        pending = pending[:cut] if cut >= 0 else pending
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
