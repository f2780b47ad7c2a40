"""`tokenizer.CachedBPE` (Gemma's tokenizer.json from arrays in the cache folder) gives the ids
and text of the `tokenizers` library, on the real Gemma 4 vocabulary and fuzzed text."""
from __future__ import annotations

import json
import shutil

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer as HFTokenizer

from gemmalite.tokenizer import CachedBPE, cached_bpe, load_tokenizer_folder

TEXTS = [
    "", "a", " ", "  ", "\n", "\n\n\n", "Hello world", "  lead and  double  spaces  ",
    "The capital of France is Paris.\n\nIt has 2,140,526 inhabitants (2019).",
    "tabs\tand\t\tmore\ttabs\r\nwindows line\r\n",
    "日本語のテキストと中文，한국어, Ελληνικά, русский, עברית, العربية",
    "emoji 😀👍🏽 🇫🇷 family 👨‍👩‍👧 and rare 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 \U0010fffd \x00\x01\x7f",
    "<bos>hi<|turn>user\nHello<turn|>\n<|turn>model\n<|\"|>quoted<|\"|><|tool_call>x<tool_call|>",
    "<bo s> <|turn <turn|>> <<|turn>> <|image|><|image|>", "def f(x):\n    return x ** 2  # comment\n",
    "\u2581already▁spaced", "a" * 300, "ab " * 200, "\n \n  \n\n\t\n",
]


@pytest.fixture(scope="module")
def gemma4(tmp_path_factory):
    import eg2_oracle as o

    src = o.gemma4_tokenizer_dir() / "tokenizer.json"
    path = tmp_path_factory.mktemp("g4") / "tokenizer.json"
    shutil.copy(src, path)
    fast = cached_bpe(path)
    assert isinstance(fast, CachedBPE)
    return fast, HFTokenizer.from_file(str(path)), path


def _same(fast, ref, text):
    for special in (True, False):
        ids = ref.encode(text, add_special_tokens=special).ids
        assert fast.encode(text, add_special_tokens=special).ids == ids, (text, special)
        for skip in (True, False):
            assert fast.decode(ids, skip_special_tokens=skip) == ref.decode(ids, skip_special_tokens=skip), (text, skip)


def test_texts_give_the_ids_and_text_of_tokenizers(gemma4):
    fast, ref, _ = gemma4
    for text in TEXTS:
        _same(fast, ref, text)
    assert fast.get_vocab_size() == ref.get_vocab_size() == 262144
    for tok in ("<bos>", "<eos>", "<|turn>", "▁the", "<0x41>", "no such token"):
        assert fast.token_to_id(tok) == ref.token_to_id(tok)
    for i in (0, 2, 107, 1000, 262143, 262144):
        assert fast.id_to_token(i) == ref.id_to_token(i)


_PIECES = st.sampled_from(["<bos>", "<eos>", "<|turn>", "<turn|>", "<|\"|>", "<|tool_call>", "\n", "\n\n", " ", "  ", "\t",
                           "▁", "<0x41>", "the", " the", "ing", "😀", "é", "e\u0301", "\r\n", "<", "|", ">", "<|image|>"])
_TEXT = st.lists(st.one_of(st.text(max_size=12), _PIECES), max_size=25).map("".join)


@settings(max_examples=300)
@given(text=_TEXT)
def test_fuzzed_text_gives_the_ids_of_tokenizers(gemma4, text):
    fast, ref, _ = gemma4
    _same(fast, ref, text)


@settings(max_examples=200)
@given(ids=st.lists(st.one_of(st.integers(0, 400), st.integers(0, 262143), st.integers(230, 300)), max_size=30))
def test_any_ids_decode_like_tokenizers(gemma4, ids):
    """Byte tokens (ids 238-493) in valid and invalid runs, specials, anything."""
    fast, ref, _ = gemma4
    for skip in (True, False):
        assert fast.decode(ids, skip_special_tokens=skip) == ref.decode(ids, skip_special_tokens=skip)


def test_cache_is_written_once_outside_the_package(gemma4, monkeypatch, tmp_path):
    _, _, path = gemma4
    monkeypatch.setenv("GEMMALITE_CACHE_DIR", str(tmp_path / "cache"))
    first = cached_bpe(path)
    files = sorted(p.name for p in (tmp_path / "cache" / "tokenizers").iterdir())
    assert len(files) == 2 and files[0].endswith(".bpe.json") and files[1].endswith(".bpe.npz")
    again = cached_bpe(path)
    assert again is not None and again.encode(TEXTS[8]).ids == first.encode(TEXTS[8]).ids
    path.touch()  # a changed file (time stamp) gets a cache of its own
    cached_bpe(path)
    assert len(list((tmp_path / "cache" / "tokenizers").iterdir())) == 4


def test_other_layouts_load_with_tokenizers(gemma4, tmp_path):
    """A tokenizer.json that CachedBPE does not reproduce (here: another normalizer) is left to
    `tokenizers`, and the loaded Tokenizer still tokenizes."""
    _, _, path = gemma4
    conf = json.loads(path.read_text(encoding="utf-8"))
    conf["normalizer"] = {"type": "Lowercase"}
    (tmp_path / "tokenizer.json").write_text(json.dumps(conf), encoding="utf-8")
    assert cached_bpe(tmp_path / "tokenizer.json") is None
    assert cached_bpe(tmp_path / "tokenizer.json") is None  # the verdict is cached too
    tok = load_tokenizer_folder(tmp_path)
    assert isinstance(tok.tk, HFTokenizer)
    assert tok.encode("Hello World") == [2] + HFTokenizer.from_str(json.dumps(conf)).encode("Hello World").ids[1:]


def test_folder_loads_gemma4_through_the_cache(gemma4, tmp_path):
    _, ref, path = gemma4
    shutil.copy(path, tmp_path / "tokenizer.json")
    tok = load_tokenizer_folder(tmp_path)
    assert isinstance(tok.tk, CachedBPE)
    assert tok.encode(TEXTS[8]) == ref.encode(TEXTS[8]).ids
    assert tok.bos_id == 2 and not tok.prepends_bos  # the post-processor adds <bos>
    stream = tok.stream()
    ids = ref.encode(TEXTS[11], add_special_tokens=False).ids
    assert "".join(stream.push(i) for i in ids) + stream.flush() == ref.decode(ids)
