"""Pictures through the server: chat requests with ``image_url`` data URLs, driven by the real
`openai` client against a live server on a tiny Gemma 4 with a vision tower (every weight random).
The oracle is `ChatSession.chat` with the same picture (itself checked against transformers in
tests/vision), computed before the server serves; bad pictures answer 400 and the server keeps
serving; a resent chat whose picture changed reuses no position of the old picture."""
from __future__ import annotations

import base64
import io
import json
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from live_server import KEY, LiveServer, stream_text

torch = pytest.importorskip("torch")
PIL = pytest.importorskip("PIL.Image")
import hf_oracle  # noqa: E402
import vision_oracle as vo  # noqa: E402

IMG, BOI, EOI = vo.IMG, vo.BOI, vo.EOI
MODEL_ID = "tiny-vision"
QUESTION = "What is in this picture?"


def _png(h: int, w: int, seed: int) -> bytes:
    buf = io.BytesIO()
    PIL.fromarray(np.random.RandomState(seed).randint(0, 256, (h, w, 3), dtype=np.uint8)).save(buf, "PNG")
    return buf.getvalue()


def _url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


PICS = {"a": _png(50, 90, 0), "b": _png(120, 40, 1), "b2": _png(120, 40, 7)}  # b2: b's size, other pixels


def _api_messages(pic: str, text: str = QUESTION) -> list[dict]:
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": _url(PICS[pic])}},
                                         {"type": "text", "text": text}]}]


def _model_messages(pic: str, text: str = QUESTION) -> list[dict]:
    return [{"role": "user", "content": [{"type": "image", "image": PICS[pic]}, {"type": "text", "text": text}]}]


@pytest.fixture(scope="module")
def model(tmp_path_factory, gl):
    """Tiny Gemma 4 + clipped vision tower, sliding window past the prompt (a cached prompt can
    roll back to any prefix), and a tokenizer whose template places <|image|>."""
    from transformers import Gemma4Config, Gemma4ForConditionalGeneration

    path = tmp_path_factory.mktemp("gemma4-vision")
    torch.manual_seed(0)
    cfg = Gemma4Config(text_config=hf_oracle._text_config_kwargs({"sliding_window": 512}),
                       vision_config=dict(vo.CLIPPED), image_token_id=IMG, boi_token_id=BOI, eoi_token_id=EOI,
                       attn_implementation="eager")
    hf = Gemma4ForConditionalGeneration(cfg).float().eval()
    hf_oracle.randomize_text_weights(hf, 0)
    vo.randomize_vision_weights([hf.model.vision_tower, hf.model.embed_vision], 1)
    hf.save_pretrained(path, safe_serialization=True)
    (path / "processor_config.json").write_text(json.dumps({"image_processor": {"max_soft_tokens": 70}}))
    vo.write_tokenizer_with_image_tokens(path)
    return gl.load(path, context=512)


@pytest.fixture(scope="module")
def refs(model):
    out = {}
    for pic in PICS:
        s = model.session().chat(_model_messages(pic), max_new_tokens=8, temperature=0, stream=True)
        out[pic] = ("".join(s), s.stats.prompt_tokens)
    two = [{"role": "user", "content": [{"type": "image", "image": PICS["a"]}, {"type": "text", "text": "and"},
                                        {"type": "image", "image": PICS["b"]}]}]
    out["two"] = model.session().chat(two, max_new_tokens=8, temperature=0.8, seed=5)
    out["text"] = model.session().chat([{"role": "user", "content": "Hello"}], max_new_tokens=8, temperature=0)
    out["first_b_row"] = int(model.with_images(model.tokenizer.chat_ids(_model_messages("b"), add_generation_prompt=True),
                                               [PICS["b"]])[1].rows[0])
    return out


@pytest.fixture(scope="module")
def live(model, refs):
    from gemmalite.server import build_app
    from gemmalite.server.protocol import Limits

    limits = Limits(max_images=2, max_image_bytes=64 << 10, max_image_pixels=20000)
    s = LiveServer(build_app(model, model_id=MODEL_ID, api_key=KEY, max_concurrency=4, prefix_cache=64 << 20, limits=limits))
    yield s
    s.stop()


def test_chat_with_pictures_equals_model(live, refs):
    c = live.client()
    r = c.chat.completions.create(model=MODEL_ID, messages=_api_messages("a"), max_tokens=8, temperature=0)
    assert (r.choices[0].message.content, r.usage.prompt_tokens) == refs["a"]
    text, _, usage = stream_text(c.chat.completions.create(model=MODEL_ID, messages=_api_messages("b"), max_tokens=8,
                                                           temperature=0, stream=True,
                                                           stream_options={"include_usage": True}))
    assert (text, usage.prompt_tokens) == refs["b"]
    two = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": _url(PICS["a"]), "detail": "auto"}},
                                        {"type": "text", "text": "and"},
                                        {"type": "image_url", "image_url": {"url": _url(PICS["b"])}}]}]
    r = c.chat.completions.create(model=MODEL_ID, messages=two, max_tokens=8, temperature=0.8, seed=5)
    assert r.choices[0].message.content == refs["two"]


def test_ollama_images_equal_model(live, refs):
    """ollama's ``images`` (base64, the client encodes the bytes) go before the message's text:
    the reply is the same as the image_url part's."""
    ollama = pytest.importorskip("ollama")
    c = ollama.Client(host=f"http://127.0.0.1:{live.port}", headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
    opts = {"temperature": 0, "num_predict": 8}
    r = c.chat(MODEL_ID, messages=[{"role": "user", "content": QUESTION, "images": [PICS["a"]]}], options=opts)
    assert (r.message.content, r.prompt_eval_count) == refs["a"]
    r = c.generate(MODEL_ID, QUESTION, images=[PICS["b"]], options=opts)
    assert (r.response, r.prompt_eval_count) == refs["b"]


def test_concurrent_pictures_no_crosstalk(live, refs):
    c = live.client()

    def one(pic):
        if pic == "text":
            r = c.chat.completions.create(model=MODEL_ID, messages=[{"role": "user", "content": "Hello"}], max_tokens=8,
                                          temperature=0)
            return r.choices[0].message.content, refs["text"]
        r = c.chat.completions.create(model=MODEL_ID, messages=_api_messages(pic), max_tokens=8, temperature=0)
        return r.choices[0].message.content, refs[pic][0]

    with ThreadPoolExecutor(4) as ex:
        for got, want in ex.map(one, ["a", "b", "b2", "text"]):
            assert got == want


def test_prefix_reuse_stops_at_a_changed_picture(live, refs):
    """b and b2 have the same size, so the same token ids: the cached prefix must end at the
    first row of the picture, and the reply is that of a fresh run."""
    c = live.client()
    live.srv.scheduler.cache.states.clear()  # idle between requests: start from no cached state
    r1 = c.chat.completions.create(model=MODEL_ID, messages=_api_messages("b"), max_tokens=8, temperature=0)
    assert r1.choices[0].message.content == refs["b"][0]
    r2 = c.chat.completions.create(model=MODEL_ID, messages=_api_messages("b2"), max_tokens=8, temperature=0)
    assert r2.choices[0].message.content == refs["b2"][0]
    assert r2.usage.prompt_tokens_details.cached_tokens == refs["first_b_row"]
    r3 = c.chat.completions.create(model=MODEL_ID, messages=_api_messages("b2"), max_tokens=8, temperature=0)
    assert r3.choices[0].message.content == refs["b2"][0]
    assert r3.usage.prompt_tokens_details.cached_tokens == refs["b2"][1] - 1  # the same picture: all but the last


def _image_msg(url) -> dict:
    return {"model": MODEL_ID, "max_tokens": 2,
            "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                                      {"type": "text", "text": "x"}]}]}


def test_bad_pictures_answer_400_and_server_keeps_serving(live, refs):
    buf = io.BytesIO()
    PIL.new("RGB", (200, 200), (9, 99, 199)).save(buf, "PNG")
    big = buf.getvalue()  # a few hundred bytes, 40000 pixels > the server's 20000
    png = PICS["a"]
    bad = [
        (_image_msg("https://example.com/cat.png"), "image_url_not_supported"),
        (_image_msg("http://127.0.0.1/cat.png"), "image_url_not_supported"),
        (_image_msg("file:///etc/passwd"), "invalid_image"),
        (_image_msg("data:image/png,rawbytes"), "invalid_image"),
        (_image_msg("data:image/png;base64,@@not base64@@"), "invalid_image"),
        (_image_msg("data:image/png;base64,"), "invalid_image"),
        (_image_msg(_url(b"this is not a picture at all")), "invalid_image"),
        (_image_msg(_url(png[: len(png) // 2])), "invalid_image"),  # truncated PNG
        (_image_msg(_url(big)), "invalid_image"),  # too many pixels, refused from the header
        (_image_msg(_url(b"\0" * (65 << 10))), "image_too_large"),
        (_image_msg(12), None),
        ({"model": MODEL_ID, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, None),
        ({"model": MODEL_ID, "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": _url(png)}}] * 3}]}, None),  # more than max_images
    ]
    for body, code in bad:
        status, _, resp = live.raw("POST", "/v1/chat/completions", body)
        assert status == 400, (str(body)[:200], resp)
        assert isinstance(resp["error"]["message"], str) and (code is None or resp["error"]["code"] == code), resp
    assert "pixels" in live.raw("POST", "/v1/chat/completions", _image_msg(_url(big)))[2]["error"]["message"]
    assert live.raw("GET", "/health", key=None)[0] == 200
    r = live.client().chat.completions.create(model=MODEL_ID, messages=_api_messages("a"), max_tokens=8, temperature=0)
    assert r.choices[0].message.content == refs["a"][0]
