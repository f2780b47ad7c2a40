#!/usr/bin/env python3
r"""gemmalite's own kernels against its ONNX export on ONNX Runtime (CPU provider), one checkpoint, one run.
Run by hand, never in CI.

For each weight format (``--only float,int8,int4``):

  gemmalite        ``gemmalite bench MODEL --json`` (float: bf16 weights used in place; int8 / int4:
                   ``--converted-int8`` / ``--converted-int4`` folders, else ``--quant`` on load)
  onnxruntime      ``gemmalite export`` of the same weights (float widened to float32; int8 / int4 as
                   MatMulNBits, accuracy_level 4), then ``gemmalite bench EXPORT --backend onnxruntime
                   --json``: the graph with a free row count, one session (one copy of the weights)
  onnxruntime static (``--static``) the static decode / prefill pair (two sessions: two copies)

Same prompt (``--prompt-tokens`` random ids, as ``gemmalite bench`` draws them), same threads; each
runtime in its own process, so each peak RSS is its own (host tables memory-mapped alike); with
``--rounds R`` they alternate (A B A B), medians reported, and each measurement records how many
cores other processes kept busy meanwhile (``others``). Exports go to ``--exports`` (default a
temporary folder, each removed after its format's rounds unless ``--keep``; E2B float: 7.5 GB of
float32 weights plus 5.5 GB of host tables, so keep room), and an export already there is reused.

    python scripts/bench_onnx.py --model SYNTH/e2b --converted-int8 SYNTH/e2b-int8 \
        --converted-int4 SYNTH/e2b-int4 --new-tokens 32 --runs 2 --rounds 2 --json onnx.json

Prints decode / prefill tok/s and peak RSS per runtime and format, and ONNX Runtime's ratio to ours.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from compare_peers import median_of, run_json, wait_idle  # noqa: E402

FORMATS = ("float", "int8", "int4")


def source(a, fmt: str) -> tuple[str, list[str]]:
    """The checkpoint a format runs from, and the ``--quant`` it needs (none for a converted folder)."""
    conv = getattr(a, f"converted_{fmt}", None) if fmt != "float" else None
    if conv:
        return str(conv), []
    return str(a.model), [] if fmt == "float" else ["--quant", fmt]


def export_once(a, fmt: str, folder: Path, env: dict) -> dict:
    """``gemmalite export`` into ``folder`` unless a finished export is there; its time and peak RSS."""
    if (folder / "gemmalite-manifest.json").is_file():
        return {"reused": str(folder)}
    src, quant = source(a, fmt)
    code = ("import json, resource, sys, time; from gemmalite.tools.export import export; t = time.perf_counter(); "
            f"export({src!r}, {str(folder)!r}, context={a.context}, quant={(quant[1] if quant else None)!r}, force=True); "
            "print(json.dumps({'export_s': round(time.perf_counter() - t, 1), "
            "'peak_rss_bytes': resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))")
    return run_json([sys.executable, "-c", code], env, a.timeout)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, required=True, help="float checkpoint folder (gemmalite synth --preset e2b)")
    ap.add_argument("--converted-int8", type=Path, default=None)
    ap.add_argument("--converted-int4", type=Path, default=None)
    ap.add_argument("--only", default=",".join(FORMATS), help="comma-separated: float,int8,int4")
    ap.add_argument("--static", action="store_true", help="also the static decode / prefill pair (two sessions)")
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--context", type=int, default=None, help="KV cache length (default: prompt + new tokens, >= 256)")
    ap.add_argument("--exports", type=Path, default=None, help="folder for the exports (default: temporary)")
    ap.add_argument("--keep", action="store_true", help="keep the exports")
    ap.add_argument("--wait-idle", type=float, default=0, metavar="S", help="wait up to S s for a quiet machine first")
    ap.add_argument("--timeout", type=float, default=3600)
    ap.add_argument("--json", type=Path, default=None, help="write the results here")
    a = ap.parse_args(argv)
    fmts = a.only.split(",")
    if any(f not in FORMATS for f in fmts):
        ap.error(f"--only takes {', '.join(FORMATS)}")
    a.context = a.context or max(a.prompt_tokens + a.new_tokens + 1, 256)
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
    exports = a.exports or Path(tempfile.mkdtemp(prefix="bench_onnx_"))
    exports.mkdir(parents=True, exist_ok=True)
    common = ["--prompt-tokens", str(a.prompt_tokens), "--new-tokens", str(a.new_tokens), "--runs", str(a.runs),
              "--threads", str(a.threads), "--json"]
    bench = [sys.executable, "-m", "gemmalite.cli", "bench"]
    results: dict = {"args": {k: str(v) for k, v in vars(a).items()}, "load_before": os.getloadavg()[0],
                     "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "formats": {}}
    try:
        for fmt in fmts:
            folder = exports / f"onnx-{fmt}"
            print(f"== {fmt}: exporting to {folder}", file=sys.stderr, flush=True)
            exp = export_once(a, fmt, folder, env)
            if "error" in exp:
                results["formats"][fmt] = {"export": exp}
                print(f"   export failed: {exp['error']}", file=sys.stderr)
                continue
            src, quant = source(a, fmt)
            runs = {"gemmalite": [*bench, src, *quant, "--context", str(a.context), *common],
                    "onnxruntime": [*bench, str(folder), "--backend", "onnxruntime", *common]}
            if a.static:
                runs["onnxruntime static"] = [*runs["onnxruntime"], "--static-shapes"]
            raw: dict[str, list] = {k: [] for k in runs}
            for _ in range(a.rounds):
                for name, cmd in runs.items():
                    if a.wait_idle:
                        wait_idle(a.wait_idle)
                    r = run_json(cmd, env, a.timeout)
                    print(f"   {name}: " + (r.get("error") or f"decode {r['decode_tok_s']} tok/s, prefill "
                          f"{r['prefill_tok_s']} tok/s, peak RSS {r['peak_rss_bytes'] / 2**30:.2f} GiB, others "
                          f"{r['others_cores']}"), file=sys.stderr, flush=True)
                    raw[name].append(r)
            results["formats"][fmt] = {"export": exp, "medians": {k: median_of(v, 0.2) for k, v in raw.items()},
                                       "rounds": raw}
            if not a.keep and not a.exports:
                shutil.rmtree(folder, ignore_errors=True)
    finally:
        if not a.keep and not a.exports:
            shutil.rmtree(exports, ignore_errors=True)
    results["load_after"] = os.getloadavg()[0]
    print(table(results))
    if a.json:
        a.json.write_text(json.dumps(results, indent=1))
    return 0


def table(results: dict) -> str:
    lines = [f"{'format':7s} {'runtime':20s} {'decode tok/s':>12s} {'prefill tok/s':>13s} {'peak RSS GiB':>12s} "
             f"{'weights':>22s} {'others':>6s}"]
    for fmt, r in results["formats"].items():
        med = r.get("medians", {})
        for name, m in med.items():
            if "error" in m:
                lines.append(f"{fmt:7s} {name:20s} {m['error'][:80]}")
                continue
            lines.append(f"{fmt:7s} {name:20s} {m['decode_tok_s']:12.2f} {m['prefill_tok_s']:13.1f} "
                         f"{m['peak_rss_bytes'] / 2**30:12.2f} {m['weights'][:22]:>22s} {m['others_cores']:6.2f}")
        g, o = med.get("gemmalite", {}), med.get("onnxruntime", {})
        if "decode_tok_s" in g and "decode_tok_s" in o:
            lines.append(f"{fmt:7s} {'onnxruntime / ours':20s} {o['decode_tok_s'] / g['decode_tok_s']:11.2f}x "
                         f"{o['prefill_tok_s'] / g['prefill_tok_s']:12.2f}x "
                         f"{o['peak_rss_bytes'] / g['peak_rss_bytes']:11.2f}x")
        if "export_s" in r.get("export", {}):
            lines.append(f"{fmt:7s} {'(export)':20s} {r['export']['export_s']:.0f} s, peak RSS "
                         f"{r['export']['peak_rss_bytes'] / 2**30:.2f} GiB")
    lines.append(f"(medians; load average {results['load_before']:.1f} before, {results['load_after']:.1f} after; "
                 "others: cores other processes kept busy during a measurement)")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
