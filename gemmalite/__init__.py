"""gemmalite: Gemma 4 E-series (and Gemma 3) text generation on the CPU, from Python, without PyTorch."""
from . import settings

# Before numpy / numba load: kernel cache under the user's cache folder (never inside the
# package), worker threads that sleep instead of spinning when they wait (see settings.py).
settings.apply()
from .chat import ChatReply, ToolCall  # noqa: E402
from .embeddings import Embedder  # noqa: E402
from .errors import (AudioError, CheckpointError, ConfigError, ContextError, HubError, ImageError,  # noqa: E402
                     InputError, NumericalError, TokenizerError)
from .loader import load, load_embedder, load_tokenizer  # noqa: E402
from .model import ChatSession, Completion, Model  # noqa: E402
from .runtime.constrain import Grammar  # noqa: E402
from .runtime.generate import GenerationStats, Stream  # noqa: E402
from .runtime.logprobs import TokenLogprob  # noqa: E402
from .tokenizer import Tokenizer  # noqa: E402

__all__ = ["load", "load_tokenizer", "load_embedder", "Model", "ChatSession", "Stream", "GenerationStats", "Tokenizer",
           "Grammar", "Completion", "TokenLogprob", "ChatReply", "ToolCall",
           "Embedder", "AudioError", "CheckpointError", "ConfigError", "ContextError", "HubError", "ImageError", "InputError",
           "NumericalError",
           "TokenizerError"]
__version__ = settings.VERSION
