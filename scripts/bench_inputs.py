#!/usr/bin/env python3
"""Make the inputs of bench_all.py's E2B and EmbeddingGemma 2 rows once, in one folder (random
weights of the real shapes; ~45 GB of disk while the bf16 GGUF exists, ~40 GB after). Each step
runs only when its output is missing, so a rerun finishes what an interrupted one left:

    e2b/            gemmalite synth --preset e2b           (Gemma 4 E2B, vision + audio towers)
    e2b-int8/       gemmalite convert --quant int8 e2b
    e2b-int4/       gemmalite convert --quant int4 e2b
    e2b-assistant/  gemmalite synth --preset e2b-assistant (the MTP drafter)
    e2b-gguf/       e2b-Q8_0.gguf, e2b-Q4_0.gguf: llama.cpp's convert_hf_to_gguf.py --outtype bf16,
                    then llama-quantize to Q8_0 and Q4_0 (llama.cpp's own recipes; the bf16 GGUF goes)
    eg2/            gemmalite synth --preset eg2           (EmbeddingGemma 2, image + audio towers)
    eg2-int8/       gemmalite convert --quant int8 eg2

    nice -n 10 python scripts/bench_inputs.py [--synth DIR] [--llama-cpp TREE] [--llama-bin DIR]

``--llama-cpp``: a llama.cpp source tree holding convert_hf_to_gguf.py and its gguf-py (default
$GEMMALITE_LLAMA_CPP; .ci/run fetches the pinned one); ``--llama-bin``: the folder of the built
llama-quantize (default $GEMMALITE_LLAMA_BIN, see scripts/README.md). Writes OUT/README.txt.
Run by hand, never in CI.
"""
from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
from pathlib import Path

STEPS = [  # (folder, what it is, command with {synth} / {py})
    ("e2b", "Gemma 4 E2B, real shapes, random bf16 weights, with its vision and audio towers",
     "gemmalite synth --preset e2b {synth}/e2b"),
    ("e2b-int8", "e2b converted to gemmalite's int8", "gemmalite convert --quant int8 {synth}/e2b {synth}/e2b-int8"),
    ("e2b-int4", "e2b converted to gemmalite's int4", "gemmalite convert --quant int4 {synth}/e2b {synth}/e2b-int4"),
    ("e2b-assistant", "an MTP drafter of google/gemma-4-E2B-it-assistant's shape, random weights",
     "gemmalite synth --preset e2b-assistant {synth}/e2b-assistant"),
    ("eg2", "EmbeddingGemma 2, real shapes, random bf16 weights, with its image and audio towers",
     "gemmalite synth --preset eg2 {synth}/eg2"),
    ("eg2-int8", "eg2 converted to gemmalite's int8", "gemmalite convert --quant int8 {synth}/eg2 {synth}/eg2-int8"),
]
GGUF = ("e2b-gguf", "llama.cpp GGUFs of e2b (text model): e2b-Q8_0.gguf and e2b-Q4_0.gguf, both quantized by "
        "llama-quantize from one bf16 GGUF written by llama.cpp's convert_hf_to_gguf.py (deleted after)")


def sh(cmd: str, env: dict | None = None) -> None:
    print("[run]", cmd, file=sys.stderr, flush=True)
    subprocess.run(shlex.split(cmd), check=True, env=env)


def make_ggufs(synth: Path, tree: Path, bin_dir: Path) -> list[str]:
    """bf16 GGUF by llama.cpp's converter, then Q8_0 and Q4_0 by llama-quantize; each written under a
    temporary name and renamed when complete. Returns the commands."""
    out = synth / "e2b-gguf"
    out.mkdir(exist_ok=True)
    bf16 = out / "e2b-bf16.gguf"
    conv = (f"{sys.executable} {tree / 'convert_hf_to_gguf.py'} {synth / 'e2b'} --outtype bf16 "
            f"--outfile {bf16}.tmp")
    quant = {k: f"{bin_dir / 'llama-quantize'} {bf16} {out / f'e2b-{k}.gguf'}.tmp {k}" for k in ("Q8_0", "Q4_0")}
    todo = [k for k in quant if not (out / f"e2b-{k}.gguf").exists()]
    if todo and not bf16.exists():
        env = {k: v for k, v in os.environ.items() if k != "NO_LOCAL_GGUF"}  # the converter's own gguf-py
        sh(conv, env)
        Path(f"{bf16}.tmp").rename(bf16)
    for k in todo:
        sh(quant[k])
        Path(f"{out / f'e2b-{k}.gguf'}.tmp").rename(out / f"e2b-{k}.gguf")
    if bf16.exists():
        bf16.unlink()
    return [conv.replace(".tmp", ""), *(q.replace(".tmp", "") for q in quant.values()), f"rm {bf16}"]


def write_block(path: Path, text: str) -> None:
    """Put ``text`` between this script's markers in ``path``, keeping what others wrote around it
    (the folder is shared); written to a temporary name, then renamed."""
    begin, end = "=== bench_inputs.py: begin ===", "=== bench_inputs.py: end ==="
    old = path.read_text() if path.exists() else ""
    head, _, rest = old.partition(begin) if begin in old else (old, "", "")
    tail = rest.partition(end)[2] if rest else ""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(f"{head}{begin}\n{text}\n{end}{tail or chr(10)}")
    tmp.rename(path)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--synth", type=Path, default=Path(os.environ.get("GEMMALITE_SYNTH") or Path.home() / ".cache" / "gemmalite-synth"))
    ap.add_argument("--llama-cpp", type=Path, default=os.environ.get("GEMMALITE_LLAMA_CPP"), metavar="TREE")
    ap.add_argument("--llama-bin", type=Path, default=os.environ.get("GEMMALITE_LLAMA_BIN"), metavar="DIR")
    ap.add_argument("--no-gguf", action="store_true", help="skip the GGUFs (no llama.cpp here)")
    a = ap.parse_args(argv)
    a.synth.mkdir(parents=True, exist_ok=True)
    gl = [sys.executable, "-m", "gemmalite.cli"]
    lines = [f"Inputs of scripts/bench_all.py (gemmalite's benchmark table), made by scripts/bench_inputs.py "
             f"(each line: the folder, what it is, the command). Random weights: speed figures only. Shared: "
             f"read them, never rewrite or delete them.", ""]
    for folder, what, cmd in STEPS:
        cmd = cmd.format(synth=a.synth)
        if not (a.synth / folder / "config.json").exists():
            sh(shlex.join(gl) + " " + cmd.removeprefix("gemmalite "))
        lines += [f"{folder}/: {what}", f"    {cmd}"]
    if not a.no_gguf:
        if not a.llama_cpp or not (a.llama_cpp / "convert_hf_to_gguf.py").exists():
            raise SystemExit("--llama-cpp TREE (or GEMMALITE_LLAMA_CPP): a llama.cpp tree with convert_hf_to_gguf.py")
        if not a.llama_bin or not (a.llama_bin / "llama-quantize").exists():
            raise SystemExit("--llama-bin DIR (or GEMMALITE_LLAMA_BIN): the folder of a built llama-quantize")
        cmds = make_ggufs(a.synth, a.llama_cpp, a.llama_bin)
        lines += [f"{GGUF[0]}/: {GGUF[1]}", *(f"    {c}" for c in cmds)]
    lines += ["", f"Use: python scripts/bench_all.py --llama-bin {a.llama_bin or 'DIR'} (it finds these inputs in "
              "$GEMMALITE_SYNTH, default ~/.cache/gemmalite-synth)."]
    write_block(a.synth / "README.txt", "\n".join(lines))
    print(f"inputs ready in {a.synth} (README.txt says what each is)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
