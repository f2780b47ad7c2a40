"""Audio: decoding to 16 kHz mono, Gemma 4 log-mel features and the Gemma 4 audio tower (used by
Gemma 4 chat and EmbeddingGemma 2). soundfile / soxr are imported only when a file is decoded or
a clip resampled (the ``audio`` extra)."""
from .decode import SAMPLE_RATE, load_audio
from .features import log_mel, soft_token_count
from .tower import AudioConfig, AudioTower, build_audio_tower

__all__ = ["SAMPLE_RATE", "AudioConfig", "AudioTower", "build_audio_tower", "load_audio", "log_mel", "soft_token_count"]
