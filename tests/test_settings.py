"""Process settings made on import: where kernels are cached, how waiting threads behave."""
from __future__ import annotations

import os
from pathlib import Path


from gemmalite import settings


def test_cache_root_precedence(monkeypatch, tmp_path):
    monkeypatch.delenv("GEMMALITE_CACHE_DIR", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert settings.cache_root() == tmp_path / "home" / ".cache" / "gemmalite"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert settings.cache_root() == tmp_path / "xdg" / "gemmalite"
    monkeypatch.setenv("GEMMALITE_CACHE_DIR", str(tmp_path / "mine"))
    assert settings.cache_root() == tmp_path / "mine"


def test_numba_cache_dir_is_keyed_by_versions_and_cpu(monkeypatch, tmp_path):
    import numba

    monkeypatch.setenv("GEMMALITE_CACHE_DIR", str(tmp_path))
    d = settings.numba_cache_dir()
    assert d.parent == tmp_path / "numba"
    assert d.name.startswith(f"gemmalite-{settings.VERSION}-{settings._kernels_key()}-numba-{numba.__version__}-cpu-")
    monkeypatch.setattr(settings, "VERSION", "9.9.9")
    assert settings.numba_cache_dir() != d  # an upgrade compiles afresh


def test_numba_cache_dir_changes_with_any_kernel_source(monkeypatch, tmp_path):
    """numba would reuse a kernel compiled against an older version of a helper it inlined from
    another file: an edit to any kernel source must move the cache folder."""
    import shutil

    kernels = tmp_path / "kernels"
    shutil.copytree(settings.KERNELS_DIR, kernels, ignore=shutil.ignore_patterns("__pycache__"))
    monkeypatch.setattr(settings, "KERNELS_DIR", kernels)
    monkeypatch.setenv("GEMMALITE_CACHE_DIR", str(tmp_path / "cache"))
    before = settings.numba_cache_dir()
    assert settings._kernels_key(kernels) == settings._kernels_key()
    simd = kernels / "simd.py"
    simd.write_text(simd.read_text() + "\n# an edit to an inlined helper's file\n")
    assert settings.numba_cache_dir() != before


def test_user_values_win(monkeypatch):
    import os

    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    monkeypatch.setenv("NUMBA_CACHE_DIR", "/somewhere/else")
    monkeypatch.setenv("KMP_BLOCKTIME", "200")
    settings.apply()
    assert os.environ["OMP_WAIT_POLICY"] == "ACTIVE" and os.environ["NUMBA_CACHE_DIR"] == "/somewhere/else"
    assert "GOMP_SPINCOUNT" not in os.environ  # it would override the user's policy
    assert os.environ["KMP_BLOCKTIME"] == "200"


def test_short_spin_by_default(monkeypatch):
    import os

    for k in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME", "OPENBLAS_THREAD_TIMEOUT"):
        monkeypatch.delenv(k, raising=False)
    settings.apply()
    assert os.environ["GOMP_SPINCOUNT"] == settings.GOMP_SPIN and os.environ["KMP_BLOCKTIME"] == "0"
    assert os.environ["OPENBLAS_THREAD_TIMEOUT"] == "4"


def test_unwritable_cache_falls_back_to_a_private_folder(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    blocked = tmp_path / "a-file"  # a folder under a file cannot be made, by root either
    blocked.write_text("")
    try:
        for where in ([] if os.geteuid() == 0 else [ro]) + [blocked]:  # root ignores the permissions
            got = settings._writable_dir(where / "numba")
            assert got != where / "numba" and got.exists() and Path(got).name.startswith("gemmalite-numba-")
    finally:
        ro.chmod(0o700)


def _folder(path: Path, days_ago: float, file: bool = False) -> Path:
    import time

    if file:
        path.write_text("")
    else:
        path.mkdir(parents=True)
        (path / "kernel.nbi").write_bytes(b"compiled")
    then = time.time() - days_ago * 86400
    os.utime(path, (then, then))
    return path


def _names(folder: Path) -> set[str]:
    return {p.name for p in folder.iterdir()}


def test_a_new_kernel_folder_removes_the_stale_ones_beside_it(tmp_path):
    root = tmp_path / "numba"
    stale = _folder(root / "gemmalite-0.0.9-aaaa-numba-0.60.0-cpu-bbbb", 31)
    other_cpu = _folder(root / "gemmalite-0.1.0-cccc-numba-0.68.1-cpu-dddd", 29)  # in use elsewhere
    _folder(root / "my-notes", 400)  # not a kernel folder: never touched
    _folder(root / "gemmalite-0.0.1-x-numba-0.1-cpu-y", 400, file=True)  # a file of that name: left
    _folder(root / ".removing-gemmalite-0.0.8-e-numba-0.59-cpu-f-123", 1)  # an interrupted removal
    current = root / "gemmalite-0.2.0-eeee-numba-0.68.1-cpu-ffff"
    assert settings.kernel_cache(current) == current and current.is_dir()
    assert _names(root) == {other_cpu.name, "my-notes", "gemmalite-0.0.1-x-numba-0.1-cpu-y", current.name}
    assert not stale.exists()


def test_a_kernel_folder_in_use_is_kept_and_prunes_nothing(tmp_path):
    """Starting with an existing folder marks it used (so another version's new folder keeps it)
    and removes nothing: pruning runs where a folder is made, an upgrade's first start."""
    import time

    root = tmp_path / "numba"
    mine = _folder(root / "gemmalite-0.1.0-aaaa-numba-0.68.1-cpu-bbbb", 40)
    stale = _folder(root / "gemmalite-0.0.9-cccc-numba-0.68.1-cpu-bbbb", 40)
    assert settings.kernel_cache(mine) == mine
    assert mine.stat().st_mtime > time.time() - 60 and stale.exists()
    newer = root / "gemmalite-0.2.0-dddd-numba-0.68.1-cpu-bbbb"
    settings.kernel_cache(newer)
    assert _names(root) == {mine.name, newer.name}


def test_apply_prunes_beside_the_folder_it_makes(monkeypatch, tmp_path):
    import numba.core.config as nconf

    monkeypatch.delenv("NUMBA_CACHE_DIR", raising=False)
    monkeypatch.setenv("GEMMALITE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(nconf, "CACHE_DIR", nconf.CACHE_DIR)  # numba is loaded: apply sets its live config
    stale = _folder(tmp_path / "numba" / "gemmalite-0.0.1-aaaa-numba-0.1.0-cpu-bbbb", 45)
    settings.apply()
    assert nconf.CACHE_DIR == str(settings.numba_cache_dir()) and not stale.exists()


def test_usable_cpus_follows_affinity():
    import os

    if hasattr(os, "sched_getaffinity"):
        assert settings.usable_cpus() == len(os.sched_getaffinity(0))
    assert settings.usable_cpus() >= 1
