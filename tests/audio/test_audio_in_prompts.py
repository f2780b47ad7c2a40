"""Gemma 4 with audio: clips placed as Gemma4Processor places them, logits and greedy tokens
against Gemma4ForConditionalGeneration (a tiny random text model with an audio tower and a vision
tower, every weight randomised) on the processor's inputs, pictures and clips in one prompt,
KV-cache reuse that never crosses a changed clip, chat and the CLI, and the errors."""
from __future__ import annotations

import io

import numpy as np
import pytest

torch = pytest.importorskip("torch")
sf = pytest.importorskip("soundfile")
PIL = pytest.importorskip("PIL.Image")
import hf_oracle  # noqa: E402
import media_oracle as mo  # noqa: E402
import vision_oracle as vo  # noqa: E402

from gemmalite.errors import AudioError, ConfigError  # noqa: E402
from gemmalite.runtime import engine as engine_mod  # noqa: E402
from gemmalite.runtime.generate import GenerationStats, generate_ids  # noqa: E402
from gemmalite.runtime.sampling import SamplingParams  # noqa: E402

IMG, BOI, EOI = mo.IMG, mo.BOI, mo.EOI
AUD, BOA, EOA = mo.AUD, mo.BOA, mo.EOA
SOFT = mo.SOFT
PROMPT = [2, 380, 391, AUD, 402, 377, IMG, 390, AUD, 415, 399]  # a clip, a picture, another clip
_clip, _wav, _audio_inputs = mo.clip, mo.wav, mo.audio_inputs
CLIPS = [_clip(1.3, 0), _clip(0.7, 1)]
PICTURE = PIL.fromarray(np.random.RandomState(0).randint(0, 256, (50, 90, 3), dtype=np.uint8))


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """Sliding window 8: the prompt crosses it many times."""
    return mo.make_gemma4_audio_checkpoint(tmp_path_factory.mktemp("gemma4-audio"), 8)


@pytest.fixture(scope="module")
def long_window(tmp_path_factory):
    """Sliding window past the prompt: a cached prompt can roll back to any prefix."""
    return mo.make_gemma4_audio_checkpoint(tmp_path_factory.mktemp("gemma4-audio-long"), 512)


def _reference_inputs(prompt, clips, pictures=()):
    """input_ids as Gemma4Processor expands them, and its audio (and pixel) inputs."""
    feats, mask, counts = _audio_inputs(clips)
    kw = {"input_features": feats, "input_features_mask": mask}
    n_img = iter(())
    if pictures:
        px = vo.image_processor(vo.CLIPPED["patch_size"], vo.CLIPPED["pooling_kernel_size"], SOFT)(
            list(pictures), return_tensors="pt")
        kw.update(pixel_values=px["pixel_values"], image_position_ids=px["image_position_ids"])
        n_img = iter(px["num_soft_tokens_per_image"])
    n_aud, ids = iter(counts), []
    for t in prompt:
        if t == AUD:
            ids += [BOA] + [AUD] * next(n_aud) + [EOA]
        elif t == IMG:
            ids += [BOI] + [IMG] * int(next(n_img)) + [EOI]
        else:
            ids.append(t)
    return torch.tensor([ids]), kw


def test_logits_and_greedy_match_transformers(ckpt, gl, monkeypatch):
    """Two clips and a picture in one prompt, as the processor batches them (padded to the longer clip)."""
    path, hf = ckpt
    model = gl.load(path)
    ids, kw = _reference_inputs(PROMPT, CLIPS, [PICTURE])
    with torch.no_grad():
        ref = hf(input_ids=ids, use_cache=False, **kw).logits[0].numpy()
    ours = model.logits(PROMPT, images=[PICTURE], audio=CLIPS)
    assert ours.shape == ref.shape
    assert np.abs(ours - ref).max() <= 1e-4, np.abs(ours - ref).max()
    monkeypatch.setattr(engine_mod, "PREFILL_CHUNK", 29)  # chunked prefill: chunk edges inside the clips
    chunked = model.logits(PROMPT, images=[PICTURE], audio=CLIPS)
    assert np.abs(chunked - ref).max() <= 1e-4, np.abs(chunked - ref).max()
    monkeypatch.undo()
    assert np.array_equal(model.with_media(PROMPT, [PICTURE], CLIPS)[0], ids[0].numpy())
    stops = sorted(model.defaults.stop_ids)  # transformers stops where we must: at the first of these
    with torch.no_grad():
        out = hf.generate(input_ids=ids, do_sample=False, max_new_tokens=24, eos_token_id=stops, pad_token_id=0,
                          top_k=None, top_p=None, temperature=None, **kw)
    want = out[0, ids.shape[1]:].tolist()
    want = want[: next((i for i, t in enumerate(want) if t in stops), len(want))]
    got = model.generate_tokens(PROMPT, images=[PICTURE], audio=CLIPS, max_new_tokens=24, temperature=0, stop=[])
    assert got == want, (got, want)
    assert len(got) >= 8, f"only {len(got)} tokens before a stop token: a weak test, change the seed"


def test_clip_forms_give_the_same_tokens(ckpt, gl, tmp_path):
    """A path, bytes, a file object, int16 samples and (array, rate) of one clip: one result."""
    path, _ = ckpt
    model = gl.load(path)
    pcm = np.round(CLIPS[0] * 32767).astype(np.int16)
    wav = _wav(pcm)
    (tmp_path / "a.wav").write_bytes(wav)
    prompt = PROMPT[:4]
    want = model.logits(prompt, audio=[pcm])
    for form in (tmp_path / "a.wav", str(tmp_path / "a.wav"), wav, io.BytesIO(wav), (pcm, 16000),
                 (np.stack([pcm, pcm], 1), 16000)):
        np.testing.assert_array_equal(model.logits(prompt, audio=[form]), want)


def test_cache_reuse_stops_at_a_changed_clip(long_window, gl):
    """Two clips of one length give the same ids: the cached prefix ends at the first row of the
    changed clip, and the continuation is that of a fresh run."""
    path, _ = long_window
    model = gl.load(path)
    other = [CLIPS[0], _clip(0.7, 9)]  # CLIPS[1]'s length, other samples
    prompt = [t for t in PROMPT if t != IMG]
    state = model.new_state()

    def run(clips):
        ids, soft = model.with_media(prompt, audio=clips)
        stats = GenerationStats()
        toks = list(generate_ids(model.engine, state, ids, max_new_tokens=6, params=SamplingParams(temperature=0.0),
                                 stop_ids=set(), stats=stats, soft=soft))
        return ids, soft, stats, toks

    ids1, soft1, s1, _ = run(CLIPS)
    ids2, soft2, s2, toks2 = run(other)
    assert s1.cached_tokens == 0 and np.array_equal(ids1, ids2)
    n_first = int(model.with_media(prompt[:4], audio=CLIPS[:1])[1].rows.size)
    second = int(soft1.rows[n_first])
    assert int(soft1.rows[soft1.keys != soft2.keys][0]) == second and s2.cached_tokens == second
    assert toks2 == model.generate_tokens(prompt, audio=other, max_new_tokens=6, temperature=0, stop=[])
    _, _, s3, toks3 = run(other)  # the same clips again: all but the last prompt token reused
    assert s3.cached_tokens == len(ids2) - 1 and toks3 == toks2


def _messages(clip, text="What is said here?"):
    return [{"role": "user", "content": [{"type": "audio", "audio": clip}, {"type": "text", "text": text}]}]


def test_chat_with_a_clip(ckpt, gl):
    """A chat turn with an audio part: the template's <|audio|> expanded as the processor does,
    greedy reply as transformers generates it."""
    from transformers import AutoTokenizer

    path, hf = ckpt
    messages = _messages(CLIPS[1])
    tok = AutoTokenizer.from_pretrained(path)
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text.count("<|audio|>") == 1
    feats, mask, (n,) = _audio_inputs(CLIPS[1:])
    ids = torch.tensor([tok(text.replace("<|audio|>", "<|audio>" + "<|audio|>" * n + "<audio|>"),
                            add_special_tokens=False)["input_ids"]])
    with torch.no_grad():
        out = hf.generate(input_ids=ids, input_features=feats, input_features_mask=mask, do_sample=False,
                          max_new_tokens=12, min_new_tokens=12, pad_token_id=0, top_k=None, top_p=None, temperature=None)
    want = out[0, ids.shape[1]:].tolist()
    model = gl.load(path)
    chat_ids = model.tokenizer.chat_ids(messages, add_generation_prompt=True)
    assert np.array_equal(model.with_media(chat_ids, audio=CLIPS[1:])[0], ids[0].numpy())
    stream = model.session().chat(messages, max_new_tokens=12, temperature=0, stream=True)
    reply = "".join(stream)
    k = next((i for i, t in enumerate(want) if t in (1, 106)), len(want))  # eos, end of turn
    assert stream.stats.prompt_tokens == ids.shape[1] and stream.stats.new_tokens == k
    assert reply == model.tokenizer.decode(want[:k])


def test_audio_errors(ckpt, gl, tmp_path):
    path, _ = ckpt
    model = gl.load(path)
    prompt = PROMPT[:4]
    with pytest.raises(AudioError, match="2 audio placeholder"):
        model.logits(PROMPT, images=[PICTURE], audio=CLIPS[:1])
    bad = [(b"this is not audio at all", "cannot decode"), (_wav(CLIPS[0])[:-3000], "truncated"),
           (np.zeros(0, np.float32), "no samples"), (np.array([0.1, np.nan] * 800, np.float32), "NaN"),
           (np.zeros(1600, np.uint8), "dtype"), ((CLIPS[0], 0), "sample rate of 0"),
           (np.zeros(150, np.float32), "too short")]
    for clip, msg in bad:
        with pytest.raises(AudioError, match=msg):
            model.logits(prompt, audio=[clip])
    with pytest.raises(AudioError, match="more than the 1 s allowed"):
        model.with_media(prompt, audio=[_wav(CLIPS[0])], max_seconds=1.0)
    with pytest.raises(AudioError, match="more than the 2.56 s allowed"):  # what a context of 64 tokens holds
        gl.load(path, context=64).logits(prompt, audio=[_wav(_clip(2.7, 3))])
    with pytest.raises(AudioError, match="URLs are not fetched"):
        model.chat(_messages("https://example.com/a.wav"))
    assert model.logits(prompt, audio=CLIPS[:1]).shape[0] > 4  # nothing broken
    hf_oracle.make_gemma4_checkpoint(tmp_path / "text")
    vo.write_tokenizer_with_image_tokens(tmp_path / "text", audio=True)
    text_only = gl.load(tmp_path / "text")
    with pytest.raises(ConfigError, match="no audio tower"):
        text_only.logits(prompt, audio=CLIPS[:1])
    with pytest.raises(ConfigError, match="no audio tower"):  # a chat audio part is never ignored
        text_only.chat(_messages(CLIPS[0]), max_new_tokens=2)


def test_converted_checkpoint_keeps_the_audio_tower(ckpt, gl, tmp_path):
    """`gemmalite convert` quantizes the audio projections too: the converted folder gives the
    logits of an int8 load of the original, clips included."""
    from gemmalite.tools.convert import convert

    path, _ = ckpt
    converted = gl.load(convert(path, tmp_path / "int8", "int8", progress=False))
    want = gl.load(path, quant="int8").logits(PROMPT, images=[PICTURE], audio=CLIPS)
    np.testing.assert_array_equal(converted.logits(PROMPT, images=[PICTURE], audio=CLIPS), want)


def test_cli_run_and_chat_with_a_clip(ckpt, gl, tmp_path, capsys, monkeypatch):
    from gemmalite.cli import main

    path, _ = ckpt
    clip = tmp_path / "clip.wav"
    clip.write_bytes(_wav(CLIPS[1]))
    assert main(["run", str(path), "--audio", str(clip), "What is said here?", "--max-new-tokens", "6",
                 "--temperature", "0"]) == 0
    out = capsys.readouterr().out
    messages = [{"role": "user", "content": [{"type": "audio", "path": str(clip)},
                                             {"type": "text", "text": "What is said here?"}]}]
    want = gl.load(path).session().chat(messages, max_new_tokens=6, temperature=0)
    assert out == want + "\n"
    monkeypatch.setattr("sys.stdin", io.StringIO(f"/audio {clip}\nWhat is said here?\n"))  # piped chat input
    assert main(["chat", str(path), "--max-new-tokens", "6", "--temperature", "0"]) == 0
    assert capsys.readouterr().out == want + "\n"
    (tmp_path / "junk.wav").write_bytes(b"not a sound")
    assert main(["run", str(path), "--audio", str(tmp_path / "junk.wav"), "hi"]) == 1
    assert "junk.wav: cannot decode" in capsys.readouterr().err
