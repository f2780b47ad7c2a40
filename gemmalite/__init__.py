"""gemmalite: Gemma 4 E-series (and Gemma 3) text generation on the CPU, from Python, without PyTorch.

Importing the package sets the process settings (`settings.apply`) and the error types, nothing
heavier: `load`, `Model`, `Grammar` and the other names of ``__all__`` import their modules (numpy,
numba, the kernels...) on first use (PEP 562), so ``import gemmalite`` and a command that never
needs a part stay fast (docs/startup.md).
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from . import settings

# Before numpy / numba load: kernel cache under the user's cache folder (never inside the
# package), worker threads that sleep instead of spinning when they wait (see settings.py).
settings.apply()
from .errors import (AudioError, CheckpointError, ConfigError, ContextError, HubError, ImageError,  # noqa: E402
                     InputError, NumericalError, TokenizerError)

if TYPE_CHECKING:  # what static analysers see; at run time `__getattr__` imports them on first use
    from .chat import ChatReply, ToolCall
    from .embeddings import Embedder
    from .loader import load, load_embedder, load_tokenizer
    from .model import ChatSession, Completion, Model
    from .runtime.constrain import Grammar
    from .runtime.generate import GenerationStats, Stream
    from .runtime.logprobs import TokenLogprob
    from .tokenizer import Tokenizer

# Public name -> the module (relative to this package) that defines it, imported on first use.
_LAZY = {
    "load": "loader", "load_tokenizer": "loader", "load_embedder": "loader",
    "Model": "model", "ChatSession": "model", "Completion": "model",
    "Stream": "runtime.generate", "GenerationStats": "runtime.generate",
    "Tokenizer": "tokenizer", "Grammar": "runtime.constrain", "TokenLogprob": "runtime.logprobs",
    "ChatReply": "chat", "ToolCall": "chat", "Embedder": "embeddings",
}

__all__ = ["load", "load_tokenizer", "load_embedder", "Model", "ChatSession", "Stream", "GenerationStats", "Tokenizer",
           "Grammar", "Completion", "TokenLogprob", "ChatReply", "ToolCall",
           "Embedder", "AudioError", "CheckpointError", "ConfigError", "ContextError", "HubError", "ImageError", "InputError",
           "NumericalError",
           "TokenizerError"]
__version__ = settings.VERSION


def __getattr__(name: str) -> Any:
    """A name of `_LAZY`: its module imported, the value kept here (the next look-up is a plain
    one); a submodule's name (``gemmalite.loader``): that submodule, imported."""
    module = _LAZY.get(name)
    if module is None:
        if name.startswith("__"):
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
        try:
            return importlib.import_module(f".{name}", __name__)
        except ModuleNotFoundError as e:
            if e.name != f"{__name__}.{name}":
                raise
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
