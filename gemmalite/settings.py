"""Process settings that must be in place before numba (and numpy's OpenBLAS) load.

`gemmalite/__init__.py` calls `apply()` first thing, so importing gemmalite sets them; a value
the user already set in the environment always wins. Nothing here imports numba or numpy.

* **Kernel cache outside the package.** numba's default cache is a ``__pycache__`` folder
  beside the source: inside site-packages, where pip leaves it behind on reinstall and a later
  import then finds an empty namespace package instead of gemmalite. Here it lives under the
  user's cache folder, keyed by gemmalite version, a digest of the kernel sources, numba version
  and CPU, so an upgrade, an edited kernel (numba would not notice a change in an inlined
  helper's file) or a different CPU on a shared home folder compiles afresh instead of loading
  stale code. Making a new folder removes those unused for `STALE_DAYS`.
* **Threads that spin briefly, then sleep.** OpenMP workers (numba's ``omp`` layer) and OpenBLAS
  workers wait at the end of every parallel region. libgomp's default spin (300000) or an
  unbounded one (``OMP_WAIT_POLICY=ACTIVE``) takes, on a busy machine, the time slices the other
  thread of the same step needs, and every step waits for the slowest (measured 5-40x slower
  than one thread); no spin at all (``PASSIVE``) costs ~25 % of decode speed on an idle machine,
  where every one of a decode step's hundreds of regions wakes a sleeping thread. So the spin is
  short, and `runtime.threads.Governor` moves the steps to one thread while the machine is busy.
"""
from __future__ import annotations

import hashlib
import os
import platform
import sys
from pathlib import Path

VERSION = "0.1.0"

# Thread-waiting policy, for every runtime numba or numpy may load.
WAIT_SETTINGS = {
    "OPENBLAS_THREAD_TIMEOUT": "4",  # OpenBLAS: 2^(4+4) cycles of spin, then sleep
    "KMP_BLOCKTIME": "0",            # Intel/LLVM OpenMP: no busy wait after a region
}
# libgomp (numba's `omp` layer here): a short spin, unless the user chose a policy of their own.
GOMP_SPIN = "30000"


def cache_root() -> Path:
    """gemmalite's cache folder: $GEMMALITE_CACHE_DIR, else $XDG_CACHE_HOME/gemmalite, else ~/.cache/gemmalite."""
    if os.environ.get("GEMMALITE_CACHE_DIR"):
        return Path(os.environ["GEMMALITE_CACHE_DIR"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "gemmalite"


def _cpu_key() -> str:
    """A short digest of the CPU model and its feature flags (compiled kernels target both)."""
    text = platform.machine() + platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "model name", "Features", "CPU part")):
                    text += line
                if line.strip() == "":  # the first processor says it all
                    break
    except OSError:
        pass
    return hashlib.sha256(text.encode()).hexdigest()[:10]


def _numba_version() -> str:
    """numba's installed version, from its dist-info folder name (importlib.metadata costs ~20 ms
    of imports at every start; it is the fallback)."""
    try:
        import importlib.util

        spec = importlib.util.find_spec("numba")
        if spec is not None and spec.origin:
            site = Path(spec.origin).parent.parent
            found = [p.name[len("numba-"):-len(".dist-info")] for p in site.glob("numba-*.dist-info")]
            if len(found) == 1:
                return found[0]
        from importlib.metadata import version

        return version("numba")
    except Exception:  # noqa: BLE001 - a missing distribution record only weakens the key
        return "unknown"


KERNELS_DIR = Path(__file__).resolve().parent / "kernels"


def _kernels_key(folder: Path | None = None) -> str:
    """A digest of the kernel sources. numba checks a cached kernel only against its own file's
    time stamp, never against the files of the kernels and intrinsics it inlined: a kernel
    compiled against an older ``simd.py`` would be loaded after an edit there (a wrong result,
    no error). Keying the folder on every kernel source makes any change compile afresh."""
    h = hashlib.sha256()
    for p in sorted((folder or KERNELS_DIR).glob("*.py")):
        h.update(p.name.encode() + b"\0" + p.read_bytes() + b"\0")
    return h.hexdigest()[:10]


def numba_cache_dir() -> Path:
    """Where this gemmalite + kernel sources + numba + CPU combination keeps its compiled kernels."""
    return (cache_root() / "numba"
            / f"gemmalite-{VERSION}-{_kernels_key()}-numba-{_numba_version()}-cpu-{_cpu_key()}")


def _writable_dir(path: Path) -> Path:
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".probe{os.getpid()}"
        probe.touch()
        probe.unlink()
        return path
    except OSError:  # read-only home (containers, CI): a private temporary folder for this process
        import tempfile

        return Path(tempfile.mkdtemp(prefix="gemmalite-numba-"))


# A kernel folder no gemmalite has started with for this many days is removed when a new one is
# made beside it: each upgrade or edited kernel source adds a folder (10-40 MB), and nothing else
# would ever delete the old ones. Days, not "all but the newest": two installed versions, or
# machines with other CPUs sharing a home folder, each keep theirs while they are in use. A process
# still running on a removed folder loses nothing it has loaded; numba makes the folder again when
# it next saves a kernel (`ensure_cache_path`).
STALE_DAYS = 30


def kernel_cache(path: Path) -> Path:
    """The kernel folder ``path`` (`numba_cache_dir`'s name), made if missing and marked as used
    now (its modification time is its last use); where this call made it, the stale ones beside it
    go (`prune_kernel_caches`). A folder that cannot be written: a private temporary one."""
    fresh = not path.is_dir()
    got = _writable_dir(path)
    if got == path:
        try:
            os.utime(path)
        except OSError:
            pass
        if fresh:
            prune_kernel_caches(path.parent, keep=path.name)
    return got


def _is_kernel_folder(name: str) -> bool:
    return name.startswith("gemmalite-") and "-numba-" in name and "-cpu-" in name


def prune_kernel_caches(folder: Path, keep: str, days: float = STALE_DAYS) -> list[str]:
    """Remove the kernel folders in ``folder`` (named as `numba_cache_dir` names them; nothing
    else is touched) other than ``keep`` that were last used more than ``days`` ago; returns their
    names. Each is renamed away before it is deleted, so a process starting meanwhile finds a
    whole folder or none. Best effort: a folder that cannot be removed stays, silently."""
    import shutil
    import time

    cutoff = time.time() - days * 86400
    removed = []
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return removed
    for e in entries:
        try:
            if (e.name == keep or not _is_kernel_folder(e.name) or not e.is_dir(follow_symlinks=False)
                    or e.stat(follow_symlinks=False).st_mtime >= cutoff):
                continue
            trash = folder / f".removing-{e.name}-{os.getpid()}"
            os.rename(e.path, trash)  # another process pruning too: one rename wins, the other fails
        except OSError:
            continue
        shutil.rmtree(trash, ignore_errors=True)
        removed.append(e.name)
    for e in entries:  # what an interrupted removal left (already renamed away: no one loads it)
        if e.name.startswith(".removing-gemmalite-"):
            shutil.rmtree(e.path, ignore_errors=True)
    return removed


def apply() -> None:
    """Set the environment (user values win). Too late for numba once it is imported: say so."""
    for k, v in WAIT_SETTINGS.items():
        os.environ.setdefault(k, v)
    if "OMP_WAIT_POLICY" not in os.environ:  # GOMP_SPINCOUNT would override the user's policy
        os.environ.setdefault("GOMP_SPINCOUNT", GOMP_SPIN)
    if not os.environ.get("NUMBA_CACHE_DIR"):
        folder = str(kernel_cache(numba_cache_dir()))
        if "numba" in sys.modules:  # numba read its config already: tell its live config instead
            import numba.core.config as nconf

            setattr(nconf, "CACHE_DIR", folder)  # set by numba at run time, unknown to type checkers
        else:
            os.environ["NUMBA_CACHE_DIR"] = folder


def usable_cpus() -> int:
    """CPUs this process may run on (its affinity mask, e.g. under taskset or a container's cpuset)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # not Linux
        return max(1, os.cpu_count() or 1)


_compile_notice_done = False


def announce_first_compile() -> None:
    """Print one line on stderr when numba first compiles (not loads from cache) a kernel in
    this process: the first run on a CPU takes a while, and a silent pause looks like a hang."""
    from numba.core import event

    class _Notice(event.Listener):
        def on_start(self, event):
            global _compile_notice_done
            if not _compile_notice_done:
                _compile_notice_done = True
                print("gemmalite: preparing kernels for this CPU, first run only (up to a minute)...",
                      file=sys.stderr, flush=True)

        def on_end(self, event):
            pass

    event.register("numba:compile", _Notice())
