#!/usr/bin/env python3
r"""gemmalite against transformers and llama.cpp on one checkpoint, in one run. Run by hand, never in CI.

Same checkpoint, same prompt (``--prompt-tokens`` random ids drawn exactly as ``gemmalite bench`` draws them:
BOS + rng(seed 0) ids >= 1000), same thread count. Each runtime runs in its own process (so each peak RSS is its
own), and with ``--rounds R`` the runtimes run interleaved R times (A B C A B C ...), medians reported:

  gemmalite f32 / int8 / int4   ``gemmalite bench --json [--quant ...]``
  transformers bf16 (f32)       AutoModelForCausalLM + ``generate`` (greedy); prefill = prompt / time(generate 1),
                                decode = (N-1) / (time(generate N) - time(generate 1))
  llama.cpp Q8_0 / Q4_0         llama-cpp-python ``Llama(n_ctx=512, n_batch=512)``; prefill = ``eval(prompt)``
                                after ``reset()``, decode = N single-token ``eval`` calls with greedy argmax;
                                or ``--llama-bench BIN`` (llama.cpp's own benchmark: ``-p P -n 0`` for prefill,
                                ``-p 0 -n N -d P`` for decode after P tokens; peak RSS of its processes), or
                                ``--llama-server BIN`` (the server's own timings)
  bandwidth                     scripts/bandwidth_probe.py (numba parallel sum over 2 GiB)

It prints prefill/decode tok/s, load s, peak RSS, weight GB read per decoded token and the fraction of the
bandwidth bound (bandwidth / bytes per token) each decode reaches, plus gemmalite's ratios to its peers, and
writes everything to ``--out`` as JSON. The machine may be shared: each measurement records how many cores other
processes kept busy meanwhile (``others``, from /proc/stat less our children's CPU time), rounds above
``--max-others`` are left out of the medians when cleaner ones exist, and ``--wait-idle S`` waits up to S seconds
for a quiet moment before each measurement.

GGUFs are converted once and cached in MODEL/gguf/ (``--gguf-dir``; ``scripts/bench_inputs.py`` makes them with
the llama-quantize binary instead): llama.cpp's convert_hf_to_gguf.py, from the llama-cpp-python
source distribution (``pip download --no-binary :all:`` into the temporary folder's lcpp_src when absent), writes Q8_0 directly
(``--outtype q8_0``); Q4_0 is converted to a bf16 GGUF, then ``llama_cpp.llama_model_quantize`` with
LLAMA_FTYPE_MOSTLY_Q4_0 (what ``llama-quantize in.gguf Q4_0`` does; the wheel ships no binary), and the bf16
GGUF is deleted (llama.cpp's own Q4_0 recipe: the tied embedding/LM head and the per-layer embedding table
become Q6_K). llama.cpp needs one vocabulary entry per embedding row, so when the checkpoint's tokenizer is
smaller than ``vocab_size`` (synthetic checkpoints with the byte-level fallback tokenizer) the converter reads
a copy of the folder (symlinked weights) whose tokenizer.json is padded with filler tokens.

Packages (pip): llama-cpp-python==0.3.36, transformers>=5 and torch (CPU), numba, numpy; the converter also
imports torch, transformers (AutoTokenizer), numpy and its vendored gguf-py; sentencepiece and protobuf are
only needed for SentencePiece checkpoints. Example (E2B: ~8 min once for the GGUFs, then ~5 min a round):

    python scripts/compare_peers.py --model MODEL --new-tokens 32 --runs 2 --rounds 3 \
        --wait-idle 300 --out peers.json
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
LCPP_VERSION = "0.3.36"


def prompt_ids(model: Path, n: int, seed: int = 0) -> list[int]:
    """The prompt ``gemmalite bench`` uses: BOS then ids drawn from [1000, vocab)."""
    cfg = json.loads((model / "config.json").read_text())
    text = cfg.get("text_config") or cfg
    vocab, bos = text["vocab_size"], text.get("bos_token_id") or 2
    rng = np.random.default_rng(seed)
    return [bos, *rng.integers(1000 if vocab > 2000 else 0, vocab, n - 1).tolist()]


def peak_rss() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


# ---------------------------------------------------------------- workers (each runs in its own process)

def hf_worker(a) -> dict:
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    transformers.logging.set_verbosity_error()
    torch.set_num_threads(a.threads)
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype={"bf16": torch.bfloat16, "f32": torch.float32}[a.dtype])
    model.eval()
    load_s = time.perf_counter() - t0
    prompt = prompt_ids(Path(a.model), a.prompt_tokens)

    def generate(ids: list[int], n: int) -> float:
        x = torch.tensor([ids])
        t = time.perf_counter()  # min_new_tokens: random weights must not stop early at an EOS
        out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, min_new_tokens=n,
                             do_sample=False, pad_token_id=0)
        dt = time.perf_counter() - t
        assert out.shape[1] == len(ids) + n, out.shape
        return dt

    with torch.inference_mode():
        generate(prompt, 2)  # warm-up on the whole prompt: its table rows are paged in before timing
        first, full = [], []
        for _ in range(a.runs):
            first.append(generate(prompt, 1))
            full.append(generate(prompt, a.new_tokens))
    t1, tn = statistics.median(first), statistics.median(full)
    per_token = sum(p.numel() * p.element_size() for n, p in model.named_parameters()
                    if "embed_tokens_per_layer" not in n)  # a row lookup; the tied embedding is the LM head
    return {"class": type(model).__name__, "load_s": load_s, "prefill_tok_s": a.prompt_tokens / t1,
            "decode_tok_s": (a.new_tokens - 1) / (tn - t1), "peak_rss_bytes": peak_rss(),
            "weight_bytes_per_token": per_token, "torch": torch.__version__, "transformers": transformers.__version__}


def llama_open(gguf: str, tokens: int, threads: int):
    """llama-cpp-python's ``Llama`` on ``gguf`` with room for ``tokens`` (prompt + new), batch 512."""
    from llama_cpp import Llama

    return Llama(gguf, n_ctx=max(512, tokens + 8), n_threads=threads, n_threads_batch=threads, n_batch=512,
                 verbose=False)


def llama_run(llm, ids: list[int], n: int) -> tuple[float, float]:
    """Seconds of ``eval(ids)`` after ``reset()`` (with the argmax of its last logits) and of ``n``
    single-token ``eval`` calls with greedy argmax."""
    from llama_cpp import llama_cpp

    n_vocab = llm.n_vocab()

    def argmax() -> int:
        logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(n_vocab,))
        return int(np.argmax(logits))

    llm.reset()
    t0 = time.perf_counter()
    llm.eval(ids)
    tok = argmax()
    t1 = time.perf_counter()
    for _ in range(n):
        llm.eval([tok])
        tok = argmax()
    return t1 - t0, time.perf_counter() - t1


def llama_worker(a) -> dict:
    from llama_cpp import llama_cpp

    t0 = time.perf_counter()
    llm = llama_open(a.gguf, a.prompt_tokens + a.new_tokens, a.threads)
    load_s = time.perf_counter() - t0
    prompt = prompt_ids(Path(a.model), a.prompt_tokens)
    llama_run(llm, prompt, 4)  # warm-up on the whole prompt: its table rows are paged in before timing
    pre, dec = zip(*(llama_run(llm, prompt, a.new_tokens) for _ in range(a.runs)))
    return {"load_s": load_s, "prefill_tok_s": a.prompt_tokens / statistics.median(pre),
            "decode_tok_s": a.new_tokens / statistics.median(dec), "peak_rss_bytes": peak_rss(),
            "weight_bytes_per_token": gguf_bytes_per_token(a.gguf),
            "system_info": llama_cpp.llama_print_system_info().decode(errors="replace").strip()}


def llama_server_worker(a) -> dict:
    """llama.cpp through its own server binary (no llama-cpp-python needed): the prompt as token ids to
    ``/completion`` (``cache_prompt`` off, end of sequence ignored, greedy), figures from the server's own
    ``timings`` (prompt_per_second, predicted_per_second); peak RSS is the server process's VmHWM."""
    import socket
    import urllib.request

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = max(512, a.prompt_tokens + a.new_tokens + 8)
    cmd = [a.llama_server, "-m", a.gguf, "--port", str(port), "-c", str(ctx), "--parallel", "1", "-t", str(a.threads),
           "-tb", str(a.threads), "--no-webui", "-cram", "0"]
    url = f"http://127.0.0.1:{port}"
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        while True:
            if proc.poll() is not None:
                raise SystemExit(f"llama-server exited with {proc.returncode}")
            try:
                with urllib.request.urlopen(url + "/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                time.sleep(0.2)
        load_s = time.perf_counter() - t0
        prompt = prompt_ids(Path(a.model), a.prompt_tokens)

        def run(n: int) -> dict:
            body = json.dumps({"prompt": prompt, "n_predict": n, "cache_prompt": False, "ignore_eos": True,
                               "temperature": 0, "top_k": 1}).encode()
            req = urllib.request.Request(url + "/completion", body, {"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=a.timeout) as r:
                t = json.loads(r.read())["timings"]
            assert t["prompt_n"] == len(prompt) and t["predicted_n"] == n, t
            return t

        run(4)  # warm-up on the whole prompt: its table rows are paged in before timing
        ts = [run(a.new_tokens) for _ in range(a.runs)]
        with open(f"/proc/{proc.pid}/status") as f:
            hwm = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM"))
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    return {"load_s": load_s, "prefill_tok_s": statistics.median(t["prompt_per_second"] for t in ts),
            "decode_tok_s": statistics.median(t["predicted_per_second"] for t in ts), "peak_rss_bytes": hwm,
            "weight_bytes_per_token": gguf_bytes_per_token(a.gguf), "server": a.llama_server}


def llama_bench_worker(a) -> dict:
    """llama.cpp through its own benchmark binary: prefill of the prompt length from an empty context
    (``-p P -n 0``), then decode of N tokens after a context of P tokens (``-p 0 -n N -d P``), each
    ``--runs`` times after llama-bench's own warm-up (its prompt: random ids of the same count). Two
    child processes; peak RSS is the larger of the two (``RUSAGE_CHILDREN``), load time is not measured."""
    import resource

    base = [a.llama_bench, "-m", a.gguf, "-t", str(a.threads), "-r", str(a.runs), "-o", "json"]
    recs = []
    for extra in (["-p", str(a.prompt_tokens), "-n", "0"],
                  ["-p", "0", "-n", str(a.new_tokens), "-d", str(a.prompt_tokens)]):
        p = subprocess.run(base + extra, capture_output=True, text=True, timeout=a.timeout)
        if p.returncode:
            raise SystemExit(f"llama-bench exited with {p.returncode}: {p.stderr.strip().splitlines()[-1:]}")
        recs += json.loads(p.stdout)
    pp = next(r for r in recs if r["n_prompt"] == a.prompt_tokens and r["n_gen"] == 0)
    tg = next(r for r in recs if r["n_gen"] == a.new_tokens and r["n_depth"] == a.prompt_tokens)
    return {"load_s": None, "prefill_tok_s": pp["avg_ts"], "decode_tok_s": tg["avg_ts"],
            "peak_rss_bytes": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024,
            "weight_bytes_per_token": gguf_bytes_per_token(a.gguf), "bench": a.llama_bench,
            "build": f"{tg.get('build_commit', '?')} ({tg.get('cpu_info', '')}; {tg.get('backends', '')})"}


def gguf_bytes_per_token(path: str) -> int:
    """Bytes of every tensor but the per-layer embedding table (row lookups); token_embd is the tied LM head."""
    from gguf import GGUFReader

    return sum(int(t.n_bytes) for t in GGUFReader(path).tensors if "per_layer_token_embd" not in t.name)


def quantize_worker(a) -> dict:
    from llama_cpp import llama_cpp

    llama_cpp.llama_backend_init()
    params = llama_cpp.llama_model_quantize_default_params()
    params.nthread, params.ftype = a.threads, llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_0
    rc = llama_cpp.llama_model_quantize(a.src.encode(), a.dst.encode(), ctypes.byref(params))
    if rc != 0:
        raise SystemExit(f"llama_model_quantize returned {rc}")
    return {"ok": True}


# ---------------------------------------------------------------- GGUF conversion (cached)

def converter(src_dir: Path) -> Path:
    conv = src_dir / f"llama_cpp_python-{LCPP_VERSION}" / "vendor" / "llama.cpp" / "convert_hf_to_gguf.py"
    if not conv.exists():
        sh([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
            f"llama-cpp-python=={LCPP_VERSION}", "-d", str(src_dir)])
        with tarfile.open(src_dir / f"llama_cpp_python-{LCPP_VERSION}.tar.gz") as tf:
            tf.extractall(src_dir, filter="data")
    return conv


def converter_input(model: Path, gdir: Path) -> Path:
    """The checkpoint folder, or a symlinked copy whose tokenizer has one entry per embedding row."""
    cfg = json.loads((model / "config.json").read_text())
    vocab = (cfg.get("text_config") or cfg)["vocab_size"]
    tok = json.loads((model / "tokenizer.json").read_text())
    ids = set(tok["model"]["vocab"].values()) | {t["id"] for t in tok["added_tokens"]}
    if len(ids) >= vocab and tok["model"].get("merges"):
        return model
    stage = gdir / "_convert_src"
    stage.mkdir(parents=True, exist_ok=True)
    for f in model.iterdir():
        if f.is_file() and f.name != "tokenizer.json" and not (stage / f.name).exists():
            (stage / f.name).symlink_to(f.resolve())
    missing = [i for i in range(vocab) if i not in ids]
    tok["model"]["vocab"].update({f"<filler{i}>": i for i in missing})
    if not tok["model"].get("merges") and len(missing) >= 3:  # llama.cpp's gemma4 vocab needs >= 1 BPE merge
        tok["model"]["vocab"].update({"z": missing[-3], "q": missing[-2], "zq": missing[-1]})
        for i in missing[-3:]:
            tok["model"]["vocab"].pop(f"<filler{i}>")
        tok["model"]["merges"] = [["z", "q"]]
    (stage / "tokenizer.json").write_text(json.dumps(tok))
    print(f"[gguf] tokenizer: {len(ids)} entries for vocab_size {vocab}: padded copy in {stage}", file=sys.stderr)
    return stage


def ensure_ggufs(model: Path, threads: int, src_dir: Path, kinds=("Q8_0", "Q4_0"),
                 gdir: Path | None = None) -> dict[str, Path]:
    gdir = gdir or model / "gguf"
    paths = {k: gdir / f"{model.name}-{k}.gguf" for k in kinds}
    if all(p.exists() for p in paths.values()):
        return paths
    gdir.mkdir(exist_ok=True)
    conv, src = converter(src_dir), converter_input(model, gdir)

    def convert(outtype: str, dst: Path) -> None:
        tmp = dst.with_suffix(".tmp")
        t0 = time.perf_counter()
        sh([sys.executable, str(conv), str(src), "--outtype", outtype, "--outfile", str(tmp)])
        tmp.rename(dst)
        print(f"[gguf] {dst.name}: {time.perf_counter() - t0:.0f} s", file=sys.stderr)

    if "Q8_0" in paths and not paths["Q8_0"].exists():
        convert("q8_0", paths["Q8_0"])
    if "Q4_0" in paths and not paths["Q4_0"].exists():
        bf16 = gdir / f"{model.name}-bf16.gguf"
        if not bf16.exists():
            convert("bf16", bf16)
        tmp = paths["Q4_0"].with_suffix(".tmp")
        sh([sys.executable, __file__, "--worker", "quantize", "--src", str(bf16), "--dst", str(tmp),
            "--threads", str(threads)])
        tmp.rename(paths["Q4_0"])
        bf16.unlink()
    return paths


def sh(cmd: list[str]) -> None:
    print("[run]", " ".join(cmd), file=sys.stderr)
    subprocess.run(cmd, check=True)


# ---------------------------------------------------------------- orchestration

def cpu_seconds() -> tuple[float, float]:
    """(busy CPU seconds of the whole machine, CPU seconds of our finished children) so far."""
    import resource

    f = [int(x) for x in open("/proc/stat").readline().split()[1:9]]
    ch = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (f[0] + f[1] + f[2] + f[5] + f[6] + f[7]) / os.sysconf("SC_CLK_TCK"), ch.ru_utime + ch.ru_stime


def wait_idle(max_wait: float, below: float = 0.3) -> None:
    """Wait (at most ``max_wait`` s) for a 3 s window in which other processes use < ``below`` cores."""
    end = time.time() + max_wait
    while time.time() < end:
        b0, _ = cpu_seconds()
        time.sleep(3)
        if (cpu_seconds()[0] - b0) / 3 < below:
            return


def run_json(cmd: list[str], env: dict, timeout: float) -> dict:
    """Run one measurement process; its last stdout line is a JSON object. ``others_cores``: the mean number of
    cores other processes kept busy meanwhile (the machine is shared; > 0.2 or so means the figures are low)."""
    t0, (b0, c0) = time.perf_counter(), cpu_seconds()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    wall, (b1, c1) = time.perf_counter() - t0, cpu_seconds()
    lines = [l for l in p.stdout.splitlines() if l.startswith("{")]
    if p.returncode != 0 or not lines:
        return {"error": f"exit {p.returncode}: " + " | ".join((p.stderr or p.stdout).strip().splitlines()[-3:])}
    others = max(0.0, (b1 - b0) - (c1 - c0)) / wall
    return {**json.loads(lines[-1]), "wall_s": round(wall, 1), "others_cores": round(others, 2)}


def runtimes(a, ggufs: dict[str, Path]) -> dict[str, list[str]]:
    py, me = sys.executable, str(Path(__file__).resolve())
    common = ["--prompt-tokens", str(a.prompt_tokens), "--new-tokens", str(a.new_tokens), "--runs", str(a.runs),
              "--threads", str(a.threads)]
    rt = {"bandwidth": [py, str(HERE / "bandwidth_probe.py"), "--json", "--threads", str(a.threads)]}
    for q in ("f32", "int8", "int4"):
        converted = getattr(a, f"converted_{q}", None)  # a `gemmalite convert` output: loads by mapping
        target = ([str(converted)] if converted else [str(a.model), *([] if q == "f32" else ["--quant", q])])
        rt[f"gemmalite {q}"] = [py, "-m", "gemmalite.cli", "bench", target[0], "--json", *common, *target[1:]]
    if not a.skip_hf:
        for dt in ("bf16", "f32") if a.with_hf_f32 else ("bf16",):
            rt[f"transformers {dt}"] = [py, me, "--worker", "hf", "--model", str(a.model), "--dtype", dt, *common]
    for k, path in ggufs.items():
        worker = (["--worker", "llama-bench", "--llama-bench", a.llama_bench] if a.llama_bench
                  else ["--worker", "llama-server", "--llama-server", a.llama_server] if a.llama_server
                  else ["--worker", "llama"])
        rt[f"llama.cpp {k}"] = [py, me, *worker, "--model", str(a.model), "--gguf", str(path), *common]
    return {k: v for k, v in rt.items() if not a.only or k == "bandwidth" or k in a.only}


def median_of(rounds: list[dict], max_others: float) -> dict:
    """Medians over the rounds other processes left alone (all rounds when none was)."""
    ok = [r for r in rounds if "error" not in r]
    if not ok:
        return {"error": rounds[-1]["error"]}
    quiet = [r for r in ok if r.get("others_cores", 0) <= max_others] or ok
    med = {k: (statistics.median(r[k] for r in quiet) if isinstance(v, (int, float)) and not isinstance(v, bool) else v)
           for k, v in quiet[0].items()}
    return {**med, "rounds_used": len(quiet)}


def ratios(m: dict) -> dict[str, float | None]:
    def r(a: str, b: str, key: str):
        x, y = m.get(a, {}).get(key), m.get(b, {}).get(key)
        return None if not x or not y else round(x / y, 2)

    return {
        "decode int8 / llama.cpp Q8_0": r("gemmalite int8", "llama.cpp Q8_0", "decode_tok_s"),
        "decode int4 / llama.cpp Q4_0": r("gemmalite int4", "llama.cpp Q4_0", "decode_tok_s"),
        "prefill int8 / llama.cpp Q8_0": r("gemmalite int8", "llama.cpp Q8_0", "prefill_tok_s"),
        "prefill int8 / transformers f32": r("gemmalite int8", "transformers f32", "prefill_tok_s"),
        "prefill int8 / transformers bf16": r("gemmalite int8", "transformers bf16", "prefill_tok_s"),
        "decode int4 / transformers bf16": r("gemmalite int4", "transformers bf16", "decode_tok_s"),
        "decode f32 / transformers bf16": r("gemmalite f32", "transformers bf16", "decode_tok_s"),
        "peak RSS int8 / llama.cpp Q8_0": r("gemmalite int8", "llama.cpp Q8_0", "peak_rss_bytes"),
    }


def table(m: dict, bw: float | None) -> str:
    head = f"{'runtime':20s} {'prefill tok/s':>13s} {'decode tok/s':>12s} {'load s':>7s} {'peak RSS GiB':>12s} " \
           f"{'GB/token':>8s} {'bound tok/s':>11s} {'% of bound':>10s} {'others':>6s} {'n':>2s}"
    out = [head, "-" * len(head)]
    for name, r in m.items():
        if name == "bandwidth":
            continue
        if "error" in r:
            out.append(f"{name:20s} FAILED: {r['error'][:200]}")
            continue
        wb = r.get("weight_bytes_per_token")
        bound = bw * 1e9 / wb if bw and wb else None
        load = "-" if r.get("load_s") is None else f"{r['load_s']:.1f}"
        out.append(f"{name:20s} {r['prefill_tok_s']:13.1f} {r['decode_tok_s']:12.2f} {load:>7s} "
                   f"{r['peak_rss_bytes'] / 2**30:12.2f} {(wb or 0) / 1e9:8.3f} "
                   + (f"{bound:11.2f} {100 * r['decode_tok_s'] / bound:9.0f}%" if bound else f"{'-':>11s} {'-':>10s}")
                   + f" {r.get('others_cores', 0):6.2f} {r['rounds_used']:2d}")
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, required=True, help="a Hugging Face folder (E2B or E4B)")
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--runs", type=int, default=3, help="timed runs inside each process (median)")
    ap.add_argument("--rounds", type=int, default=1, help="interleaved rounds over all runtimes (median)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--skip-llama", action="store_true")
    ap.add_argument("--with-hf-f32", action="store_true",
                    help="also transformers f32 (4 bytes/param of RAM: ~20 GB for E2B with its per-layer table)")
    ap.add_argument("--lcpp-src", type=Path, default=Path(tempfile.gettempdir()) / "lcpp_src", help="llama-cpp-python sdist folder")
    ap.add_argument("--timeout", type=float, default=3600, help="seconds per measurement process")
    ap.add_argument("--wait-idle", type=float, default=0, metavar="S",
                    help="before each measurement wait up to S seconds for other processes to go quiet")
    ap.add_argument("--max-others", type=float, default=0.2, metavar="CORES",
                    help="leave out of the medians rounds where other processes kept more cores busy (default 0.2)")
    ap.add_argument("--out", type=Path, default=None, help="write all results as JSON here")
    ap.add_argument("--converted-int8", type=Path, default=None,
                    help="checkpoint written by `gemmalite convert --quant int8` (else quantized at load)")
    ap.add_argument("--converted-int4", type=Path, default=None,
                    help="checkpoint written by `gemmalite convert --quant int4` (else quantized at load)")
    ap.add_argument("--llama-server", default=None, metavar="BIN",
                    help="run llama.cpp through this llama-server binary (its own timings) instead of llama-cpp-python")
    ap.add_argument("--llama-bench", default=None, metavar="BIN",
                    help="run llama.cpp through this llama-bench binary (prefill from empty, decode after the "
                         "prompt; peak RSS of its processes) instead of llama-cpp-python or llama-server")
    ap.add_argument("--gguf-dir", type=Path, default=None,
                    help="where MODEL's GGUFs are (MODEL-NAME-Q8_0.gguf, -Q4_0.gguf; default MODEL/gguf), made "
                         "there when absent")
    ap.add_argument("--only", default=None, metavar="NAMES",
                    help="comma-separated runtimes to run, e.g. 'gemmalite int8,transformers bf16,llama.cpp Q8_0'")
    ap.add_argument("--worker", choices=["hf", "llama", "llama-server", "llama-bench", "quantize"],
                    help=argparse.SUPPRESS)
    ap.add_argument("--dtype", default="bf16", help=argparse.SUPPRESS)
    ap.add_argument("--gguf", "--src", dest="gguf", help=argparse.SUPPRESS)
    ap.add_argument("--dst", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker:
        a.src = a.gguf
        workers = {"hf": hf_worker, "llama": llama_worker, "llama-server": llama_server_worker,
                   "llama-bench": llama_bench_worker, "quantize": quantize_worker}
        print(json.dumps(workers[a.worker](a)))
        return 0

    a.model = a.model.resolve()
    a.only = [n.strip() for n in a.only.split(",")] if a.only else None
    kinds = [k for k in ("Q8_0", "Q4_0") if not a.only or f"llama.cpp {k}" in a.only]
    ggufs = {} if a.skip_llama or not kinds else ensure_ggufs(a.model, a.threads, a.lcpp_src, kinds, a.gguf_dir)
    env = {**os.environ, **{v: str(a.threads) for v in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS",
                                                          "NUMBA_NUM_THREADS")}, "TOKENIZERS_PARALLELISM": "false"}
    rt = runtimes(a, ggufs)
    raw: dict[str, list[dict]] = {name: [] for name in rt}
    for rnd in range(a.rounds):
        for name, cmd in rt.items():
            wait_idle(a.wait_idle)
            print(f"[round {rnd + 1}/{a.rounds}] {name} ...", end=" ", file=sys.stderr, flush=True)
            res = run_json(cmd, env, a.timeout)
            raw[name].append(res)
            print(res.get("error") or f"{res['wall_s']} s, others kept {res['others_cores']} cores busy",
                  file=sys.stderr)
    med = {name: median_of(rs, a.max_others) for name, rs in raw.items()}
    bw = med["bandwidth"].get("numba_parallel_gb_s")
    rat = ratios(med)
    print(f"\n{a.model}: prompt {a.prompt_tokens} tokens, {a.new_tokens} new, {a.threads} threads, "
          f"{a.runs} runs x {a.rounds} rounds (medians)")
    print(f"read bandwidth: numba {a.threads} threads {bw} GB/s, numpy 1 thread "
          f"{med['bandwidth'].get('numpy_1thread_gb_s')} GB/s (bound tok/s = bandwidth / GB per token)\n")
    print(table(med, bw))
    print(f"(others: cores other processes kept busy meanwhile, of {os.cpu_count()}; n: rounds in the medians, "
          f"those with others <= {a.max_others} when there are any)")
    print("\nratios (gemmalite / peer; > 1 = gemmalite faster, for RSS > 1 = gemmalite larger)")
    for k, v in rat.items():
        print(f"  {k:34s} {'n/a' if v is None else f'{v:.2f}x'}")
    if a.out:
        a.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(a).items() if v is not None},
                                     "ggufs": {k: str(v) for k, v in ggufs.items()},
                                     "medians": med, "ratios": rat, "rounds": raw}, indent=2))
        print(f"\nwrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
