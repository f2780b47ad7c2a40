"""Shared fixtures: the engine module and small helpers for the transformers-parity tests."""
from __future__ import annotations

import importlib.util
import os
import re
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, settings

# No clock in the property tests: a loaded machine (CI's) must not fail an example by its time.
settings.register_profile("gemmalite", deadline=None,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
settings.load_profile("gemmalite")

sys.path.insert(0, str(Path(__file__).resolve().parent))  # `import hf_oracle`
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def _numba_cache() -> str:
    """The tests' compiled kernels: in gemmalite's own keyed folder (`settings.numba_cache_dir`:
    its version, a digest of every kernel source, numba's version, the CPU; numba alone would load
    a kernel compiled against an older simd.py), so an edited kernel compiles afresh and a second
    run loads what the first compiled; under a root of the tests' own ($GEMMALITE_TEST_CACHE, else
    ~/.cache/gemmalite-tests; folders unused for 30 days pruned as the user's are), never the user's
    cache folder. settings.py is read on its own: the package's import would set NUMBA_CACHE_DIR to
    the user's folder first."""
    package = Path(importlib.util.find_spec("gemmalite").origin).parent  # the gemmalite the tests import
    spec = importlib.util.spec_from_file_location("_gemmalite_settings", package / "settings.py")
    settings_module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(settings_module)
    root = Path(os.environ.get("GEMMALITE_TEST_CACHE") or Path.home() / ".cache" / "gemmalite-tests")
    return str(settings_module.kernel_cache(root / "numba" / settings_module.numba_cache_dir().name))


os.environ.setdefault("NUMBA_CACHE_DIR", _numba_cache())
# gemmalite's other caches (tokenizers built from GGUF files, the bundled vocabulary): fresh in
# every run, so the tests run the build paths and never write into the user's cache folder.
os.environ.setdefault("GEMMALITE_CACHE_DIR", tempfile.mkdtemp(prefix="gemmalite-cache-"))


@pytest.fixture(scope="session")
def gl():
    """The gemmalite package."""
    import gemmalite

    return gemmalite


@pytest.fixture
def w8a8_weights(monkeypatch):
    """The ids of the int8 weight arrays the VNNI W8A8 prefill kernel ran on during the test (a
    spy on `weights.quant.i8_mm_vnni`): which matrices took int8 activations."""
    from gemmalite.weights import quant

    seen: set[int] = set()
    kernel = quant.i8_mm_vnni

    def spy(q, scale, xu, xh, *args):
        if xh is None:  # int8 activations (int16 ones come as two byte planes)
            seen.add(id(q))
        return kernel(q, scale, xu, xh, *args)

    monkeypatch.setattr(quant, "i8_mm_vnni", spy)
    return seen


# numba's target for a CPU without AVX-512 (``NUMBA_CPU_NAME=haswell`` with these features): a subprocess
# under ``haswell_env`` compiles every kernel as such a CPU gets it, whatever the host
HASWELL = ("+64bit,+avx,+avx2,+bmi,+bmi2,+cmov,+cx16,+f16c,+fma,+fsgsbase,+lzcnt,+mmx,+movbe,+pclmul,+popcnt,"
           "+rdrnd,+sahf,+sse,+sse2,+sse3,+sse4.1,+sse4.2,+ssse3,+xsave,+xsaveopt")


def haswell_env(cache_dir) -> dict:
    """The environment of a subprocess whose kernels compile for Haswell, cached in ``cache_dir``."""
    import os

    return {**os.environ, "NUMBA_CPU_NAME": "haswell", "NUMBA_CPU_FEATURES": HASWELL, "NUMBA_CACHE_DIR": str(cache_dir)}


def random_ids(n: int, vocab: int, seed: int = 0, low: int = 5) -> list[int]:
    """``n`` random token ids in ``[low, vocab)`` (no pad/eos/bos/unk/mask)."""
    return [int(i) for i in np.random.RandomState(seed).randint(low, vocab, size=n)]


# -- skips under CI --------------------------------------------------------------------------
# CI (CI=true; .ci/run sets it) installs every extra, so a skip there means a test silently
# stopped running: the session fails unless the reason names hardware the machine lacks.
CI_ALLOWED_SKIPS = (  # re.match against the skip's reason
    r"(the host has )?no (AVX2|AVX-512 BF16|AVX-512 VNNI|AVX2 / VNNI|VNNI)\b",  # x86 SIMD levels: a CPU
    # without them runs the kernels' portable paths, which the same tests check on it
    r"madvise / smaps are Linux's$",  # the memory-map checks, on other systems
)
_skips: list[tuple[str, str]] = []


def _record_skip(report) -> None:
    if report.skipped and not hasattr(report, "wasxfail"):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        _skips.append((report.nodeid, reason.removeprefix("Skipped: ")))


def pytest_collectreport(report) -> None:  # a module's importorskip
    _record_skip(report)


def pytest_runtest_logreport(report) -> None:
    _record_skip(report)


def _ci_forbidden_skips() -> list[tuple[str, str]]:
    if os.environ.get("CI", "").lower() not in ("1", "true", "yes"):
        return []
    return [(n, r) for n, r in _skips if not any(re.match(a, r) for a in CI_ALLOWED_SKIPS)]


def pytest_terminal_summary(terminalreporter) -> None:
    bad = _ci_forbidden_skips()
    if bad:
        terminalreporter.section("skips CI does not allow (tests/conftest.py CI_ALLOWED_SKIPS)", red=True)
        for nodeid, reason in bad:
            terminalreporter.line(f"{nodeid}: {reason}")


def pytest_sessionfinish(session, exitstatus) -> None:
    if _ci_forbidden_skips() and exitstatus in (pytest.ExitCode.OK, pytest.ExitCode.NO_TESTS_COLLECTED):
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


# -- tiers -----------------------------------------------------------------------------------
# `pytest -m kernels` (or parity, peers, browser; markers registered in pyproject.toml) runs one
# tier: each test is marked by the file it lives in. Slow tests stay out unless the -m expression
# names `slow` (`-m "kernels and slow"`), as they stay out of a plain run.
TESTS = Path(__file__).resolve().parent
TIER_PATHS = {  # tier -> files or folders under tests/
    "kernels": ("kernels/", "weights/"),  # numba / LLVM kernels and weight formats against numpy
    "peers": ("formats/test_gguf_gemma.py",  # llama.cpp's converter (GEMMALITE_LLAMA_CPP)
              "formats/test_spm_fuzz.py",  # llama.cpp's tokenizer (llama-cpp-python)
              "formats/test_gguf_tokenizer.py",  # token ids llama.cpp produced (scripts/oracle_tokenize_llamacpp.py)
              "models/test_gemma3_270m.py"),  # llama.cpp's logits and text (scripts/oracle_gemma3_llamacpp.py)
    "browser": ("server/test_ui.py",),  # headless Chromium
}
# parity: a test file that imports the reference math (transformers, torch, sentence-transformers,
# or one of the oracle modules here built on them)
PARITY_IMPORT = re.compile(r"^\s*(?:import|from)\s+(?:transformers|torch|sentence_transformers|hf_oracle|"
                           r"eg2_oracle|audio_oracle|vision_oracle|assistant_oracle|media_oracle)\b"
                           r"|importorskip\(\s*[\"'](?:transformers|torch|sentence_transformers)[\"']", re.M)
_file_tiers: dict[Path, list[str]] = {}


def tiers_of(path: Path) -> list[str]:
    """The tiers of the tests in ``path`` (a test file under tests/)."""
    if path not in _file_tiers:
        if not path.resolve().is_relative_to(TESTS) or path.suffix != ".py":
            return []
        rel = path.resolve().relative_to(TESTS).as_posix()
        found = [t for t, places in TIER_PATHS.items()
                 if any(rel == p or (p.endswith("/") and rel.startswith(p)) for p in places)]
        if PARITY_IMPORT.search(path.read_text(encoding="utf-8")):
            found.append("parity")
        _file_tiers[path] = found
    return _file_tiers[path]


@pytest.hookimpl(tryfirst=True)  # before pytest's own -m selection reads the marks
def pytest_collection_modifyitems(config, items) -> None:
    for item in items:
        for tier in tiers_of(Path(item.path)):
            item.add_marker(getattr(pytest.mark, tier))
    if "slow" not in (config.getoption("markexpr") or ""):
        slow = [i for i in items if i.get_closest_marker("slow")]
        if slow:
            config.hook.pytest_deselected(items=slow)
            items[:] = [i for i in items if not i.get_closest_marker("slow")]
