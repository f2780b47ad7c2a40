"""gemmalite: Gemma 4 E-series (and Gemma 3) text generation on the CPU, from Python, without PyTorch."""
import os

# OpenBLAS worker threads otherwise spin for ~2^28 cycles after every BLAS call, fighting the
# numba kernel threads for the same cores: measured on E2B int8, decode 3.9 -> 6.9 tok/s and
# prefill 40 -> 86 tok/s with a short timeout. Effective when gemmalite is imported before numpy.
os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "4")
from .embeddings import Embedder, load_embedder  # noqa: E402
from .errors import (CheckpointError, ConfigError, ContextError, ImageError, InputError, NumericalError,  # noqa: E402
                     TokenizerError)
from .loader import load, load_tokenizer  # noqa: E402
from .model import ChatSession, Model  # noqa: E402
from .runtime.generate import GenerationStats, Stream  # noqa: E402
from .tokenizer import Tokenizer  # noqa: E402

__all__ = ["load", "load_tokenizer", "load_embedder", "Model", "ChatSession", "Stream", "GenerationStats", "Tokenizer",
           "Embedder", "CheckpointError", "ConfigError", "ContextError", "ImageError", "InputError", "NumericalError",
           "TokenizerError"]
__version__ = "0.1.0"
