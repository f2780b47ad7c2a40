"""`Model.chat` takes the content parts the server takes (OpenAI's ``image_url`` with a data URL,
``input_audio``) beside its own (``image`` / ``audio``), and refuses a part it does not know,
naming it, instead of dropping it. The oracle of an OpenAI-shaped part is the same picture or clip
given in the Python shape (the path the Python API has always had), on a tiny random Gemma 4 with
its toy towers."""
from __future__ import annotations

import base64
import io

import numpy as np
import pytest

from gemmalite.errors import ConfigError, InputError


@pytest.fixture(scope="module")
def model(tmp_path_factory, gl):
    from gemmalite.tools.synth import synth

    return gl.load(synth("tiny", tmp_path_factory.mktemp("tiny-av"), vision=True, audio=True, progress=False),
                   context=512)


@pytest.fixture(scope="module")
def text_model(tmp_path_factory, gl):
    from gemmalite.tools.synth import synth

    return gl.load(synth("tiny", tmp_path_factory.mktemp("tiny"), progress=False), context=256)


def _png() -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(np.random.RandomState(0).randint(0, 256, (40, 60, 3), dtype=np.uint8)).save(buf, "PNG")
    return buf.getvalue()


def _wav() -> bytes:
    import soundfile as sf

    buf = io.BytesIO()
    sf.write(buf, (np.sin(np.arange(8000) / 5.0) * 0.5).astype(np.float32), 16000, subtype="PCM_16", format="WAV")
    return buf.getvalue()


def _chat(model, part: dict) -> str:
    model.reset_chat()
    return model.chat([{"role": "user", "content": [part, {"type": "text", "text": "What is this?"}]}],
                      max_new_tokens=6, temperature=0)


def test_openai_parts_equal_the_python_parts(model):
    png, wav = _png(), _wav()
    url = "data:image/png;base64," + base64.b64encode(png).decode()
    assert _chat(model, {"type": "image_url", "image_url": {"url": url}}) == _chat(model, {"type": "image", "image": png})
    audio = {"type": "input_audio", "input_audio": {"data": base64.b64encode(wav).decode(), "format": "wav"}}
    assert _chat(model, audio) == _chat(model, {"type": "audio", "audio": wav})


def test_an_audio_part_is_never_dropped(text_model):
    """A model without an audio tower refuses the clip (it used to answer as if there were none)."""
    audio = {"type": "input_audio", "input_audio": {"data": base64.b64encode(_wav()).decode(), "format": "wav"}}
    with pytest.raises(ConfigError, match="audio"):
        _chat(text_model, audio)


@pytest.mark.parametrize("part, match", [
    ({"type": "video", "video": "clip.mp4"}, "'video'"),
    ({"type": "file", "file": {"file_id": "x"}}, "'file'"),
    ({"type": "input_text", "text": "hi"}, "'input_text'"),
    ({"type": "text", "text": 3}, "text"),
    ({"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}, "not fetched"),
    ({"type": "image_url", "image_url": {"url": "data:image/png;base64,@@"}}, "base64"),
    ({"type": "input_audio", "input_audio": {"data": base64.b64encode(b"not a sound").decode()}}, "audio"),
])
def test_unknown_or_bad_parts_raise_naming_them(text_model, part, match):
    with pytest.raises(InputError, match=match) as e:
        _chat(text_model, part)
    assert "messages[0]['content'][0]" in str(e.value)
