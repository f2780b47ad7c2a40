"""Sentence embeddings with EmbeddingGemma 2: `load_embedder` -> `Embedder`."""
from .embedder import Embedder, load_embedder

__all__ = ["Embedder", "load_embedder"]
