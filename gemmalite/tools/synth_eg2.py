"""Random-weight EmbeddingGemma 2 checkpoints (`gemmalite synth --preset eg2`).

The text encoder of the real shape (issue 11 / architecture map §5: 24 layers, hidden 512,
4 heads with 2 KV heads of 256 on sliding layers and 1 of 512 on every 6th (full) layer, MLP
2048, PLE 512, output 768, vocabulary 262144) in bfloat16, laid out as transformers saves
``EmbeddingGemma2Model`` (``language_model.`` prefix, nested config with the Gemma 4 vision
tower (16 layers, hidden 768) and audio tower (12 layers, hidden 1024): 744 M parameters, as
published) or ``EmbeddingGemma2TextModel`` (text only); the real Gemma 4 tokenizer, whose
post-processor adds ``<bos> … <eos>``; ``processor_config.json``; and the sentence-transformers
files with the standard prompt table.
"""
from __future__ import annotations

import json
from pathlib import Path

from ..embeddings.st_files import STANDARD_PROMPTS, write_pipeline
from ..models.gemma.config import FULL, SLIDING
from ..models.gemma.encoder import EncoderConfig, encoder_shapes
from .synth import (
    MULTIMODAL_IDS,
    _add_multimodal_tokens,
    audio_config,
    audio_tower_shapes,
    processor_config,
    vision_config,
    vision_tower_shapes,
    write_random_checkpoint,
)

SHAPES: dict[str, dict] = {
    "eg2": dict(hidden_size=512, num_hidden_layers=24, intermediate_size=2048, num_attention_heads=4,
                num_key_value_heads=2, head_dim=256, global_head_dim=512, num_global_key_value_heads=1,
                hidden_size_per_layer_input=512, embedding_dim=768, sliding_window=512),
    # every feature at toy size (two head sizes, windows shorter than a sentence), real tokenizer
    "eg2-tiny": dict(hidden_size=64, num_hidden_layers=6, intermediate_size=128, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=16, global_head_dim=32, num_global_key_value_heads=1,
                     hidden_size_per_layer_input=16, embedding_dim=48, sliding_window=8),
}
COMMON = dict(model_type="embedding_gemma2_text", vocab_size=262144, max_position_embeddings=262144,
              rms_norm_eps=1e-6, hidden_activation="gelu_pytorch_tanh", attention_bias=False, attention_dropout=0.0,
              pad_token_id=0, bos_token_id=2, eos_token_id=1,
              rope_parameters={SLIDING: {"rope_type": "default", "rope_theta": 10000.0},
                               FULL: {"rope_type": "default", "rope_theta": 1000000.0}})
TOWERS = {"eg2": "real", "eg2-tiny": "tiny"}  # the vision / audio preset of each


def eg2_text_config(preset: str) -> dict:
    """The text config as transformers saves it: explicit layer types and ``per_layer_config``."""
    shape = dict(SHAPES[preset])
    n = shape["num_hidden_layers"]
    types = [SLIDING if (i + 1) % 6 else FULL for i in range(n)]
    types[-1] = FULL
    full = {"head_dim": shape.pop("global_head_dim"), "num_key_value_heads": shape.pop("num_global_key_value_heads")}
    return {**COMMON, **shape, "layer_types": types,
            "per_layer_config": {str(i): dict(full) for i, t in enumerate(types) if t == FULL}}


def add_eos_template(folder: Path) -> None:
    """Make the folder's tokenizer add ``<bos> … <eos>``, as the EmbeddingGemma tokenizers do."""
    from tokenizers import Tokenizer
    from tokenizers.processors import TemplateProcessing

    tk = Tokenizer.from_file(str(folder / "tokenizer.json"))
    bos, eos = tk.token_to_id("<bos>"), tk.token_to_id("<eos>")
    tk.post_processor = TemplateProcessing(single="<bos> $A <eos>", pair="<bos> $A <eos> $B <eos>",
                                           special_tokens=[("<bos>", bos), ("<eos>", eos)])
    tk.save(str(folder / "tokenizer.json"))
    conf_path = folder / "tokenizer_config.json"
    conf = json.loads(conf_path.read_text()) if conf_path.exists() else {}
    conf.update(add_bos_token=True, add_eos_token=True, padding_side="right")
    conf_path.write_text(json.dumps(conf, indent=2))
    (folder / "chat_template.jinja").unlink(missing_ok=True)  # an encoder has no chat


def synth_eg2(preset: str, out: str | Path, *, tokenizer: str | Path | None = None, layout: str = "conditional",
              seed: int = 0, progress: bool = True, force: bool = False, vision: bool | None = None,
              audio: bool | None = None) -> Path:
    """Write a random EmbeddingGemma 2 folder; ``layout`` "conditional" (nested with both towers, as
    published; ``vision=False`` leaves both towers out, ``audio=False`` the audio tower) or "causal"
    (text only)."""
    if preset not in SHAPES:
        raise ValueError(f"unknown EmbeddingGemma 2 preset {preset!r}; choose from {sorted(SHAPES)}")
    text = eg2_text_config(preset)
    cfg = EncoderConfig.from_hf(text)
    prefix = {"conditional": "language_model.", "causal": ""}[layout]
    shapes = {prefix + k: v for k, v in encoder_shapes(cfg).items()}
    towers = layout == "conditional" and vision is not False
    extra: dict[str, dict] = {}
    if layout == "conditional":
        vcfg = vision_config(TOWERS[preset]) if towers else None
        acfg = audio_config(TOWERS[preset]) if towers and audio is not False else None
        config = {"model_type": "embedding_gemma2", "architectures": ["EmbeddingGemma2Model"], "text_config": text,
                  "vision_config": vcfg, "audio_config": acfg, "dtype": "bfloat16", **MULTIMODAL_IDS}
        if towers:
            shapes |= vision_tower_shapes(vcfg, cfg.hidden_size, "vision_tower.", "embed_vision.")
            if acfg:
                shapes |= audio_tower_shapes(acfg, cfg.hidden_size, "audio_tower.", "embed_audio.")
            extra["processor_config.json"] = {**processor_config(vcfg, audio=acfg is not None, video=True),
                                              "processor_class": "EmbeddingGemma2Processor"}
    else:
        config = {**text, "architectures": ["EmbeddingGemma2TextModel"], "dtype": "bfloat16"}

    def finish(folder: Path) -> None:
        add_eos_template(folder)
        if towers:
            _add_multimodal_tokens(folder)
        write_pipeline(folder, cfg.embedding_dim, STANDARD_PROMPTS)

    return write_random_checkpoint(out, shapes, config, tokenizer=tokenizer, seed=seed, progress=progress,
                                   force=force, extra_json=extra, finish=finish)
