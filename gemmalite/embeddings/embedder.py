"""`Embedder`: texts, images and videos in, unit-length embeddings out, as the reference computes them.

Pipeline (the checkpoint's sentence-transformers files, `st_files`): the task prompt is
prepended to the text, the checkpoint's tokenizer adds its special tokens (EmbeddingGemma 2:
``<bos> … <eos>``, from its post-processor, exactly as transformers' tokenizer call does), the
encoder runs, the token outputs are averaged and L2-normalised; a Matryoshka ``dimensions``
cut is re-normalised.

Batches are sorted by length and packed (`EncoderGraph` computes no padding), then put back
in input order, so a batch gives the same vectors as one text at a time.

Images and audio (`media`): an input with pictures or clips is written as the
EmbeddingGemma2Processor's text, its parts in order with an ``<|image|>`` (``<|video|>``,
``<|audio|>``) placeholder per picture (video, clip), then tokenized like a text; each
placeholder becomes ``<|image>`` + N soft-token rows + ``<image|>`` (one such block per video
frame; ``<|audio>`` ... ``<audio|>`` for a clip), and those rows take the tower's soft tokens
instead of token embeddings; the encoder, pooling (over every row) and normalisation are the text's.
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable, Iterable, Sequence

import numpy as np

from ..audio.decode import SAMPLE_RATE, load_audio
from ..audio.features import WINDOW_SAMPLES
from ..errors import AudioError, CheckpointError, ContextError, ImageError, InputError, TokenizerError
from ..runtime.engine import place_blocks
from ..runtime.threads import check_threads, compute
from .media import Part, parse_inputs, placeholder_text
from .st_files import PipelineConfig, read_pipeline

MAX_BATCH_TOKENS = 1024  # tokens packed into one encoder pass: bounds the activations; larger passes measured slower (cache)


class Embedder:
    """An EmbeddingGemma 2 embedder of texts, images and both. Thread-safe; build it with `load_embedder`."""

    def __init__(self, graph, tokenizer, pipeline: PipelineConfig, max_length: int, source: str = "",
                 threads: int | None = None, vision=None, audio=None):
        self.graph = graph
        self.threads = threads  # compute threads per pass; None = as many as the machine gives
        self.vision = vision  # gemmalite.vision.prompt.Vision, when the checkpoint has a vision tower
        self.audio = audio  # gemmalite.audio.prompt.Audio, when the checkpoint has an audio tower
        self.cfg = graph.cfg
        self.tokenizer = tokenizer  # gemmalite Tokenizer or None (ids only)
        self.pipeline = pipeline
        self.max_length = max_length
        self.source = source
        self._truncating = None

    # ------------------------------------------------------------------ properties
    @property
    def dim(self) -> int:
        """Size of the full embedding (before any Matryoshka cut)."""
        return self.cfg.embedding_dim

    @property
    def prompts(self) -> dict[str, str]:
        return dict(self.pipeline.prompts)

    # ------------------------------------------------------------------ public API
    def embed(self, inputs, *, prompt_name: str | None = None, prompt: str | None = None,
              dimensions: int | None = None, batch_size: int = 32, truncate: bool = False,
              max_soft_tokens: int | None = None) -> np.ndarray:
        """float32 ``[n, dimensions or dim]`` unit rows, one per input, in order.

        ``inputs``: one input or a list of them. An input is a text (a ``str`` is always text), an
        image (``pathlib.Path``, bytes, a file object, a PIL image or a uint8 array), a video
        (``{"video": [frame, ...]}``), an audio clip (``{"audio": clip}``), or a list of such parts
        (or a dict ``{"text": ..., "image": ..., "audio": ...}``, parts in key order), which gives
        ONE embedding of the parts interleaved.

        ``prompt_name``: a task prompt of the checkpoint's table (`prompts`); ``prompt``: a literal
        prefix instead. Neither: the checkpoint's default prompt, if any; it goes before the whole
        input. A text longer than `max_length` tokens raises `ContextError` naming it, unless
        ``truncate`` (then it keeps its first tokens and the special tokens, as sentence-transformers
        truncates; inputs with pictures are never cut; a clip longer than 30 s raises `ContextError`,
        or with ``truncate`` keeps its first 30 s as the reference does). ``max_soft_tokens`` overrides the image
        processor's budget per image (70, 140, 280, 560, 1120).
        """
        self._dimensions(dimensions)
        return self.embed_prepared(self.prepare(inputs, prompt_name=prompt_name, prompt=prompt, truncate=truncate,
                                                max_soft_tokens=max_soft_tokens), dimensions=dimensions,
                                   batch_size=batch_size)

    def prepare(self, inputs, *, prompt_name: str | None = None, prompt: str | None = None, truncate: bool = False,
                max_soft_tokens: int | None = None) -> tuple[list[np.ndarray], list | None]:
        """`embed`'s first half: each input's token ids as the encoder runs them (pictures and clips
        expanded) and its soft tokens (``None`` for text-only calls); a server counts usage from them."""
        items = parse_inputs(inputs)
        text_prompt = self.resolve_prompt(prompt_name, prompt)
        if all(isinstance(it, str) for it in items):  # texts only: the batched tokenizer path
            return self.tokenize(items, prompt=text_prompt, truncate=truncate), None
        seqs: list[np.ndarray] = [None] * len(items)  # type: ignore[list-item]
        soft: list[tuple[np.ndarray, np.ndarray] | None] = [None] * len(items)
        texts = [i for i, it in enumerate(items) if isinstance(it, str)]
        for i, ids in zip(texts, self.tokenize([items[i] for i in texts], prompt=text_prompt, truncate=truncate,
                                               index=texts)):
            seqs[i] = ids
        for i, it in enumerate(items):
            if not isinstance(it, str):
                seqs[i], soft[i] = self._media_ids(i, it, text_prompt, max_soft_tokens, truncate)
        return seqs, soft

    def embed_prepared(self, prepared: tuple[list[np.ndarray], list | None], *, dimensions: int | None = None,
                       batch_size: int = 32) -> np.ndarray:
        """`embed`'s second half: the unit rows of what `prepare` returned."""
        return self._embed(prepared[0], dimensions, batch_size, prepared[1])

    def embed_ids(self, sequences: Sequence[Sequence[int]], *, dimensions: int | None = None,
                  batch_size: int = 32) -> np.ndarray:
        """Like `embed` for token-id sequences, taken exactly as given (no special tokens added)."""
        seqs = []
        for i, s in enumerate(_check_iterable(sequences, "sequences")):
            a = np.asarray(s)
            if a.ndim != 1 or a.size == 0 or not np.issubdtype(a.dtype, np.integer):
                raise InputError(f"sequences[{i}] must be a non-empty sequence of token ids")
            if a.min() < 0 or a.max() >= self.cfg.vocab_size:
                raise InputError(f"sequences[{i}] has token ids outside [0, {self.cfg.vocab_size})")
            if a.size > self.cfg.max_position_embeddings:
                raise ContextError(f"sequences[{i}] has {a.size} tokens, more than the model's maximum "
                                   f"{self.cfg.max_position_embeddings}")
            seqs.append(a.astype(np.int64))
        return self._embed(seqs, dimensions, batch_size)

    @staticmethod
    def similarity(a: np.ndarray, b: np.ndarray) -> np.ndarray:
        """Cosine similarities ``[len(a), len(b)]`` (1-D inputs count as one row)."""
        a, b = np.atleast_2d(np.asarray(a, np.float32)), np.atleast_2d(np.asarray(b, np.float32))
        if a.shape[1] != b.shape[1]:
            raise InputError(f"cannot compare vectors of {a.shape[1]} and {b.shape[1]} dimensions")
        a = a / np.maximum(np.linalg.norm(a, axis=1, keepdims=True), 1e-12)
        b = b / np.maximum(np.linalg.norm(b, axis=1, keepdims=True), 1e-12)
        return a @ b.T

    def resolve_prompt(self, prompt_name: str | None, prompt: str | None) -> str:
        """The prefix for a call: a literal ``prompt``, a named one, or the checkpoint's default."""
        if prompt is not None and prompt_name is not None:
            raise InputError("give prompt_name or prompt, not both")
        if prompt is not None:
            if not isinstance(prompt, str):
                raise InputError(f"prompt must be a string, not {type(prompt).__name__}")
            return prompt
        name = prompt_name if prompt_name is not None else self.pipeline.default_prompt_name
        if name is None:
            return ""
        if name not in self.pipeline.prompts:
            known = ", ".join(sorted(self.pipeline.prompts)) or "none"
            raise InputError(f"unknown prompt name {name!r} (this model has: {known})")
        return self.pipeline.prompts[name]

    def tokenize(self, texts: Sequence[str], *, prompt: str = "", truncate: bool = False,
                 index: Sequence[int] | None = None) -> list[np.ndarray]:
        """Token ids exactly as the reference pipeline builds them: ``tokenizer(prompt + text)``
        (``index``: the texts' positions among the caller's inputs, for error messages)."""
        if self.tokenizer is None:
            raise TokenizerError(f"{self.source}: this checkpoint has no tokenizer; use embed_ids")
        full = [prompt + t for t in texts]
        tk = self._truncating_tokenizer() if truncate else self.tokenizer.tk
        out = [np.asarray(e.ids, dtype=np.int64) for e in tk.encode_batch(full, add_special_tokens=True)]
        if not truncate:
            for i, ids in enumerate(out):
                if len(ids) > self.max_length:
                    i = index[i] if index is not None else i
                    raise ContextError(f"texts[{i}] is {len(ids)} tokens long, more than the model's {self.max_length}"
                                       " (pass truncate=True to cut it)")
        return out

    # ------------------------------------------------------------------ internals
    def _truncating_tokenizer(self):
        if self._truncating is None:
            from tokenizers import Tokenizer as HFTokenizer

            tk = HFTokenizer.from_str(self.tokenizer.tk.to_str())
            tk.enable_truncation(self.max_length)  # counts the post-processor's special tokens, like transformers
            self._truncating = tk
        return self._truncating

    def _media_ids(self, i: int, parts: list[Part], prompt: str, max_soft_tokens: int | None,
                   truncate: bool = False) -> tuple[np.ndarray, tuple[np.ndarray, np.ndarray]]:
        """Token ids of one input with pictures or clips (placeholders expanded) and its soft-token rows.
        A clip longer than the reference's 30 s raises `ContextError` unless ``truncate`` (its first
        30 s then, as transformers' feature extractor cuts it)."""
        if self.tokenizer is None:
            raise TokenizerError(f"{self.source}: this checkpoint has no tokenizer; use embed_ids")
        text, images, videos, clips = placeholder_text(parts, prompt)
        if (images or videos) and self.vision is None:
            raise ImageError(f"inputs[{i}] has an image or video, but {self.source or 'this model'} has no vision tower")
        if clips and self.audio is None:
            raise AudioError(f"inputs[{i}] has an audio clip, but {self.source or 'this model'} has no audio tower")
        ids = np.asarray(self.tokenizer.tk.encode(text, add_special_tokens=True).ids, dtype=np.int64)
        slots = []
        try:
            with compute(self.threads):  # the towers' kernels share numba's process-wide pool
                if images or videos:
                    slots += self.vision.blocks(ids, images, videos=videos, max_soft_tokens=max_soft_tokens)
                if clips:
                    slots += self.audio.blocks(ids, [self._clip(i, k, c, truncate) for k, c in enumerate(clips)])
        except (ImageError, AudioError) as e:
            raise type(e)(f"inputs[{i}]: {e}") from None
        expanded, soft = place_blocks(ids, slots, self.cfg.hidden_size)
        if len(expanded) > self.max_length:
            raise ContextError(f"inputs[{i}] is {len(expanded)} tokens long with its pictures and clips, more than the "
                               f"model's {self.max_length} (inputs with pictures or clips are not cut)")
        return expanded, (soft.rows, soft.vectors)

    @staticmethod
    def _clip(i: int, k: int, clip, truncate: bool) -> np.ndarray:
        """One clip's samples, at most the reference's 30 s (cut only with ``truncate``)."""
        try:
            samples = load_audio(clip)
        except AudioError as e:
            raise AudioError(f"inputs[{i}]: audio clip {k}: {e}") from None
        if len(samples) > WINDOW_SAMPLES:
            if not truncate:
                raise ContextError(f"inputs[{i}]: audio clip {k} is {len(samples) / SAMPLE_RATE:.2f} s long, more than "
                                   f"the model's {WINDOW_SAMPLES // SAMPLE_RATE} s (pass truncate=True to keep its "
                                   "start, as transformers does)")
            samples = samples[:WINDOW_SAMPLES]
        return samples

    def _embed(self, seqs: list[np.ndarray], dimensions: int | None, batch_size: int,
               soft: list[tuple[np.ndarray, np.ndarray] | None] | None = None) -> np.ndarray:
        d = self._dimensions(dimensions)
        if int(batch_size) < 1:
            raise InputError(f"batch_size must be at least 1, got {batch_size}")
        out = np.empty((len(seqs), self.dim), dtype=np.float32)
        for batch in plan_batches([len(s) for s in seqs], int(batch_size)):
            with compute(self.threads):  # numba's thread pool is process-wide: one pass at a time
                out[batch] = self.graph.encode([seqs[i] for i in batch], [soft[i] for i in batch] if soft else None)
        return normalize(out, d)

    def _dimensions(self, dimensions: int | None) -> int:
        if dimensions is None:
            dimensions = self.pipeline.truncate_dim or self.dim
        if isinstance(dimensions, bool) or not isinstance(dimensions, (int, np.integer)) or not 1 <= dimensions <= self.dim:
            raise InputError(f"dimensions must be an integer from 1 to {self.dim}, got {dimensions!r}")
        return int(dimensions)


def normalize(v: np.ndarray, dimensions: int | None = None) -> np.ndarray:
    """L2-normalise rows, then (Matryoshka) keep the first ``dimensions`` and re-normalise."""
    v = np.asarray(v, dtype=np.float64)
    v = v / np.maximum(np.linalg.norm(v, axis=1, keepdims=True), 1e-30)
    if dimensions is not None and dimensions < v.shape[1]:
        v = v[:, :dimensions]
        v = v / np.maximum(np.linalg.norm(v, axis=1, keepdims=True), 1e-30)
    return np.ascontiguousarray(v, dtype=np.float32)


def plan_batches(lengths: Sequence[int], batch_size: int, max_tokens: int = MAX_BATCH_TOKENS) -> list[list[int]]:
    """Indices grouped for packed passes: longest first, at most ``batch_size`` texts and
    ``max_tokens`` tokens per pass (a longer text goes alone)."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    batches: list[list[int]] = []
    cur: list[int] = []
    tokens = 0
    for i in order:
        if cur and (len(cur) >= batch_size or tokens + lengths[i] > max_tokens):
            batches.append(cur)
            cur, tokens = [], 0
        cur.append(i)
        tokens += lengths[i]
    if cur:
        batches.append(cur)
    return batches


def _check_iterable(x, what: str) -> Iterable:
    if isinstance(x, (bytes, dict)) or not hasattr(x, "__iter__"):
        raise InputError(f"{what} must be a list of token-id sequences, not {type(x).__name__}")
    return x


def load_embedder(path: str | Path, quant: str | None = None, threads: int | None = None, *,
                  encoder: Callable | None = None) -> Embedder:
    """An `Embedder` for an EmbeddingGemma 2 folder (either config layout, or a `gemmalite convert`
    output); ``quant`` "int8" / "int4" quantizes the projections on load; ``threads`` as for `load`.
    ``encoder(cfg, tensors, quant, folder)`` builds what runs the encoder (default `own_encoder`: our
    kernels; `gemmalite.load_embedder` passes ONNX Runtime's)."""
    from ..formats.folder import load_folder, read_tensors
    from ..models.gemma.build import QUANT_KINDS
    from ..models.gemma.encoder import EncoderConfig
    from ..tokenizer import load_tokenizer_folder
    from ..audio.prompt import folder_audio
    from ..vision.prompt import folder_vision

    if quant not in QUANT_KINDS:
        raise InputError(f"quant must be one of {QUANT_KINDS}, got {quant!r}")
    check_threads(threads)
    p = Path(path)
    if not p.is_dir():
        raise CheckpointError(f"{p}: not a checkpoint folder")
    cfg, tensors, raw = load_folder(p, parse=EncoderConfig.from_hf)
    graph = (encoder or own_encoder)(cfg, tensors, quant, p)
    pipeline = read_pipeline(p)
    if pipeline.truncate_dim is not None and not 1 <= pipeline.truncate_dim <= cfg.embedding_dim:
        raise CheckpointError(f"{p}: truncate_dim {pipeline.truncate_dim} is not within 1..{cfg.embedding_dim}")
    tokenizer = load_tokenizer_folder(p)
    tensors = read_tensors(p, raw)  # tower tensors memory-mapped, each tower built on first use
    vision, audio = folder_vision(p, raw, tensors, quant), folder_audio(raw, tensors, quant)
    return Embedder(graph, tokenizer, pipeline, _max_length(p, cfg, pipeline), str(p), threads=threads, vision=vision,
                    audio=audio)


def own_encoder(cfg, tensors: dict, quant: str | None, folder: Path):
    """The encoder on gemmalite's kernels, from a checkpoint's (checked) tensors."""
    from ..models.gemma.build import matrix_factory, table
    from ..models.gemma.contract import check_tensors
    from ..models.gemma.encoder import build_encoder, encoder_shapes

    check_tensors(cfg, tensors, str(folder), shapes=encoder_shapes(cfg))
    return build_encoder(cfg, tensors, matrix_factory(quant), table)


def _max_length(folder: Path, cfg, pipeline: PipelineConfig) -> int:
    """sentence-transformers' ``max_seq_length``: its own setting, else the tokenizer's
    ``model_max_length`` capped at the model's ``max_position_embeddings``."""
    import json

    n = cfg.max_position_embeddings
    if pipeline.max_seq_length is not None:
        return min(pipeline.max_seq_length, n)
    conf = folder / "tokenizer_config.json"
    if conf.exists():
        try:
            m = json.loads(conf.read_text()).get("model_max_length")
        except ValueError:
            m = None
        if isinstance(m, (int, float)) and 0 < m < n:
            return int(m)
    return n
