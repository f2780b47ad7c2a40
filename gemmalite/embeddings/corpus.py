"""Embed a JSONL corpus into a Parquet file: streaming, resumable, with progress.

Input: one JSON value per line, either an object with a text field and / or an image field and /
or an audio field (a path, or a list of paths, relative to the JSONL file's folder; optionally an
id field) or a bare string; blank lines are skipped; a record without an id gets its record
number. A record with a text and images or clips is one interleaved input, its parts in the
record's key order. Output: Parquet with columns ``id`` (int64 or string, as the first record's) and
``embedding`` (fixed-size list of float32).

Resumability: records are embedded in chunks of ``chunk_size``; each finished chunk is
written atomically as one part file under ``<output>.parts/`` (with a manifest of the run's
settings). An interrupted run leaves whole parts only; running the same command again skips
the records those parts hold, so nothing is embedded twice and nothing is lost. When the
input is exhausted the parts are streamed into ``<output>`` and removed. Memory stays at one
chunk whatever the corpus size.
"""
from __future__ import annotations

import itertools
import json
import os
import shutil
import time
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from ..errors import InputError

PART_ROWS = 1024


def _require_pyarrow():
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        raise InputError("corpus mode writes Parquet: pip install 'gemmalite[embed]' (pyarrow)") from None
    return pa, pq


def read_records(path: Path, text_field: str = "text", id_field: str = "id", image_field: str | None = "image",
                 audio_field: str | None = "audio") -> Iterator[tuple[Any, Any]]:
    """``(id, input)`` per non-blank line (input: a text, or a list of parts with image / audio paths);
    InputError naming the line on anything malformed."""
    n = 0
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise InputError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None
            if isinstance(rec, str):
                rid, item = n, rec
            elif isinstance(rec, dict):
                rid, item = rec.get(id_field, n), _record_input(rec, path, lineno, text_field, image_field, audio_field)
            else:
                raise InputError(f"{path}:{lineno}: expected an object or a string, got {type(rec).__name__}")
            if isinstance(item, str) and not item:
                raise InputError(f"{path}:{lineno}: the text must be a non-empty string")
            if isinstance(rid, bool) or not isinstance(rid, (int, str)):
                raise InputError(f"{path}:{lineno}: the id must be an integer or a string")
            yield rid, item
            n += 1


def _record_input(rec: dict, path: Path, lineno: int, text_field: str, image_field: str | None,
                  audio_field: str | None = None) -> Any:
    """A record's text, or its parts (text, image and audio paths, in the record's key order)."""
    media = [f for f in (image_field, audio_field) if f]
    if not any(f in rec for f in media):
        if text_field not in rec:
            fields = " or ".join(repr(f) for f in [text_field, *media])
            raise InputError(f"{path}:{lineno}: no {fields} field")
        if not isinstance(rec[text_field], str) or not rec[text_field]:
            raise InputError(f"{path}:{lineno}: the text must be a non-empty string")
        return rec[text_field]
    parts: list[Any] = []
    for key, value in rec.items():
        if key == text_field:
            if not isinstance(value, str) or not value:
                raise InputError(f"{path}:{lineno}: the text must be a non-empty string")
            parts.append(value)
        elif key in media:
            paths = value if isinstance(value, list) else [value]
            if not paths or not all(isinstance(v, str) and v for v in paths):
                raise InputError(f"{path}:{lineno}: {key!r} must be a path or a list of paths")
            if key == image_field:
                parts += [path.parent / v for v in paths]  # Path: an image (a str would be text)
            else:
                parts += [{"audio": path.parent / v} for v in paths]
    return parts


def _count_records(path: Path) -> int:
    with open(path, "rb") as f:
        return sum(1 for line in f if line.strip())


def embed_corpus(embedder, input_path: str | Path, output_path: str | Path, *, prompt_name: str | None = None,
                 prompt: str | None = None, dimensions: int | None = None, batch_size: int = 32,
                 truncate: bool = False, text_field: str = "text", id_field: str = "id",
                 image_field: str | None = "image", audio_field: str | None = "audio", chunk_size: int = PART_ROWS,
                 progress: bool = True) -> dict:
    """Embed every record of ``input_path`` into ``output_path`` (Parquet); resumes an interrupted run.

    Returns ``{"rows", "resumed_rows", "seconds", "texts_per_s", "output"}``."""
    pa, pq = _require_pyarrow()
    from tqdm import tqdm

    src, out = Path(input_path), Path(output_path)
    if not src.is_file():
        raise InputError(f"{src}: no such input file")
    if int(chunk_size) < 1:
        raise InputError(f"chunk_size must be at least 1, got {chunk_size}")
    pre = embedder.resolve_prompt(prompt_name, prompt)
    dim = embedder._dimensions(dimensions)
    parts = out.with_name(out.name + ".parts")
    manifest = {"model": str(embedder.source), "input": str(src.resolve()), "prompt": pre, "dimensions": dim,
                "truncate": bool(truncate), "text_field": text_field, "id_field": id_field, "image_field": image_field,
                "audio_field": audio_field,
                "chunk_size": int(chunk_size)}
    done = _resume(parts, manifest, pq)
    total = _count_records(src)
    t0 = time.perf_counter()
    bar = tqdm(total=total, initial=done, unit="inputs", desc="embedding", disable=not progress, smoothing=0.1)
    first = next(read_records(src, text_field, id_field, image_field, audio_field), None)
    id_type = pa.int64() if first is None or isinstance(first[0], int) else pa.string()
    records = itertools.islice(read_records(src, text_field, id_field, image_field, audio_field), done, None)  # skip finished parts
    part_no = done // chunk_size
    while True:
        chunk = [r for _, r in zip(range(chunk_size), records)]
        if not chunk:
            break
        ids = [rid for rid, _ in chunk]
        vecs = embedder.embed([t for _, t in chunk], prompt=pre, dimensions=dim, batch_size=batch_size,
                              truncate=truncate)
        _write_part(parts, part_no, ids, id_type, vecs, pa, pq)
        part_no += 1
        bar.update(len(chunk))
    bar.close()
    rows = _merge(parts, out, dim, pa, pq)
    secs = time.perf_counter() - t0
    new = rows - done
    return {"rows": rows, "resumed_rows": done, "seconds": secs, "texts_per_s": new / secs if secs > 0 else 0.0,
            "output": str(out)}


def _resume(parts: Path, manifest: dict, pq) -> int:
    """Rows already written by an earlier run with the same settings (0 when starting afresh)."""
    mpath = parts / "manifest.json"
    if not mpath.exists():
        if parts.exists():
            shutil.rmtree(parts)
        parts.mkdir(parents=True)
        mpath.write_text(json.dumps(manifest, indent=2))
        return 0
    old = json.loads(mpath.read_text())
    if old != manifest:
        diff = sorted(k for k in manifest if old.get(k) != manifest[k])
        raise InputError(f"{parts}: an unfinished run with other settings ({', '.join(diff)}) is there; "
                         "delete it to start over")
    for tmp in parts.glob("*.tmp"):
        tmp.unlink()
    files = sorted(parts.glob("part-*.parquet"))
    rows = [pq.ParquetFile(f).metadata.num_rows for f in files]
    chunk = manifest["chunk_size"]
    if any(r != chunk for r in rows[:-1]) or [f.name for f in files] != [f"part-{i:06d}.parquet" for i in range(len(files))]:
        raise InputError(f"{parts}: parts are missing or damaged; delete the folder to start over")
    return sum(rows)


def _write_part(parts: Path, n: int, ids: list, id_type, vecs: np.ndarray, pa, pq) -> None:
    d = vecs.shape[1]
    try:
        id_arr = pa.array(ids, type=id_type)
    except (pa.ArrowInvalid, pa.ArrowTypeError):
        raise InputError(f"ids must all be {'integers' if id_type == pa.int64() else 'strings'} "
                         f"(as the first record's); chunk {n} mixes types") from None
    emb = pa.FixedSizeListArray.from_arrays(pa.array(vecs.reshape(-1), type=pa.float32()), d)
    table = pa.table({"id": id_arr, "embedding": emb})
    final = parts / f"part-{n:06d}.parquet"
    tmp = final.with_suffix(".tmp")
    pq.write_table(table, tmp)
    os.replace(tmp, final)  # a part is there whole or not at all


def _merge(parts: Path, out: Path, dim: int, pa, pq) -> int:
    files = sorted(parts.glob("part-*.parquet"))
    tmp = out.with_name(out.name + ".tmp")
    rows = 0
    writer = None
    try:
        for f in files:
            t = pq.read_table(f)
            if writer is None:
                writer = pq.ParquetWriter(tmp, t.schema)
            writer.write_table(t)
            rows += t.num_rows
    finally:
        if writer is not None:
            writer.close()
    if writer is None:  # an empty corpus: an empty table
        pq.write_table(pa.table({"id": pa.array([], pa.int64()), "embedding": pa.array([], pa.list_(pa.float32(), dim))}),
                       tmp)
    os.replace(tmp, out)
    shutil.rmtree(parts)
    return rows
