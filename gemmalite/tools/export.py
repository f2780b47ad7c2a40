"""``gemmalite export MODEL OUT --format onnx``: the decoder graph (or an EmbeddingGemma 2 encoder)
as ONNX, in a folder that loads as it is (``gemmalite.load(OUT, backend="onnxruntime")``,
``gemmalite.load_embedder(OUT, backend="onnxruntime")``), written all or nothing.

OUT holds the graphs and their weights (`gemmalite.backends.onnx.export`: ``decoder.onnx``,
``prefill.onnx``, ``dynamic.onnx``, ``decoder.onnx.data``, ``onnx.json``; an encoder's
``encoder.onnx`` and ``encoder.onnx.data``) and what the host side needs, from MODEL:
``config.json``, the tokenizer, generation and sentence-transformers files, and
``host.safetensors`` with every stored tensor the graphs do not hold (token embedding, PLE table,
an untied or quantized LM head, an encoder's output projection, vision / audio towers), as stored. ``gemmalite-manifest.json`` (last) lists
every file with its size. Like `convert`, the files go into a temporary folder beside OUT, are
checked (``onnx.checker``) and flushed, and the folder is renamed into place.
"""
from __future__ import annotations

import errno
import json
import shutil
import tempfile
from pathlib import Path
from typing import Iterator

import numpy as np

from ..errors import CheckpointError, ConfigError, InputError
from ..formats.converted import write_manifest
from ..formats.folder import TEXT_PREFIXES, read_config, safetensors_files
from ..formats.gguf import is_gguf
from ..formats.safetensors import read_safetensors, write_safetensors
from ..loader import resolve
from ..models.gemma.build import QUANT_KINDS
from ..models.gemma.encoder import is_encoder_config
from .convert import SIDE_FILES, _check_paths, _fsync, _install, _umask

FORMATS = ("onnx",)
HOST_STEM = "host"
# text-model tensors the graphs hold (named after the text prefix); the rest is the host's
GRAPH_TENSORS = ("layers.", "per_layer_model_projection.", "per_layer_projection_norm.", "norm.",
                 "ple.")  # (the encoder's PLE projection and norm)
CHUNK_BYTES = 64 << 20  # host tensors are copied this much at a time


def export(src: str | Path, out: str | Path, fmt: str = "onnx", *, context: int | None = None,
           quant: str | None = None, quant_format: str = "matmulnbits", accuracy_level: int | None = None,
           chunk: int | None = None, force: bool = False) -> Path:
    """Export ``src``'s decoder graph (caches for ``context`` positions: the load default if None),
    its weights as stored or ``quant`` ("int8" / "int4", as ``load(quant=)``: a converted checkpoint
    exports its own), int8 / int4 ones as ``quant_format`` ("matmulnbits" / "qdq") computed at
    ``accuracy_level`` (`export.DEFAULT_ACCURACY`); ``chunk``: the static prefill graph's rows."""
    if fmt not in FORMATS:
        raise InputError(f"format must be one of {FORMATS}, got {fmt!r}")
    if quant not in QUANT_KINDS:
        raise InputError(f"quant must be one of {QUANT_KINDS}, got {quant!r}")
    try:
        from ..backends.onnx.encoder import ENCODER_FILE, export_encoder
        from ..backends.onnx.export import DEFAULT_ACCURACY, PREFILL_CHUNK, check_file, check_folder, export_graphs
        from ..backends.onnx.layouts import QUANT_FORMATS
    except ImportError as e:
        raise ConfigError(f"ONNX export needs the onnx extra: pip install 'gemmalite[onnx]' ({e})") from None
    if quant_format not in QUANT_FORMATS:
        raise InputError(f"quant_format must be one of {QUANT_FORMATS}, got {quant_format!r}")
    import gemmalite

    given, src_path, out = str(src), resolve(src), Path(out)
    if not src_path.exists():
        raise CheckpointError(f"{src_path}: no such file or folder")
    if src_path.is_file() and is_gguf(src_path):
        raise CheckpointError(f"{given}: ONNX export takes a Hugging Face checkpoint folder (or its gemmalite "
                              "convert output); GGUF blocks are not mapped onto ONNX's operators")
    target = _check_paths(src_path, out, force)
    encoder = src_path.is_dir() and is_encoder_config(read_config(src_path))
    if encoder and (context is not None or chunk is not None):
        raise InputError("an EmbeddingGemma 2 encoder export has no context or chunk (one graph, any length)")
    level = DEFAULT_ACCURACY if accuracy_level is None else accuracy_level
    meta = {"quant": quant, "source": given}
    model = gemmalite.load_embedder(src_path, quant=quant) if encoder else gemmalite.load(
        src_path, context=context, quant=quant, huge_pages=False)  # read to be written: no copy to 2 MiB pages
    tmp = None
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.partial-", dir=target.parent))
        tmp.chmod(0o777 & ~_umask())
        if encoder:
            export_encoder(model.graph, tmp, quant_format=quant_format, accuracy_level=level, meta=meta)
            check_file(tmp / ENCODER_FILE)
        else:
            export_graphs(model.engine.graph, tmp, model.engine.context, PREFILL_CHUNK if chunk is None else chunk,
                          quant_format=quant_format, accuracy_level=level, meta=meta)
            check_folder(tmp)
        del model
        _write_host(src_path, tmp)
        for f in tmp.rglob("*"):
            _fsync(f)
        write_manifest(tmp)
        _fsync(tmp)
        _check_paths(src_path, out, force)  # nothing appeared at out meanwhile
        _install(tmp, target)
    except OSError as e:
        what = "no space left on the device" if e.errno == errno.ENOSPC else e.strerror or str(e)
        raise CheckpointError(f"cannot write {out}: {what}; nothing was written") from e
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def host_tensor_names(names: list[str]) -> list[str]:
    """The stored tensors the host keeps: all but the text model's layers, PLE projection and final norm."""
    prefix = next((p for p in TEXT_PREFIXES if p + "embed_tokens.weight" in names), None)
    if prefix is None:
        raise CheckpointError("no embed_tokens.weight under any known prefix")
    return [n for n in names if not (n.startswith(prefix) and n[len(prefix):].startswith(GRAPH_TENSORS))]


def _write_host(src: Path, out: Path) -> None:
    """config.json (its quantized-tensor list cut to the host's), the side files and the host tensors."""
    stored: dict[str, np.ndarray] = {}
    for f in safetensors_files(src):
        stored.update(read_safetensors(f))
    keep = host_tensor_names(list(stored))

    def produce(name: str) -> Iterator[bytes]:
        flat = np.ascontiguousarray(stored[name]).reshape(-1).view(np.uint8)
        for i in range(0, flat.size, CHUNK_BYTES):
            yield flat[i:i + CHUNK_BYTES].tobytes()

    write_safetensors(out, {n: (stored[n].shape, stored[n].dtype) for n in keep}, produce, stem=HOST_STEM)
    config = read_config(src)
    qc = config.get("quantization_config")
    if isinstance(qc, dict) and isinstance(qc.get("formats"), dict):
        kept = {n.rsplit(".", 1)[0] for n in keep}
        config["quantization_config"] = dict(qc, formats={n: f for n, f in qc["formats"].items() if n in kept})
    (out / "config.json").write_text(json.dumps(config, indent=2))
    for f in SIDE_FILES:
        if (src / f).is_file():
            (out / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(src / f, out / f)
