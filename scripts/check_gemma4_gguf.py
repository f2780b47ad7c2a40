"""Manual check (not in CI): a Gemma 4 checkpoint converted by llama.cpp's own converter loads
with the same numbers as the safetensors it came from.

    python scripts/check_gemma4_gguf.py /path/to/llama.cpp/convert_hf_to_gguf.py

Writes a tiny random Gemma 4 checkpoint (`gemmalite synth --preset tiny`, real Gemma 4
vocabulary), converts it to a BF16 GGUF with the given converter (llama-cpp-python's source
distribution vendors one under vendor/llama.cpp/), and compares tokenization and logits.
BF16 -> BF16 is lossless, so the logits must be identical.
"""
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

import gemmalite
from gemmalite.tools.synth import synth

converter = sys.argv[1]
with tempfile.TemporaryDirectory() as d:
    folder = synth("tiny", Path(d) / "tiny", progress=False)
    gguf = Path(d) / "tiny-bf16.gguf"
    subprocess.run([sys.executable, converter, str(folder), "--outtype", "bf16", "--outfile", str(gguf)], check=True)
    a, b = gemmalite.load(gguf), gemmalite.load(folder)
    text = "The quick brown fox jumps over the lazy dog. Ünïcödé 日本語 🙂"
    ids = b.tokenizer.encode(text)
    assert a.tokenizer.encode(text) == ids, "tokenization differs"
    diff = float(np.abs(a.logits(ids) - b.logits(ids)).max())
    print(f"{len(ids)} tokens, max |logit difference| GGUF vs safetensors: {diff}")
    assert diff == 0.0
