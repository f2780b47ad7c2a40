"""`synth` writes the vision and audio towers transformers builds: every tensor name and shape of
the real EmbeddingGemma 2 / Gemma 4 configs (checked on the meta device, nothing allocated), and a
small towered eg2 folder that transformers loads with no missing or unexpected key and whose text
embedding gemmalite reproduces."""
from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from gemmalite.tools.synth import (audio_config, audio_tower_shapes, text_config,  # noqa: E402
                                   vision_config, vision_tower_shapes)
from gemmalite.tools.synth_eg2 import eg2_text_config, synth_eg2  # noqa: E402


def _meta_shapes(model) -> dict[str, tuple[int, ...]]:
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


@pytest.mark.parametrize("preset", ["real", "tiny"])
def test_eg2_tower_contract_is_transformers(preset):
    from transformers import AutoModel, EmbeddingGemma2Config

    text = eg2_text_config("eg2" if preset == "real" else "eg2-tiny")
    cfg = EmbeddingGemma2Config(text_config=text, vision_config=vision_config(preset), audio_config=audio_config(preset))
    with torch.device("meta"):
        model = AutoModel.from_config(cfg)
    want = {k: v for k, v in _meta_shapes(model).items() if not k.startswith("language_model.")}
    got = vision_tower_shapes(vision_config(preset), text["hidden_size"], "vision_tower.", "embed_vision.")
    got |= audio_tower_shapes(audio_config(preset), text["hidden_size"], "audio_tower.", "embed_audio.")
    assert got == want
    if preset == "real":  # the published count, towers included
        assert sum(int(np.prod(s)) for s in _meta_shapes(model).values()) // 10**6 == 744


def test_e2b_vision_contract_is_transformers():
    from transformers import Gemma4Config, Gemma4ForConditionalGeneration

    text = text_config("e2b")
    cfg = Gemma4Config(text_config=text, vision_config=vision_config("real"))
    with torch.device("meta"):
        model = Gemma4ForConditionalGeneration(cfg)
    want = {k: v for k, v in _meta_shapes(model).items() if k.startswith(("model.vision_tower.", "model.embed_vision."))}
    assert vision_tower_shapes(vision_config("real"), text["hidden_size"], "model.vision_tower.",
                               "model.embed_vision.") == want


def test_synth_eg2_tiny_with_towers_loads_in_transformers(tmp_path):
    import eg2_oracle as o
    from transformers import AutoModel, AutoTokenizer
    from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil

    from gemmalite import load_embedder

    path = synth_eg2("eg2-tiny", tmp_path / "s", tokenizer=o.gemma4_tokenizer_dir() / "tokenizer.json", progress=False)
    model, info = AutoModel.from_pretrained(path, dtype=torch.float64, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    assert model.vision_tower is not None and model.audio_tower is not None
    tok = AutoTokenizer.from_pretrained(path)
    assert (tok.boi_token, tok.eoi_token, tok.image_token) == ("<|image>", "<image|>", "<|image|>")
    proc = json.loads((path / "processor_config.json").read_text())
    image = Gemma4ImageProcessorPil(**{k: v for k, v in proc["image_processor"].items() if k != "image_processor_type"})
    assert (image.patch_size, image.pooling_kernel_size, image.max_soft_tokens) == (16, 3, 280)
    texts = ["Hello world", "the quick brown fox jumps over the lazy dog"]
    ids = [tok(t)["input_ids"] for t in texts]
    assert all(i[0] == 2 and i[-1] == 1 for i in ids)
    model.language_model.float()  # loaded in float64; ref_pair runs a float64 copy and this float32 model
    o.assert_parity(load_embedder(path).embed(texts), *o.ref_pair(model.language_model, ids))


@pytest.mark.parametrize("preset", ["e2b", "e4b"])
def test_gemma4_audio_contract_is_transformers(preset):
    from transformers import Gemma4Config, Gemma4ForConditionalGeneration

    text = text_config(preset)
    cfg = Gemma4Config(text_config=text, vision_config=None, audio_config=audio_config("real"))
    with torch.device("meta"):
        model = Gemma4ForConditionalGeneration(cfg)
    want = {k: v for k, v in _meta_shapes(model).items() if k.startswith(("model.audio_tower.", "model.embed_audio."))}
    assert audio_tower_shapes(audio_config("real"), text["hidden_size"], "model.audio_tower.",
                              "model.embed_audio.") == want


@pytest.mark.parametrize("preset", ["tiny", "eg2-tiny"])
def test_tiny_audio_towers_run_as_transformers(preset, tmp_path):
    """The toy audio towers of `synth` run, and give what transformers' Gemma4AudioModel +
    embed_audio give on the same (bf16) weights, loaded strictly from the folder."""
    import audio_oracle as ao

    from gemmalite.audio import build_audio_tower
    from gemmalite.formats.folder import read_config, read_tensors
    from gemmalite.tools.synth import synth

    if preset == "tiny":
        path, prefix = synth("tiny", tmp_path / "s", audio=True, progress=False), "model."
    else:
        path, prefix = synth_eg2("eg2-tiny", tmp_path / "s", progress=False), ""
    raw = read_config(path)
    tensors = read_tensors(path, raw)
    text_hidden = raw["text_config"]["hidden_size"]
    inner = ao.StandaloneAudio(raw["audio_config"], text_hidden).load(tensors, prefix)
    x = ao.speechy(16000, 2)
    ref64, ref32 = ao.hf_audio_features(inner, x), ao.hf_audio_features(inner, x, torch.float32)
    ours = build_audio_tower(tensors, raw).encode(x)
    assert ours.shape == ref64.shape == (25, text_hidden)
    assert np.abs(ours - ref64).max() <= 4 * np.abs(ref32 - ref64).max() + 1e-6
