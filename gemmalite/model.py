"""`Model`: the Python API over one loaded checkpoint, and `ChatSession`, one conversation.

A `Model` holds only what every call shares and none changes: the configuration, the `Engine`
(weights) and the tokenizer. Each call builds its own state (KV caches, sampler, statistics),
so one model serves several threads at once. A `ChatSession` owns the KV state of its
conversation, so that a follow-up turn runs only its new tokens; ``Model.chat`` is the
convenient form with one default session.
"""
from __future__ import annotations

import threading
from typing import Any, Callable, Iterable, Iterator

import numpy as np

from .errors import ConfigError, TokenizerError
from .models.gemma.config import ModelConfig
from .runtime import inputs
from .runtime.cache import KVState
from .runtime.engine import Engine, SoftTokens
from .runtime.generate import (DEFAULT_MAX_NEW_TOKENS, GenerationDefaults, GenerationStats, Stream,
                               cut_tokens_at_strings, fit_prompt, generate_ids, prompt_lookup_drafts, stop_sets,
                               text_pieces)
from .runtime.sampling import SamplingParams
from .tokenizer import Tokenizer
from .vision.prompt import Vision, message_images


class Model:
    def __init__(self, cfg: ModelConfig, engine: Engine, tokenizer: Tokenizer | None, defaults: GenerationDefaults,
                 source: str = "", vision: Vision | None = None):
        self.config = cfg
        self.vision = vision  # the vision tower, when the checkpoint has one (images in prompts)
        self.engine = engine
        self._tokenizer = tokenizer
        self.defaults = defaults
        self.source = source
        self._default_session: ChatSession | None = None
        self._session_lock = threading.Lock()

    @property
    def context(self) -> int:
        return self.engine.context

    @property
    def tokenizer(self) -> Tokenizer:
        if self._tokenizer is None:
            raise TokenizerError(f"{self.source or 'this model'} has no tokenizer: use token ids (logits, generate_tokens)")
        return self._tokenizer

    def new_state(self) -> KVState:
        return self.engine.new_state()

    def check_ids(self, ids: Iterable[int]) -> np.ndarray:
        """Token ids as an int64 array, each an integer inside the vocabulary (else `InputError`)."""
        return inputs.token_ids(ids, self.config.vocab_size)

    def _fit(self, arr: np.ndarray, max_new_tokens: int, truncate: bool) -> np.ndarray:
        return fit_prompt(arr, self.context, max_new_tokens, truncate, self.config.bos_token_id)

    def _options(self, max_new_tokens: Any, truncate: Any, stream: Any, *sampling: Any) -> tuple[int, SamplingParams]:
        """A generation call's options, checked at the call: (max_new_tokens, sampling parameters)."""
        inputs.flag(truncate, "truncate")
        inputs.flag(stream, "stream")
        return inputs.integer(max_new_tokens, "max_new_tokens", 0), self.defaults.params(*sampling)

    def with_images(self, ids: Iterable[int], images, **limits: int) -> tuple[np.ndarray, SoftTokens | None]:
        """The prompt as it runs: each image placeholder of ``ids`` expanded with the next image's
        soft tokens (as transformers' Gemma4Processor places them); unchanged without images.
        ``limits``: `Vision.prompt`'s (``max_pixels``, ``max_soft_tokens``)."""
        arr = self.check_ids(ids)
        if not images:
            return arr, None
        if self.vision is None:
            raise ConfigError(f"{self.source or 'this model'} has no vision tower: it cannot take images")
        p = self.vision.prompt(arr, list(images), **limits)
        return p.ids, SoftTokens(p.rows, p.vectors, p.keys)

    def _prompt(self, ids: Iterable[int], images, max_new_tokens: int, truncate: bool):
        """(ids, soft tokens) as they will run: pictures expanded, fitted to the context (a prompt
        with pictures is never cut)."""
        arr, soft = self.with_images(ids, images)
        return self._fit(arr, max_new_tokens, truncate and soft is None), soft

    # -- numerical entry points -------------------------------------------------------
    def logits(self, ids: Iterable[int], images=None) -> np.ndarray:
        """float32 ``[T, vocab]`` logits of a fresh full prefill (after softcap); no state kept.
        ``images`` fill the prompt's image placeholders (T counts their soft tokens)."""
        arr, soft = self._prompt(ids, images, 0, truncate=False)
        return self.engine.logits(self.engine.forward(self.new_state(), arr, soft=soft))

    def hidden_states(self, ids: Iterable[int]) -> list[np.ndarray]:
        """Per-layer hidden states (debugging hook), transformers' ``output_hidden_states`` layout:
        the scaled embeddings, each layer's output, and the last one after the final norm."""
        arr = self._fit(self.check_ids(ids), 0, truncate=False)
        captured: list[np.ndarray] = []
        final = self.engine.forward(self.new_state(), arr, capture=captured)
        captured[-1] = final
        return captured

    # -- generation ---------------------------------------------------------------------
    def _token_stream(self, state: KVState, arr: np.ndarray, soft: SoftTokens | None, *, max_new_tokens: int,
                      params: SamplingParams, stop_ids: set[int], stats: GenerationStats, drafts: int = 0):
        return generate_ids(self.engine, state, arr, max_new_tokens=max_new_tokens, params=params,
                            stop_ids=stop_ids, stats=stats, soft=soft, prompt_lookup=drafts)

    def generate_tokens(self, ids: list[int], *, max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS, temperature=None,
                        top_k=None, top_p=None, min_p=None, repetition_penalty=None, seed=None, stop=None,
                        stream: bool = False, truncate: bool = False, images=None, prompt_lookup: int | bool = False):
        """New token ids after ``ids`` (a list, or with ``stream=True`` a `Stream` of ids whose
        ``stats`` fill in as it runs). ``images`` fill the image placeholders of ``ids``.

        ``stop``: extra stop token ids, or stop strings (needs a tokenizer); the stopping
        token is not returned. ``temperature=0`` is greedy. ``prompt_lookup``: draft tokens
        copied from the text's own n-grams and verified in one step (True: 3 per step; the same
        tokens as without it, faster when the reply repeats its input).
        """
        self.check_ids(ids)
        max_new_tokens, params = self._options(max_new_tokens, truncate, stream, temperature, top_k, top_p, min_p,
                                               repetition_penalty, seed)
        drafts = prompt_lookup_drafts(prompt_lookup)
        stop_ids, stop_strings = stop_sets(stop, self.defaults, self._tokenizer, chat=False,
                                           vocab_size=self.config.vocab_size)
        if stop_strings:
            self.tokenizer  # noqa: B018 - stop strings need a tokenizer: raise now, not mid-stream
        arr, soft = self._prompt(ids, images, max_new_tokens, truncate)

        def items(stats: GenerationStats):
            it = self._token_stream(self.new_state(), arr, soft, max_new_tokens=max_new_tokens, params=params,
                                    stop_ids=stop_ids, stats=stats, drafts=drafts)
            return cut_tokens_at_strings(it, self.tokenizer, stop_strings, stats) if stop_strings else it

        out = Stream(items)
        return out if stream else list(out)

    def generate(self, prompt: str, *, max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS, temperature=None, top_k=None,
                 top_p=None, min_p=None, repetition_penalty=None, seed=None, stop=None, stream: bool = False,
                 truncate: bool = False, prompt_lookup: int | bool = False):
        """Continue ``prompt`` (plain text, ``<bos>`` added): the new text, or a `Stream` of pieces."""
        inputs.text(prompt, "prompt")
        max_new_tokens, params = self._options(max_new_tokens, truncate, stream, temperature, top_k, top_p, min_p,
                                               repetition_penalty, seed)
        drafts = prompt_lookup_drafts(prompt_lookup)
        stop_sets(stop, self.defaults, None, chat=False)  # checked before the tokenizer is asked for
        return self.text(self.new_state(), self.tokenizer.encode(prompt), chat=False, stream=stream,
                          max_new_tokens=max_new_tokens, stop=stop, truncate=truncate, params=params, drafts=drafts)

    def session(self) -> "ChatSession":
        """A new conversation with its own KV state (any number can run side by side)."""
        return ChatSession(self)

    def chat(self, messages: list[dict[str, Any]], **kwargs: Any):
        """`ChatSession.chat` on the model's default session: the KV cache of the previous call is
        reused for the longest common token prefix, so a follow-up turn only runs its new tokens.
        For conversations in several threads, give each its own `session()` (a reply asked for
        while another holds the default session runs on a state of its own, see `ChatSession`)."""
        with self._session_lock:
            if self._default_session is None:
                self._default_session = ChatSession(self)
            session = self._default_session
        return session.chat(messages, **kwargs)

    def reset_chat(self) -> None:
        with self._session_lock:
            self._default_session = None

    def text(self, state: KVState | None, ids: list[int], *, chat: bool, stream: bool, max_new_tokens: int,
              stop, truncate: bool, params: SamplingParams, session: "ChatSession | None" = None, images=None,
              drafts: int = 0):
        """Generate text after ``ids`` on an explicit ``state`` (what `generate` and `chat` run): tokens,
        then text cut at stop strings; ``drafts``: prompt-lookup draft tokens per step (0: none).
        Inputs are checked at the call; with a ``session`` (``state`` None) the reply runs on the
        state `ChatSession.replying` gives it when it starts."""
        stop_ids, stop_strings = stop_sets(stop, self.defaults, self._tokenizer, chat=chat)
        arr, soft = self._prompt(ids, images, max_new_tokens, truncate)

        def items(stats: GenerationStats):
            def run(st: KVState) -> Iterator[str]:
                tokens = self._token_stream(st, arr, soft, max_new_tokens=max_new_tokens, params=params,
                                            stop_ids=stop_ids, stats=stats, drafts=drafts)
                return text_pieces(tokens, self.tokenizer, stop_strings, stats)

            return run(state) if session is None else session.replying(run)

        out = Stream(items)
        return out if stream else "".join(out)


class ChatSession:
    """One conversation: its KV state is reused across turns for the common token prefix.

    The state serves one reply at a time, from the reply's first piece to its last (or until its
    stream is closed). A reply that starts while another still holds it -- a second stream
    consumed in the same thread, or a call from another thread -- neither waits (which in one
    thread would never end) nor fails: it runs on a fresh state of its own, computing its whole
    prompt (the reply a new session would give), and leaves the conversation's state to the first."""

    def __init__(self, model: Model):
        self.model = model
        self.state = model.new_state()
        self._lock = threading.Lock()

    def chat(self, messages: list[dict[str, Any]], *, max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS, temperature=None,
             top_k=None, top_p=None, min_p=None, repetition_penalty=None, seed=None, stop=None, stream: bool = False,
             truncate: bool = False, prompt_lookup: int | bool = False, **template_kwargs: Any):
        """The model's reply to the conversation ``messages`` (the text, or a `Stream` of pieces).
        Images come as content parts ``{"type": "image", "image": path | bytes | PIL image | array}``."""
        m = self.model
        inputs.messages(messages)
        max_new_tokens, params = m._options(max_new_tokens, truncate, stream, temperature, top_k, top_p, min_p,
                                            repetition_penalty, seed)
        drafts = prompt_lookup_drafts(prompt_lookup)
        stop_sets(stop, m.defaults, None, chat=True)  # checked before the template runs
        ids = m.tokenizer.chat_ids(messages, add_generation_prompt=True, **template_kwargs)
        return m.text(None, ids, chat=True, stream=stream, max_new_tokens=max_new_tokens, stop=stop,
                       truncate=truncate, params=params, session=self, images=message_images(messages),
                       drafts=drafts)

    def replying(self, run: Callable[[KVState], Iterator[Any]]) -> Iterator[Any]:
        """``run(state)``'s items, on the conversation's state when no other reply holds it (held
        from the first item to the last, or until closed), else on a fresh state of its own."""
        if not self._lock.acquire(blocking=False):
            yield from run(self.model.new_state())
            return
        try:
            yield from run(self.state)
        finally:
            self._lock.release()

    def reset(self) -> None:
        """Forget the conversation. A reply still running keeps the state it has; the next starts afresh."""
        if self._lock.acquire(blocking=False):
            try:
                self.state.reset()
            finally:
                self._lock.release()
        else:
            self.state = self.model.new_state()
