"""Gemma 4 with pictures: soft tokens placed as Gemma4Processor places them, logits and greedy
tokens against Gemma4ForConditionalGeneration (tiny random text model + clipped vision tower,
every weight randomised), and KV-cache reuse that never crosses a changed picture."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import hf_oracle
import vision_oracle as vo
from gemmalite.errors import ConfigError, ImageError
from gemmalite.runtime import engine as engine_mod
from gemmalite.runtime.generate import GenerationStats, generate_ids
from gemmalite.runtime.sampling import SamplingParams

PIL = pytest.importorskip("PIL.Image")

IMG, BOI, EOI = vo.IMG, vo.BOI, vo.EOI
SOFT = 70
PROMPT = [2, 380, 391, IMG, 402, 377, 390, IMG, 415, 399]


def _image(h: int, w: int, seed: int):
    return PIL.fromarray(np.random.RandomState(seed).randint(0, 256, (h, w, 3), dtype=np.uint8))


IMAGES = [_image(50, 90, 0), _image(120, 40, 1)]


def _checkpoint(path, sliding_window: int):
    from transformers import Gemma4Config, Gemma4ForConditionalGeneration

    torch.manual_seed(0)
    cfg = Gemma4Config(text_config=hf_oracle._text_config_kwargs({"sliding_window": sliding_window}),
                       vision_config=dict(vo.CLIPPED), image_token_id=IMG, boi_token_id=BOI, eoi_token_id=EOI,
                       attn_implementation="eager")
    model = Gemma4ForConditionalGeneration(cfg).float().eval()
    hf_oracle.randomize_text_weights(model, 0)
    vo.randomize_vision_weights([model.model.vision_tower, model.model.embed_vision], 1)
    model.save_pretrained(path, safe_serialization=True)
    # the budget comes from the folder's processor config; patch / pooling sizes from vision_config
    (path / "processor_config.json").write_text(json.dumps({"image_processor": {"max_soft_tokens": SOFT}}))
    return path, model


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """Sliding window 8: the prompt crosses it many times."""
    return _checkpoint(tmp_path_factory.mktemp("gemma4-vision"), 8)


@pytest.fixture(scope="module")
def long_window(tmp_path_factory):
    """Sliding window past the prompt: a cached prompt can roll back to any prefix."""
    return _checkpoint(tmp_path_factory.mktemp("gemma4-vision-long"), 512)


def _reference_inputs(images):
    """input_ids as Gemma4Processor expands them, and its pixel inputs."""
    proc = vo.image_processor(vo.CLIPPED["patch_size"], vo.CLIPPED["pooling_kernel_size"], SOFT)
    out = proc(images, return_tensors="pt")
    ids, counts = [], iter(out["num_soft_tokens_per_image"])
    for t in PROMPT:
        ids += [BOI] + [IMG] * int(next(counts)) + [EOI] if t == IMG else [t]
    return torch.tensor([ids]), out["pixel_values"], out["image_position_ids"]


def test_logits_and_greedy_match_transformers(ckpt, gl, monkeypatch):
    path, hf = ckpt
    model = gl.load(path)
    ids, pix, pos = _reference_inputs(IMAGES)
    with torch.no_grad():
        ref = hf(input_ids=ids, pixel_values=pix, image_position_ids=pos, use_cache=False).logits[0].numpy()
    ours = model.logits(PROMPT, images=IMAGES)
    assert ours.shape == ref.shape
    assert np.abs(ours - ref).max() <= 1e-4, np.abs(ours - ref).max()
    monkeypatch.setattr(engine_mod, "PREFILL_CHUNK", 37)  # chunked prefill: chunk edges inside the pictures
    chunked = model.logits(PROMPT, images=IMAGES)
    assert np.abs(chunked - ref).max() <= 1e-4, np.abs(chunked - ref).max()
    monkeypatch.undo()
    assert np.array_equal(model.with_images(PROMPT, IMAGES)[0], ids[0].numpy())
    stops = sorted(model.defaults.stop_ids)  # transformers stops where we must: at the first of these
    with torch.no_grad():
        out = hf.generate(input_ids=ids, pixel_values=pix, image_position_ids=pos, do_sample=False, max_new_tokens=24,
                          eos_token_id=stops, pad_token_id=0, top_k=None, top_p=None, temperature=None)
    want = out[0, ids.shape[1]:].tolist()
    want = want[: next((i for i, t in enumerate(want) if t in stops), len(want))]
    got = model.generate_tokens(PROMPT, images=IMAGES, max_new_tokens=24, temperature=0, stop=[])
    assert got == want, (got, want)
    assert len(got) >= 8, f"only {len(got)} tokens before a stop token: a weak test, change the seed"


def test_cache_reuse_stops_at_a_changed_picture(long_window, gl):
    """Two pictures of one size give the same ids: the cached prefix ends at the first row of the
    changed picture, and the continuation is that of a fresh run."""
    path, _ = long_window
    model = gl.load(path)
    other = [IMAGES[0], _image(120, 40, 7)]  # same size as IMAGES[1], other pixels
    state = model.new_state()

    def run(images):
        ids, soft = model.with_images(PROMPT, images)
        stats = GenerationStats()
        toks = list(generate_ids(model.engine, state, ids, max_new_tokens=6, params=SamplingParams(temperature=0.0),
                                 stop_ids=set(), stats=stats, soft=soft))
        return ids, soft, stats, toks

    ids1, soft1, s1, _ = run(IMAGES)
    ids2, soft2, s2, toks2 = run(other)
    assert s1.cached_tokens == 0 and np.array_equal(ids1, ids2)
    second_image = int(soft1.rows[(soft1.keys != soft2.keys)][0])
    n_first = int(model.with_images(PROMPT[:4], IMAGES[:1])[1].rows.size)
    assert second_image == soft1.rows[n_first] and s2.cached_tokens == second_image
    assert toks2 == model.generate_tokens(PROMPT, images=other, max_new_tokens=6, temperature=0, stop=[])
    _, _, s3, toks3 = run(other)  # same pictures again: all but the last prompt token reused
    assert s3.cached_tokens == len(ids2) - 1 and toks3 == toks2


def test_image_errors(ckpt, gl, tmp_path):
    path, _ = ckpt
    model = gl.load(path)
    with pytest.raises(ImageError, match="2 image placeholder"):
        model.logits(PROMPT, images=IMAGES[:1])
    with pytest.raises(ImageError, match="not an image"):
        model.logits(PROMPT, images=[IMAGES[0], b"junk"])
    hf_oracle.make_gemma4_checkpoint(tmp_path / "text")
    with pytest.raises(ConfigError, match="no vision tower"):
        gl.load(tmp_path / "text").logits(PROMPT, images=IMAGES)


def test_chat_with_a_picture(ckpt, gl):
    """A chat turn with an image part: the template's <|image|> expanded as the processor does
    (its replace_image_token on the rendered text), greedy reply as transformers generates it."""
    from transformers import AutoTokenizer

    path, hf = ckpt
    if not (path / "tokenizer.json").exists():
        vo.write_tokenizer_with_image_tokens(path)
    messages = [{"role": "user", "content": [{"type": "image", "image": IMAGES[1]},
                                             {"type": "text", "text": "What is in this picture?"}]}]
    tok = AutoTokenizer.from_pretrained(path)
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text.count("<|image|>") == 1
    proc = vo.image_processor(vo.CLIPPED["patch_size"], vo.CLIPPED["pooling_kernel_size"], SOFT)
    px = proc([IMAGES[1]], return_tensors="pt")
    n = int(px["num_soft_tokens_per_image"][0])
    ids = torch.tensor([tok(text.replace("<|image|>", "<|image>" + "<|image|>" * n + "<image|>"),
                            add_special_tokens=False)["input_ids"]])
    with torch.no_grad():
        out = hf.generate(input_ids=ids, pixel_values=px["pixel_values"], image_position_ids=px["image_position_ids"],
                          do_sample=False, max_new_tokens=12, min_new_tokens=12, pad_token_id=0, top_k=None,
                          top_p=None, temperature=None)
    want = out[0, ids.shape[1]:].tolist()
    model = gl.load(path)
    chat_ids = model.tokenizer.chat_ids(messages, add_generation_prompt=True)
    assert np.array_equal(model.with_images(chat_ids, [IMAGES[1]])[0], ids[0].numpy())
    stream = model.session().chat(messages, max_new_tokens=12, temperature=0, stream=True)
    reply = "".join(stream)
    k = next((i for i, t in enumerate(want) if t in (1, 106)), len(want))  # eos, end of turn
    assert stream.stats.prompt_tokens == ids.shape[1] and stream.stats.new_tokens == k
    assert reply == model.tokenizer.decode(want[:k])


def test_converted_checkpoint_keeps_the_tower(ckpt, gl, tmp_path):
    """`gemmalite convert` quantizes the vision projections too: the converted folder gives the
    logits of an int8 load of the original, pictures included."""
    from gemmalite.tools.convert import convert

    path, _ = ckpt
    out = convert(path, tmp_path / "int8", "int8", progress=False)
    assert (out / "processor_config.json").exists()
    converted = gl.load(out)
    assert type(converted.vision.tower.layers[0].q.w).__name__ == "Int8Matrix"
    want = gl.load(path, quant="int8").logits(PROMPT, images=IMAGES)
    np.testing.assert_array_equal(converted.logits(PROMPT, images=IMAGES), want)


@pytest.mark.parametrize("quant", [None, "int8"])
def test_the_thread_count_changes_no_number(ckpt, gl, quant):
    """The tower's BLAS attention and the prompt's float32 products through BLAS (whose own sums
    depend on its thread count) give the same logits on 1 and 2 compute threads, bit for bit."""
    path, _ = ckpt
    one = gl.load(path, quant=quant, threads=1).logits(PROMPT, images=IMAGES)
    np.testing.assert_array_equal(gl.load(path, quant=quant, threads=2).logits(PROMPT, images=IMAGES), one)


def test_cli_run_with_an_image(ckpt, gl, tmp_path, capsys):
    from gemmalite.cli import main

    path, _ = ckpt
    if not (path / "tokenizer.json").exists():
        vo.write_tokenizer_with_image_tokens(path)
    picture = tmp_path / "picture.png"
    IMAGES[1].save(picture)
    args = ["run", str(path), "--image", str(picture), "What is in this picture?", "--max-new-tokens", "6",
            "--temperature", "0"]
    assert main(args) == 0
    out = capsys.readouterr().out
    messages = [{"role": "user", "content": [{"type": "image", "path": str(picture)},
                                             {"type": "text", "text": "What is in this picture?"}]}]
    assert out == gl.load(path).session().chat(messages, max_new_tokens=6, temperature=0) + "\n"
    (tmp_path / "junk.png").write_bytes(b"not a picture")
    assert main(["run", str(path), "--image", str(tmp_path / "junk.png"), "hi"]) == 1
    assert "junk.png: not an image" in capsys.readouterr().err
