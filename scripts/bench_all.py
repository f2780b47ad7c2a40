#!/usr/bin/env python3
"""The whole benchmark table against the peers from one command: runs the side-by-side scripts
(compare_peers.py, bench_gemma3_gguf.py, bench_server.py, bench_prompt_lookup.py, bench_mtp.py, bench_onnx.py,
bench_eg2_peers.py, bench_eg2_images.py, bench_audio.py) row by row, keeps each row's figures with its date, CPU,
machine load and exact command, and writes the markdown table and SVG plots. Run by hand, never in CI.

    python scripts/bench_all.py --quick                  # the real Gemma 3 270M rows only, minutes
    python scripts/bench_all.py                          # every row, 3 rounds (~2 h on 2 quiet cores)
    (scripts/README.md: "The full run", a plan that fits about an hour, most wanted rows first)
    python scripts/bench_all.py --smoke                  # every row once, smallest settings: does it run?
    python scripts/bench_all.py --only e2b-int8,g3-long  # rerun some rows, keep the others' figures
    python scripts/bench_all.py --page BENCHMARKS.md     # also replace the page's table block
    python scripts/bench_all.py --no-run --page BENCHMARKS.md  # the page from the stored results

Every row runs ``--rounds`` times; each run of a script measures gemmalite and its peer one after
the other, so the rounds alternate them (A B A B) and the table gives the median of each figure and
of the per-round ratio, with the ratio's min-max. A peer that is not there (no llama.cpp, no
llama-server binary, no egemma2, no checkpoint) is a "not run: why" cell, never a missing row.
Results accumulate in OUT/results.json (OUT: docs/benchmarks, or a temporary folder with
``--quick``), so ``--only`` reruns a row and the table keeps the rest with their own dates.
Inputs (the E2B / EG2 rows; random weights of the real shapes): ``python scripts/bench_inputs.py`` makes
them all once in one folder (``$GEMMALITE_SYNTH``, default ~/.cache/gemmalite-synth): ``e2b`` (``gemmalite synth --preset
e2b``), ``e2b-int8`` / ``e2b-int4`` (``gemmalite convert``), ``e2b-gguf/e2b-Q8_0.gguf`` / ``-Q4_0.gguf`` (llama.cpp's
convert_hf_to_gguf.py + llama-quantize), ``e2b-assistant`` (the MTP drafter), ``eg2`` and ``eg2-int8``; each
can be pointed elsewhere (``--e2b`` etc.). llama.cpp's binaries: ``--llama-bin DIR`` (or
``$GEMMALITE_LLAMA_BIN``) holding llama-bench and llama-server. ``--only`` runs the rows in the order given.
"""
from __future__ import annotations

import argparse
import datetime
import functools
import importlib.util
import json
import math
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
HERE = ROOT / "scripts"
BEGIN, END = "<!-- bench_all:begin -->", "<!-- bench_all:end -->"


@dataclass
class Fig:
    """One table line from one round: gemmalite's figure and its peer's (None: not measured)."""
    what: str
    unit: str
    ours: float | None
    peer_name: str
    peer: float | None
    peer_note: str = ""  # why the peer has no figure
    x: float | None = None  # the abscissa when the line is a point of a curve
    series: str = ""  # the curve it belongs to
    side: str = "both"  # "ours" / "peer": this output holds only that side (the peer ran as its own command)


@dataclass
class Row:
    id: str
    title: str
    quick: bool  # runs under --quick (the real Gemma 3 270M only)
    commands: Callable[[argparse.Namespace], list[tuple[float | None, list[str]]]]  # (x, command) each
    figs: Callable[[float | None, object, argparse.Namespace], list[Fig]]  # from one command's output
    missing: Callable[[argparse.Namespace], str | None] = lambda a: None  # why the row cannot run
    rounds: int | None = None  # this row's own alternation is inside its script
    plot: tuple[str, str, str] | None = None  # (series, x label, y label) of a curve worth a plot
    notes: list[str] = field(default_factory=list)


# ---------------------------------------------------------------- peers and checkpoints

# the E2B / EmbeddingGemma 2 rows' inputs: scripts/bench_inputs.py makes them in $GEMMALITE_SYNTH
INPUTS = {"e2b": "`gemmalite synth --preset e2b` folder (random weights, vision + audio towers)",
          "e2b-int8": "its `gemmalite convert --quant int8` output", "e2b-int4": "its `--quant int4` output",
          "e2b-gguf": "folder of e2b-Q8_0.gguf / e2b-Q4_0.gguf (llama.cpp's converter + llama-quantize)",
          "e2b-assistant": "`gemmalite synth --preset e2b-assistant` folder (the MTP drafter)",
          "eg2": "`gemmalite synth --preset eg2` folder (image + audio towers)",
          "eg2-int8": "its `gemmalite convert --quant int8` output"}


def find_binary(name: str, folder) -> str | None:
    """``folder/name`` when it is there, else ``name`` on PATH."""
    if folder and (Path(folder) / name).exists():
        return str(Path(folder) / name)
    return shutil.which(name)


def has_module(name: str) -> bool:
    return importlib.util.find_spec(name) is not None


_LLAMA_PROBE = """
import sys
from llama_cpp import Llama
Llama(sys.argv[1], n_ctx=64, n_threads=1, verbose=False).eval([2, 818])
"""


@functools.cache
def llama_cpp_problem() -> str:
    """Why llama-cpp-python cannot be the peer here ('' when it evaluates the bundled GGUF)."""
    if not has_module("llama_cpp"):
        return "not run: llama-cpp-python is not installed (pip install llama-cpp-python==0.3.36)"
    p = subprocess.run([sys.executable, "-c", _LLAMA_PROBE, str(bundled_gguf(None))], capture_output=True, text=True)
    if p.returncode == 0:
        return ""
    how = f"signal {-p.returncode}" if p.returncode < 0 else f"exit {p.returncode}"
    return (f"not run: llama-cpp-python crashed ({how}) evaluating two tokens on this CPU; a wheel built "
            "with GGML_NATIVE has AMX on, a suspect: rebuild it with CMAKE_ARGS='-DGGML_NATIVE=OFF' and the CPU's flags)")


def has_llama_cpp() -> bool:
    return not llama_cpp_problem()


def peer_llama(a) -> str:
    return llama_cpp_problem()


def peer_server(a, gguf: Path | None = None) -> str:
    if gguf is not None and not Path(gguf).exists():
        return f"not run: no GGUF {gguf} (python scripts/bench_inputs.py)"
    if a.llama_server and Path(a.llama_server).exists():
        return ""
    return ("not run: no llama-server binary (--llama-server BIN; build it from the llama-cpp-python sdist's "
            "vendor/llama.cpp, GGML_NATIVE=OFF and the CPU's flags, see scripts/README.md)")


def peer_egemma2() -> str:
    return "" if has_module("egemma2") else "not run: egemma2 is not installed (pip install egemma2)"


def need_dirs(*names: str) -> Callable[[argparse.Namespace], str | None]:
    def check(a) -> str | None:
        gone = [f"--{n.replace('_', '-')} {getattr(a, n)}" for n in names
                if not getattr(a, n) or not (Path(getattr(a, n)) / "config.json").exists()]
        return f"not run: no checkpoint ({', '.join(gone)}; `gemmalite synth` / `gemmalite convert`)" if gone else None
    return check


def e2b_gguf(a, kind: str) -> Path:
    """compare_peers.py's name for the E2B GGUFs: GGUF_DIR/MODEL-NAME-KIND.gguf."""
    return Path(a.e2b_gguf or Path(a.e2b) / "gguf") / f"{Path(a.e2b).name}-{kind}.gguf"


def q8_gguf(a) -> Path:
    return e2b_gguf(a, "Q8_0")


def e2b_llama(a, kinds: list[str]) -> tuple[list[str], str, str]:
    """compare_peers.py's llama.cpp flags for the E2B rows, the peer's label and why it cannot run ('' when it
    can): llama-bench when given (llama.cpp's own benchmark), else llama-cpp-python, else llama-server."""
    gone = [str(e2b_gguf(a, k)) for k in kinds if not e2b_gguf(a, k).exists()]
    if gone:
        return ["--skip-llama"], "", f"not run: no GGUF {', '.join(gone)} (python scripts/bench_inputs.py)"
    flags = ["--gguf-dir", str(e2b_gguf(a, kinds[0]).parent)]
    if a.llama_bench:
        return [*flags, "--llama-bench", a.llama_bench], "llama-bench", ""
    if has_llama_cpp():
        return flags, "llama-cpp-python 0.3.36", ""
    if a.llama_server:
        return [*flags, "--llama-server", a.llama_server], "llama-server", ""
    return ["--skip-llama"], "", "not run: no llama-bench / llama-server binary (--llama-bin DIR) and " + (
        llama_cpp_problem().removeprefix("not run: "))


# ---------------------------------------------------------------- the rows

def size(a, full, quick=None, smoke=None):
    """A setting of a row: its ``--smoke`` value (the smallest that runs every path), its ``--quick`` one, or
    the full run's."""
    if a.smoke and smoke is not None:
        return smoke
    return quick if a.quick and quick is not None else full


def py(script: str, *args) -> list[str]:
    return [sys.executable, str(HERE / script), *map(str, args)]


def g3_commands(a):
    lengths = size(a, [128, 512, 1024, 2048, 4096], [128, 512, 1024], [64])
    new, runs = size(a, (64, 3), (32, 2), (8, 1))
    engines = "gemmalite,gemmalite-int8,llamacpp" if has_llama_cpp() else "gemmalite,gemmalite-int8"
    out = []
    for n in lengths:
        out.append((n, py("bench_gemma3_gguf.py", "--prompt-tokens", n, "--new-tokens", new, "--runs", runs,
                          "--threads", a.threads, "--engines", engines, "--json", "{out}")))
        if not has_llama_cpp() and a.llama_bench:  # llama.cpp's own benchmark instead (its prompt: random ids)
            out.append((-n, [a.llama_bench, "-m", str(bundled_gguf(a)), "-p", str(n), "-n", str(new), "-d", f"0,{n}",
                             "-t", str(a.threads), "-r", str(runs), "-o", "json"]))
    return out


def g3_figs(n, out, a):
    if n < 0:  # llama-bench: prefill of -n tokens from empty, decode after -n tokens
        n, peer = -n, "llama.cpp (llama-bench)"
        pp = next(t["avg_ts"] for t in out if t["n_prompt"] == n and t["n_depth"] == 0)
        tg = next(t for t in out if t["n_gen"] > 0 and t["n_depth"] == n)
        figs = [Fig(f"decode, {tg['n_gen']} tokens after {n:,}", "tok/s", None, peer, tg["avg_ts"], side="peer")]
        if n in (128, max(x for x, _ in g3_commands(a))):
            figs.append(Fig(f"prefill, {n:,} tokens", "tok/s", None, peer, pp, side="peer"))
        return figs
    r, note = out["results"], peer_llama(a)
    g, l = r["gemmalite"], r.get("llamacpp", {})
    new, peer = out["new_tokens"], "llama.cpp (llama-cpp-python 0.3.36)"
    side = "both"
    if note and a.llama_bench:
        note, peer, side = "", "llama.cpp (llama-bench)", "ours"
    figs = [Fig(f"decode, {new} tokens after {n:,}", "tok/s", g["decode_tok_s"], peer, l.get("decode_tok_s"), note,
                x=n, series="decode", side=side)]
    if n in (128, max(x for x, _ in g3_commands(a))):
        figs.append(Fig(f"prefill, {n:,} tokens", "tok/s", g["prefill_tok_s"], peer, l.get("prefill_tok_s"), note,
                        side=side))
        if "gemmalite-int8" in r:  # --gguf-prefill int8: the prompt's activations in int8, as llama.cpp's
            figs.append(Fig(f"prefill, {n:,} tokens, `--gguf-prefill int8`", "tok/s", r["gemmalite-int8"]["prefill_tok_s"],
                            peer, l.get("prefill_tok_s"), note, side=side))
        figs.append(Fig(f"peak RSS, {n:,}-token prompt (lower is better)", "GiB", g["peak_rss_bytes"] / 2**30,
                        peer.replace("llama-bench", "not measured by llama-bench"),
                        l["peak_rss_bytes"] / 2**30 if l else None, note))
    return figs


def bundled_gguf(a) -> Path:
    sys.path.insert(0, str(ROOT))
    from gemmalite.loader import resolve

    return resolve("gemma3-270m")


def server_commands(model: Callable, gguf: Callable, levels: str, tokens: int):
    def make(a):
        peer = [] if peer_server(a, gguf(a)) else ["--llama-server", a.llama_server, "--gguf", gguf(a)]
        return [(None, py("bench_server.py", "--gemmalite", model(a), *peer,
                          "--levels", size(a, "1,2,4,8", levels, "1,2"), "--max-tokens", size(a, tokens, smoke=8),
                          "--threads", a.threads, "--json"))]
    return make


def server_figs(gguf: Callable):
    def figs(_x, out, a):
        s = out["servers"]
        g, l = s["gemmalite"]["rows"], s.get("llama-server", {}).get("rows", [])
        note = peer_server(a, gguf(a))
        res = []
        for i, row in enumerate(g):
            p = l[i] if i < len(l) else {}
            n = row["streams"]
            res.append(Fig(f"{n} stream{'s' if n > 1 else ''}, aggregate decode", "tok/s", row["tokens_per_s"],
                           "llama-server", p.get("tokens_per_s"), note, x=n, series="tok/s"))
            res.append(Fig(f"{n} stream{'s' if n > 1 else ''}, p99 first token (lower is better)", "s",
                           row["ttft_p99_s"], "llama-server", p.get("ttft_p99_s"), note))
        return res
    return figs


def lookup_figs(_x, out, a):
    figs = []
    for r in out:
        for plain, look in zip(r["plain_tok_s"], r["lookup_tok_s"]):  # one round: plain then lookup
            figs.append(Fig(f"prompt lookup, {r['prompt']} prompt ({r['new_tokens']} tokens, "
                            f"{r['accepted']}/{r['drafted']} drafts kept, same text: {r['identical_text']})",
                            "tok/s", look, "plain decoding", plain))
    return figs


GGUF_KIND = {"int8": "Q8_0", "int4": "Q4_0"}


def peers_commands(quants: str, prompt: int | list[int], new: int, runs: int, hf: bool = False,
                   llama: bool = True):
    """compare_peers.py on the E2B checkpoint: gemmalite in ``quants`` (converted folders) against
    transformers bf16 (``hf``), llama.cpp on the matching GGUFs (``llama``), or only each other."""
    def make(a):
        conv = [f"--converted-{q}" for q in ("int8", "int4") if q in quants]
        args = ["--model", a.e2b, *sum(([c, getattr(a, "e2b_" + c[12:])] for c in conv), [])]
        only = [f"gemmalite {q}" for q in quants.split(",")]
        peer = ["--skip-llama"]
        if hf:
            only.append("transformers bf16")
        elif llama:
            kinds = [GGUF_KIND[q] for q in quants.split(",")]
            only += [f"llama.cpp {k}" for k in kinds]
            peer = e2b_llama(a, kinds)[0]
        prompts = size(a, [prompt] if isinstance(prompt, int) else prompt, smoke=[32] if isinstance(prompt, int)
                       else [32, 64])
        return [(p, py("compare_peers.py", *args, "--only", ",".join(only), "--prompt-tokens", p,
                       "--new-tokens", size(a, new, smoke=4), "--runs", size(a, runs, smoke=1),
                       "--threads", a.threads, *peer, "--out", "{out}")) for p in prompts]
    return make


def peers_figs(quant: str, peer: str, curve: bool = False):
    """One compare_peers.py run's lines: decode, prefill (and peak RSS); for int8 / int4 against llama.cpp
    also the machine's read bandwidth measured in the same run and each decode's weight reads per second
    as a share of it (decode tok/s x weight bytes per token / bandwidth)."""
    def figs(p, out, a):
        m = out["medians"]
        g, q = m[f"gemmalite {quant}"], m.get(peer, {})
        name, note = peer, ""
        if peer.startswith("llama.cpp"):
            _, how, note = e2b_llama(a, [peer.split()[-1]])
            name = f"{peer} ({how})" if how else peer
        if "error" in q:
            note, q = f"failed: {q['error'][:120]}", {}
        label = {"f32": "bf16 in place", "int8": "int8", "int4": "int4"}[quant]
        new = int(out["args"]["new_tokens"])
        if "error" in g:
            raise RuntimeError(f"gemmalite {quant}: {g['error']}")
        res = [Fig(f"decode, {label}, {new} tokens after {p:,}", "tok/s", g["decode_tok_s"], name,
                   q.get("decode_tok_s"), note, x=p, series="decode")]
        res.append(Fig(f"prefill, {label}, {p:,} tokens", "tok/s", g["prefill_tok_s"], name, q.get("prefill_tok_s"),
                       note))
        if not curve:
            res.append(Fig(f"peak RSS, {label}, {p:,}-token prompt (lower is better)", "GiB",
                           g["peak_rss_bytes"] / 2**30, name, q["peak_rss_bytes"] / 2**30 if q else None, note))
        bw = m.get("bandwidth", {}).get("numba_parallel_gb_s")
        if bw and not curve and peer.startswith("llama.cpp"):
            share = lambda r: 100 * r["decode_tok_s"] * r["weight_bytes_per_token"] / 1e9 / bw  # noqa: E731
            res += [Fig(f"read bandwidth of this machine, same run (scripts/bandwidth_probe.py, {a.threads} threads)",
                        "GB/s", bw, "", None),
                    Fig(f"weights read per decoded token, {label} (lower is better)", "GB",
                        g["weight_bytes_per_token"] / 1e9, name,
                        q["weight_bytes_per_token"] / 1e9 if q.get("weight_bytes_per_token") else None, note),
                    Fig(f"decode, {label}: weight reads per second as a share of that bandwidth", "%", share(g), name,
                        share(q) if q.get("weight_bytes_per_token") else None, note)]
        return res
    return figs


def int4_prefill_figs(p, out, a):
    """int4 against int8 prefill (and decode) in one compare_peers.py run: the int4 integer tiles' pace."""
    m = out["medians"]
    g, q = m["gemmalite int4"], m["gemmalite int8"]
    for r in (g, q):
        if "error" in r:
            raise RuntimeError(r["error"])
    new = int(out["args"]["new_tokens"])
    return [Fig(f"prefill, int4 against int8, {p:,} tokens", "tok/s", g["prefill_tok_s"], "gemmalite int8",
                q["prefill_tok_s"], x=p, series="prefill"),
            Fig(f"decode, int4 against int8, {new} tokens after {p:,}", "tok/s", g["decode_tok_s"], "gemmalite int8",
                q["decode_tok_s"])]


# the acceptance peers publish for the Gemma 4 assistants (Google cites ~80 %, third parties 70-87 %; no
# E2B-specific figure found: BENCHMARKS history, MTP section)
PUBLISHED_ACCEPTANCE = ("0.7", "0.8")


def mtp_commands(a):
    prompt, new, reps = size(a, (128, 48, 7), smoke=(32, 8, 1))
    return [(None, py("bench_mtp.py", a.e2b_int8, a.e2b_assistant, "--prompt-tokens", prompt, "--new-tokens", new,
                      "--rounds", a.rounds, "--reps", reps, "--threads", a.threads,
                      *size(a, [], smoke=["--rates", "0,0.8"])))]


def mtp_figs(_x, out, a):
    """bench_mtp.py's three JSON lines: step costs, replayed end-to-end runs, projection."""
    micro, e2e, proj = (out if isinstance(out, list) else [out])[:3]
    step = micro["one_row_step_ms"]
    plain = "one-row target step"
    res = [Fig("drafter (4 Q-only layers + centroid head), time per drafted token", "ms",
               micro["drafter_ms_per_token"], plain, step)]
    for r, cost in sorted(micro["verify_cost_vs_one_row"].items()):
        if int(r) > 1:
            res.append(Fig(f"verify step of {r} rows (the token + {int(r) - 1} draft{'s' if int(r) > 2 else ''})",
                           "ms", cost * step, plain, step))
    for acc, r in e2e["speculative"].items():
        kept = ", ".join(f"{k}/{d}" for d, k in r["drafted_kept"])
        res.append(Fig(f"end to end, replayed acceptance {acc} (kept/drafted per round: {kept}; same tokens: "
                       f"{e2e['identical_tokens']})", "tok/s", r["tok_s"], "plain decoding", e2e["plain_tok_s"]))
    for alpha in PUBLISHED_ACCEPTANCE:
        pr = proj["projected_speedup_by_acceptance"][alpha]
        res.append(Fig(f"projected speed-up at acceptance {alpha} (published range; {pr['drafts']} drafts a step), "
                       "from the measured costs", "x", pr["speedup"], "", None))
    return res


def _peer_note(peer: str, q: dict) -> str:
    """Why an EmbeddingGemma 2 peer has no figures ('' when it ran): its error, or egemma2 missing."""
    if peer.startswith("egemma2") and peer_egemma2():
        return peer_egemma2()
    return q.get("error", "") and f"failed: {q['error'][:120]}"


def eg2_text_figs(_x, out, a):
    ours = out.get("gemmalite/converted") or out["gemmalite/int8"]
    res = []
    for peer, name in (("transformers/none", "transformers float32"), ("egemma2/none", "egemma2 (CPU)")):
        q = out.get(peer, {})
        note = _peer_note(peer, q)
        q = {} if note else q
        res += [Fig("one 18-token query (lower is better)", "ms", ours["query_ms"], name, q.get("query_ms"), note),
                Fig(f"{a.docs} documents of 512 tokens", "texts/s", ours["docs_texts_s"], name,
                    q.get("docs_texts_s"), note),
                Fig("peak RSS, text (lower is better)", "GiB", ours["peak_rss_bytes"] / 2**30, name,
                    q["peak_rss_bytes"] / 2**30 if q.get("peak_rss_bytes") else None, note)]
    return res


def eg2_image_figs(_x, out, a):
    m = out["median"]
    ours, res = m["gemmalite/int8"], []
    for peer, name in (("transformers/none", "transformers float32"), ("egemma2/none", "egemma2 (CPU)")):
        q = m.get(peer, {})
        note = _peer_note(peer, q)
        q = {} if note else q
        res += [Fig(f"{a.images} images of 768 x 768", "images/s", ours["images_s"], name, q.get("images_s"), note),
                Fig("peak RSS, images (lower is better)", "GiB", ours["peak_rss_bytes"] / 2**30, name,
                    q["peak_rss_bytes"] / 2**30 if q.get("peak_rss_bytes") else None, note)]
    return res


def onnx_figs(_x, out, a):
    """gemmalite's kernels against its ONNX export on ONNX Runtime's CPU provider, per weight format."""
    import onnxruntime

    peer = f"ONNX Runtime {onnxruntime.__version__} CPU (gemmalite export)"
    figs = []
    for fmt, r in out["formats"].items():
        med = r.get("medians")
        if med is None:
            raise RuntimeError(f"{fmt}: export failed: {r['export'].get('error', '?')[:150]}")
        g, o = med["gemmalite"], med.get("onnxruntime", {})
        if "error" in g:
            raise RuntimeError(f"gemmalite {fmt}: {g['error'][:150]}")
        note = o.get("error", "") and f"failed: {o['error'][:120]}"
        o = {} if note else o
        label = {"float": "float (bf16 in place; ORT float32)", "int8": "int8", "int4": "int4"}[fmt]
        figs += [Fig(f"decode, {label}", "tok/s", g["decode_tok_s"], peer, o.get("decode_tok_s"), note),
                 Fig(f"prefill, {label}", "tok/s", g["prefill_tok_s"], peer, o.get("prefill_tok_s"), note),
                 Fig(f"peak RSS, {label} (lower is better)", "GiB", g["peak_rss_bytes"] / 2**30, peer,
                     o["peak_rss_bytes"] / 2**30 if o else None, note)]
    return figs


def eg2_audio_figs(_x, out, a):
    m = out["median"]
    ours, res = m["gemmalite/int8"], []
    if "error" in ours:
        raise RuntimeError(f"gemmalite int8: {ours['error']}")
    for peer, name in (("egemma2/none", "egemma2 (CPU)"), ("transformers/none", "transformers float32")):
        q = m.get(peer, {})
        note = _peer_note(peer, q)
        q = {} if note else q
        res += [Fig(f"{out['args']['clips']} clips of {out['args']['seconds']:g} s", "clips/s", ours["clips_s"], name,
                    q.get("clips_s"), note),
                Fig("peak RSS, audio (lower is better)", "GiB", ours["peak_rss_bytes"] / 2**30, name,
                    q["peak_rss_bytes"] / 2**30 if q.get("peak_rss_bytes") else None, note)]
    return res


def audio_ttft_figs(_x, out, a):
    m = out["median"]
    ours, q = m["gemmalite/int8"], m.get("transformers/bf16", {})
    if "error" in ours:
        raise RuntimeError(f"gemmalite int8: {ours['error']}")
    note = q.get("error", "") and f"failed: {q['error'][:120]}"
    q = {} if note else q
    what = f"first token, one {out['args']['seconds']:g} s clip ({ours['prompt_tokens']} prompt tokens; lower is better)"
    return [Fig(what, "s", ours["ttft_s"], "transformers bf16", q.get("ttft_s"), note),
            Fig("peak RSS, chat with a clip (lower is better)", "GiB", ours["peak_rss_bytes"] / 2**30,
                "transformers bf16", q["peak_rss_bytes"] / 2**30 if q.get("peak_rss_bytes") else None, note)]


ROWS = [
    Row("g3-long", "Gemma 3 270M Q4_K_M (the bundled `gemma3-270m`, real weights) against llama.cpp, "
        "prompt lengths", True, g3_commands, g3_figs,
        plot=("decode", "prompt tokens", "decode tok/s")),
    Row("g3-server", "the server, Gemma 3 270M: `gemmalite serve` against `llama-server` (same GGUF)", True,
        server_commands(lambda a: "gemma3-270m", bundled_gguf, "1,2,4", 32), server_figs(bundled_gguf),
        plot=("tok/s", "concurrent streams", "aggregate decode tok/s")),
    Row("g3-lookup", "prompt lookup against plain decoding, Gemma 3 270M, greedy chat (identical text)", True,
        lambda a: [(None, py("bench_prompt_lookup.py", "--new-tokens", size(a, 200, 64, 16),
                             "--rounds", a.rounds))], lookup_figs, rounds=1),
    Row("e2b-int8", "Gemma 4 E2B shape, int8 against llama.cpp Q8_0", False,
        peers_commands("int8", 128, 32, 2), peers_figs("int8", "llama.cpp Q8_0"), need_dirs("e2b", "e2b_int8")),
    Row("e2b-int4", "Gemma 4 E2B shape, int4 against llama.cpp Q4_0", False,
        peers_commands("int4", 128, 32, 2), peers_figs("int4", "llama.cpp Q4_0"), need_dirs("e2b", "e2b_int4")),
    Row("e2b-int4-prefill", "Gemma 4 E2B shape, int4 prompts against int8 (integer tiles both)", False,
        peers_commands("int4,int8", [128, 512], 8, 2, llama=False), int4_prefill_figs,
        need_dirs("e2b", "e2b_int8", "e2b_int4")),
    Row("e2b-mtp", "MTP speculative decoding, E2B int8 target + `e2b-assistant` drafter (random weights cannot show "
        "real acceptance: drafts replayed right with probability α, the real drafter's step charged)", False,
        mtp_commands, mtp_figs, need_dirs("e2b_int8", "e2b_assistant"), rounds=1),
    Row("e2b-bf16", "Gemma 4 E2B shape, bf16 weights in place against transformers bf16", False,
        peers_commands("f32", 128, 16, 2, hf=True), peers_figs("f32", "transformers bf16"), need_dirs("e2b")),
    Row("e2b-long", "Gemma 4 E2B shape, int8 against llama.cpp Q8_0, long prompts", False,
        peers_commands("int8", [512, 2048], 16, 1), peers_figs("int8", "llama.cpp Q8_0", curve=True),
        need_dirs("e2b", "e2b_int8"), plot=("decode", "prompt tokens", "decode tok/s")),
    Row("e2b-server", "the server, E2B int8 against `llama-server` (Q8_0), 32 tokens a stream", False,
        server_commands(lambda a: a.e2b_int8, q8_gguf, "1,2,4,8", 32), server_figs(q8_gguf),
        need_dirs("e2b", "e2b_int8"),
        plot=("tok/s", "concurrent streams", "aggregate decode tok/s")),
    Row("e2b-onnx", "Gemma 4 E2B shape, gemmalite's kernels against its ONNX export on ONNX Runtime (CPU provider), "
        "float / int8 / int4", False,
        lambda a: [(None, py("bench_onnx.py", "--model", a.e2b, "--converted-int8", a.e2b_int8, "--converted-int4",
                             a.e2b_int4, "--prompt-tokens", size(a, 128, smoke=32),
                             "--new-tokens", size(a, 16, smoke=4), "--runs", size(a, 2, smoke=1), "--rounds", a.rounds,
                             *size(a, [], smoke=["--only", "int4"]),
                             "--threads", a.threads, "--json", "{out}"))],
        onnx_figs, lambda a: need_dirs("e2b", "e2b_int8", "e2b_int4")(a) or (
            None if has_module("onnxruntime") else "not run: onnxruntime is not installed (pip install 'gemmalite[onnx]')"),
        rounds=1),
    Row("eg2-text", "EmbeddingGemma 2 (whole 744 M model, random weights), int8 text embeddings", False,
        lambda a: [(None, py("bench_eg2_peers.py", a.eg2, "--converted-int8", a.eg2_int8, "--rounds", 1,
                             "--docs", a.docs, "--engines", "gemmalite/int8,transformers/none,egemma2/none",
                             "--threads", a.threads, "--json"))], eg2_text_figs, need_dirs("eg2", "eg2_int8")),
    Row("eg2-images", "EmbeddingGemma 2, int8 image embeddings", False,
        lambda a: [(None, py("bench_eg2_images.py", a.eg2, "--images", a.images, "--rounds", 1,
                             "--engines", "gemmalite/int8,transformers/none,egemma2/none",
                             "--threads", a.threads, "--json"))], eg2_image_figs, need_dirs("eg2")),
    Row("eg2-audio", "EmbeddingGemma 2, int8 audio embeddings (10 s clips)", False,
        lambda a: [(None, py("bench_audio.py", "embed", a.eg2, "--converted-int8", a.eg2_int8,
                             "--clips", size(a, 8, smoke=1),
                             "--rounds", 1, "--threads", a.threads, "--json"))], eg2_audio_figs,
        need_dirs("eg2", "eg2_int8")),
    Row("e2b-audio", "Gemma 4 E2B shape, int8, time to the first token of a chat turn with a 10 s clip", False,
        lambda a: [(None, py("bench_audio.py", "ttft", a.e2b, "--converted-int8", a.e2b_int8,
                             "--turns", size(a, 3, smoke=1),
                             "--rounds", 1, "--threads", a.threads, "--engines", "gemmalite/int8,transformers/bf16",
                             "--json"))], audio_ttft_figs, need_dirs("e2b", "e2b_int8")),
]


# ---------------------------------------------------------------- running

def machine() -> str:
    info = {}
    try:
        for line in subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines():
            k, _, v = line.partition(":")
            info[k.strip()] = v.strip()
    except OSError:
        pass
    flags = info.get("Flags", "").split()
    isa = [f for f in ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_int8") if f in flags]
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return (f"{info.get('Model name', 'unknown CPU')} (family {info.get('CPU family', '?')} model "
            f"{info.get('Model', '?')}), {os.cpu_count()} CPUs, {mem:.0f} GiB, {' '.join(isa)}")


def parse_output(stdout: str, out_file: Path | None):
    if out_file is not None:
        return json.loads(out_file.read_text())
    try:
        return json.loads(stdout)
    except json.JSONDecodeError:
        objs = [json.loads(ln) for ln in stdout.splitlines() if ln.startswith("{")]
        if not objs:
            raise
        return objs if len(objs) > 1 or "prompt" in objs[0] else objs[0]


def run_command(cmd: list[str], a, tmp: Path) -> object:
    out = tmp / "out.json" if "{out}" in cmd else None
    cmd = [str(out) if c == "{out}" else c for c in cmd]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(HERE), os.environ.get("PYTHONPATH", "")])}
    print("[run]", shlex.join(cmd), file=sys.stderr, flush=True)
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=a.timeout, cwd=ROOT)
    if p.returncode:
        tail = (p.stderr or p.stdout).strip().splitlines()[-2:]
        raise RuntimeError(f"exit {p.returncode}: {' | '.join(tail)[:200]}")
    return parse_output(p.stdout, out)


def shown(cmd: list[str], a) -> str:
    """The command as a reader types it (relative script path, placeholders for the JSON file)."""
    subs = {sys.executable: "python", str(ROOT) + "/": ""}
    subs |= {str(Path(p).parent) + "/": "" for p in (a.e2b, a.eg2) if p}  # the inputs by their folder names
    subs |= {str(Path(b).parent) + "/": "LLAMA_BIN/" for b in (a.llama_bench, a.llama_server) if b}
    text = shlex.join(["OUT.json" if c == "{out}" else c for c in cmd])
    for k, v in subs.items():
        text = text.replace(k, v)
    return text


def run_row(row: Row, a) -> dict:
    """All rounds of one row: each figure's per-round values, the commands, date, CPU and load."""
    rec = {"row": row.id, "title": row.title, "quick": a.quick, "machine": machine(),
           "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
           "load_before": round(os.getloadavg()[0], 1)}
    why = row.missing(a)
    cmds = [] if why else row.commands(a)
    rec["commands"] = [shown(c, a) for _, c in cmds]
    flags = [f for f, on in ((" --quick", a.quick), (" --smoke", a.smoke), (f" --rounds {a.rounds}", True),
                             (f" --images {a.images}", row.id == "eg2-images"),
                             (f" --docs {a.docs}", row.id == "eg2-text")) if on]
    rec["bench_all"] = f"python scripts/bench_all.py{''.join(flags)} --only {row.id}"
    if why:
        return {**rec, "status": why}
    rounds = row.rounds or a.rounds
    figs: dict[tuple[str, str], dict] = {}
    t0 = time.perf_counter()
    try:
        with tempfile.TemporaryDirectory(prefix="bench_all_") as tmp:
            for rnd in range(rounds):
                for x, cmd in cmds:
                    out = run_command(cmd, a, Path(tmp))
                    for f in row.figs(x, out, a):
                        # one line per figure and peer (the EmbeddingGemma 2 rows give each figure twice)
                        d = figs.setdefault((f.what, f.peer_name), {**f.__dict__, "ours": [], "peer": []})
                        if f.side != "peer":
                            d["ours"].append(f.ours)
                        if f.side != "ours":
                            d["peer"].append(f.peer)
                        if f.side == "ours":
                            d.update(peer_note=f.peer_note, peer_name=f.peer_name)
    except (RuntimeError, subprocess.TimeoutExpired, KeyError, ValueError) as e:
        return {**rec, "status": f"failed: {type(e).__name__}: {e}"[:300], "figs": list(figs.values())}
    return {**rec, "status": "ok", "rounds": rounds, "wall_s": round(time.perf_counter() - t0),
            "load_after": round(os.getloadavg()[0], 1), "figs": list(figs.values())}


# ---------------------------------------------------------------- the table and the plots

def fmt(v: float | None, unit: str) -> str:
    if v is None:
        return "-"
    digits = 3 if unit in ("texts/s", "images/s", "clips/s") and v < 10 else 2 if v < 10 else 1 if v < 1000 else 0
    return f"{v:,.{digits}f} {unit}"


def summary(vals: list, unit: str) -> str:
    vals = [v for v in vals if v is not None]
    if not vals:
        return "-"
    s = fmt(statistics.median(vals), unit)
    return s if len(vals) == 1 else f"{s} ({fmt(min(vals), '').strip()}-{fmt(max(vals), '').strip()})"


def cell(text: str) -> str:
    return text.replace("|", "/").replace("\n", " ")


def table(results: dict, a) -> str:
    cpus = {}
    lines = ["| what | gemmalite | peer | peer's figure | gemmalite / peer (min-max) | run | command |",
             "|---|---|---|---|---|---|---|"]
    for row in ROWS:
        rec = results.get(row.id)
        if rec is None:
            why = ("not run: --quick runs the Gemma 3 270M rows only" if a.quick and not row.quick
                   else f"not run yet: `python scripts/bench_all.py --only {row.id}`")
            lines.append(f"| **{row.title}** | {why} | | | | | |")
            continue
        cpu = cpus.setdefault(rec["machine"], f"cpu{len(cpus) + 1}")
        run = f"{rec['date']}, {cpu}, load {rec['load_before']}" + (
            f"-{rec['load_after']}" if "load_after" in rec else "")
        cmd = f"[{row.id}](#{row.id})"
        notes = {f["peer_note"] for f in rec.get("figs", [])} - {""}
        status = " ".join(([] if rec["status"] == "ok" else [rec["status"]]) + [f"peer {n}" for n in sorted(notes)])
        lines.append(f"| **{row.title}** | {cell(status)} | | | | {run} | {cmd} |")
        for f in rec.get("figs", []):
            ratios = [o / p for o, p in zip(f["ours"], f["peer"]) if o and p]
            ratio = "-" if not ratios else f"**{statistics.median(ratios):.2f}x**" + (
                f" ({min(ratios):.2f}-{max(ratios):.2f}, {len(ratios)} rounds)" if len(ratios) > 1 else "")
            peer = summary(f["peer"], f["unit"]) if not f["peer_note"] else f["peer_note"].split(":")[0]
            lines.append(f"| {f['what']} | {summary(f['ours'], f['unit'])} | {f['peer_name']} | {peer} | {ratio} "
                         f"| | |")
    lines.append("")
    lines += [f"{v}: {k}" + "  " for k, v in cpus.items()]
    lines.append("")
    lines.append("Commands (each row: `python scripts/bench_all.py --only ROW`, which runs):")
    lines.append("")
    for row in ROWS:
        rec = results.get(row.id)
        if rec and rec.get("commands"):
            cmds = "\n".join(rec["commands"])
            lines += [f'<a id="{row.id}"></a>**{row.id}** (`{rec["bench_all"]}`), each {rec.get("rounds", 1)} '
                      f"time(s):", "", "```bash", cmds, "```", ""]
    return "\n".join(lines)


def svg_plot(title: str, xlabel: str, ylabel: str, series: dict[str, list[tuple[float, float]]], logx: bool) -> str:
    """A small line chart, written by hand (no plotting dependency)."""
    w, h, l, r, t, b = 640, 400, 70, 170, 40, 50
    xs = [x for pts in series.values() for x, _ in pts]
    ys = [y for pts in series.values() for _, y in pts]
    if not xs:
        return ""
    tx = (lambda v: math.log2(v)) if logx else (lambda v: v)
    x0, x1 = tx(min(xs)), tx(max(xs))
    x1 = x1 if x1 > x0 else x0 + 1
    y1 = max(ys) * 1.1 or 1.0

    def px(x: float) -> float:
        return l + (tx(x) - x0) / (x1 - x0) * (w - l - r)

    def py_(y: float) -> float:
        return h - b - y / y1 * (h - t - b)

    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="sans-serif" '
           f'font-size="12"><rect width="{w}" height="{h}" fill="white"/>',
           f'<text x="{w / 2}" y="20" text-anchor="middle" font-size="14">{title}</text>',
           f'<line x1="{l}" y1="{h - b}" x2="{w - r}" y2="{h - b}" stroke="black"/>',
           f'<line x1="{l}" y1="{t}" x2="{l}" y2="{h - b}" stroke="black"/>',
           f'<text x="{(l + w - r) / 2}" y="{h - 12}" text-anchor="middle">{xlabel}</text>',
           f'<text x="16" y="{(t + h - b) / 2}" text-anchor="middle" transform="rotate(-90 16 {(t + h - b) / 2})">'
           f'{ylabel}</text>']
    for x in sorted(set(xs)):
        out.append(f'<text x="{px(x):.1f}" y="{h - b + 16}" text-anchor="middle">{x:g}</text>')
    for i in range(6):
        y = y1 * i / 5
        out.append(f'<line x1="{l - 4}" y1="{py_(y):.1f}" x2="{w - r}" y2="{py_(y):.1f}" stroke="#ddd"/>'
                   f'<text x="{l - 8}" y="{py_(y) + 4:.1f}" text-anchor="end">{y:.3g}</text>')
    colours = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd"]
    for i, (name, pts) in enumerate(series.items()):
        c, pts = colours[i % len(colours)], sorted(pts)
        out.append(f'<polyline fill="none" stroke="{c}" stroke-width="2" points="'
                   + " ".join(f"{px(x):.1f},{py_(y):.1f}" for x, y in pts) + '"/>')
        out += [f'<circle cx="{px(x):.1f}" cy="{py_(y):.1f}" r="3" fill="{c}"/>' for x, y in pts]
        out.append(f'<rect x="{w - r + 12}" y="{t + 20 * i}" width="12" height="12" fill="{c}"/>'
                   f'<text x="{w - r + 30}" y="{t + 20 * i + 11}">{name}</text>')
    return "\n".join(out + ["</svg>", ""])


def plots(results: dict, out: Path, suffix: str) -> list[Path]:
    written = []
    for row in ROWS:
        rec = results.get(row.id)
        if not row.plot or not rec or not rec.get("figs"):
            continue
        name, xlabel, ylabel = row.plot
        series: dict[str, list] = {}
        for f in rec["figs"]:
            if f["series"] != name:
                continue
            for who, vals in (("gemmalite", f["ours"]), (f["peer_name"], f["peer"])):
                vals = [v for v in vals if v is not None]
                if vals:
                    series.setdefault(who, []).append((f["x"], statistics.median(vals)))
        svg = svg_plot(f"{row.id}: {rec['date']}, load {rec['load_before']}", xlabel, ylabel, series,
                       logx=xlabel.startswith("prompt"))
        if svg:
            path = out / f"{row.id}{suffix}.svg"
            path.write_text(svg)
            written.append(path)
    return written


def header(a) -> str:
    return (f"Produced by `python scripts/bench_all.py{' --quick' if a.quick else ''}`: each row's run (date UTC, "
            f"CPU, load average at its start and end) is its own; {a.threads} threads for every runtime, each in its "
            "own process, gemmalite and its peer alternated round by round (medians; the ratio's min-max over the "
            f"rounds). The load says how busy the machine ({os.cpu_count()} CPUs) was: a row run at a load near or "
            "above its CPU count shared them with other work, so its absolute speeds are low and noisy; read its "
            "ratios. E2B / EmbeddingGemma 2 rows: random weights of the real shapes (`scripts/bench_inputs.py`).")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="the Gemma 3 270M rows only, short prompts, 2 rounds")
    ap.add_argument("--smoke", action="store_true",
                    help="prove that rows run: 1 round, the shortest settings (figures mean nothing), results in a "
                         "temporary folder unless --out")
    ap.add_argument("--only", default=None, help="comma-separated row ids: " + ", ".join(r.id for r in ROWS))
    ap.add_argument("--out", type=Path, default=None,
                    help="results.json, table.md and the SVGs (default docs/benchmarks; --quick: a temporary folder)")
    ap.add_argument("--page", type=Path, default=None,
                    help=f"replace the part of this markdown file between {BEGIN} and {END} with the table")
    ap.add_argument("--rounds", type=int, default=None, help="alternations per row (default 2; 3 in a full run)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=3600, help="seconds a command may take")
    synth = Path(os.environ.get("GEMMALITE_SYNTH") or Path.home() / ".cache" / "gemmalite-synth")
    for name in INPUTS:
        ap.add_argument(f"--{name}", default=str(synth / name) if (synth / name).exists() else None,
                        help=f"{INPUTS[name]} (default $GEMMALITE_SYNTH/{name}, $GEMMALITE_SYNTH: ~/.cache/gemmalite-synth)")
    ap.add_argument("--llama-bin", default=os.environ.get("GEMMALITE_LLAMA_BIN"), metavar="DIR",
                    help="folder of llama.cpp's llama-bench and llama-server (default $GEMMALITE_LLAMA_BIN)")
    ap.add_argument("--llama-server", default=None, metavar="BIN", help="default: in --llama-bin, or on PATH")
    ap.add_argument("--llama-bench", default=None, metavar="BIN",
                    help="llama.cpp's benchmark: the E2B rows' peer, and the Gemma 3 rows' when llama-cpp-python "
                         "cannot run (default: in --llama-bin, beside --llama-server, or on PATH)")
    ap.add_argument("--images", type=int, default=8)
    ap.add_argument("--docs", type=int, default=32, help="EmbeddingGemma 2 documents of 512 tokens")
    ap.add_argument("--list", action="store_true", help="print the rows and exit")
    ap.add_argument("--no-run", action="store_true", help="rewrite the table, plots (and --page) from results.json")
    a = ap.parse_args(argv)
    if a.list:
        for r in ROWS:
            print(f"{r.id:12s} {'quick' if r.quick else 'full '} {r.title}")
        return 0
    if a.smoke:
        a.rounds, a.images, a.docs = a.rounds or 1, 1, 2
    a.rounds = a.rounds or (2 if a.quick else 3)
    a.llama_server = a.llama_server or find_binary("llama-server", a.llama_bin)
    a.llama_bench = a.llama_bench or find_binary("llama-bench", a.llama_bin or (
        Path(a.llama_server).parent if a.llama_server else None))
    a.out = a.out or (Path(tempfile.gettempdir()) / f"gemmalite-bench-{'smoke' if a.smoke else 'quick'}"
                      if a.quick or a.smoke else ROOT / "docs" / "benchmarks")
    a.out.mkdir(parents=True, exist_ok=True)
    ids = [r.id for r in ROWS]
    only = a.only.split(",") if a.only else [r.id for r in ROWS if r.quick or not a.quick]  # in this order
    only = [] if a.no_run else only
    bad = [i for i in only if i not in ids]
    if bad:
        ap.error(f"unknown rows {bad}; rows: {', '.join(ids)}")
    store = a.out / "results.json"
    results = json.loads(store.read_text()) if store.exists() else {}
    for row in [next(r for r in ROWS if r.id == i) for i in only]:
        print(f"== {row.id}: {row.title}", file=sys.stderr, flush=True)
        results[row.id] = run_row(row, a)
        print(f"   {results[row.id]['status']}", file=sys.stderr, flush=True)
        store.write_text(json.dumps(results, indent=1))
    text = header(a) + "\n\n" + table(results, a)
    (a.out / "table.md").write_text(text + "\n")
    svgs = plots(results, a.out.resolve(), "")
    if a.page and svgs:
        text += "\n\n" + " ".join(f"![{p.stem}]({os.path.relpath(p, a.page.resolve().parent)})" for p in svgs)
    print(text)
    print(f"\nwrote {store}, {a.out / 'table.md'}" + "".join(f", {p}" for p in svgs), file=sys.stderr)
    if a.page:
        page = a.page.read_text()
        if BEGIN not in page or END not in page:
            raise SystemExit(f"{a.page} has no {BEGIN} ... {END} block")
        head, rest = page.split(BEGIN, 1)
        a.page.write_text(head + BEGIN + "\n" + text + "\n" + END + rest.split(END, 1)[1])
    return 0


if __name__ == "__main__":
    sys.exit(main())
