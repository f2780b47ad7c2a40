"""`gemmalite bench` on a tiny random checkpoint: the report's fields and the bytes it counts."""
import json
import struct
import subprocess
import sys

import pytest

from gemmalite.tools.bench import bench
from gemmalite.tools.synth import synth

MATRICES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
            "per_layer_input_gate", "per_layer_projection", "per_layer_model_projection", "embed_tokens")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return synth("tiny", tmp_path_factory.mktemp("tiny"), progress=False)


def _stored_matrices(folder):
    """Shapes of the decode-time matrices, read from the safetensors headers (the tied
    embedding is the LM head; the PLE table itself is a row lookup, not a product)."""
    shapes = []
    for f in sorted(folder.glob("*.safetensors")):
        with open(f, "rb") as fh:
            header = json.loads(fh.read(struct.unpack("<Q", fh.read(8))[0]))
        for name, meta in header.items():
            if name != "__metadata__" and name.removesuffix(".weight").rsplit(".", 1)[-1] in MATRICES:
                shapes.append(meta["shape"])
    return shapes


def test_bench_reports_int8_bytes_per_token(tiny):
    r = bench(str(tiny), prompt_tokens=12, new_tokens=3, runs=1, quant="int8", progress=False)
    # int8: one byte per weight plus a float32 scale per output row, for every matrix
    expected = sum(rows * cols + 4 * rows for rows, cols in _stored_matrices(tiny))
    assert r["weight_bytes_per_token"] == expected
    assert r["prefill_tok_s"] > 0 and r["decode_tok_s"] > 0 and r["peak_rss_bytes"] > 0
    assert r["implied_read_gb_s"] == pytest.approx(expected * r["decode_tok_s"] / 1e9, abs=0.01)


def test_bench_cli_json(tiny):
    out = subprocess.run([sys.executable, "-m", "gemmalite.cli", "bench", str(tiny), "--json", "--runs", "1",
                          "--prompt-tokens", "8", "--new-tokens", "2", "--threads", "1"],
                         capture_output=True, text=True, check=True)
    r = json.loads(out.stdout)
    for key in ("load_s", "prefill_tok_s", "decode_tok_s", "peak_rss_bytes", "weight_bytes_per_token"):
        assert r[key] > 0, key
    assert r["threads"] == 1 and r["prompt_tokens"] == 8 and r["new_tokens"] == 2
