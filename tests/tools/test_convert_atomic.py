"""`gemmalite convert` is all or nothing: it never touches the source, refuses outputs that would
overwrite it, and leaves either the complete converted folder or nothing loadable -- when it
fails, when the disk fills up, and when it is interrupted (SIGINT, SIGKILL) at each stage of a running conversion."""
from __future__ import annotations

import errno
import hashlib
import os
import signal
import subprocess
import sys
import textwrap
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
    import signal, sys, time
    # Ctrl-C as a user's shell delivers it: a child of a background job (CI started with `&`) inherits
    # SIGINT ignored, and Python then installs no KeyboardInterrupt handler
    signal.signal(signal.SIGINT, signal.default_int_handler)
    from gemmalite.tools import convert as c
    from gemmalite.formats.folder import load_folder
    src, out, phase = sys.argv[1:]
    load_folder(src)  # warm the imports

    def pause(name, real):
        # announce the phase (the parent then sends its signal) and hold there, so that the signal
        # provably lands inside a running conversion, at that point
        def wrapped(*a, **k):
            result = real(*a, **k) if name != "install" else None
            print(name, flush=True)
            time.sleep(60)
            return real(*a, **k) if name == "install" else result
        return wrapped

    hook = {"quantize": "quantize", "saved": "save_arrays", "install": "_install"}[phase]
    setattr(c, hook, pause(phase, getattr(c, hook)))
    c.convert(src, out, "int8", progress=False, force=True)
    print("done", flush=True)
""")

# (phase the signal lands in, signal, whether a complete conversion is already at the output)
# quantize: the partial folder holds nothing yet; saved: every tensor file written, no manifest;
# install: the manifest written, the rename not done
KILLS = [("quantize", signal.SIGINT, False), ("saved", signal.SIGKILL, False), ("install", signal.SIGINT, False),
         ("install", signal.SIGKILL, False), ("saved", signal.SIGINT, True), ("install", signal.SIGKILL, True)]


@pytest.mark.parametrize("phase,sig,existing", KILLS, ids=[f"{p}-{s.name}-{'over' if e else 'fresh'}" for p, s, e in KILLS])
def test_interrupted_conversion_never_leaves_a_loadable_partial_folder(src, converted, tmp_path, phase, sig, existing):
    before = fingerprint(src)
    target = tmp_path / "out"
    if existing:  # a complete conversion that --force would replace: it must survive the interruption
        import shutil
        shutil.copytree(converted, target)
    old = fingerprint(target) if existing else None
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    p = subprocess.Popen([sys.executable, "-c", CHILD, str(src), str(target), phase], stdout=subprocess.PIPE,
                         text=True, env=env, cwd=ROOT)
    try:
        assert p.stdout.readline().strip() == phase, "the conversion never reached the phase"
        partial = [tmp_path / n for n in leftovers(tmp_path) if ".partial-" in n]
        assert len(partial) == 1, f"no partial folder while converting: {sorted(os.listdir(tmp_path))}"
        if phase == "install":
            check_manifest(partial[0])  # complete, but not yet in place
        p.send_signal(sig)
        rest, _ = p.communicate(timeout=120)
    finally:
        p.kill()
    assert p.returncode == -sig, f"exit status {p.returncode}: the signal did not end the conversion"
    assert "done" not in rest
    # the output is what it was: absent, or the previous conversion untouched
    assert (fingerprint(target) == old) if existing else not target.exists()
    left = leftovers(tmp_path)
    if sig == signal.SIGINT:  # an interruption the process sees cleans up after itself
        assert left == [], f"SIGINT left {left} behind"
    else:  # SIGKILL gives no chance to clean up: what stays is never taken for a checkpoint
        assert [n for n in left if ".partial-" in n] == [partial[0].name]
        assert phase == "install" or not loads(partial[0])
    assert fingerprint(src) == before
