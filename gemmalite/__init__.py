"""gemmalite: Gemma 4 E-series (and Gemma 3) text generation on the CPU, from Python, without PyTorch."""
import os

# OpenBLAS worker threads otherwise spin for ~2^28 cycles after every BLAS call, fighting the
# numba kernel threads for the same cores: measured on E2B int8, decode 3.9 -> 6.9 tok/s and
# prefill 40 -> 86 tok/s with a short timeout. Effective when gemmalite is imported before numpy.
os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "4")
from .errors import CheckpointError, ConfigError, ContextError, TokenizerError
from .loader import load
from .model import Model
from .tokenizer import Tokenizer

__all__ = ["load", "load_tokenizer", "Model", "Tokenizer", "CheckpointError", "ConfigError", "ContextError",
           "TokenizerError"]
__version__ = "0.1.0"


def load_tokenizer(path):
    """A tokenizer from a tokenizer.json, a checkpoint folder, or a GGUF file (vocabulary-only too)."""
    from .tokenizer import load_tokenizer_any

    return load_tokenizer_any(path)
