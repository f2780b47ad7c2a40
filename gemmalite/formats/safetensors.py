"""safetensors files: a memory-mapped reader and a streaming writer.

The safetensors layout is an 8-byte header size, a JSON header, then raw little-endian
tensor bytes. We map those bytes with `numpy.memmap` in their stored dtype (bfloat16 via
ml_dtypes, imported for the first bfloat16 tensor), so a 2.3-billion-value PLE table costs
nothing until rows are read. (The `safetensors` package's numpy loader cannot hand out bfloat16
arrays, hence this reader.)
"""
from __future__ import annotations

import json
import math
import struct
from pathlib import Path
from typing import Any, Callable, Iterable

import numpy as np

from ..errors import CheckpointError
from ..kernels.common import ALIGN
from ..weights import bf16


DTYPES = {  # and "BF16" (`_dtype`)
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "F64": np.dtype(np.float64),
    "I8": np.dtype(np.int8),
    "U8": np.dtype(np.uint8),
    "I32": np.dtype(np.int32),
    "I64": np.dtype(np.int64),
}

MAX_HEADER_BYTES = 100_000_000  # the official reader's limit


def _dtype(name: str) -> np.dtype | None:
    """The numpy dtype of a header's dtype name (None: not one we read)."""
    return bf16.dtype() if name == "BF16" else DTYPES.get(name)


def _dtype_name(dtype: np.dtype) -> str:
    """A numpy dtype's name in a header."""
    return "BF16" if bf16.is_bf16(dtype) else _DTYPE_NAMES[dtype]


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    d = dict(pairs)
    if len(d) != len(pairs):
        dup = next(k for i, (k, _) in enumerate(pairs) if k in dict(pairs[:i]))
        raise CheckpointError(f"duplicate key {dup!r}")
    return d


def _count(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def read_header(path: Path) -> tuple[int, dict[str, tuple[np.dtype, tuple[int, ...], int, int]]]:
    """The data section's start and every tensor's (dtype, shape, start, end), checked the way the
    official reader checks them (and a little more): the header fits the file, is a JSON object
    of well-typed entries, and the tensors tile the data section exactly -- sized for their dtype
    and shape, no overlap, no gap, nothing past the end and nothing after the last one."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise CheckpointError(f"{path}: not a safetensors file (too short)")
        (n,) = struct.unpack("<Q", head)
        if n > size - 8 or n > MAX_HEADER_BYTES:
            raise CheckpointError(f"{path}: corrupt safetensors header (size {n}, file {size} bytes)")
        raw = f.read(n)
    try:
        text = raw.decode("utf-8")
        if not text.startswith("{"):
            raise ValueError("the header is not a JSON object")
        header = json.loads(text, object_pairs_hook=_no_duplicates)
    except CheckpointError as e:
        raise CheckpointError(f"{path}: corrupt safetensors header ({e})") from None
    except (ValueError, RecursionError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise CheckpointError(f"{path}: corrupt safetensors header ({str(e) or 'nested too deeply'})") from None
    meta = header.pop("__metadata__", None)
    if meta is not None and not (isinstance(meta, dict) and all(isinstance(v, str) for v in meta.values())):
        raise CheckpointError(f"{path}: __metadata__ must map strings to strings")
    base, data_len = 8 + n, size - 8 - n
    entries: dict[str, tuple[np.dtype, tuple[int, ...], int, int]] = {}
    for name, info in header.items():
        if not isinstance(info, dict):
            raise CheckpointError(f"{path}: tensor {name} has a malformed header entry")
        dtype = _dtype(info["dtype"]) if isinstance(info.get("dtype"), str) else None
        if dtype is None:
            raise CheckpointError(f"{path}: tensor {name} has unsupported dtype {info.get('dtype')!r}")
        shape, offsets = info.get("shape"), info.get("data_offsets")
        if not isinstance(shape, list) or not all(_count(d) for d in shape):
            raise CheckpointError(f"{path}: tensor {name} has an invalid shape {shape!r}")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(_count(o) for o in offsets)
                and offsets[0] <= offsets[1]):
            raise CheckpointError(f"{path}: tensor {name} has invalid data_offsets {offsets!r}")
        nbytes = math.prod(shape) * dtype.itemsize  # Python ints: no overflow
        if offsets[1] - offsets[0] != nbytes:
            raise CheckpointError(f"{path}: tensor {name} data_offsets {offsets} hold {offsets[1] - offsets[0]} "
                                  f"bytes, its dtype and shape {tuple(shape)} need {nbytes}")
        entries[name] = (dtype, tuple(shape), offsets[0], offsets[1])
    end = 0
    for name, (_, _, a, b) in sorted(entries.items(), key=lambda kv: (kv[1][2], kv[1][3])):
        if a != end:
            what = "overlaps the tensor before it" if a < end else f"leaves a gap of {a - end} bytes before it"
            raise CheckpointError(f"{path}: tensor {name} data [{a}, {b}) {what}: the file is corrupted")
        end = b
    if end != data_len:
        raise CheckpointError(f"{path}: the tensors cover {end} bytes of a {data_len}-byte data section: "
                              "the file is truncated or corrupted")
    return base, entries


def read_safetensors(path: Path) -> dict[str, np.ndarray]:
    """Memory-map every tensor of one .safetensors file (no copy, stored dtype), after `read_header`'s checks."""
    base, entries = read_header(Path(path))
    out: dict[str, np.ndarray] = {}
    for name, (dtype, shape, start, end) in entries.items():
        if end == start:
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
        # The tensors whose size is a multiple of ALIGN first in the file, so each starts on an
        # ALIGN boundary of the data, and the header padded (with spaces, as the format allows) so
        # that the data starts on one too: memory-mapped, their rows are where the SIMD tiles want
        # them. ``produce`` is still called in the given order (a generator of random weights
        # draws them in that order), each tensor written at its place.
        offsets, off = {}, 0
        for n in sorted(names, key=lambda n: sizes[n] % ALIGN != 0):
            offsets[n], off = off, off + sizes[n]
        header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
        for n in names:
            shape, dtype = specs[n]
            header[n] = {"dtype": _dtype_name(np.dtype(dtype)), "shape": list(shape),
                         "data_offsets": [offsets[n], offsets[n] + sizes[n]]}
        blob = json.dumps(header, separators=(",", ":")).encode()
        blob += b" " * (-(8 + len(blob)) % ALIGN)
        with open(path, "wb") as f:
            f.write(struct.pack("<Q", len(blob)) + blob)
            start = f.tell()
            for n in names:
                f.seek(start + offsets[n])
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
