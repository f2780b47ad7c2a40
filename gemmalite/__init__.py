"""gemmalite: Gemma 4 E-series (and Gemma 3) text generation on the CPU, from Python, without PyTorch."""
from . import settings

# Before numpy / numba load: kernel cache under the user's cache folder (never inside the
# package), worker threads that sleep instead of spinning when they wait (see settings.py).
settings.apply()
from .errors import CheckpointError, ConfigError, ContextError, TokenizerError  # noqa: E402
from .loader import load, load_tokenizer  # noqa: E402
from .model import ChatSession, Model  # noqa: E402
from .runtime.generate import GenerationStats, Stream  # noqa: E402
from .tokenizer import Tokenizer  # noqa: E402

__all__ = ["load", "load_tokenizer", "Model", "ChatSession", "Stream", "GenerationStats", "Tokenizer",
           "CheckpointError", "ConfigError", "ContextError", "TokenizerError"]
__version__ = settings.VERSION
