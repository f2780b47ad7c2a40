"""transformers oracle for audio in prompts (imported by tests, contains no tests).

A tiny random Gemma4ForConditionalGeneration with an audio tower (and a vision tower), every
weight randomised (hf_oracle, vision_oracle, audio_oracle), its tokenizer with the media tokens
and the real Gemma 4 chat template; test clips; and the processor side of the reference:
transformers' Gemma 4 feature extractor and Gemma4Processor's placeholder count per clip.
"""
from __future__ import annotations

import io
import json
from types import SimpleNamespace

import numpy as np
import torch

import audio_oracle as ao
import hf_oracle
import vision_oracle as vo

IMG, BOI, EOI = vo.IMG, vo.BOI, vo.EOI
AUD, BOA, EOA = vo.AUD, vo.BOA, vo.EOA
SOFT = 70  # the image budget written into processor_config.json


def clip(seconds: float, seed: int) -> np.ndarray:
    """``seconds`` of audio_oracle's speech-like test signal (float32, 16 kHz)."""
    return ao.speechy(int(round(seconds * 16000)), seed)


def wav(samples: np.ndarray, rate: int = 16000) -> bytes:
    """16-bit PCM WAV bytes (soundfile)."""
    import soundfile as sf

    buf = io.BytesIO()
    sf.write(buf, samples, rate, format="WAV", subtype="PCM_16")
    return buf.getvalue()


def make_gemma4_audio_checkpoint(path, sliding_window: int = 512, vision: bool = True):
    """Save the tiny Gemma 4 with an audio tower (and a vision tower); return (path, float32 eager model)."""
    from transformers import Gemma4Config, Gemma4ForConditionalGeneration

    torch.manual_seed(0)
    cfg = Gemma4Config(text_config=hf_oracle._text_config_kwargs({"sliding_window": sliding_window}),
                       vision_config=dict(vo.CLIPPED) if vision else None, audio_config=dict(ao.CLIPPED),
                       image_token_id=IMG, boi_token_id=BOI, eoi_token_id=EOI,
                       audio_token_id=AUD, boa_token_id=BOA, eoa_token_index=EOA, attn_implementation="eager")
    model = Gemma4ForConditionalGeneration(cfg).float().eval()
    hf_oracle.randomize_text_weights(model, 0)
    if vision:
        vo.randomize_vision_weights([model.model.vision_tower, model.model.embed_vision], 1)
    ao.randomize_audio_weights([model.model.audio_tower, model.model.embed_audio], 2)
    model.save_pretrained(path, safe_serialization=True)
    (path / "processor_config.json").write_text(json.dumps({"image_processor": {"max_soft_tokens": SOFT}}))
    vo.write_tokenizer_with_image_tokens(path, audio=True)
    return path, model


def audio_inputs(clips) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """transformers' feature extractor output for the clips (batched as the processor batches
    them), and each clip's placeholder count as Gemma4Processor.replace_audio_token counts it."""
    from transformers import Gemma4Processor
    from transformers.models.gemma4.feature_extraction_gemma4 import Gemma4AudioFeatureExtractor

    out = Gemma4AudioFeatureExtractor()(list(clips), return_tensors="pt")
    names = SimpleNamespace(boa_token="B", audio_token="A", eoa_token="E")
    counts = [Gemma4Processor.replace_audio_token(names, out, i).count("A") for i in range(len(clips))]
    return out["input_features"], out["input_features_mask"], counts
