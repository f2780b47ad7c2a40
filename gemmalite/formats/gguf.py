"""Read GGUF files (llama.cpp's model format): metadata, memory-mapped tensors, HF naming.

The header is parsed here rather than with ``gguf.GGUFReader``: the reader builds a numpy view
per string, which takes tens of seconds on a 262k-token vocabulary (780k strings with merges);
this parser reads the same file in well under a second, checks every length and offset against
the file size, and reports a cut or corrupted file as a `GGUFError` naming the file and what is
wrong (the reader raises bare IndexErrors, or memory-maps past the end without a word).

The Gemma-specific mapping (llama.cpp names and metadata -> Hugging Face names and config) is in
`gguf_gemma`. Tensor data stays in the memory map: 2-D (and larger) tensors become `GGMLMatrix` objects over
their raw blocks, 1-D tensors (norms, scalars) become small float32 arrays. GGUF lists dimensions
innermost first (``ne[0]`` = columns); shapes here are numpy order (rows first).
"""
from __future__ import annotations

import hashlib
import marshal
import math
import mmap
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import CheckpointError
from ..kernels.ggml import GGML_TYPES, block_info, type_name
from ..settings import VERSION, cache_root
from ..weights.ggml import GGMLMatrix, quantized_nbytes
from ..weights.matrix import Matrix

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
MAX_NAME = 64  # GGML_MAX_NAME: llama.cpp refuses longer tensor names

# GGUF value types -> (struct format, numpy dtype); 8 = string, 9 = array
_SCALARS = {
    0: ("<B", np.uint8), 1: ("<b", np.int8), 2: ("<H", np.uint16), 3: ("<h", np.int16),
    4: ("<I", np.uint32), 5: ("<i", np.int32), 6: ("<f", np.float32), 7: ("<?", np.bool_),
    10: ("<Q", np.uint64), 11: ("<q", np.int64), 12: ("<d", np.float64),
}
_STRING, _ARRAY = 8, 9


class GGUFError(CheckpointError):  # a ValueError
    """A GGUF file that cannot be used: not GGUF, truncated, corrupted or unsupported."""


@dataclass
class TensorInfo:
    name: str
    qtype: str  # GGML type name, e.g. "Q4_K"
    shape: tuple[int, ...]  # numpy order: rows first, columns last
    offset: int  # absolute byte offset in the file
    nbytes: int


@dataclass
class GGUFFile:
    path: str
    version: int
    metadata: dict[str, Any]
    tensor_info: dict[str, TensorInfo]
    tensors: dict[str, Matrix | np.ndarray] = field(default_factory=dict)

    @property
    def arch(self) -> str:
        return str(self.metadata.get("general.architecture", ""))


_U64 = struct.Struct("<Q")


class _Cursor:
    """Bounds-checked little-endian reads from a buffer; errors name the file and the place."""

    def __init__(self, buf, path: str):
        self.buf, self.path, self.pos, self.size = buf, path, 0, len(buf)

    def fail(self, what: str) -> GGUFError:
        return GGUFError(f"{self.path}: {what}")

    def take(self, n: int, what: str) -> int:
        if n < 0 or self.pos + n > self.size:
            raise self.fail(f"truncated or corrupted: {what} needs {n} bytes at offset {self.pos}, "
                            f"file has {self.size}")
        p = self.pos
        self.pos += n
        return p

    def scalar(self, vtype: int, what: str):
        fmt, _ = _SCALARS[vtype]
        p = self.take(struct.calcsize(fmt), what)
        return struct.unpack_from(fmt, self.buf, p)[0]

    def string(self, what: str) -> str:
        n = self.scalar(10, what)
        p = self.take(n, what)
        raw = bytes(self.buf[p:p + n])
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:  # llama.cpp treats token text as bytes; keep it readable
            return raw.decode("utf-8", errors="replace")

    def strings(self, n: int, what: str) -> list[str]:
        """``n`` strings in a row: `string` unrolled (a vocabulary holds 262144 of them)."""
        buf, size, pos, out = self.buf, self.size, self.pos, []
        length = _U64.unpack_from
        for _ in range(n):
            n_bytes = length(buf, pos)[0] if pos + 8 <= size else size
            if pos + 8 + n_bytes > size:
                self.pos = pos
                self.string(what)  # raises the truncation error, with its place
            pos += 8
            out.append(str(buf[pos:pos + n_bytes], "utf-8", "replace"))  # see `string`
            pos += n_bytes
        self.pos = pos
        return out

    def value(self, vtype: int, what: str):
        if vtype in _SCALARS:
            v = self.scalar(vtype, what)
            if vtype == 6:  # shortest decimal that round-trips the float32 (1e-06, not 9.99e-07)
                return float(str(np.float32(v)))
            return bool(v) if vtype == 7 else v
        if vtype == _STRING:
            return self.string(what)
        if vtype == _ARRAY:
            etype = self.scalar(4, what)
            n = self.scalar(10, what)
            if etype in _SCALARS:
                dt = np.dtype(_SCALARS[etype][1]).newbyteorder("<")
                p = self.take(n * dt.itemsize, what)
                return np.frombuffer(self.buf, dtype=dt, count=n, offset=p).astype(dt.newbyteorder("="))
            if etype == _STRING:
                if n > self.size:  # each string needs at least 8 bytes
                    raise self.fail(f"corrupted: {what} claims {n} strings")
                return self.strings(n, what)
            if etype == _ARRAY:  # llama.cpp rejects these too; a recursion here could be 10^5 deep
                raise self.fail(f"{what} is an array of arrays, which GGUF readers do not accept")
            raise self.fail(f"corrupted: {what} has unknown array element type {etype}")
        raise self.fail(f"corrupted: {what} has unknown value type {vtype}")


def _parse(buf, path: str) -> tuple[int, dict[str, Any], list[TensorInfo]]:
    cur = _Cursor(buf, path)
    if cur.size < 4 or bytes(buf[:4]) != GGUF_MAGIC:
        raise GGUFError(f"{path}: not a GGUF file (bad magic {bytes(buf[:4])!r})")
    cur.pos = 4
    version = cur.scalar(4, "version")
    if version not in (2, 3):
        raise GGUFError(f"{path}: unsupported GGUF version {version} (expected 2 or 3; a "
                        "big-endian file also shows up this way)")
    n_tensors = cur.scalar(10, "tensor count")
    n_kv = cur.scalar(10, "metadata count")
    # a metadata entry takes at least 12 bytes (key length, type), a tensor entry at least 32
    if n_tensors * 32 > cur.size or n_kv * 12 > cur.size:
        raise GGUFError(f"{path}: corrupted header ({n_tensors} tensors, {n_kv} metadata keys in "
                        f"{cur.size} bytes)")
    meta: dict[str, Any] = {}
    types: dict[str, int] = {}
    for i in range(n_kv):
        key = cur.string(f"metadata key #{i}")
        if key in meta:
            raise GGUFError(f"{path}: duplicate metadata key {key!r}")
        types[key] = cur.scalar(4, f"type of {key!r}")
        meta[key] = cur.value(types[key], f"metadata {key!r}")
    raw_infos = []
    seen: set[str] = set()
    for i in range(n_tensors):
        name = cur.string(f"tensor name #{i}")
        if len(name.encode()) >= MAX_NAME:
            raise GGUFError(f"{path}: tensor name #{i} is {len(name.encode())} bytes long (at most {MAX_NAME - 1})")
        if name in seen:
            raise GGUFError(f"{path}: duplicate tensor name {name!r}")
        seen.add(name)
        n_dims = cur.scalar(4, f"tensor {name!r}")
        if not 1 <= n_dims <= 4:
            raise GGUFError(f"{path}: corrupted tensor {name!r}: {n_dims} dimensions")
        ne = [cur.scalar(10, f"tensor {name!r}") for _ in range(n_dims)]
        if math.prod(ne) >= 2**63:
            raise GGUFError(f"{path}: corrupted tensor {name!r}: dimensions {ne} (negative or too large)")
        raw_infos.append((name, ne, cur.scalar(4, f"tensor {name!r}"), cur.scalar(10, f"tensor {name!r}")))
    align = meta.get("general.alignment", DEFAULT_ALIGNMENT)
    if "general.alignment" in meta and types["general.alignment"] != 4:
        raise GGUFError(f"{path}: general.alignment must be a uint32 (llama.cpp requires it)")
    if align <= 0 or align & (align - 1):
        raise GGUFError(f"{path}: invalid general.alignment {align}")
    data_start = -(-cur.pos // align) * align
    infos, expected = [], 0
    for ri in raw_infos:  # llama.cpp's layout: in order, each at the padded end of the one before
        info = _tensor_info(path, cur.size, data_start, align, *ri)
        if info.offset - data_start != expected:
            raise GGUFError(f"{path}: tensor {info.name!r} data offset {info.offset - data_start}, expected "
                            f"{expected} (tensors lie in order, each padded to {align} bytes): the file is corrupted")
        expected += -(-info.nbytes // align) * align
        infos.append(info)
    return version, meta, infos


def _tensor_info(path: str, size: int, data_start: int, align: int, name: str, ne: list[int],
                 tid: int, rel: int) -> TensorInfo:
    if tid not in GGML_TYPES:
        raise GGUFError(f"{path}: tensor {name!r} has GGML type {tid}, which gemmalite does not "
                        f"support (supported: {', '.join(v[0] for v in GGML_TYPES.values())})")
    qtype = type_name(tid)
    shape = tuple(int(d) for d in reversed(ne))
    if rel % align:
        raise GGUFError(f"{path}: tensor {name!r} data offset {rel} is not a multiple of the "
                        f"alignment {align}: the file is corrupted")
    if shape[-1] % block_info(qtype)[0]:
        raise GGUFError(f"{path}: tensor {name!r} ({qtype}) has {shape[-1]} columns, not a "
                        f"multiple of the block size")
    nbytes = quantized_nbytes(qtype, shape)
    start = data_start + rel
    if start + nbytes > size:
        raise GGUFError(f"{path}: tensor {name!r} data [{start}, {start + nbytes}) lies past the "
                        f"end of the file ({size} bytes): the file is truncated or corrupted")
    return TensorInfo(name, qtype, shape, start, nbytes)


def _tensor(data: np.ndarray, info: TensorInfo) -> Matrix | np.ndarray:
    raw = data[info.offset:info.offset + info.nbytes]
    if len(info.shape) == 1:  # norms, scalars: small, float32 in memory
        return GGMLMatrix(raw, info.qtype, (1, info.shape[0])).dense()[0]
    # 2-D weights; a 3-D expert stack is viewed as its rows stacked (shape kept in tensor_info)
    return GGMLMatrix(raw, info.qtype, (math.prod(info.shape[:-1]), info.shape[-1]))


def is_gguf(path: str | os.PathLike) -> bool:
    """Whether the file starts with the GGUF magic."""
    try:
        with open(path, "rb") as f:
            return f.read(4) == GGUF_MAGIC
    except OSError:
        return False


def read_gguf(path: str | os.PathLike, *, load_tensors: bool = True) -> GGUFFile:
    """Parse a GGUF file; tensors (if asked for) are views of a read-only memory map."""
    path = os.fspath(path)
    try:
        size = os.path.getsize(path)
    except OSError as e:
        raise GGUFError(f"{path}: cannot open: {e}") from e
    if size == 0:
        raise GGUFError(f"{path}: empty file, not a GGUF file")
    parsed = _cached_header(path)
    if parsed is None:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            buf = memoryview(mm)
            try:
                parsed = _parse(buf, path)
            finally:
                buf.release()
        _store_header(path, parsed)
    version, meta, infos = parsed
    gf = GGUFFile(path, version, meta, {i.name: i for i in infos})
    if load_tensors and infos:
        data = np.memmap(path, dtype=np.uint8, mode="r")
        gf.tensors = {i.name: _tensor(data, i) for i in infos}
    return gf


# A parsed header with a vocabulary (262k strings) is kept in the user's cache folder: reading
# it back (marshal: plain values only, no code) takes ~30 ms where parsing takes ~140 ms.
CACHED_HEADER_MIN_ITEMS = 10_000
_HEADER_FORMAT = 1


def _header_cache_path(path: str) -> Path | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    ident = f"{os.path.abspath(path)}|{st.st_size}|{st.st_mtime_ns}|{VERSION}|{_HEADER_FORMAT}"
    return cache_root() / "gguf" / f"{hashlib.sha256(ident.encode()).hexdigest()[:20]}.header"


def _cached_header(path: str) -> tuple[int, dict[str, Any], list[TensorInfo]] | None:
    cpath = _header_cache_path(path)
    try:
        version, meta, infos = marshal.loads(cpath.read_bytes())  # type: ignore[union-attr]
        meta = {k: np.frombuffer(v[2], dtype=v[1]).copy() if isinstance(v, tuple) else v for k, v in meta.items()}
        return version, meta, [TensorInfo(*i) for i in infos]
    except Exception:  # noqa: BLE001 - absent, partial or from another version: parse the file
        return None


def _store_header(path: str, parsed: tuple[int, dict[str, Any], list[TensorInfo]]) -> None:
    """Keep a large header (atomically: tmp + rename); a read-only cache folder only costs speed."""
    version, meta, infos = parsed
    if sum(len(v) for v in meta.values() if isinstance(v, (list, np.ndarray))) < CACHED_HEADER_MIN_ITEMS:
        return
    cpath = _header_cache_path(path)
    if cpath is None:
        return
    frozen = {k: ("ndarray", v.dtype.str, v.tobytes()) if isinstance(v, np.ndarray) else v for k, v in meta.items()}
    try:
        data = marshal.dumps((version, frozen, [(i.name, i.qtype, i.shape, i.offset, i.nbytes) for i in infos]))
        cpath.parent.mkdir(parents=True, exist_ok=True)
        tmp = cpath.with_name(f"{cpath.name}.tmp{os.getpid()}")
        tmp.write_bytes(data)
        os.replace(tmp, cpath)
    except (OSError, ValueError):
        pass
