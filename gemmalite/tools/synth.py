"""Random-weight checkpoints of the real Gemma 4 shapes, in the Hugging Face layout.

Real E2B/E4B weights cannot be downloaded here, so full-size speed and memory figures come
from checkpoints of exactly the published shapes (architecture map §0) filled with random
bfloat16 values, plus a working tokenizer and chat template, so every path runs end to end.
`write_random_checkpoint` is the one writer; the Gemma 4 decoders here and the EmbeddingGemma 2
encoders (synth_eg2) only choose tensors and config files. The vision and audio towers are
transformers' ``gemma4_vision`` / ``gemma4_audio`` (their default configs are the real shapes).
"""
from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from typing import Callable, Iterator

import ml_dtypes
import numpy as np

from ..errors import CheckpointError
from ..formats.gguf_tokenizer import gemma4_tokenizer_gguf_path
from ..formats.safetensors import write_safetensors
from ..loader import load_tokenizer
from ..models.gemma.config import FULL, SLIDING, ModelConfig
from ..models.gemma.contract import expected_shapes
from ..tokenizer import fallback_tokenizer, save_tokenizer
from ..audio.tower import AudioConfig
from ..audio.tower import expected_shapes as audio_shapes
from ..vision.tower import VisionConfig
from ..vision.tower import expected_shapes as vision_shapes

BF16 = np.dtype(ml_dtypes.bfloat16)
SHARD_BYTES = 2 << 30


def _layer_types(n: int, every: int, offset: int) -> list[str]:
    return [FULL if i % every == offset else SLIDING for i in range(n)]


PRESETS: dict[str, dict] = {
    # The published E2B text shapes (§0 of the architecture map).
    "e2b": dict(hidden_size=1536, num_hidden_layers=35, intermediate_size=6144, num_attention_heads=8,
                num_key_value_heads=1, head_dim=256, global_head_dim=512, layer_types=_layer_types(35, 5, 4),
                sliding_window=512, num_kv_shared_layers=20, use_double_wide_mlp=True,
                hidden_size_per_layer_input=256),
    # E4B-like (third-party configs).
    "e4b": dict(hidden_size=2560, num_hidden_layers=42, intermediate_size=10240, num_attention_heads=8,
                num_key_value_heads=2, head_dim=256, global_head_dim=512, layer_types=_layer_types(42, 6, 5),
                sliding_window=512, num_kv_shared_layers=18, use_double_wide_mlp=False,
                hidden_size_per_layer_input=256),
    # Every feature at toy size: PLE, KV sharing of both layer types, double-wide MLP, two head sizes.
    "tiny": dict(hidden_size=128, num_hidden_layers=6, intermediate_size=256, num_attention_heads=4,
                 num_key_value_heads=1, head_dim=32, global_head_dim=64, layer_types=_layer_types(6, 2, 1),
                 sliding_window=16, num_kv_shared_layers=2, use_double_wide_mlp=True,
                 hidden_size_per_layer_input=16),
}
COMMON = dict(model_type="gemma4_text", vocab_size=262144, vocab_size_per_layer_input=262144, rms_norm_eps=1e-6,
              hidden_activation="gelu_pytorch_tanh", max_position_embeddings=131072, final_logit_softcapping=30.0,
              tie_word_embeddings=True, attention_k_eq_v=False, enable_moe_block=False, attention_bias=False,
              pad_token_id=0, bos_token_id=2, eos_token_id=1,
              rope_parameters={SLIDING: {"rope_type": "default", "rope_theta": 10000.0},
                               FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                      "rope_theta": 1000000.0}})
GENERATION_CONFIG = {"bos_token_id": 2, "eos_token_id": [1, 106, 50], "pad_token_id": 0, "do_sample": True,
                     "temperature": 1.0, "top_k": 64, "top_p": 0.95}


def text_config(preset: str, vocab_size: int | None = None) -> dict:
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose from {sorted(PRESETS)}")
    cfg = {**COMMON, **PRESETS[preset]}
    if vocab_size:
        cfg["vocab_size"] = cfg["vocab_size_per_layer_input"] = vocab_size
    return cfg


# The towers: transformers' defaults are the real checkpoints' shapes; "tiny" keeps every option
# (clipped linears, standardize) at toy size.
VISION_PRESETS: dict[str, dict] = {
    "real": dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=16, num_attention_heads=12,
                 num_key_value_heads=12, head_dim=64, patch_size=16, pooling_kernel_size=3,
                 position_embedding_size=10240, use_clipped_linears=False, standardize=False),
    "tiny": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=2, head_dim=16, patch_size=16, pooling_kernel_size=3,
                 position_embedding_size=512, use_clipped_linears=True, standardize=True),
}
AUDIO_PRESETS: dict[str, dict] = {
    "real": dict(hidden_size=1024, num_hidden_layers=12, num_attention_heads=8, subsampling_conv_channels=[128, 32],
                 conv_kernel_size=5, output_proj_dims=1536),
    # the first subsampling layer stays 128 wide: the input projection's width is (128 mel bins / 4) * c1
    "tiny": dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, subsampling_conv_channels=[128, 8],
                 conv_kernel_size=5, output_proj_dims=48),
}
MULTIMODAL_IDS = dict(image_token_id=258880, boi_token_id=255999, eoi_token_id=258882, video_token_id=258884,
                      audio_token_id=258881, boa_token_id=256000, eoa_token_index=258883)
#: the tokenizer attributes transformers' Gemma 4 / EmbeddingGemma 2 processors read (tokenizer.boi_token, ...)
MULTIMODAL_TOKENS = dict(image_token="<|image|>", boi_token="<|image>", eoi_token="<image|>", video_token="<|video|>",
                         audio_token="<|audio|>", boa_token="<|audio>", eoa_token="<audio|>")


def vision_config(preset: str = "real") -> dict:
    return {"model_type": "gemma4_vision", **VISION_PRESETS[preset], "hidden_activation": "gelu_pytorch_tanh",
            "rms_norm_eps": 1e-6, "attention_bias": False, "attention_dropout": 0.0,
            "rope_parameters": {"rope_type": "axial", "rope_theta": 100.0}}


def audio_config(preset: str = "real") -> dict:
    return {"model_type": "gemma4_audio", **AUDIO_PRESETS[preset], "hidden_act": "silu", "residual_weight": 0.5,
            "attention_chunk_size": 12, "attention_context_left": 13, "attention_context_right": 0,
            "attention_logit_cap": 50.0, "attention_invalid_logits_value": -1e9, "use_clipped_linears": True,
            "rms_norm_eps": 1e-6, "gradient_clipping": 1e10}


def vision_tower_shapes(config: dict, text_hidden: int, tower: str, embed: str) -> dict[str, tuple[int, ...]]:
    return vision_shapes(VisionConfig.from_hf(config), text_hidden, tower, embed)


def audio_tower_shapes(config: dict, text_hidden: int, tower: str, embed: str) -> dict[str, tuple[int, ...]]:
    return audio_shapes(AudioConfig.from_hf(config), text_hidden, tower, embed)


def processor_config(vision: dict | None, *, audio: bool, video: bool) -> dict:
    """``processor_config.json`` as transformers' Gemma 4 / EmbeddingGemma 2 processors save it
    (the image processor, and the video processor / audio feature extractor, for the towers the
    model has; ``vision`` None: no vision tower)."""
    conf: dict = {}
    sizes = {k: vision[k] for k in ("patch_size", "pooling_kernel_size")} if vision else {}
    if vision:
        conf["image_processor"] = {
            "image_processor_type": "Gemma4ImageProcessor", "do_convert_rgb": True, "do_resize": True, "resample": 3,
            "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": False, "image_mean": [0.0, 0.0, 0.0],
            "image_std": [1.0, 1.0, 1.0], "max_soft_tokens": 280, **sizes}
        conf["image_seq_length"] = 280
    if video and vision:
        conf["video_processor"] = {
            "video_processor_type": "EmbeddingGemma2VideoProcessor", "do_convert_rgb": True, "do_resize": True,
            "resample": 3, "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True,
            "image_mean": [0.0, 0.0, 0.0], "image_std": [1.0, 1.0, 1.0], "do_sample_frames": True, "fps": 1,
            "max_frames": 32, "overflow_strategy": "uniform", "add_timestamps": False, "max_soft_tokens": 70, **sizes}
    if audio:
        conf["feature_extractor"] = {
            "feature_extractor_type": "Gemma4AudioFeatureExtractor", "feature_size": 128, "sampling_rate": 16000,
            "padding_value": 0.0, "padding_side": "right", "return_attention_mask": True, "min_frequency": 0.0,
            "max_frequency": 8000.0, "preemphasis": 0.0, "preemphasis_htk_flavor": True, "fft_overdrive": False,
            "dither": 0.0, "input_scale_factor": 1.0, "mel_floor": 1e-3, "per_bin_mean": None, "per_bin_stddev": None,
            "frame_length_ms": 20.0, "hop_length_ms": 10.0, "frame_length": 320, "hop_length": 160, "fft_length": 512}
        conf.update(audio_seq_length=750, audio_ms_per_token=40)
    return conf


def random_bf16(shape: tuple[int, ...], scale: float, rng: np.random.Generator) -> Iterator[bytes]:
    """Random bfloat16 values of magnitude ~scale, produced in chunks straight from random bits
    (sign, a 2-bit exponent spread, 7 mantissa bits): fast enough for billions of values."""
    n = int(np.prod(shape))
    e = 127 + math.floor(math.log2(scale))
    for i in range(0, n, 1 << 26):
        r = rng.integers(0, 1 << 16, size=min(1 << 26, n - i), dtype=np.uint16)
        exp = (np.uint16(e) - ((r >> 7) & 3)).astype(np.uint16)
        yield ((r & 0x807F) | (exp << 7)).tobytes()


CLIP_BOUND = 64.0  # clipped linears: finite bounds (as trained checkpoints store), wide for random weights


def _tensor_bytes(name: str, shape: tuple[int, ...], rng: np.random.Generator) -> Iterator[bytes]:
    if name.endswith("layer_scalar"):
        yield np.array([rng.uniform(0.5, 1.0)], dtype=BF16).tobytes()
    elif name.endswith(("_min", "_max")) and not shape:  # clip bounds of a ClippableLinear
        yield np.array(-CLIP_BOUND if name.endswith("_min") else CLIP_BOUND, dtype=BF16).tobytes()
    elif name.endswith((".bias", "std_bias")):
        yield (0.02 * rng.standard_normal(shape)).astype(BF16).tobytes()
    elif len(shape) == 1:  # norm scales: Gemma 4 multiplies by w, stored around 1
        w = 1.0 + 0.1 * rng.standard_normal(shape)
        if name.endswith(("q_norm.weight", "k_norm.weight")):
            # attention runs unscaled (scaling 1.0): q.k of unit-RMS heads would have std sqrt(D),
            # saturated softmaxes that make random weights chaotic (float32 rounding flips the output)
            w *= shape[0] ** -0.25
        yield w.astype(BF16).tobytes()
    elif "embed_tokens" in name or "position_embedding_table" in name:
        yield from random_bf16(shape, 0.03, rng)
    else:  # linear and conv weights: ~1/sqrt(fan-in)
        yield from random_bf16(shape, 1.0 / math.sqrt(int(np.prod(shape[1:]))), rng)


def write_random_checkpoint(out: str | Path, shapes: dict[str, tuple[int, ...]], config: dict, *,
                            tokenizer: str | Path | None = None, seed: int = 0, progress: bool = True,
                            force: bool = False, extra_json: dict[str, dict] | None = None,
                            finish: Callable[[Path], None] | None = None,
                            fixed: dict[str, np.ndarray] | None = None) -> Path:
    """The one synth writer: random bfloat16 ``shapes`` (and the ``fixed`` tensors as given),
    ``config.json``, tokenizer files, then ``extra_json`` (file name -> content) and
    ``finish(folder)``. An existing, non-empty ``out`` is an error unless ``force`` (then it is
    replaced)."""
    fixed = fixed or {}
    out = Path(out)
    if out.exists() and not (out.is_dir() and not any(out.iterdir())):
        if not force:
            raise CheckpointError(f"{out} already exists: choose another folder, or pass --force (force=True) to replace it")
        if out.is_dir():
            shutil.rmtree(out)
        else:
            out.unlink()
    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    specs = {k: (v, BF16) for k, v in shapes.items()} | {k: (a.shape, a.dtype) for k, a in fixed.items()}
    write_safetensors(out, specs, lambda name: [fixed[name].tobytes()] if name in fixed else
                      _tensor_bytes(name, shapes[name], rng), shard_bytes=SHARD_BYTES, progress=progress)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    for name, content in (extra_json or {}).items():
        (out / name).write_text(json.dumps(content, indent=2))
    export_tokenizer(tokenizer, out)
    if finish is not None:
        finish(out)
    return out


def synth(preset: str, out: str | Path, *, tokenizer: str | Path | None = None, layout: str = "conditional",
          seed: int = 0, progress: bool = True, force: bool = False, vision: bool | None = None,
          audio: bool | None = None) -> Path:
    """Write a random-weight checkpoint folder for ``preset`` (tiny, e2b, e4b). ``vision`` /
    ``audio``: with the real Gemma 4 vision / audio tower (default for e2b / e4b in the
    conditional layout; tiny gets toy towers, which run, when asked)."""
    text = text_config(preset)
    prefix = {"conditional": "model.language_model.", "causal": "model."}[layout]
    shapes = {prefix + k: v for k, v in expected_shapes(ModelConfig.from_hf(text)).items()}
    default = preset != "tiny" and layout == "conditional"
    vision = default if vision is None else vision
    audio = default if audio is None else audio
    if (vision or audio) and layout != "conditional":
        raise ValueError("a vision or audio tower needs the conditional layout (Gemma4ForCausalLM has none)")
    towers = "tiny" if preset == "tiny" else "real"
    if layout == "conditional":
        vcfg = vision_config(towers) if vision else None
        acfg = audio_config(towers) if audio else None
        config = {"model_type": "gemma4", "architectures": ["Gemma4ForConditionalGeneration"],
                  "text_config": text, "vision_config": vcfg, "audio_config": acfg, "dtype": "bfloat16",
                  "tie_word_embeddings": True, **MULTIMODAL_IDS}
        if vcfg:
            shapes |= vision_tower_shapes(vcfg, text["hidden_size"], "model.vision_tower.", "model.embed_vision.")
        if acfg:
            shapes |= audio_tower_shapes(acfg, text["hidden_size"], "model.audio_tower.", "model.embed_audio.")
    else:
        config = {**text, "architectures": ["Gemma4ForCausalLM"], "dtype": "bfloat16"}
    extra = {"generation_config.json": GENERATION_CONFIG}
    if vision or audio:
        extra["processor_config.json"] = {**processor_config(config["vision_config"], audio=audio, video=False),
                                          "processor_class": "Gemma4Processor"}
    return write_random_checkpoint(out, shapes, config, tokenizer=tokenizer, seed=seed, progress=progress,
                                   force=force, extra_json=extra,
                                   finish=_add_multimodal_tokens if vision or audio else None)


# The published MTP drafters (google/gemma-4-E2B-it-assistant, -E4B-: architecture map §8):
# 4 Q-only layers [S, S, S, F] of width 256 over the target's head geometry, 2048 centroids, top 32.
ASSISTANT_PRESETS = {"e2b-assistant": "e2b", "e4b-assistant": "e4b"}


def assistant_config(preset: str) -> dict:
    if preset not in ASSISTANT_PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose from {sorted(ASSISTANT_PRESETS)}")
    target = text_config(ASSISTANT_PRESETS[preset])
    text = {**COMMON, "hidden_size": 256, "num_hidden_layers": 4, "intermediate_size": 2048,
            "num_attention_heads": 4, "num_key_value_heads": target["num_key_value_heads"], "head_dim": 256,
            "global_head_dim": 512, "layer_types": [SLIDING] * 3 + [FULL], "sliding_window": 512,
            "num_kv_shared_layers": 4, "use_double_wide_mlp": False, "hidden_size_per_layer_input": 0,
            "vocab_size_per_layer_input": 0, "final_logit_softcapping": None}
    return {"model_type": "gemma4_assistant", "architectures": ["Gemma4AssistantForCausalLM"], "dtype": "bfloat16",
            "text_config": text, "backbone_hidden_size": target["hidden_size"], "use_ordered_embeddings": True,
            "num_centroids": 2048, "centroid_intermediate_top_k": 32, "tie_word_embeddings": True}


def synth_assistant(preset: str, out: str | Path, *, seed: int = 0, progress: bool = True, force: bool = False,
                    **_: object) -> Path:
    """A random MTP drafter of a published shape (``e2b-assistant``, ``e4b-assistant``), with
    ``token_ordering`` a random permutation of the vocabulary."""
    from ..models.gemma.assistant import AssistantConfig

    config = assistant_config(preset)
    shapes = AssistantConfig.from_hf(config).expected_shapes()
    order = shapes.pop("masked_embedding.token_ordering")
    fixed = {"masked_embedding.token_ordering": np.random.default_rng(seed + 1).permutation(order[0]).astype(np.int64)}
    return write_random_checkpoint(out, shapes, config, seed=seed, progress=progress, force=force, fixed=fixed,
                                   extra_json={"generation_config.json": {"num_assistant_tokens": 4}})


def _add_multimodal_tokens(folder: Path) -> None:
    """Name the image / audio tokens in tokenizer_config.json, where transformers' processors look."""
    path = folder / "tokenizer_config.json"
    conf = json.loads(path.read_text()) if path.exists() else {}
    conf.update(MULTIMODAL_TOKENS, extra_special_tokens=dict(MULTIMODAL_TOKENS))
    path.write_text(json.dumps(conf, indent=2))


def export_tokenizer(src: str | Path | None, out: Path) -> None:
    """Give a checkpoint folder tokenizer files: from ``src`` (tokenizer.json, folder or GGUF), else
    the real Gemma 4 vocabulary bundled with the package, else a byte-level fallback."""
    if src is None:
        try:
            src = gemma4_tokenizer_gguf_path()
        except FileNotFoundError:
            src = None
    tok = load_tokenizer(src) if src is not None else fallback_tokenizer()
    save_tokenizer(tok, out)
