"""EmbeddingGemma 2 image, interleaved and video embeddings against transformers.

Checkpoint: a tiny random ``EmbeddingGemma2Model`` (every text and vision weight randomised by
eg2_oracle / vision_oracle; the vision tower with clipped linears, standardize, GQA, patch 4 /
pooling 2), the real Gemma 4 vocabulary (the image tokens are special tokens of it), and a
processor_config.json. Reference: transformers' ``EmbeddingGemma2Model`` in float64 on the
ids the EmbeddingGemma2Processor builds (its text with each ``<|image|>`` replaced by
``<|image>`` + N x ``<|image|>`` + ``<image|>``, tokenized by transformers' tokenizer), pixel
values from transformers' Gemma 4 PIL image processor; mean over every token, L2-normalised. Run
in float64 (float64 throughout) and float32: ours must be within 4x the float32 run's own error
of the float64 one (``o.assert_parity``); int8 at a measured bound.
"""
from __future__ import annotations

import contextlib
import copy
import io
import json
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
import eg2_oracle as o  # noqa: E402
import vision_oracle as vo  # noqa: E402

from gemmalite import ImageError, InputError, load_embedder  # noqa: E402
from gemmalite.embeddings.media import PART_SEPARATOR  # noqa: E402

SOFT = 70  # the processor's budget: 70 soft tokens = 280 patches of 4 x 4 pixels
BOI, IMG, EOI, VID = "<|image>", "<|image|>", "<image|>", "<|video|>"


def _image(h: int, w: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:h, 0:w]
    base = np.stack([xx * 255 / w, yy * 255 / h, (xx + yy) * 127 / (h + w)], -1)
    return np.clip(base + rng.normal(0, 40, (h, w, 3)), 0, 255).astype(np.uint8)


def _checkpoint(path: Path, gentle: bool = False):
    """``gentle``: text weights about as sensitive to weight noise as a trained net's (eg2_oracle),
    for the int8 bound; the default wide ranges make a random net chaotic."""
    from transformers import EmbeddingGemma2Config, EmbeddingGemma2Model

    torch.manual_seed(0)
    cfg = EmbeddingGemma2Config(text_config=o.eg2_config_kwargs(dict(vocab_size=262144)),
                                vision_config=dict(vo.CLIPPED, model_type="gemma4_vision"),
                                attn_implementation="eager")
    model = EmbeddingGemma2Model(cfg).float().eval()
    o.randomize_eg2_weights(model, 0, gentle=gentle)
    vo.randomize_vision_weights([model.vision_tower, model.embed_vision], 1)
    model.save_pretrained(path, safe_serialization=True)
    o.write_eg2_tokenizer(path, "gemma4")
    (path / "processor_config.json").write_text(json.dumps({
        "image_processor": {"image_processor_type": "Gemma4ImageProcessor", "patch_size": 4, "pooling_kernel_size": 2,
                            "max_soft_tokens": SOFT, "do_rescale": True, "rescale_factor": 1 / 255},
        "video_processor": {"video_processor_type": "EmbeddingGemma2VideoProcessor", "patch_size": 4,
                            "pooling_kernel_size": 2, "max_soft_tokens": SOFT, "max_frames": 3,
                            "overflow_strategy": "uniform", "do_normalize": True, "image_mean": [0, 0, 0],
                            "image_std": [1, 1, 1]},
        "image_seq_length": SOFT}))
    return path, model


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return _checkpoint(tmp_path_factory.mktemp("eg2_images"))


class Reference:
    """transformers' (float64, float32) embeddings of one input given as the processor's text and pictures."""

    def __init__(self, path: Path, model):
        from transformers import AutoTokenizer

        self.tok = AutoTokenizer.from_pretrained(path)
        self.models = {torch.float64: copy.deepcopy(model).double(), torch.float32: model}
        self.proc = vo.image_processor(patch_size=4, pooling_kernel_size=2, max_soft_tokens=SOFT)

    def _pixels(self, images, budget=SOFT):
        out = self.proc(list(images), return_tensors="pt", max_soft_tokens=budget)
        counts = [int(n) for n in out["num_soft_tokens_per_image"]]
        return out["pixel_values"], out["image_position_ids"], counts

    @torch.no_grad()
    def __call__(self, text: str, images=(), video=None, budget=SOFT) -> tuple[np.ndarray, np.ndarray]:
        kw = {}
        if images:
            kw["pixel_values"], kw["image_position_ids"], counts = self._pixels(images, budget)
            for n in counts:
                text = text.replace(IMG, BOI + "\0" * n + EOI, 1)
            text = text.replace("\0", IMG)
        if video is not None:
            pix, pos, counts = self._pixels(video)
            kw.update(pixel_values_videos=pix, video_position_ids=pos,
                      num_frames_per_video=torch.tensor([len(video)]))
            text = text.replace(VID, "".join(BOI + VID * n + EOI for n in counts))
        ids = self.tok(text, return_tensors="pt")["input_ids"]
        out = []
        for dtype, model in self.models.items():
            pix = {k: v.to(dtype) for k, v in kw.items() if k.startswith("pixel_values")}
            with o.hf_oracle.float64_throughout() if dtype == torch.float64 else contextlib.nullcontext():
                h = model(input_ids=ids, attention_mask=torch.ones_like(ids), **kw | pix).last_hidden_state[0]
            h = h.double().mean(0)
            out.append((h / h.norm()).numpy())
        return tuple(out)


@pytest.fixture(scope="module")
def ref(ckpt):
    return Reference(*ckpt)


@pytest.fixture(scope="module")
def emb(ckpt):
    return load_embedder(ckpt[0])


def _check(want, got, what="") -> None:
    """``want``: the Reference's (float64, float32) pair per row of ``got``."""
    o.assert_parity(got, np.stack([w[0] for w in want]), np.stack([w[1] for w in want]), what)


def test_images_every_input_kind(emb, ref, tmp_path):
    from PIL import Image

    a, b, c = _image(50, 70, 0), _image(90, 40, 1), _image(33, 33, 2)
    Image.fromarray(b).save(tmp_path / "b.png")
    buf = io.BytesIO()
    Image.fromarray(c).save(buf, format="PNG")
    got = emb.embed([a, tmp_path / "b.png", buf.getvalue(), Image.fromarray(a), io.BytesIO(buf.getvalue())])
    want = [ref(IMG, [x]) for x in (a, b, c, a, c)]
    _check(want, got)
    np.testing.assert_allclose(got[0], got[3], atol=1e-6)  # array and PIL image: the same pixels
    single = emb.embed(a)  # one input, not a batch
    assert single.shape == (1, emb.dim)
    _check([want[0]], single, "one input")


def test_interleaved_inputs(emb, ref):
    a, b = _image(50, 70, 3), _image(64, 48, 4)
    s = PART_SEPARATOR
    inputs = [["a photo of", a], [a, "caption", b], {"text": "left", "image": [a, b]}, [a, b],
              ["first", {"image": b}, "then text only"]]
    want = [ref("a photo of" + s + IMG, [a]), ref(IMG + s + "caption" + s + IMG, [a, b]),
            ref("left" + s + IMG + s + IMG, [a, b]), ref(IMG + s + IMG, [a, b]),
            ref("first" + s + IMG + s + "then text only", [b])]
    got = emb.embed(inputs)
    _check(want, got)
    # a batch mixing texts and pictures equals one input at a time; prompts go first
    mixed = ["just text", ["a photo of", a], "more text"]
    one_by_one = np.concatenate([emb.embed([m]) for m in mixed])
    np.testing.assert_allclose(emb.embed(mixed), one_by_one, atol=2e-6)
    prompted = emb.embed([["a photo of", a]], prompt="title: none | text: ")
    _check([ref("title: none | text: " + "a photo of" + s + IMG, [a])], prompted, "prompt")


def test_budget_override_and_dimensions(emb, ref):
    a = _image(80, 120, 5)
    got = emb.embed(a, max_soft_tokens=140, dimensions=16)
    want = tuple(w[:16] / np.linalg.norm(w[:16]) for w in ref(IMG, [a], budget=140))
    _check([want], got)


def test_video_frames(emb, ref):
    frames = [_image(40, 60, 10 + i) for i in range(5)]
    kept = [frames[i] for i in np.linspace(0, 4, 3, dtype=int)]  # max_frames 3, "uniform"
    got = emb.embed([{"video": frames}, ["clip:", {"video": frames[:2]}]])
    want = [ref(VID, video=kept), ref("clip:" + PART_SEPARATOR + VID, video=frames[:2])]
    _check(want, got)


def test_int8_images(tmp_path):
    path, model = _checkpoint(tmp_path / "gentle", gentle=True)
    ref = Reference(path, model)
    a, b = _image(50, 70, 6), _image(64, 48, 7)
    got = load_embedder(path, quant="int8").embed([a, ["a photo of", b]])
    want = np.stack([ref(IMG, [a])[0], ref("a photo of" + PART_SEPARATOR + IMG, [b])[0]])
    # measured 2026-12-02 on this gentle checkpoint (these two inputs): 1 - cos 2.3e-4; the bound is
    # about 2x it, far below an unrelated vector (~1)
    gap = (1 - o.cosine_rows(want, got)).max()
    assert gap <= 5e-4, gap


def test_bad_image_inputs(emb, tmp_path):
    for bad, err, msg in (([[]], InputError, r"inputs\[0\] is an empty list"),
                          ([["ok", 3]], InputError, r"inputs\[0\]\[1\] is a int, not an image"),
                          ([{"sound": 1}], InputError, "unknown part 'sound'"),
                          ([{"video": []}], InputError, "non-empty list of frames"),
                          ([b"not an image"], ImageError, r"inputs\[0\]"),
                          ([tmp_path / "missing.png"], ImageError, "missing.png")):
        with pytest.raises(err, match=msg):
            emb.embed(bad)
    with pytest.raises(ImageError, match="placeholder"):  # a literal placeholder in a text part
        emb.embed([["see <|image|> here", _image(20, 20, 0)]])


def test_text_only_checkpoint_refuses_images(tmp_path):
    path = tmp_path / "t"
    o.make_eg2_checkpoint(path, layout="text", st=False)
    with pytest.raises(ImageError, match="no vision tower"):
        load_embedder(path).embed([_image(20, 20, 0)])


def test_cli_and_corpus_with_images(ckpt, emb, tmp_path, capsys):
    pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq
    from PIL import Image

    from gemmalite.cli import main
    from gemmalite.embeddings.corpus import embed_corpus

    a, b = _image(50, 70, 8), _image(64, 48, 9)
    (tmp_path / "img").mkdir()
    Image.fromarray(a).save(tmp_path / "img" / "a.png")
    Image.fromarray(b).save(tmp_path / "img" / "b.png")
    assert main(["embed", str(ckpt[0]), "hello", "--image", str(tmp_path / "img" / "a.png"), "--json"]) == 0
    out = np.array(json.loads(capsys.readouterr().out)["embeddings"])
    np.testing.assert_allclose(out, emb.embed(["hello", a]), atol=2e-6)
    lines = [{"id": "x", "image": "img/a.png"}, {"id": "y", "text": "caption", "image": ["img/a.png", "img/b.png"]},
             {"id": "z", "image": "img/b.png", "text": "after"}, "just a text"]
    (tmp_path / "c.jsonl").write_text("\n".join(json.dumps(x) for x in lines[:3]) + "\n" + json.dumps({"id": "w", "text": lines[3]}))
    embed_corpus(emb, tmp_path / "c.jsonl", tmp_path / "v.parquet", chunk_size=2, progress=False)
    t = pq.read_table(tmp_path / "v.parquet")
    assert t.column("id").to_pylist() == ["x", "y", "z", "w"]
    want = emb.embed([a, ["caption", a, b], [b, "after"], "just a text"])
    np.testing.assert_allclose(np.array(t.column("embedding").to_pylist()), want, atol=2e-6)


def test_video_file(emb, ref, tmp_path):
    """A file decoded with PyAV and sampled as transformers' PyAV loader + the EmbeddingGemma 2
    video processor's sample_frames (fps 1 by default, max_frames 3 here) pick frames."""
    av = pytest.importorskip("av")
    from transformers.video_utils import read_video_pyav

    path = tmp_path / "clip.mp4"
    with av.open(str(path), "w") as out:
        stream = out.add_stream("mpeg4", rate=4)
        stream.width, stream.height, stream.pix_fmt = 64, 48, "yuv420p"
        for i in range(18):  # 4.5 s at 4 fps: 4 samples at 1 fps, capped to 3 uniformly
            frame = av.VideoFrame.from_ndarray(_image(48, 64, 20 + i), format="rgb24")
            for packet in stream.encode(frame):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)

    def sample(metadata, **_):
        return _reference_sample_frames()(None, metadata, fps=1, max_frames=3, overflow_strategy="uniform")

    frames, meta = read_video_pyav(str(path), sample)
    assert len(frames) == 3
    got = emb.embed([{"video": path}])
    _check([ref(VID, video=list(frames))], got, "video file")


def _reference_sample_frames():
    """``EmbeddingGemma2VideoProcessor.sample_frames`` itself: its module wants torchvision at import
    time (not installable here), so the method's source is taken from the file and run alone."""
    import ast
    import logging

    import transformers

    src = Path(transformers.__file__).parent / "models/embedding_gemma2/video_processing_embedding_gemma2.py"
    tree = ast.parse(src.read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "EmbeddingGemma2VideoProcessor")
    fn = next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "sample_frames")
    fn.returns = None
    for a in fn.args.args + fn.args.kwonlyargs:
        a.annotation = None
    ns = {"np": np, "logger": logging.getLogger("reference")}
    exec(compile(ast.Module(body=[fn], type_ignores=[]), str(src), "exec"), ns)
    return ns["sample_frames"]
