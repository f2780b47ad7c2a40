"""`gemmalite convert`: write a self-describing int8/int4 checkpoint that loads by memory-mapping.

Every projection (and the LM head, stored apart from the tied embedding table) becomes an
`Int8Matrix` or `Int4Matrix` in the format of `gemmalite.formats.converted`; the embedding and
PLE tables, norms and scalars are copied as stored. Loading takes well under two seconds.

A tied embedding is thus stored twice: as stored (bfloat16) for the row lookups, and quantized
for the LM head, whose every row each step reads (``quantization_config.tied_lm_head`` says
so). For a model whose embedding is a large share of it (Gemma 3 270M: two thirds) the output
is larger than a bfloat16 source; `gemmalite convert` prints both sizes.

Only Hugging Face folders convert: a GGUF file is already quantized, and runs as it is.
"""
from __future__ import annotations

import ctypes
import errno
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from ..errors import CheckpointError, InputError
from ..formats.converted import QUANT_METHOD, format_name, write_manifest
from ..formats.folder import load_folder, read_config, read_tensors
from ..formats.gguf import is_gguf
from ..formats.safetensors import save_arrays
from ..loader import resolve
from ..models.gemma.config import ModelConfig
from ..models.gemma.contract import check_tensors, expected_shapes, quantizable
from ..models.gemma.encoder import EncoderConfig, encoder_shapes, is_encoder_config
from ..audio.tower import audio_tensors
from ..vision.tower import vision_tensors
from ..weights.matrix import Matrix
from ..weights.quant import quantize

SIDE_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "chat_template.json",
              "special_tokens_map.json", "generation_config.json", "tokenizer.model", "processor_config.json",
              "preprocessor_config.json",
              # sentence-transformers pipeline of an embedding model
              "modules.json", "config_sentence_transformers.json", "sentence_bert_config.json",
              "1_Pooling/config.json", "2_Normalize/config.json")


def _dense(t: Any) -> np.ndarray:
    return t.dense() if isinstance(t, Matrix) else t


def _check_paths(src: Path, out: Path, force: bool) -> Path:
    """The resolved output folder, after refusing one that would overwrite, hold or lie in the source."""
    rs, ro = src.resolve(), out.resolve()
    if ro == rs or rs in ro.parents or ro in rs.parents:
        rel = "is" if ro == rs else "is inside" if rs in ro.parents else "contains"
        raise CheckpointError(f"output {out} {rel} the source {src}: choose another folder")
    if ro.exists() and not ro.is_dir():
        raise CheckpointError(f"output {out} exists and is not a folder")
    if ro.is_dir() and any(ro.iterdir()) and not force:
        raise CheckpointError(f"output {out} is not empty: pass --force (force=True) to replace it")
    return ro


def _umask() -> int:
    """The process umask, read without setting it (os.umask would change it for every thread a moment)."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1], 8) for line in f if line.startswith("Umask:"))
    except (OSError, StopIteration, ValueError):
        return 0o022


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths in one step (Linux renameat2 RENAME_EXCHANGE); False where unavailable."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    return fn(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0


def _install(tmp: Path, out: Path) -> None:
    """Put the finished folder ``tmp`` at ``out`` by renames; an existing ``out`` is replaced whole (in one
    atomic swap where the system has one: it then ends up at ``tmp``, which the caller removes)."""
    if out.exists() and not _exchange(tmp, out):
        old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
        os.rename(out, old / "x")
        os.rename(tmp, out)
        shutil.rmtree(old, ignore_errors=True)
    elif not out.exists():
        os.rename(tmp, out)
    _fsync(out.parent)


def convert(src: str | Path, out: str | Path, quant: str, *, progress: bool = True, force: bool = False) -> Path:
    """Write ``src`` (a Hugging Face folder) as an int8/int4 checkpoint at ``out``.

    All or nothing: the files go into a temporary folder beside ``out``, are flushed to disk with
    the manifest last, and the folder is renamed into place; on any error or interruption the
    temporary folder is removed and ``out`` is as it was. ``out`` must not be, hold or lie in
    ``src``, and must be empty or absent unless ``force`` (which replaces it whole)."""
    given, src, out = str(src), resolve(src), Path(out)
    if quant not in ("int8", "int4"):
        raise InputError(f"quant must be int8 or int4, got {quant!r}")
    if src.is_file() and is_gguf(src):
        raise CheckpointError(f"{given}: a GGUF file is already quantized, and convert takes a Hugging Face checkpoint "
                              f"folder: run the GGUF directly (gemmalite run {given}), or requantize on load (--quant {quant})")
    if not src.is_dir():
        raise CheckpointError(f"{src}: convert takes a Hugging Face checkpoint folder")
    target = _check_paths(src, out, force)
    encoder = is_encoder_config(read_config(src))  # EmbeddingGemma 2: the encoder's config and contract
    cfg, tensors, raw = load_folder(src, parse=EncoderConfig.from_hf if encoder else ModelConfig.from_hf)
    if isinstance(raw.get("quantization_config"), dict):
        raise CheckpointError(f"{src} is already quantized ({raw['quantization_config'].get('quant_method')})")
    shapes = encoder_shapes(cfg) if encoder else expected_shapes(cfg)
    check_tensors(cfg, tensors, str(src), shapes=shapes)
    tmp = None
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.partial-", dir=target.parent))
        tmp.chmod(0o777 & ~_umask())  # mkdtemp's 0700 would outlive the rename
        _write(src, tmp, cfg, shapes, tensors, raw, quant, progress, lm_head=not encoder)
        for f in tmp.rglob("*"):  # every file and folder
            _fsync(f)
        write_manifest(tmp)
        _fsync(tmp)
        _check_paths(src, out, force)  # nothing appeared at out meanwhile
        _install(tmp, target)
    except OSError as e:
        what = "no space left on the device" if e.errno == errno.ENOSPC else \
            "permission denied" if e.errno in (errno.EACCES, errno.EPERM) else e.strerror or str(e)
        raise CheckpointError(f"cannot write {out}: {what} ({e.filename or target.parent}); nothing was "
                              "written") from e
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def _write(src: Path, out: Path, cfg, shapes: dict, tensors: dict[str, Any], raw: dict, quant: str, progress: bool,
           *, lm_head: bool) -> None:
    """The converted checkpoint's files, written into the (empty, temporary) folder ``out``: the text
    model's tensors (named by its contract ``shapes``, prefix-free) and the vision and audio towers'
    (under their stored names); ``lm_head`` stores a quantized LM head apart from a tied embedding table."""
    stored = read_tensors(src, raw)
    vision, vision_rest = vision_tensors(stored, raw)
    audio, audio_rest = audio_tensors(stored, raw)
    towers, towers_rest = vision + audio, vision_rest + audio_rest
    jobs = {name: tensors[name] for name in quantizable(cfg, shapes)}
    if lm_head and cfg.tie_word_embeddings:
        jobs["lm_head.weight"] = tensors["embed_tokens.weight"]
    jobs |= {name: stored[name] for name in towers}
    arrays: dict[str, np.ndarray] = {}
    formats: dict[str, str] = {}
    # compile the quantizer on a toy matrix first: the bar's estimate then measures quantizing only
    quantize(np.zeros((2, next(iter(jobs.values())).shape[1]), np.float32), quant)
    bar = tqdm(total=sum(int(np.prod(t.shape)) for t in jobs.values()), desc=f"quantizing to {quant}",
               disable=not progress, unit="param", unit_scale=True)
    for name, t in jobs.items():
        m = quantize(_dense(t), quant)
        for part, a in m.tensors().items():
            arrays[f"{name}.{part}"] = a
        formats[name] = format_name(m)
        bar.update(int(np.prod(m.shape)))
    bar.close()
    arrays |= {name: np.asarray(tensors[name]) for name in shapes if name not in formats}
    arrays |= {name: np.asarray(stored[name]) for name in towers_rest}
    save_arrays(out, arrays, progress=progress)
    config = dict(raw)
    config["quantization_config"] = {"quant_method": QUANT_METHOD, "default": quant, "formats": formats,
                                     "tied_lm_head": "lm_head.weight" in jobs and "lm_head.weight" not in tensors}
    (out / "config.json").write_text(json.dumps(config, indent=2))
    for f in SIDE_FILES:
        if (src / f).is_file():
            (out / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(src / f, out / f)
