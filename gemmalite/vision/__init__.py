"""Images: Gemma 4 image preprocessing and the Gemma 4 vision tower (used by Gemma 4 chat and
EmbeddingGemma 2). Pillow decodes images; it is imported only when an image is read."""
from .preprocess import ImagePatches, ImageProcessorConfig, preprocess
from .tower import VisionConfig, VisionTower, build_vision_tower

__all__ = ["ImagePatches", "ImageProcessorConfig", "VisionConfig", "VisionTower", "build_vision_tower", "preprocess"]
