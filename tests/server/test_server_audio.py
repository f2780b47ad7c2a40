"""Audio through the server: chat requests with ``input_audio`` parts and
``/v1/audio/transcriptions``, driven by the real `openai` client against a live server on a tiny
Gemma 4 with an audio tower (every weight random). The oracle is `ChatSession.chat` with the same
clip (itself checked against transformers in tests/audio), computed before the server serves;
bad audio answers 400 naming the parameter, and the server keeps serving."""
from __future__ import annotations

import base64
import io

import numpy as np
import pytest
from live_server import KEY, LiveServer

torch = pytest.importorskip("torch")
pytest.importorskip("soundfile")
pytest.importorskip("multipart")
import media_oracle as mo  # noqa: E402

MODEL_ID = "tiny-audio"
EMB_ID = "tiny-eg2"
MAX_TOKENS = 24  # the server's bound on a reply
QUESTION = "What is said here?"
CLIPS = {"a": mo.wav(mo.clip(1.1, 0)), "b": mo.wav(mo.clip(0.6, 1))}
# Google's wording (Gemma 4 model card): with a language, the "Best Practices / Audio" ASR prompt; without,
# the instruction of its "Code for processing Audio" example; the clip before the text in both
RULES = ("Follow these specific instructions for formatting the answer:\n* Only output the transcription, with no "
         "newlines.\n* When transcribing numbers, write the digits, i.e. write 1.7 and not one point seven, and "
         "write 3 instead of three.")
INSTRUCTIONS = {None: "Transcribe the following speech segment in its original language. " + RULES,
                "French": "Transcribe the following speech segment in French into French text.\n\n" + RULES,
                # the model card's AST prompt, into English, the source language unnamed
                "translate": "Transcribe the following speech segment in its original language, then translate it "
                             "into English.\nWhen formatting the answer, first output the transcription in its "
                             "original language, then one newline, then output the string 'English: ', then the "
                             "translation in English."}
WINDOW = 0.6  # seconds per segment in the windowed tests (the server's is 30 s): clip "a" (1.1 s) gives two


def _api_messages(clip: str, text: str = QUESTION, fmt: str = "wav") -> list[dict]:
    data = base64.b64encode(CLIPS[clip]).decode()
    return [{"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": data, "format": fmt}},
                                         {"type": "text", "text": text}]}]


def _model_messages(clip: str, text: str = QUESTION) -> list[dict]:
    return [{"role": "user", "content": [{"type": "audio", "audio": CLIPS[clip]}, {"type": "text", "text": text}]}]


def _transcribe_messages(clip, language: str | None) -> list[dict]:
    audio = CLIPS[clip] if isinstance(clip, str) else clip
    return [{"role": "user", "content": [{"type": "audio", "audio": audio},
                                         {"type": "text", "text": INSTRUCTIONS[language]}]}]


@pytest.fixture(scope="module")
def model(tmp_path_factory, gl):
    path, _ = mo.make_gemma4_audio_checkpoint(tmp_path_factory.mktemp("gemma4-audio"), vision=False)
    return gl.load(path, context=512)


@pytest.fixture(scope="module")
def refs(model):
    def chat(messages, max_new_tokens=8):
        return model.session().chat(messages, max_new_tokens=max_new_tokens, temperature=0)

    def transcribe(clip, language):  # a transcription runs to the server's max_tokens (or the context's end)
        messages = _transcribe_messages(clip, language)
        audio = messages[0]["content"][0]["audio"]
        ids = model.with_media(model.tokenizer.chat_ids(messages, add_generation_prompt=True), audio=[audio])[0]
        return chat(messages, min(MAX_TOKENS, model.context - len(ids)))

    from gemmalite.audio.decode import load_audio

    a = load_audio(CLIPS["a"])  # the decoded clip, cut as the windowed tests' server cuts it
    cut = int(WINDOW * 16000)

    return {"a": chat(_model_messages("a")), "b": chat(_model_messages("b")),
            "two": chat([{"role": "user", "content": [{"type": "audio", "audio": CLIPS["b"]},
                                                      {"type": "text", "text": "and"},
                                                      {"type": "audio", "audio": CLIPS["a"]}]}]),
            "transcribe_any": transcribe("a", None),
            "transcribe_fr": transcribe("b", "French"),
            "translate": transcribe("a", "translate"),
            "windows": [transcribe(a[:cut], None), transcribe(a[cut:], None)],
            "windows_translated": [transcribe(a[:cut], "translate"), transcribe(a[cut:], "translate")]}


@pytest.fixture(scope="module")
def embedder(tmp_path_factory, gl):
    """The tiny EmbeddingGemma 2 preset with its (tiny) audio and vision towers."""
    from gemmalite.tools.synth_eg2 import synth_eg2

    return gl.load_embedder(synth_eg2("eg2-tiny", tmp_path_factory.mktemp("eg2"), progress=False))


@pytest.fixture(scope="module")
def live(model, refs, embedder):
    from gemmalite.server import build_app
    from gemmalite.server.protocol import Limits

    limits = Limits(max_tokens=MAX_TOKENS, max_audio=2, max_audio_bytes=64 << 10, max_audio_seconds=1.5)
    s = LiveServer(build_app(model, embedder, model_id=MODEL_ID, embedder_id=EMB_ID, api_key=KEY, max_concurrency=4,
                             limits=limits))
    yield s
    s.stop()


def test_chat_with_audio_equals_model(live, refs):
    c = live.client()
    r = c.chat.completions.create(model=MODEL_ID, messages=_api_messages("a"), max_tokens=8, temperature=0)
    assert r.choices[0].message.content == refs["a"]
    r = c.chat.completions.create(model=MODEL_ID, messages=_api_messages("b", fmt="mp3"), max_tokens=8, temperature=0)
    assert r.choices[0].message.content == refs["b"]  # WAV bytes said to be mp3: the bytes decide
    two = [{"role": "user", "content": [_api_messages("b")[0]["content"][0], {"type": "text", "text": "and"},
                                        _api_messages("a")[0]["content"][0]]}]
    r = c.chat.completions.create(model=MODEL_ID, messages=two, max_tokens=8, temperature=0)
    assert r.choices[0].message.content == refs["two"]


def test_transcriptions_equal_model(live, refs):
    c = live.client()
    r = c.audio.transcriptions.create(model=MODEL_ID, file=("a.wav", io.BytesIO(CLIPS["a"]), "audio/wav"))
    assert r.text == refs["transcribe_any"]
    text = c.audio.transcriptions.create(model=MODEL_ID, file=("b.wav", CLIPS["b"]), language="fr",
                                         response_format="text")
    assert text == refs["transcribe_fr"]


def test_capabilities_list_the_audio_limits(live):
    status, _, caps = live.raw("GET", "/v1/capabilities")
    assert status == 200 and caps["audio"] is True
    lim = live.srv.limits
    assert (caps["limits"]["max_audio"], caps["limits"]["max_audio_bytes"], caps["limits"]["max_audio_seconds"]) == \
        (lim.max_audio, lim.max_audio_bytes, lim.max_audio_seconds) == (2, 64 << 10, 1.5)


def test_transcription_formats(live, refs, model):
    """verbose_json (one segment per 30 s window: the whole 1.1 s clip), srt and vtt of the same
    reply; the segment's tokens decode to its text."""
    c = live.client()
    text = refs["transcribe_any"]
    file = ("a.wav", CLIPS["a"], "audio/wav")
    r = c.audio.transcriptions.create(model=MODEL_ID, file=file, response_format="verbose_json",
                                      timestamp_granularities=["segment"])
    assert r.text == text and r.duration == 1.1 and r.language is None
    [seg] = r.segments
    assert (seg.id, seg.start, seg.end, seg.text, seg.seek) == (0, 0.0, 1.1, text, 0)
    assert model.tokenizer.decode(seg.tokens) == text and seg.avg_logprob <= 0
    r = c.audio.transcriptions.create(model=MODEL_ID, file=("b.wav", CLIPS["b"]), language="fr",
                                      response_format="verbose_json")
    assert r.text == refs["transcribe_fr"] and r.language == "french" and r.segments[0].end == 0.6
    srt = c.audio.transcriptions.create(model=MODEL_ID, file=file, response_format="srt")
    assert srt == f"1\n00:00:00,000 --> 00:00:01,100\n{text.strip()}\n\n"
    vtt = c.audio.transcriptions.create(model=MODEL_ID, file=file, response_format="vtt")
    assert vtt == f"WEBVTT\n\n00:00:00.000 --> 00:00:01.100\n{text.strip()}\n\n"


def test_windows_are_segments_and_stream_in_order(live, refs, monkeypatch):
    """A clip longer than the window is transcribed window by window (batched): one segment each,
    the text their replies joined by a space; the stream's deltas join to the same text."""
    from gemmalite.server import transcription

    monkeypatch.setattr(transcription, "WINDOW_S", WINDOW)
    c = live.client()
    file = ("a.wav", CLIPS["a"], "audio/wav")
    want = refs["windows"]
    r = c.audio.transcriptions.create(model=MODEL_ID, file=file, response_format="verbose_json")
    assert [(s.start, s.end, s.text) for s in r.segments] == [(0.0, 0.6, want[0]), (0.6, 1.1, want[1])]
    assert r.text == " ".join(want)
    deltas, done = [], None
    for ev in c.audio.transcriptions.create(model=MODEL_ID, file=file, stream=True):
        if ev.type == "transcript.text.delta":
            deltas.append(ev.delta)
        else:
            assert ev.type == "transcript.text.done" and done is None
            done = ev
    assert "".join(deltas) == done.text == " ".join(want)
    assert done.usage.output_tokens > 0
    r = c.audio.translations.create(model=MODEL_ID, file=file, response_format="verbose_json")
    assert [s.text for s in r.segments] == refs["windows_translated"] and r.language == "english"


def test_translations_equal_model(live, refs):
    """The model card's AST prompt; the translation is what follows the reply's 'English: ' line, or
    (random weights write none) the whole reply, with a warning saying so."""
    from gemmalite.server.transcription import translation_text

    c = live.client()
    raw = c.audio.translations.with_raw_response.create(model=MODEL_ID, file=("a.wav", CLIPS["a"]))
    assert raw.parse().text == refs["translate"]
    assert "no 'English: ' line" in raw.headers["x-gemmalite-warning"]
    assert c.audio.translations.create(model=MODEL_ID, file=("a.wav", CLIPS["a"]), response_format="text") \
        == refs["translate"]
    assert translation_text("Bonjour le monde.\nEnglish: Hello world.") == "Hello world."
    from openai import BadRequestError

    with pytest.raises(BadRequestError) as e:
        c.audio.translations.create(model=MODEL_ID, file=("a.wav", CLIPS["a"]), extra_body={"language": "fr"})
    assert e.value.body["param"] == "language"


def test_embeddings_with_audio_parts(live, embedder):
    """The extension: an input that is a list of content parts is one input of those parts; the
    vectors are `Embedder.embed`'s of the same parts, usage counts the clips' soft tokens."""
    part = _api_messages("b")[0]["content"][0]
    body = {"model": EMB_ID, "encoding_format": "float",
            "input": [[{"type": "text", "text": "a dog barking"}, part], "plain text", [part]]}
    status, _, r = live.raw("POST", "/v1/embeddings", body)
    assert status == 200, r
    inputs = [["a dog barking", {"audio": CLIPS["b"]}], "plain text", [{"audio": CLIPS["b"]}]]
    want = embedder.embed(inputs)
    assert (np.array([d["embedding"] for d in r["data"]], np.float32) == want).all()
    assert r["usage"]["prompt_tokens"] == sum(len(x) for x in embedder.prepare(inputs)[0])
    bad = dict(body, input=[[{"type": "input_audio", "input_audio": {"data": base64.b64encode(b"junk").decode()}}]])
    status, _, r = live.raw("POST", "/v1/embeddings", bad)
    assert status == 400 and r["error"]["code"] == "invalid_audio" and r["error"]["param"], r


def _audio_msg(input_audio) -> dict:
    return {"model": MODEL_ID, "max_tokens": 2,
            "messages": [{"role": "user", "content": [{"type": "input_audio", "input_audio": input_audio}]}]}


def test_bad_audio_answers_400_and_server_keeps_serving(live, refs):
    def b64(data: bytes) -> str:
        return base64.b64encode(data).decode()

    wav = CLIPS["a"]
    long_clip = mo.wav(mo.clip(1.8, 3))  # 1.8 s > the server's 1.5 s, refused from the header
    bad = [
        (_audio_msg({"data": "https://example.com/a.wav", "format": "wav"}), "audio_url_not_supported"),
        (_audio_msg({"data": "@@not base64@@", "format": "wav"}), "invalid_audio"),
        (_audio_msg({"data": "", "format": "wav"}), "invalid_audio"),
        (_audio_msg({"data": b64(b"this is not a sound at all"), "format": "wav"}), "invalid_audio"),
        (_audio_msg({"data": b64(wav[: len(wav) // 2]), "format": "wav"}), "invalid_audio"),  # truncated WAV
        (_audio_msg({"data": b64(b"RIFF\x00\x00\x00\x00WAVEjunk"), "format": "wav"}), "invalid_audio"),
        (_audio_msg({"data": b64(long_clip), "format": "wav"}), "invalid_audio"),
        (_audio_msg({"data": b64(wav), "format": "aiff"}), "invalid_audio"),
        (_audio_msg({"data": b64(b"RIFF" + b"\0" * (65 << 10)), "format": "wav"}), "audio_too_large"),
        (_audio_msg("raw"), "invalid_audio"),
        ({"model": MODEL_ID, "messages": [{"role": "user", "content": [
            {"type": "input_audio", "input_audio": {"data": b64(wav), "format": "wav"}}] * 3}]}, None),
    ]
    for body, code in bad:
        status, _, resp = live.raw("POST", "/v1/chat/completions", body)
        assert status == 400, (str(body)[:200], resp)
        assert resp["error"]["param"] and (code is None or resp["error"]["code"] == code), resp
    assert "1.5 s allowed" in live.raw("POST", "/v1/chat/completions", bad[6][0])[2]["error"]["message"]
    c = live.client()
    from openai import BadRequestError

    for kw, param in [(dict(file=("x.wav", b"not audio")), "file"),
                      (dict(file=("x.wav", wav), response_format="xml"), "response_format"),
                      (dict(file=("x.wav", wav), response_format="srt", stream=True), "stream"),
                      (dict(file=("x.wav", wav), timestamp_granularities=["segment"]), "timestamp_granularities[]"),
                      (dict(file=("x.wav", wav), language="english!"), "language"),
                      (dict(file=("x.wav", wav), timestamp_granularities=["word"]), "timestamp_granularities[]")]:
        with pytest.raises(BadRequestError) as e:
            c.audio.transcriptions.create(model=MODEL_ID, **kw)
        assert e.value.body["param"] == param, e.value.body
    assert live.raw("GET", "/health", key=None)[0] == 200
    r = c.chat.completions.create(model=MODEL_ID, messages=_api_messages("a"), max_tokens=8, temperature=0)
    assert r.choices[0].message.content == refs["a"]


def test_transcription_reply_is_capped_by_the_clip_length(model):
    """Without a max_tokens cap on the server, a transcription still cannot run to the context's
    end: its reply is capped at 12 tokens a second of its clip, plus 32 (docs/server-operations.md);
    the clip's length counted by its audio tokens (25 a second), so within a token of the seconds'."""
    import math

    from gemmalite.server import build_app

    s = LiveServer(build_app(model, model_id=MODEL_ID, api_key=KEY))
    caps, submit = [], s.srv.scheduler.submit
    s.srv.scheduler.submit = lambda seq: (caps.append(seq.max_tokens), submit(seq))[1]
    try:
        s.client().audio.transcriptions.create(model=MODEL_ID, file=("a.wav", CLIPS["a"], "audio/wav"))
    finally:
        s.stop()
    [cap] = caps
    assert abs(cap - (math.ceil(1.1 * 12) + 32)) <= 1 and cap < s.srv.limits.default_max_tokens, cap
