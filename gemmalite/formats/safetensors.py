"""safetensors files: a memory-mapped reader and a streaming writer.

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

from ..errors import CheckpointError


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
