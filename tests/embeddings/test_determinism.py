"""A sequence's embedding is bit for bit the same whatever it is packed with (alone, in a batch
of 32, in another order), whatever the thread count (1, 2, 4) and whether the checkpoint was
converted or quantized on load: float32, int8 and int4, on widths that take the integer tiles
(multiples of 256) and widths that do not (the row kernels)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("transformers")
import eg2_oracle as o  # noqa: E402

from gemmalite import load_embedder  # noqa: E402

QUANTS = [None, "int8", "int4"]
WIDE = dict(hidden_size=256, intermediate_size=512, head_dim=64, global_head_dim=64, hidden_size_per_layer_input=16)
NARROW = dict(hidden_size=96, intermediate_size=160, head_dim=24, global_head_dim=48, hidden_size_per_layer_input=8)


def _seqs() -> list[np.ndarray]:
    rng = np.random.RandomState(4)
    lengths = [1, 2, 3, 4, 5, *rng.randint(1, 90, size=19)]  # the few-row sizes included
    return [rng.randint(5, 512, size=n) for n in lengths]


@pytest.fixture(scope="module", params=["wide", "narrow"])
def ckpt(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(f"eg2_{request.param}")
    o.make_eg2_checkpoint(path, seed=2, gentle=True, tokenizer=None, **(WIDE if request.param == "wide" else NARROW))
    return path


def _vectors(emb, seqs) -> dict[str, np.ndarray]:
    return {"alone": np.concatenate([emb.embed_ids([s]) for s in seqs]),
            "batch": emb.embed_ids(seqs, batch_size=32),
            "reversed": emb.embed_ids(seqs[::-1], batch_size=7)[::-1]}


@pytest.mark.parametrize("quant", QUANTS)
def test_alone_equals_any_batch_on_any_threads(ckpt, quant):
    seqs = _seqs()
    ref = None
    for threads in (1, 2):
        for name, got in _vectors(load_embedder(ckpt, quant=quant, threads=threads), seqs).items():
            if ref is None:
                ref = got
            np.testing.assert_array_equal(got, ref, err_msg=f"{threads} threads, {name}")


@pytest.mark.parametrize("quant", ["int8", "int4"])
def test_converted_equals_quantized_on_load(ckpt, tmp_path, quant):
    from gemmalite.tools.convert import convert

    seqs = _seqs()
    out = convert(ckpt, tmp_path / quant, quant, progress=False)
    np.testing.assert_array_equal(load_embedder(out, threads=1).embed_ids(seqs, batch_size=32),
                                  load_embedder(ckpt, quant=quant, threads=2).embed_ids(seqs, batch_size=5))


CHILD = """
import json, sys
import numpy as np
from gemmalite import load_embedder
path, seqs, out = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
res = {}
for quant in (None, "int8", "int4"):
    for threads in (1, 2, 4):
        emb = load_embedder(path, quant=quant, threads=threads)
        res[f"{quant}-{threads}"] = emb.embed_ids(seqs, batch_size=32)
        res[f"{quant}-{threads}-alone"] = np.concatenate([emb.embed_ids([s]) for s in seqs])
np.savez(out, **res)
"""


def test_four_threads(ckpt, tmp_path):
    """In a process whose thread pool has 4 threads (more than this machine may have CPUs: the
    numbers cannot depend on how the work is shared), 1, 2 and 4 threads give the same vectors,
    alone and in a batch."""
    seqs = _seqs()
    env = {**os.environ, "NUMBA_NUM_THREADS": "4"}
    root = Path(__file__).resolve().parents[2]
    subprocess.run([sys.executable, "-c", CHILD, str(ckpt), json.dumps([s.tolist() for s in seqs]),
                    str(tmp_path / "v.npz")], check=True, env=env, cwd=root)
    got = np.load(tmp_path / "v.npz")
    assert len(got.files) == 18
    for quant in QUANTS:
        for key in (f"{quant}-{t}{alone}" for t in (1, 2, 4) for alone in ("", "-alone")):
            np.testing.assert_array_equal(got[key], got[f"{quant}-1"], err_msg=key)



RUNS = """
import numpy as np
from gemmalite import load, load_embedder


def run(eg2_dirs, dec_dir, order):
    rng = np.random.RandomState(4)
    seqs = [rng.randint(5, 512, size=n) for n in (1, 2, 3, 4, 5, 17, 40, 90)]
    prompt = rng.randint(5, 500, size=130)  # past a key block of the prefill and of the decode attention
    res = {}

    def embed():
        for i, path in enumerate(eg2_dirs):
            for quant in (None, "int8"):
                emb = load_embedder(path, quant=quant, threads=2)
                res[f"embed{i}-{quant}"] = emb.embed_ids(seqs, batch_size=32)
                res[f"embed{i}-{quant}-alone"] = np.concatenate([emb.embed_ids([s]) for s in seqs])

    def decode():
        for quant in (None, "int8"):
            m = load(dec_dir, quant=quant, threads=2, context=192)
            state = m.new_state()
            rows = [m.engine.logits(m.engine.prefill(state, prompt))[0]]
            for tok in (7, 300, 41, 9):  # decode steps: the sliding-ring and full-context attention kernels
                rows.append(m.engine.decode_step(state, tok))
            res[f"decode-{quant}"] = np.stack(rows)

    for part in order.split(","):
        {"embed": embed, "decode": decode}[part]()
    return res
"""
ACROSS = RUNS + """
import sys
np.savez(sys.argv[3], **run(sys.argv[1].split(","), sys.argv[2], sys.argv[4]))
"""


def test_compiled_equals_cached(tmp_path):
    """numba compiles a parallel kernel's body twice (once alone, once linked into the kernel); a
    process that compiles runs the first copy, one that loads numba's disk cache the second
    (`kernels.fdot`). Three processes share a fresh cache folder: the first compiles every kernel,
    the second loads them all, the third too but runs the decoder before the embedder (another call
    history). Float and int8 embeddings (alone and batched, two widths) and decoder logits (prefill
    and decode steps; bfloat16 weights as stored, and int8) are equal bit for bit across the three,
    and to this process's own."""
    from small_checkpoint import write_small_checkpoint

    eg2 = []
    for name, kw in (("wide", WIDE), ("narrow", NARROW)):
        eg2.append(tmp_path / name)
        o.make_eg2_checkpoint(eg2[-1], seed=2, gentle=True, tokenizer=None, **kw)
    dec = write_small_checkpoint(tmp_path / "dec")
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path / "numba")}
    root = Path(__file__).resolve().parents[2]
    runs = {}
    for name, order in (("compiles", "embed,decode"), ("loads", "embed,decode"), ("loads-other-order", "decode,embed")):
        p = subprocess.run([sys.executable, "-c", ACROSS, ",".join(map(str, eg2)), str(dec), str(tmp_path / name),
                            order], env=env, cwd=root, capture_output=True, text=True)
        assert p.returncode == 0, p.stderr[-3000:]
        # gemmalite says so on stderr when a process first compiles a kernel instead of loading it
        assert ("preparing kernels" in p.stderr) == (name == "compiles"), (name, p.stderr[-3000:])
        runs[name] = np.load(tmp_path / f"{name}.npz")
    ref = runs["compiles"]
    assert sorted(ref.files) == sorted([f"embed{i}-{q}{a}" for i in (0, 1) for q in (None, "int8") for a in ("", "-alone")]
                                       + ["decode-None", "decode-int8"])
    ns: dict = {}
    exec(RUNS, ns)
    runs["this process"] = ns["run"](eg2, dec, "embed,decode")
    for name in ("loads", "loads-other-order", "this process"):
        for key in ref.files:
            np.testing.assert_array_equal(runs[name][key], ref[key], err_msg=f"{name}: {key}")
