"""Shared fixtures: the engine module and small helpers for the transformers-parity tests."""
from __future__ import annotations

import os
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
# numba's on-disk cache keys a kernel on its own file only: a change in a module it inlines
# (simd.py's IR generators) would be hidden behind a stale cached kernel. Tests compile afresh.
os.environ.setdefault("NUMBA_CACHE_DIR", tempfile.mkdtemp(prefix="gemmalite-numba-"))
# gemmalite's other caches (tokenizers built from GGUF files, the bundled vocabulary): fresh too,
# so the tests run the build paths and never write into the user's cache folder.
os.environ.setdefault("GEMMALITE_CACHE_DIR", tempfile.mkdtemp(prefix="gemmalite-cache-"))


@pytest.fixture(scope="session")
def gl():
    """The gemmalite package."""
    import gemmalite

    return gemmalite


def random_ids(n: int, vocab: int, seed: int = 0, low: int = 5) -> list[int]:
    """``n`` random token ids in ``[low, vocab)`` (no pad/eos/bos/unk/mask)."""
    return [int(i) for i in np.random.RandomState(seed).randint(low, vocab, size=n)]
