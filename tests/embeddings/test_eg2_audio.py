"""EmbeddingGemma 2 audio and mixed (text, picture, audio) embeddings against transformers.

Checkpoint: a tiny random ``EmbeddingGemma2Model`` with an audio tower and a vision tower (every
weight randomised by eg2_oracle / vision_oracle / audio_oracle), the real Gemma 4 vocabulary (the
audio tokens are special tokens of it). Reference: transformers' ``EmbeddingGemma2Model`` on the
ids the EmbeddingGemma2Processor builds (its text with each ``<|audio|>`` replaced by ``<|audio>``
+ N x ``<|audio|>`` + ``<audio|>``, N from the extractor's mask as the processor counts it,
tokenized by transformers' tokenizer), features from transformers' Gemma 4 feature extractor;
mean over every token, L2-normalised. Run in float64 (float64 throughout) and float32; ours must
be within 4x the float32 reference's own error of the float64 one (``o.assert_parity``).
"""
from __future__ import annotations

import contextlib
import json
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("soundfile")
import audio_oracle as ao  # noqa: E402
import eg2_oracle as o  # noqa: E402
import media_oracle as mo  # noqa: E402
import vision_oracle as vo  # noqa: E402

from gemmalite import AudioError, ContextError, InputError, load_embedder  # noqa: E402
from gemmalite.embeddings.media import PART_SEPARATOR  # noqa: E402

SOFT = 70
BOI, IMG, EOI = "<|image>", "<|image|>", "<image|>"
BOA, AUD, EOA = "<|audio>", "<|audio|>", "<audio|>"
S = PART_SEPARATOR


def _image(h: int, w: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)


def _checkpoint(path: Path, gentle: bool = False):
    from transformers import EmbeddingGemma2Config, EmbeddingGemma2Model

    torch.manual_seed(0)
    cfg = EmbeddingGemma2Config(text_config=o.eg2_config_kwargs(dict(vocab_size=262144, max_position_embeddings=1024)),
                                vision_config=dict(vo.CLIPPED, model_type="gemma4_vision"),
                                audio_config=dict(ao.CLIPPED, model_type="gemma4_audio"), attn_implementation="eager")
    model = EmbeddingGemma2Model(cfg).float().eval()
    o.randomize_eg2_weights(model, 0, gentle=gentle)
    vo.randomize_vision_weights([model.vision_tower, model.embed_vision], 1, gentle)
    ao.randomize_audio_weights([model.audio_tower, model.embed_audio], 2)
    model.save_pretrained(path, safe_serialization=True)
    o.write_eg2_tokenizer(path, "gemma4")
    (path / "processor_config.json").write_text(json.dumps({
        "image_processor": {"image_processor_type": "Gemma4ImageProcessor", "patch_size": 4, "pooling_kernel_size": 2,
                            "max_soft_tokens": SOFT, "do_rescale": True, "rescale_factor": 1 / 255},
        "image_seq_length": SOFT}))
    return path, model


class Reference:
    """transformers' embedding (float64 and float32) of one input given as the processor's text, pictures and clips."""

    def __init__(self, path: Path, model):
        from transformers import AutoTokenizer

        self.tok = AutoTokenizer.from_pretrained(path)
        self.model = model
        self.proc = vo.image_processor(patch_size=4, pooling_kernel_size=2, max_soft_tokens=SOFT)

    @torch.no_grad()
    def __call__(self, text: str, clips=(), images=(), dtype=torch.float64) -> np.ndarray:
        kw = {}
        if clips:
            feats, mask, counts = mo.audio_inputs(clips)
            kw.update(input_features=feats.to(dtype), input_features_mask=mask)
            for n in counts:
                text = text.replace(AUD, BOA + "\0" * n + EOA, 1)
            text = text.replace("\0", AUD)
        if images:
            out = self.proc(list(images), return_tensors="pt", max_soft_tokens=SOFT)
            kw.update(pixel_values=out["pixel_values"].to(dtype), image_position_ids=out["image_position_ids"])
            for n in out["num_soft_tokens_per_image"]:
                text = text.replace(IMG, BOI + "\0" * int(n) + EOI, 1)
            text = text.replace("\0", IMG)
        ids = self.tok(text, return_tensors="pt")["input_ids"]
        model = self.model.to(dtype)
        try:  # transformers' own float32 casts (text, vision and audio) kept in float64 too
            with o.hf_oracle.float64_throughout() if dtype == torch.float64 else contextlib.nullcontext():
                h = model(input_ids=ids, attention_mask=torch.ones_like(ids), **kw).last_hidden_state[0]
            h = h.double().mean(0)
        finally:
            self.model.float()
        return (h / h.norm()).numpy()


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return _checkpoint(tmp_path_factory.mktemp("eg2_audio"))


@pytest.fixture(scope="module")
def ref(ckpt):
    return Reference(*ckpt)


@pytest.fixture(scope="module")
def emb(ckpt):
    return load_embedder(ckpt[0])


def _check(ref, cases, got) -> None:
    """The rows within 4x the float32 reference's own error of the float64 reference."""
    r64 = np.stack([ref(text, **kw) for text, kw in cases])
    r32 = np.stack([ref(text, dtype=torch.float32, **kw) for text, kw in cases])
    o.assert_parity(got, r64, r32, [text for text, _ in cases])


def test_audio_and_mixed_inputs(emb, ref, tmp_path):
    a, b = mo.clip(1.2, 0), mo.clip(0.5, 1)
    pic = _image(50, 70, 2)
    (tmp_path / "a.wav").write_bytes(mo.wav(a))
    inputs = [{"audio": b}, {"audio": tmp_path / "a.wav"}, ["a dog barking", {"audio": b}],
              {"text": "sound:", "audio": [a, b]}, [pic, "and", {"audio": a}], ["before", {"audio": (b, 16000)}, "after"]]
    from transformers.audio_utils import load_audio

    from_file = load_audio(str(tmp_path / "a.wav"), sampling_rate=16000).astype(np.float32)  # the reference's loader
    cases = [(AUD, {"clips": [b]}), (AUD, {"clips": [from_file]}), ("a dog barking" + S + AUD, {"clips": [b]}),
             ("sound:" + S + AUD + S + AUD, {"clips": [a, b]}),
             (IMG + S + "and" + S + AUD, {"clips": [a], "images": [pic]}),
             ("before" + S + AUD + S + "after", {"clips": [b]})]
    got = emb.embed(inputs)
    assert got.shape == (len(inputs), emb.dim)
    _check(ref, cases, got)
    mixed = ["just text", {"audio": b}, "more text"]  # a batch equals one input at a time
    np.testing.assert_allclose(emb.embed(mixed), np.concatenate([emb.embed([m]) for m in mixed]), atol=2e-6)


def test_a_clip_past_30_s(emb, ref):
    """Refused unless truncate=True, which keeps the first 30 s exactly as transformers' extractor cuts it."""
    long = mo.clip(30.4, 3)
    with pytest.raises(ContextError, match=r"inputs\[0\]: audio clip 0 is 30.40 s long"):
        emb.embed([{"audio": long}])
    got = emb.embed([{"audio": long}], truncate=True)
    _check(ref, [(AUD, {"clips": [long]})], got)  # the extractor truncates at 480000 samples itself


def test_bad_audio_inputs(emb, tmp_path):
    for bad, err, msg in (([{"audio": b"not audio"}], AudioError, r"inputs\[0\]: audio clip 0"),
                          ([{"audio": []}], InputError, "a clip or a non-empty list"),
                          ([["x", {"audio": np.zeros(100, np.float32)}]], AudioError, "too short"),
                          ([{"audio": tmp_path / "missing.wav"}], AudioError, "missing.wav")):
        with pytest.raises(err, match=msg):
            emb.embed(bad)
    text_only = tmp_path / "t"
    o.make_eg2_checkpoint(text_only, layout="text", st=False)
    with pytest.raises(AudioError, match="no audio tower"):
        load_embedder(text_only).embed([{"audio": mo.clip(0.5, 0)}])


def test_int8_audio(tmp_path):
    path, model = _checkpoint(tmp_path / "gentle", gentle=True)
    ref = Reference(path, model)
    a = mo.clip(1.0, 4)
    got = load_embedder(path, quant="int8").embed([{"audio": a}, ["a sound", {"audio": a}]])
    want = np.stack([ref(AUD, [a]), ref("a sound" + S + AUD, [a])])
    # measured 2026-12-02 on this gentle checkpoint (these two inputs): 1 - cos 3.9e-4; the bound
    # is about 2x it, far below an unrelated vector (~1)
    gap = (1 - o.cosine_rows(want, got)).max()
    assert gap <= 8e-4, gap


def test_cli_and_corpus_with_audio(ckpt, emb, tmp_path, capsys):
    pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    from gemmalite.cli import main
    from gemmalite.embeddings.corpus import embed_corpus

    a, b = mo.clip(0.8, 5), mo.clip(0.4, 6)
    (tmp_path / "snd").mkdir()
    (tmp_path / "snd" / "a.wav").write_bytes(mo.wav(a))
    (tmp_path / "snd" / "b.wav").write_bytes(mo.wav(b))
    assert main(["embed", str(ckpt[0]), "hello", "--audio", str(tmp_path / "snd" / "a.wav"), "--json"]) == 0
    out = np.array(json.loads(capsys.readouterr().out)["embeddings"])
    np.testing.assert_allclose(out, emb.embed(["hello", {"audio": tmp_path / "snd" / "a.wav"}]), atol=2e-6)
    lines = [{"id": "x", "audio": "snd/a.wav"}, {"id": "y", "text": "two sounds", "audio": ["snd/a.wav", "snd/b.wav"]},
             {"id": "z", "audio": "snd/b.wav", "text": "after"}, {"id": "w", "text": "just a text"}]
    (tmp_path / "c.jsonl").write_text("\n".join(json.dumps(x) for x in lines))
    embed_corpus(emb, tmp_path / "c.jsonl", tmp_path / "v.parquet", chunk_size=2, progress=False)
    t = pq.read_table(tmp_path / "v.parquet")
    assert t.column("id").to_pylist() == ["x", "y", "z", "w"]
    wa, wb = {"audio": tmp_path / "snd" / "a.wav"}, {"audio": tmp_path / "snd" / "b.wav"}
    want = emb.embed([wa, ["two sounds", wa, wb], [wb, "after"], "just a text"])
    np.testing.assert_allclose(np.array(t.column("embedding").to_pylist()), want, atol=2e-6)
