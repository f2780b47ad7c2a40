"""`gemmalite convert` is all or nothing: it never touches the source, refuses outputs that would
overwrite it, and leaves either the complete converted folder or nothing loadable -- when it
fails, when the disk fills up, and when it is interrupted (SIGINT, SIGKILL) at random points."""
from __future__ import annotations

import errno
import hashlib
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from small_checkpoint import write_small_checkpoint

from gemmalite.errors import CheckpointError
from gemmalite.formats.converted import MANIFEST, check_manifest
from gemmalite.tools import convert as convert_mod
from gemmalite.tools.convert import convert

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    return write_small_checkpoint(tmp_path_factory.mktemp("conv_src") / "model")


def fingerprint(folder: Path) -> dict[str, tuple[int, int, str]]:
    """Every file under ``folder`` with its size, mtime and hash: the source must never change."""
    return {str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns, hashlib.sha256(p.read_bytes()).hexdigest())
            for p in sorted(folder.rglob("*")) if p.is_file()}


def loads(folder: Path) -> bool:
    """Whether ``folder`` loads as a checkpoint (a CheckpointError means it does not)."""
    import gemmalite

    try:
        gemmalite.load(folder)
    except CheckpointError:
        return False
    return True


def leftovers(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if ".partial-" in p.name or ".old-" in p.name)


@pytest.fixture(scope="module")
def converted(src, tmp_path_factory):
    before = fingerprint(src)
    out = convert(src, tmp_path_factory.mktemp("conv_ok") / "q8", "int8", progress=False)
    assert fingerprint(src) == before
    return out


def test_complete_conversion_has_a_manifest_and_loads(converted):
    check_manifest(converted)
    assert (converted / MANIFEST).is_file() and loads(converted)
    assert oct(converted.stat().st_mode & 0o777) != oct(0o700), "the temporary folder's 0700 mode leaked"
    assert leftovers(converted.parent) == []


@pytest.mark.parametrize("damage", ["no_manifest", "missing_file", "truncated_shard", "grown_file"])
def test_a_partial_or_damaged_conversion_does_not_load(converted, tmp_path, damage):
    import shutil

    out = Path(shutil.copytree(converted, tmp_path / "copy"))
    if damage == "no_manifest":
        (out / MANIFEST).unlink()
    elif damage == "missing_file":
        (out / "chat_template.jinja").unlink()
    elif damage == "truncated_shard":
        with open(out / "model.safetensors", "r+b") as f:
            f.truncate(1000)
    else:
        with open(out / "generation_config.json", "a") as f:
            f.write(" ")
    with pytest.raises(CheckpointError, match="manifest|missing|damaged"):
        import gemmalite

        gemmalite.load(out)


@pytest.mark.parametrize("where", ["same", "inside", "contains", "symlink"])
def test_refuses_an_output_that_is_holds_or_lies_in_the_source(src, tmp_path, where):
    before = fingerprint(src)
    if where == "same":
        out = src
    elif where == "inside":
        out = src / "sub"
    elif where == "contains":
        out = src.parent
    else:
        out = tmp_path / "link"
        out.symlink_to(src)
    with pytest.raises(CheckpointError, match="source"):
        convert(src, out, "int8", progress=False)
    assert fingerprint(src) == before and not (src / "sub").exists()


def test_non_empty_output_needs_force_which_replaces_it_whole(src, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "generation_config.json").write_text('{"stale": true}')
    (out / "model.safetensors.index.json").write_text("{}")
    with pytest.raises(CheckpointError, match="not empty.*--force"):
        convert(src, out, "int8", progress=False)
    assert (out / "generation_config.json").read_text() == '{"stale": true}'  # untouched
    convert(src, out, "int8", progress=False, force=True)
    assert not (out / "model.safetensors.index.json").exists()
    assert (out / "generation_config.json").read_bytes() == (src / "generation_config.json").read_bytes()
    check_manifest(out)
    assert leftovers(tmp_path) == []
    empty = tmp_path / "empty"
    empty.mkdir()
    convert(src, empty, "int8", progress=False)  # an empty folder is fine without force
    check_manifest(empty)


def _fail_midway(exc: OSError):
    real = convert_mod.save_arrays

    def save(folder, arrays, **kw):
        files = real(folder, arrays, **kw)
        with open(files[0], "r+b") as f:  # a shard written halfway, then the disk says no
            f.truncate(f.seek(0, 2) // 2)
        raise exc
    return save


@pytest.mark.parametrize("exc, needle", [(OSError(errno.ENOSPC, "No space left on device"), "no space left"),
                                         (PermissionError(errno.EACCES, "Permission denied"), "permission denied")])
def test_write_errors_are_checkpoint_errors_and_leave_nothing(src, tmp_path, monkeypatch, exc, needle):
    """Simulated by making the writer fail after a half-written shard (see the tmpfs test for a real full disk)."""
    before = fingerprint(src)
    monkeypatch.setattr(convert_mod, "save_arrays", _fail_midway(exc))
    with pytest.raises(CheckpointError, match=needle):
        convert(src, tmp_path / "out", "int8", progress=False)
    assert not (tmp_path / "out").exists() and leftovers(tmp_path) == []
    assert fingerprint(src) == before


def test_unwritable_parent_is_a_checkpoint_error(src, tmp_path, monkeypatch):
    def deny(*a, **k):
        raise PermissionError(errno.EACCES, "Permission denied", str(tmp_path))
    monkeypatch.setattr(convert_mod.tempfile, "mkdtemp", deny)
    with pytest.raises(CheckpointError, match="permission denied"):
        convert(src, tmp_path / "out", "int8", progress=False)


@pytest.fixture
def small_disk(tmp_path):
    """A 1 MiB tmpfs (smaller than the converted checkpoint), where this machine allows mounting one."""
    disk = tmp_path / "disk"
    disk.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(disk)], capture_output=True)
    if r.returncode:
        pytest.skip(f"cannot mount a tmpfs here ({r.stderr.decode().strip()}); ENOSPC is covered by the simulated test")
    yield disk
    subprocess.run(["umount", str(disk)], check=True)


def test_full_disk(src, small_disk):
    before = fingerprint(src)
    with pytest.raises(CheckpointError, match="no space left"):
        convert(src, small_disk / "out", "int8", progress=False)
    assert list(small_disk.iterdir()) == []  # nothing partial left behind, the space is free again
    assert fingerprint(src) == before


CHILD = textwrap.dedent("""
    import sys, time
    from gemmalite.tools.convert import convert
    from gemmalite.formats.folder import load_folder
    load_folder(sys.argv[1])  # warm the imports before the clock starts
    print("ready", flush=True)
    t = time.perf_counter()
    convert(sys.argv[1], sys.argv[2], "int8", progress=False, force=True)
    print(f"done {time.perf_counter() - t:.3f}", flush=True)
""")


def _child(src: Path, out: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    p = subprocess.Popen([sys.executable, "-c", CHILD, str(src), str(out)], stdout=subprocess.PIPE, text=True,
                         env=env, cwd=ROOT)
    assert p.stdout.readline().strip() == "ready"
    return p


def test_interrupted_conversion_never_leaves_a_loadable_partial_folder(src, tmp_path):
    before = fingerprint(src)
    p = _child(src, tmp_path / "clean")  # an uninterrupted run times the conversion
    out, _ = p.communicate(timeout=120)
    duration = float(out.split()[-1])
    assert p.returncode == 0 and loads(tmp_path / "clean")

    rng = random.Random(9)
    seen: set[str] = set()
    for i, sig in enumerate([signal.SIGINT, signal.SIGKILL, signal.SIGINT, signal.SIGKILL]):
        target = tmp_path / f"out{i}"
        if i >= 2:  # an existing (complete) conversion that --force would replace: it must survive a kill
            import shutil
            shutil.copytree(tmp_path / "clean", target)
        p = _child(src, target)
        time.sleep(rng.uniform(0, duration))
        p.send_signal(sig)
        p.communicate(timeout=120)
        # the output is absent or complete (the old one or the new one), never a partial folder
        assert not target.exists() or loads(target), f"kill #{i} ({sig.name}) left a partial {target} that loads"
        if i >= 2:
            assert target.exists(), "--force lost the previous conversion on an interruption"
        new = set(leftovers(tmp_path)) - seen
        seen |= new
        for name in new:
            partial = tmp_path / name
            assert sig == signal.SIGKILL, f"SIGINT left {name} behind"  # SIGKILL gives no chance to clean up
            if (partial / MANIFEST).exists():  # killed between the manifest and the rename: complete
                check_manifest(partial)
            else:
                assert not loads(partial) if (partial / "config.json").exists() else True
        assert fingerprint(src) == before
