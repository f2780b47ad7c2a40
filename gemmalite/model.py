"""`Model`: the Python API over one loaded checkpoint, and `ChatSession`, one conversation.

A `Model` holds only what every call shares and none changes: the configuration, the `Engine`
(weights) and the tokenizer. Each call builds its own state (KV caches, sampler, statistics),
so one model serves several threads at once. A `ChatSession` owns the KV state of its
conversation, so that a follow-up turn runs only its new tokens; ``Model.chat`` is the
convenient form with one default session.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator

import numpy as np

from .chat import content, history
from .chat.parser import ChatReply, OutputParser, reply_events
from .errors import ConfigError, InputError, TokenizerError
from .models.gemma.config import ModelConfig
from .runtime import inputs
from .runtime.budget import ThoughtBudget
from .runtime.cache import KVState
from .runtime.checkpoints import marker_ids
from .runtime.constrain import Grammar, constraint
from .runtime.drafting import Drafter
from .runtime.engine import Engine, SoftTokens, place_blocks
from .runtime.generate import (DEFAULT_MAX_NEW_TOKENS, GenerationDefaults, GenerationStats, Stream,
                               cut_tokens_at_strings, fit_prompt, generate_ids, prompt_lookup_drafts, stop_sets,
                               text_pieces)
from .runtime.logprobs import logprobs_option
from .runtime.sampling import SamplingParams
from .tokenizer import Tokenizer

if TYPE_CHECKING:  # the media towers' modules load with a checkpoint or a message that has media
    from .audio.prompt import Audio
    from .vision.prompt import Vision


class Model:
    def __init__(self, cfg: ModelConfig, engine: Engine, tokenizer: Tokenizer | None, defaults: GenerationDefaults,
                 source: str = "", vision: Vision | None = None, audio: Audio | None = None,
                 drafter: Drafter | None = None):
        self.config = cfg
        self.drafter = drafter  # an MTP drafter (`load(..., drafter=)`): every generation drafts with it
        self.vision = vision  # the vision tower, when the checkpoint has one (images in prompts)
        self.audio = audio  # the audio tower, when the checkpoint has one (clips in prompts)
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

    def with_media(self, ids: Iterable[int], images=None, audio=None, *, max_seconds: float | None = None,
                   **limits: int) -> tuple[np.ndarray, SoftTokens | None]:
        """The prompt as it runs: each image placeholder of ``ids`` expanded with the next image's
        soft tokens, each audio placeholder with the next clip's (as transformers' Gemma4Processor
        places them); unchanged without either. ``limits``: `Vision.blocks`'s (``max_pixels``,
        ``max_soft_tokens``); ``max_seconds``: the longest clip taken (default and at most: what the
        context holds, 25 soft tokens a second), refused from a file's header before decoding."""
        arr = self.check_ids(ids)
        slots = []
        if images:
            if self.vision is None:
                raise ConfigError(f"{self.source or 'this model'} has no vision tower: it cannot take images")
            slots += self.vision.blocks(arr, list(images), **limits)
        if audio:
            if self.audio is None:
                raise ConfigError(f"{self.source or 'this model'} has no audio tower: it cannot take audio")
            from .audio.prompt import TOKENS_PER_SECOND

            fits = self.context / TOKENS_PER_SECOND  # a longer clip could never run: refuse it before the tower
            slots += self.audio.blocks(arr, list(audio), max_seconds=fits if max_seconds is None else min(max_seconds, fits))
        return place_blocks(arr, slots, self.config.hidden_size)

    def with_images(self, ids: Iterable[int], images, **limits: int) -> tuple[np.ndarray, SoftTokens | None]:
        """`with_media` with images only."""
        return self.with_media(ids, images, **limits)

    def _prompt(self, ids: Iterable[int], images, max_new_tokens: int, truncate: bool, audio=None):
        """(ids, soft tokens) as they will run: pictures and clips expanded, fitted to the context
        (a prompt with either is never cut)."""
        arr, soft = self.with_media(ids, images, audio)
        return self._fit(arr, max_new_tokens, truncate and soft is None), soft

    # -- numerical entry points -------------------------------------------------------
    def logits(self, ids: Iterable[int], images=None, audio=None) -> np.ndarray:
        """float32 ``[T, vocab]`` logits of a fresh full prefill (after softcap); no state kept.
        ``images`` fill the prompt's image placeholders, ``audio`` (clips: paths, bytes, file
        objects, 16 kHz arrays or ``(array, sample_rate)``) its audio placeholders, in order (T
        counts their soft tokens)."""
        arr, soft = self._prompt(ids, images, 0, truncate=False, audio=audio)
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
                      params: SamplingParams, stop_ids: set[int], stats: GenerationStats, drafts: int = 0,
                      grammar: Grammar | None = None, logprobs: int | None = None,
                      thinking_budget: int | None = None, checkpoints: bool = False):
        """`generate_ids` on ``state``; ``checkpoints`` (a conversation's state): checkpoint its
        sliding rings where the prompt's last turn starts and where it ends (`runtime.checkpoints`)."""
        matcher = grammar.matcher(stop_ids) if grammar is not None else None
        budget = ThoughtBudget.of(self.tokenizer, thinking_budget) if thinking_budget is not None else None
        marks = marker_ids(self._tokenizer) if checkpoints else None
        return generate_ids(self.engine, state, arr, max_new_tokens=max_new_tokens, params=params,
                            stop_ids=stop_ids, stats=stats, soft=soft, prompt_lookup=drafts, matcher=matcher,
                            logprobs=logprobs, drafter=self.drafter, budget=budget, checkpoints=marks)

    def constraint(self, json_schema=None, regex=None, grammar=None) -> Grammar | None:
        """The compiled `Grammar` of a call's ``json_schema`` / ``regex`` / ``grammar`` options
        (at most one; None without any); an engine-refused one is an `InputError` naming it."""
        return constraint(self._tokenizer, json_schema=json_schema, regex=regex, grammar=grammar)

    def generate_tokens(self, ids: list[int], *, max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS, temperature=None,
                        top_k=None, top_p=None, min_p=None, repetition_penalty=None, seed=None, stop=None,
                        stream: bool = False, truncate: bool = False, images=None, audio=None, prompt_lookup: int | bool = False,
                        json_schema=None, regex=None, grammar=None, logprobs=None):
        """New token ids after ``ids`` (a list, or with ``stream=True`` a `Stream` of ids whose
        ``stats`` fill in as it runs). ``images`` / ``audio`` fill the image / audio placeholders of ``ids``.

        ``stop``: extra stop token ids, or stop strings (needs a tokenizer); the stopping
        token is not returned. ``temperature=0`` is greedy. ``prompt_lookup``: draft tokens
        copied from the text's own n-grams and verified in one step (True: 3 per step; the same
        tokens as without it, faster when the reply repeats its input).

        Constraints (at most one): ``json_schema`` (a dict or JSON text), ``regex``, ``grammar``
        (Lark text in llguidance's dialect, or a compiled `Grammar`): every token is sampled among
        those the grammar allows (temperature, top-k/p, min-p and penalties apply over them).
        ``logprobs``: True, or a count of top tokens (<= 20): ``stats.logprobs`` holds one
        `TokenLogprob` per new token; a call that does not stream then returns a `Completion`.
        """
        self.check_ids(ids)
        max_new_tokens, params = self._options(max_new_tokens, truncate, stream, temperature, top_k, top_p, min_p,
                                               repetition_penalty, seed)
        drafts = prompt_lookup_drafts(prompt_lookup)
        top = logprobs_option(logprobs)
        gram = self.constraint(json_schema, regex, grammar)
        stop_ids, stop_strings = stop_sets(stop, self.defaults, self._tokenizer, chat=False,
                                           vocab_size=self.config.vocab_size)
        if stop_strings:
            self.tokenizer  # noqa: B018 - stop strings need a tokenizer: raise now, not mid-stream
        arr, soft = self._prompt(ids, images, max_new_tokens, truncate, audio)

        def items(stats: GenerationStats):
            it = self._token_stream(self.new_state(), arr, soft, max_new_tokens=max_new_tokens, params=params,
                                    stop_ids=stop_ids, stats=stats, drafts=drafts, grammar=gram, logprobs=top)
            return cut_tokens_at_strings(it, self.tokenizer, stop_strings, stats) if stop_strings else it

        out = Stream(items)
        if stream:
            return out
        ids_out = list(out)
        return ids_out if top is None else Completion(ids_out, out.stats)

    def generate(self, prompt: str, *, max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS, temperature=None, top_k=None,
                 top_p=None, min_p=None, repetition_penalty=None, seed=None, stop=None, stream: bool = False,
                 truncate: bool = False, prompt_lookup: int | bool = False, json_schema=None, regex=None, grammar=None,
                 logprobs=None):
        """Continue ``prompt`` (plain text, ``<bos>`` added): the new text, or a `Stream` of pieces.
        ``json_schema`` / ``regex`` / ``grammar`` and ``logprobs`` as in `generate_tokens`."""
        inputs.text(prompt, "prompt")
        max_new_tokens, params = self._options(max_new_tokens, truncate, stream, temperature, top_k, top_p, min_p,
                                               repetition_penalty, seed)
        drafts = prompt_lookup_drafts(prompt_lookup)
        top = logprobs_option(logprobs)
        stop_sets(stop, self.defaults, None, chat=False)  # checked before the tokenizer is asked for
        gram = self.constraint(json_schema, regex, grammar)
        return self.text(self.new_state(), self.tokenizer.encode(prompt), chat=False, stream=stream,
                          max_new_tokens=max_new_tokens, stop=stop, truncate=truncate, params=params, drafts=drafts,
                          grammar=gram, logprobs=top)

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
             drafts: int = 0, audio=None, grammar: Grammar | None = None, logprobs: int | None = None):
        """Generate text after ``ids`` on an explicit ``state`` (what `generate` and `chat` run): tokens,
        then text cut at stop strings; ``drafts``: prompt-lookup draft tokens per step (0: none);
        ``grammar``: a compiled constraint; ``logprobs``: top count (None: off; a call that does not
        stream then returns a `Completion`). Inputs are checked at the call; with a ``session``
        (``state`` None) the reply runs on the state `ChatSession.replying` gives it when it starts."""
        stop_ids, stop_strings = stop_sets(stop, self.defaults, self._tokenizer, chat=chat)
        arr, soft = self._prompt(ids, images, max_new_tokens, truncate, audio)

        def items(stats: GenerationStats):
            def run(st: KVState) -> Iterator[str]:
                tokens = self._token_stream(st, arr, soft, max_new_tokens=max_new_tokens, params=params,
                                            stop_ids=stop_ids, stats=stats, drafts=drafts, grammar=grammar,
                                            logprobs=logprobs, checkpoints=session is not None)
                return text_pieces(tokens, self.tokenizer, stop_strings, stats)

            return run(state) if session is None else session.replying(run)

        out = Stream(items)
        if stream:
            return out
        text = "".join(out)
        return text if logprobs is None else Completion(text, out.stats)

    def reply(self, state: KVState | None, ids: list[int], *, stream: bool, max_new_tokens: int, stop, truncate: bool,
              params: SamplingParams, tools: bool, max_calls: int | None = None, session: "ChatSession | None" = None,
              images=None, audio=None, drafts: int = 0, grammar: Grammar | None = None,
              logprobs: int | None = None, thinking_budget: int | None = None):
        """A chat reply with its parts apart (`ChatReply`, or with ``stream`` a `Stream` of the
        `chat.parser` events): `text`'s generation, read by the `OutputParser` (``tools``: parse
        tool calls; ``max_calls``: end the turn after that many); stop strings end the content only;
        ``session`` as in `text`; ``thinking_budget``: thought tokens before the thought is closed
        (`runtime.budget`)."""
        stop_ids, stop_strings = stop_sets(stop, self.defaults, self._tokenizer, chat=True)
        arr, soft = self._prompt(ids, images, max_new_tokens, truncate, audio)
        parser = OutputParser(self.tokenizer, tools=tools, stops=stop_strings, max_calls=max_calls)

        def items(stats: GenerationStats):
            def run(st: KVState) -> Iterator[Any]:
                tokens = self._token_stream(st, arr, soft, max_new_tokens=max_new_tokens, params=params,
                                            stop_ids=stop_ids, stats=stats, drafts=drafts, grammar=grammar,
                                            logprobs=logprobs, thinking_budget=thinking_budget,
                                            checkpoints=session is not None)
                return reply_events(tokens, parser, stats)

            return run(state) if session is None else session.replying(run)

        out = Stream(items)
        if stream:
            return out
        reply = ChatReply.of(out)
        reply.stats, reply.logprobs = out.stats, out.stats.logprobs
        return reply


@dataclass
class Completion:
    """A finished call that asked for logprobs: its ``output`` (text, or token ids from
    `Model.generate_tokens`) and its `GenerationStats` (``logprobs``, ``finish_reason``, counts)."""

    output: Any
    stats: GenerationStats

    @property
    def logprobs(self):
        return self.stats.logprobs

    @property
    def finish_reason(self) -> str | None:
        return self.stats.finish_reason


def _message_media(messages) -> dict[str, list]:
    """The ``images`` and ``audio`` of chat messages (`vision.prompt.message_images`,
    `audio.prompt.message_audio`); only messages in the content-part form can hold media, so
    only they load those modules."""
    if not any(isinstance(m, dict) and isinstance(m.get("content"), list) for m in messages):
        return {"images": [], "audio": []}
    from .audio.prompt import message_audio
    from .vision.prompt import message_images

    return {"images": message_images(messages), "audio": message_audio(messages)}


class ChatSession:
    """One conversation: its KV state is reused across turns for the common token prefix (where
    a sliding layer's cache cannot roll back so far, from its newest checkpoint before it: the
    state keeps some where each prompt's last turn starts and where it ends, `runtime.checkpoints`).

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
             truncate: bool = False, prompt_lookup: int | bool = False, tools: list[dict[str, Any]] | None = None,
             tool_choice: str | dict | None = None, parallel_tool_calls: bool = True, thinking: bool | None = None,
             structured: bool = False, json_schema=None, regex=None, grammar=None, logprobs=None,
             response_format: dict | None = None, thinking_budget: int | None = None, **template_kwargs: Any):
        """The model's reply to the conversation ``messages``: the text (or a `Stream` of pieces);
        with ``tools``, ``tool_choice``, ``thinking`` or ``structured=True``, a `ChatReply` (content,
        reasoning, tool calls, finish reason, logprobs), or a `Stream` of `chat.parser` events.
        Images come as content parts ``{"type": "image", "image": path | bytes | PIL image | array}``,
        audio clips as ``{"type": "audio", "audio": path | bytes | file | array | (array, sample_rate)}``,
        or in OpenAI's shapes (``image_url`` with a data URL, ``input_audio``: `chat.content`); a part
        of any other type is an `InputError` naming it;
        messages may carry OpenAI's ``tool_calls`` (arguments as JSON text), ``role: "tool"``
        results and ``reasoning_content``. ``tools``: OpenAI's function declarations;
        ``tool_choice``: "auto" (the default with tools: text, then calls if the model makes any),
        "required" (calls only), ``{"type": "function", "function": {"name": ...}}`` (calls of that
        one) or "none" (the tools are not declared); with tools, the calls' arguments are
        constrained to each tool's ``parameters`` schema (`chat.tool_grammar`).
        ``parallel_tool_calls=False``: one call at most; ``thinking``: let the model think first
        (off by default). ``json_schema`` / ``regex`` / ``grammar`` and ``logprobs`` as in
        `Model.generate_tokens` (a constraint of its own does not go with tools); ``response_format``:
        OpenAI's (``json_object`` / ``json_schema``), beside tools with "auto" (that JSON or calls).
        ``thinking_budget``: at most this many thought tokens in the reply (the ``<|channel>`` ...
        ``<channel|>`` span, its name ``thought\n`` included): then the thought is closed and the
        answer begins (`runtime.budget`); it turns ``thinking`` on unless that is given."""
        m = self.model
        messages = content.messages_content(inputs.messages(messages))  # OpenAI's parts too; none dropped
        max_new_tokens, params = m._options(max_new_tokens, truncate, stream, temperature, top_k, top_p, min_p,
                                            repetition_penalty, seed)
        drafts = prompt_lookup_drafts(prompt_lookup)
        top = logprobs_option(logprobs)
        stop_sets(stop, m.defaults, None, chat=True)  # checked before the template runs
        gram = m.constraint(json_schema, regex, grammar)
        if thinking_budget is not None:
            ThoughtBudget.of(m.tokenizer, thinking_budget)  # checked at the call
            thinking = True if thinking is None else thinking
        structured = inputs.flag(structured, "structured") or tools is not None or tool_choice is not None \
            or thinking is not None or response_format is not None or thinking_budget is not None
        if not structured:
            ids = history.chat_ids(m.tokenizer, messages, **template_kwargs)
            return m.text(None, ids, chat=True, stream=stream, max_new_tokens=max_new_tokens, stop=stop,
                          truncate=truncate, params=params, session=self, **_message_media(messages),
                          drafts=drafts, grammar=gram, logprobs=top)
        decls = history.check_tools(tools) if tools is not None else []
        choice = history.check_tool_choice("auto" if tool_choice is None and decls else tool_choice or "none", decls)
        parallel = inputs.flag(parallel_tool_calls, "parallel_tool_calls")
        think = inputs.flag(thinking, "thinking") if thinking is not None else bool(template_kwargs.pop("enable_thinking", False))
        calls = choice != "none" and bool(decls)
        if calls:
            if gram is not None:
                raise InputError("json_schema / regex / grammar do not go with tools (unless tool_choice='none'): "
                                 "the tools' own grammar constrains the reply (give response_format= for JSON "
                                 "beside the calls)")
            from .chat.tool_grammar import tool_grammar

            gram = tool_grammar(m.tokenizer, decls, choice, parallel, thinking=think, response_format=response_format)
        elif response_format is not None:
            if gram is not None:
                raise InputError("response_format and json_schema / regex / grammar: give one constraint")
            from .chat.tool_grammar import response_format_grammar

            gram = response_format_grammar(m.tokenizer, response_format, thinking=think)
        ids = history.chat_ids(m.tokenizer, messages, tools=decls if choice != "none" else None, thinking=think,
                               **template_kwargs)
        return m.reply(None, ids, stream=stream, max_new_tokens=max_new_tokens, stop=stop, truncate=truncate,
                       params=params, tools=calls, max_calls=None if parallel else 1, session=self,
                       **_message_media(messages), drafts=drafts, grammar=gram, logprobs=top,
                       thinking_budget=thinking_budget)

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
