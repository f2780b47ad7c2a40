"""Hugging Face checkpoint folders: config.json plus (sharded) safetensors, memory-mapped.

The safetensors layout is an 8-byte header size, a JSON header, then raw little-endian
tensor bytes. We map those bytes with `numpy.memmap` in their stored dtype (bfloat16 via
ml_dtypes), so a 2.3-billion-value PLE table costs nothing until rows are read. (The
`safetensors` package's numpy loader cannot hand out bfloat16 arrays, hence this reader.)
"""
from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any, Callable, Iterable

import ml_dtypes
import numpy as np

from .config import ModelConfig
from .errors import CheckpointError, ConfigError


DTYPES = {
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F64": np.dtype(np.float64),
    "I8": np.dtype(np.int8),
    "U8": np.dtype(np.uint8),
    "I32": np.dtype(np.int32),
    "I64": np.dtype(np.int64),
}

TEXT_PREFIXES = ("model.language_model.", "model.", "language_model.model.", "language_model.", "")


def read_safetensors(path: Path) -> dict[str, np.ndarray]:
    """Memory-map every tensor of one .safetensors file (no copy, stored dtype)."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise CheckpointError(f"{path}: not a safetensors file (too short)")
        (n,) = struct.unpack("<Q", head)
        if n > size - 8 or n > 100_000_000:
            raise CheckpointError(f"{path}: corrupt safetensors header (size {n})")
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{path}: corrupt safetensors header ({e})") from None
    header.pop("__metadata__", None)
    base = 8 + n
    out: dict[str, np.ndarray] = {}
    for name, info in header.items():
        dtype = DTYPES.get(info.get("dtype"))
        if dtype is None:
            raise CheckpointError(f"{path}: tensor {name} has unsupported dtype {info.get('dtype')}")
        start, end = info["data_offsets"]
        shape = tuple(info["shape"])
        count = int(np.prod(shape, dtype=np.int64))
        if end - start != count * dtype.itemsize or base + end > size:
            raise CheckpointError(f"{path}: tensor {name} data is truncated or inconsistent with its shape {shape}")
        if count == 0:
            out[name] = np.zeros(shape, dtype)
        else:
            out[name] = np.memmap(path, dtype=dtype, mode="r", offset=base + start, shape=shape)
    return out


def safetensors_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.exists():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (json.JSONDecodeError, KeyError) as e:
            raise CheckpointError(f"{index}: malformed index ({e})") from None
        files = [folder / n for n in names]
        missing = [str(p) for p in files if not p.exists()]
        if missing:
            raise CheckpointError(f"{index} names missing shard(s): {', '.join(missing)}")
        return files
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{folder}: no .safetensors files")
    return files


def read_config(folder: Path) -> dict:
    path = folder / "config.json"
    if not path.exists():
        raise CheckpointError(f"{folder}: config.json is missing")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path}: not valid JSON ({e})") from None


def load_folder(folder: str | Path) -> tuple[ModelConfig, dict[str, np.ndarray], dict]:
    """Config and text tensors (prefix stripped, memory-mapped) of a checkpoint folder."""
    folder = Path(folder)
    if not folder.is_dir():
        raise CheckpointError(f"{folder}: not a checkpoint folder")
    raw = read_config(folder)
    try:
        cfg = ModelConfig.from_hf(raw)
    except ConfigError as e:
        raise CheckpointError(f"{folder / 'config.json'}: {e}") from None
    tensors: dict[str, np.ndarray] = {}
    for f in safetensors_files(folder):
        tensors.update(read_safetensors(f))
    tensors = strip_prefix(tensors)
    if isinstance(raw.get("quantization_config"), dict):  # written by `gemmalite convert`
        from .convert import assemble

        tensors = assemble(tensors, raw["quantization_config"])
    return cfg, tensors, raw


def strip_prefix(tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Keep the text-decoder tensors, named relative to their prefix (plus an untied lm_head)."""
    for p in TEXT_PREFIXES:
        if p + "embed_tokens.weight" in tensors:
            out = {k[len(p) :]: v for k, v in tensors.items() if k.startswith(p)}
            if "lm_head.weight" in tensors:
                out["lm_head.weight"] = tensors["lm_head.weight"]
            return out
    raise CheckpointError("no embed_tokens.weight under any known prefix (" + ", ".join(repr(p) for p in TEXT_PREFIXES) + ")")


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor the text decoder needs, with its shape (the contract a checkpoint must meet)."""
    H, L, P = cfg.hidden_size, cfg.num_hidden_layers, cfg.ple_dim
    nq = cfg.num_attention_heads
    shapes: dict[str, tuple[int, ...]] = {"embed_tokens.weight": (cfg.vocab_size, H), "norm.weight": (H,)}
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, H)
    if P:
        shapes["embed_tokens_per_layer.weight"] = (cfg.ple_vocab, L * P)
        shapes["per_layer_model_projection.weight"] = (L * P, H)
        shapes["per_layer_projection_norm.weight"] = (P,)
    for s in cfg.layers:
        p = f"layers.{s.index}."
        D, kv, I = s.head_dim, s.num_kv_heads, s.intermediate_size
        for norm in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm"):
            shapes[p + norm + ".weight"] = (H,)
        shapes[p + "self_attn.q_proj.weight"] = (nq * D, H)
        shapes[p + "self_attn.q_norm.weight"] = (D,)
        shapes[p + "self_attn.o_proj.weight"] = (H, nq * D)
        projs = ["q_proj", "o_proj"]
        if s.owns_kv:
            shapes[p + "self_attn.k_proj.weight"] = (kv * D, H)
            shapes[p + "self_attn.k_norm.weight"] = (D,)
            projs.append("k_proj")
            if not s.k_eq_v:
                shapes[p + "self_attn.v_proj.weight"] = (kv * D, H)
                projs.append("v_proj")
        if cfg.attention_bias:
            for proj in projs:
                shapes[p + f"self_attn.{proj}.bias"] = (shapes[p + f"self_attn.{proj}.weight"][0],)
        shapes[p + "mlp.gate_proj.weight"] = (I, H)
        shapes[p + "mlp.up_proj.weight"] = (I, H)
        shapes[p + "mlp.down_proj.weight"] = (H, I)
        if P:
            shapes[p + "per_layer_input_gate.weight"] = (P, H)
            shapes[p + "per_layer_projection.weight"] = (H, P)
            shapes[p + "post_per_layer_input_norm.weight"] = (H,)
        if cfg.family == "gemma4":
            shapes[p + "layer_scalar"] = (1,)
    return shapes


def check_tensors(cfg: ModelConfig, tensors: dict, where: str, shape_of=lambda t: tuple(t.shape)) -> None:
    """Raise CheckpointError naming the first missing or mis-shaped tensor."""
    problems: list[str] = []
    for name, shape in expected_shapes(cfg).items():
        if name not in tensors:
            problems.append(f"missing tensor {name} (expected shape {shape})")
        elif tuple(shape_of(tensors[name])) != shape:
            problems.append(f"tensor {name} has shape {tuple(shape_of(tensors[name]))}, expected {shape}")
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise CheckpointError(f"{where}: {problems[0]}{more}")


_DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


def write_safetensors(folder: Path, specs: dict[str, tuple[tuple[int, ...], np.dtype]],
                      produce: Callable[[str], Iterable[bytes]], *, shard_bytes: int = 2 << 30,
                      progress: bool = False, stem: str = "model") -> list[Path]:
    """Stream tensors into (sharded) safetensors files without holding them in memory.

    ``specs`` gives each tensor's shape and dtype; ``produce(name)`` yields its bytes in chunks.
    Several shards get the Hugging Face names and a ``.index.json`` weight map.
    """
    from tqdm import tqdm

    folder = Path(folder)
    sizes = {n: int(np.prod(s, dtype=np.int64)) * np.dtype(d).itemsize for n, (s, d) in specs.items()}
    shards: list[list[str]] = [[]]
    acc = 0
    for name in specs:
        if shards[-1] and acc + sizes[name] > shard_bytes:
            shards.append([])
            acc = 0
        shards[-1].append(name)
        acc += sizes[name]
    files = [folder / f"{stem}.safetensors"] if len(shards) == 1 else [
        folder / f"{stem}-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    bar = tqdm(total=sum(sizes.values()), unit="B", unit_scale=True, disable=not progress, desc="writing")
    for path, names in zip(files, shards):
        header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
        off = 0
        for n in names:
            shape, dtype = specs[n]
            header[n] = {"dtype": _DTYPE_NAMES[np.dtype(dtype)], "shape": list(shape), "data_offsets": [off, off + sizes[n]]}
            off += sizes[n]
        blob = json.dumps(header, separators=(",", ":")).encode()
        blob += b" " * (-len(blob) % 8)
        with open(path, "wb") as f:
            f.write(struct.pack("<Q", len(blob)) + blob)
            for n in names:
                written = 0
                for chunk in produce(n):
                    f.write(chunk)
                    written += len(chunk)
                    bar.update(len(chunk))
                if written != sizes[n]:
                    raise RuntimeError(f"tensor {n}: produced {written} bytes, expected {sizes[n]}")
    bar.close()
    if len(files) > 1:
        weight_map = {n: f.name for f, names in zip(files, shards) for n in names}
        (folder / f"{stem}.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": sum(sizes.values())}, "weight_map": weight_map}, indent=1))
    return files


def save_arrays(folder: Path, arrays: dict[str, np.ndarray], **kw: Any) -> list[Path]:
    """Write in-memory (or memory-mapped) arrays with `write_safetensors`."""
    return write_safetensors(folder, {n: (a.shape, a.dtype) for n, a in arrays.items()},
                             lambda n: [np.ascontiguousarray(arrays[n]).tobytes()], **kw)
