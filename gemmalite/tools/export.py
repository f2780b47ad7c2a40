"""``gemmalite export MODEL OUT --format onnx``: the decoder graph as ONNX, written all or nothing.

OUT gets ``decoder.onnx`` (the one-token decode graph, `gemmalite.backends.onnx.export`),
``prefill.onnx`` (a fixed chunk) and ``decoder.onnx.data`` (the weights both share); the host
side (tokenizer, tables, LM head) stays in MODEL.
Like `convert`, the files go into a temporary folder beside OUT, are checked (``onnx.checker``)
and flushed, and the folder is renamed into place.
"""
from __future__ import annotations

import errno
import shutil
import tempfile
from pathlib import Path

from ..errors import CheckpointError, ConfigError, InputError
from ..loader import resolve
from .convert import _check_paths, _fsync, _install, _umask

FORMATS = ("onnx",)


def export(src: str | Path, out: str | Path, fmt: str = "onnx", *, context: int | None = None,
           force: bool = False) -> Path:
    """Export ``src``'s decoder graph (caches for ``context`` positions: the load default if None)."""
    if fmt not in FORMATS:
        raise InputError(f"format must be one of {FORMATS}, got {fmt!r}")
    try:
        from ..backends.onnx.export import check_folder, export_graphs
    except ImportError as e:
        raise ConfigError(f"ONNX export needs the onnx extra: pip install 'gemmalite[onnx]' ({e})") from None
    import gemmalite

    src_path, out = resolve(src), Path(out)
    if not src_path.exists():
        raise CheckpointError(f"{src_path}: no such file or folder")
    target = _check_paths(src_path, out, force)
    model = gemmalite.load(src, context=context)
    tmp = None
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.partial-", dir=target.parent))
        tmp.chmod(0o777 & ~_umask())
        export_graphs(model.engine.graph, tmp, model.engine.context)
        check_folder(tmp)
        for f in tmp.rglob("*"):
            _fsync(f)
        _fsync(tmp)
        _install(tmp, target)
    except OSError as e:
        what = "no space left on the device" if e.errno == errno.ENOSPC else e.strerror or str(e)
        raise CheckpointError(f"cannot write {out}: {what}; nothing was written") from e
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    return out
