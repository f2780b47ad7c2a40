"""Chat template and tokenizer parity with transformers (same tokenizer folder for both), and the
single-<bos> rule for the prompt `Model.chat` runs."""
from __future__ import annotations

import pytest

import hf_oracle as H

BOS = 2

SINGLE = [{"role": "user", "content": "What is the capital of France?"}]
MULTI = [
    {"role": "system", "content": "  You are a terse assistant.  "},
    {"role": "user", "content": "Hello there!"},
    {"role": "assistant", "content": "Hi. How can I help?"},
    {"role": "user", "content": "Tell me a story about a cat.\n"},
    {"role": "assistant", "content": "<|channel>thought\nshort one<channel|>Once upon a time, a cat."},
    {"role": "user", "content": [{"type": "text", "text": "And a dog?"}]},
]
NO_SYSTEM_MULTI = [
    {"role": "user", "content": "one"},
    {"role": "assistant", "content": "two"},
    {"role": "user", "content": "three"},
]
TOOLS = [{
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "the city"}},
                       "required": ["city"]},
    },
}]

CONVERSATIONS = {"single": SINGLE, "multi_system": MULTI, "multi": NO_SYSTEM_MULTI}


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("chat_ckpt")
    H.make_gemma4_checkpoint(path, seed=5, tokenizer=True, sliding_window=8)
    return path


@pytest.fixture(scope="module")
def hf_tok(folder):
    return H.load_hf_tokenizer(folder)


@pytest.fixture(scope="module")
def model(folder, gl):
    return gl.load(folder)


def test_template_shipped_with_the_tests():
    text = H.CHAT_TEMPLATE_PATH.read_text()
    assert "<|turn>" in text and "enable_thinking" in text


@pytest.mark.parametrize("conv", list(CONVERSATIONS))
@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("kwargs", [{}, {"enable_thinking": True}, {"enable_thinking": False}],
                         ids=["default", "thinking", "no_thinking"])
def test_chat_template_text_matches_transformers(model, hf_tok, conv, add_generation_prompt, kwargs):
    msgs = CONVERSATIONS[conv]
    ours = model.tokenizer.apply_chat_template(msgs, add_generation_prompt=add_generation_prompt, **kwargs)
    ref = hf_tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs)
    assert ours == ref


def test_chat_template_with_tools_matches_transformers(model, hf_tok):
    ours = model.tokenizer.apply_chat_template(SINGLE, add_generation_prompt=True, tools=TOOLS)
    ref = hf_tok.apply_chat_template(SINGLE, tokenize=False, add_generation_prompt=True, tools=TOOLS)
    assert "<|tool>" in ref
    assert ours == ref


def test_known_rendering(model):
    """Pin the Gemma 4 format itself (not only agreement with transformers)."""
    text = model.tokenizer.apply_chat_template(SINGLE, add_generation_prompt=True)
    assert text == ("<bos><|turn>user\nWhat is the capital of France?<turn|>\n<|turn>model\n"
                    "<|channel>thought\n<channel|>")
    text = model.tokenizer.apply_chat_template(SINGLE, add_generation_prompt=True, enable_thinking=True)
    assert text.startswith("<bos><|turn>system\n<|think|>\n<turn|>\n") and text.endswith("<|turn>model\n")


@pytest.mark.parametrize("text", ["Hello world!", "The capital of France is Paris.\nNew line", "é 日本 tabs\tand  spaces",
                                  "<|turn>user\nhi<turn|>\n"])
def test_encode_decode_match_transformers(model, hf_tok, text):
    tok = model.tokenizer
    assert tok.encode(text) == hf_tok(text).input_ids
    assert tok.encode(text, add_special_tokens=False) == hf_tok(text, add_special_tokens=False).input_ids
    ids = tok.encode(text)
    assert ids[0] == BOS and ids.count(BOS) == 1
    assert tok.decode(ids[1:]) == hf_tok.decode(ids[1:])
    assert tok.decode(ids[1:]) == text


@pytest.mark.parametrize("conv", list(CONVERSATIONS))
def test_rendered_prompt_ids_have_one_bos(model, hf_tok, conv):
    """The template writes <bos>; tokenising the rendered text must not add a second one."""
    msgs = CONVERSATIONS[conv]
    ref_ids = hf_tok.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True)
    ref_ids = ref_ids["input_ids"] if isinstance(ref_ids, dict) or hasattr(ref_ids, "keys") else ref_ids
    text = model.tokenizer.apply_chat_template(msgs, add_generation_prompt=True)
    ids = model.tokenizer.encode(text, add_special_tokens=False)
    assert ids == list(ref_ids)
    assert ids[0] == BOS and ids.count(BOS) == 1


def test_chat_prompt_has_exactly_one_bos(folder, gl):
    """`Model.chat` runs the single-<bos> prompt: its reply equals greedy generation from the
    single-<bos> ids and (where they differ) not the one from a doubled <bos>."""
    m = gl.load(folder)
    tok = m.tokenizer
    msgs = MULTI
    ids = tok.encode(tok.apply_chat_template(msgs, add_generation_prompt=True), add_special_tokens=False)
    assert ids.count(BOS) == 1
    n = 12
    turn_end = tok.encode("<turn|>", add_special_tokens=False)
    single = m.generate_tokens(ids, max_new_tokens=n, temperature=0.0, stop=turn_end)
    double = m.generate_tokens([BOS] + ids, max_new_tokens=n, temperature=0.0, stop=turn_end)
    reply = m.chat(msgs, max_new_tokens=n, temperature=0.0)
    expected = {tok.decode(single), tok.decode(single, skip_special_tokens=True)}
    assert reply in expected, f"chat reply {reply!r} is not the greedy continuation of the single-<bos> prompt"
    if single != double:
        assert reply not in {tok.decode(double), tok.decode(double, skip_special_tokens=True)}
