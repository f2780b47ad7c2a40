#!/usr/bin/env python3
"""Audio side by side (issue 21 item 8): EmbeddingGemma 2 audio embeddings and Gemma 4 E2B's time to
the first token of a chat turn with a clip, each runtime in its own process. Run by hand, never in CI.

    python scripts/bench_audio.py embed EG2_DIR [--converted-int8 DIR] [--clips 8] [--seconds 10]
                                  [--rounds 3] [--threads 2] [--engines ...] [--json]
    python scripts/bench_audio.py ttft E2B_DIR [--converted-int8 DIR] [--seconds 10] [--rounds 3]
                                  [--threads 2] [--hf-float32] [--engines ...] [--json]

``embed``: clips/s for ``--clips`` clips of ``--seconds`` s embedded in one call (after a warm-up
clip), for gemmalite int8 (quantized on load, or ``--converted-int8``: a ``gemmalite convert
--quant int8`` folder, what a user runs) and float32 (the folder's weights), egemma2 (CPU,
``--threads`` / ``--small-threads``) and transformers (``EmbeddingGemma2Model`` float32, eager;
features from its Gemma4AudioFeatureExtractor, the ids as EmbeddingGemma2Processor places
them); peak RSS of each process (egemma2: its server's). gemmalite's workers also report where
one clip's time goes: features (log-mel), the audio tower by stage (subsampling convolutions,
feed-forwards, attention, light convolution, the rest) and the text encoder.

``ttft``: seconds from the call to the first token of a chat turn "What is said in this clip?"
with one ``--seconds`` s clip, gemmalite int8 / float32 against transformers bf16
(``Gemma4ForConditionalGeneration.generate(max_new_tokens=1)``, features extracted inside the
timing; ``--hf-float32`` adds transformers float32); each engine takes a new clip per timed turn
(no soft-token cache hit), median of ``--turns``.

gemmalite runs as a user gets it: every CPU the process may use (``NUMBA_NUM_THREADS`` =
``--threads``), its governor dropping to one thread while the machine is busy. Clips:
deterministic synthetic signals (a gliding tone with harmonics, an amplitude envelope and noise, a
different seed per clip), not speech: the cost of every stage depends on the clip's length only.
Engines alternate within each round (A B C A B C ...); the tables give medians over the rounds
and the ratios against the peers (TTFT: ours / theirs, lower is better).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

_CLIPS = """
import json, os, resource, sys, time
import numpy as np
model, quant, threads, n, seconds = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), float(sys.argv[5])
def clip(seed):  # a gliding tone with harmonics, an envelope and noise; 16 kHz float32
    rng = np.random.default_rng(1000 + seed)
    t = np.arange(int(round(seconds * 16000))) / 16000
    f0 = 120 + 80 * rng.random() + 60 * np.sin(2 * np.pi * 0.4 * t)
    ph = 2 * np.pi * np.cumsum(f0) / 16000
    x = sum(0.25 / k * np.sin(k * ph) for k in range(1, 6)) * (0.6 + 0.4 * np.sin(2 * np.pi * 3.1 * t))
    return (x + 0.02 * rng.standard_normal(t.size)).astype(np.float32)
def rss(who=resource.RUSAGE_SELF):
    return resource.getrusage(who).ru_maxrss * 1024
"""

_EMBED_PROFILE = """
def profile(emb, x):
    # where one new clip's time goes: features, the tower's stages, the text encoder
    from gemmalite.audio import tower as T
    from gemmalite.audio.features import log_mel
    tw = emb.audio.tower
    spent = {}
    def timed(name, fn):
        def run(*a, **k):
            t = time.perf_counter(); r = fn(*a, **k); spent[name] = spent.get(name, 0.0) + time.perf_counter() - t
            return r
        return run
    saved = {k: getattr(tw, k) for k in ("_feed_forward", "_attention", "_light_conv")}
    conv = T._subsample
    for k, fn in saved.items():
        setattr(tw, k, timed(k.strip("_"), fn))
    T._subsample = timed("subsampling", conv)
    try:
        t = time.perf_counter(); feats, valid = log_mel(x); features = time.perf_counter() - t
        t = time.perf_counter(); soft = tw.project(tw.forward(feats[:valid])); tower = time.perf_counter() - t
    finally:
        for k in saved:
            delattr(tw, k)
        T._subsample = conv
    prepared = emb.prepare([{"audio": x}])  # the soft tokens are cached now: this is placement only
    t = time.perf_counter(); emb.embed_prepared(prepared); text = time.perf_counter() - t
    out = {"features": features, "audio_tower": tower, "text_encoder": text, "soft_tokens": soft.shape[0]}
    out.update({"tower_" + k: v for k, v in spent.items()})
    out["tower_rest"] = tower - sum(spent.values())
    return out
"""

_EMBED = {
    "gemmalite": _CLIPS + _EMBED_PROFILE + """
from gemmalite import load_embedder
clips = [clip(i) for i in range(n + 2)]  # warm-up, n timed, one for the profile
t0 = time.perf_counter()
emb = load_embedder(model, quant=None if quant in ("none", "converted") else quant)
load = time.perf_counter() - t0
emb.embed([{"audio": clips[0]}])
t = time.perf_counter(); v = emb.embed([{"audio": c} for c in clips[1:-1]]); d = time.perf_counter() - t
assert v.shape[0] == n
prof = profile(emb, clips[-1])
print(json.dumps({"load_s": load, "clips_s": n / d, "peak_rss_bytes": rss(), "profile_s": prof}))
""",
    "transformers": _CLIPS + """
import torch
torch.set_num_threads(threads)
from transformers import AutoModel, AutoTokenizer
from transformers.models.gemma4.feature_extraction_gemma4 import Gemma4AudioFeatureExtractor
clips = [clip(i) for i in range(n + 1)]
t0 = time.perf_counter()
m = AutoModel.from_pretrained(model, dtype=torch.float32, attn_implementation="eager").eval()
tok = AutoTokenizer.from_pretrained(model)
fe = Gemma4AudioFeatureExtractor()
load = time.perf_counter() - t0
@torch.no_grad()
def embed(xs):
    out = []
    for x in xs:  # EmbeddingGemma2Processor's layout of a clip alone: <bos><|audio>N x <|audio|><audio|><eos>
        f = fe([x], return_tensors="pt")
        mask = f["input_features_mask"]
        n_soft = int(-(-int(mask.sum()) // 4))  # Gemma4Processor: ceil(valid frames / 4)
        ids = tok("<|audio>" + "<|audio|>" * n_soft + "<audio|>", return_tensors="pt")["input_ids"]
        h = m(input_ids=ids, attention_mask=torch.ones_like(ids), input_features=f["input_features"],
              input_features_mask=mask).last_hidden_state.mean(1)
        out.append(torch.nn.functional.normalize(h, dim=-1))
    return torch.cat(out)
embed(clips[:1])
t = time.perf_counter(); embed(clips[1:]); d = time.perf_counter() - t
print(json.dumps({"load_s": load, "clips_s": n / d, "peak_rss_bytes": rss()}))
""",
    "egemma2": _CLIPS + """
from egemma2 import Egemma2
clips = [clip(i) for i in range(n + 1)]
t0 = time.perf_counter()
with Egemma2(model_dir=model, device="cpu", args=["--threads", str(threads), "--small-threads", str(threads)],
             stderr=open(os.devnull, "w")) as e:
    v = e.embed([{"audio": (clips[0], 16000)}]); load = time.perf_counter() - t0
    t = time.perf_counter(); v = e.embed([{"audio": (c, 16000)} for c in clips[1:]]); d = time.perf_counter() - t
    assert len(v) == n
print(json.dumps({"load_s": load, "clips_s": n / d, "peak_rss_bytes": rss(resource.RUSAGE_CHILDREN)}))
""",
}

QUESTION = "What is said in this clip?"

_TTFT = {
    "gemmalite": _CLIPS + """
import gemmalite
turns = n
clips = [clip(i) for i in range(turns + 1)]
t0 = time.perf_counter()
m = gemmalite.load(model, quant=None if quant in ("none", "converted") else quant)
load = time.perf_counter() - t0
def msgs(x):
    return [{"role": "user", "content": [{"type": "audio", "audio": x}, {"type": "text", "text": %r}]}]
res = []
for x in clips:  # the first turn compiles and warms up; not counted
    t = time.perf_counter()
    for _ in m.session().chat(msgs(x), max_new_tokens=1, temperature=0, stream=True):
        break
    res.append(time.perf_counter() - t)
ids = m.with_media(m.tokenizer.chat_ids(msgs(clips[0]), add_generation_prompt=True), audio=[clips[0]])[0]
print(json.dumps({"load_s": load, "ttft_s": sorted(res[1:])[len(res[1:]) // 2], "ttft_all_s": res[1:],
                  "prompt_tokens": int(len(ids)), "peak_rss_bytes": rss()}))
""" % QUESTION,
    "transformers": _CLIPS + """
import torch
torch.set_num_threads(threads)
from transformers import AutoTokenizer, Gemma4ForConditionalGeneration
from transformers.models.gemma4.feature_extraction_gemma4 import Gemma4AudioFeatureExtractor
dtype = {"bf16": torch.bfloat16, "float32": torch.float32}[quant]
turns = n
clips = [clip(i) for i in range(turns + 1)]
t0 = time.perf_counter()
hf = Gemma4ForConditionalGeneration.from_pretrained(model, dtype=dtype).eval()
tok = AutoTokenizer.from_pretrained(model)
fe = Gemma4AudioFeatureExtractor()
load = time.perf_counter() - t0
msgs = [{"role": "user", "content": [{"type": "audio"}, {"type": "text", "text": %r}]}]
text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
res = []
for x in clips:
    t = time.perf_counter()
    f = fe([x], return_tensors="pt")
    mask = f["input_features_mask"]
    n_soft = int(-(-int(mask.sum()) // 4))  # Gemma4Processor.replace_audio_token: ceil(valid frames / 4)
    ids = tok(text.replace("<|audio|>", "<|audio>" + "<|audio|>" * n_soft + "<audio|>", 1), return_tensors="pt",
              add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        hf.generate(input_ids=ids, attention_mask=torch.ones_like(ids), input_features=f["input_features"].to(dtype),
                    input_features_mask=mask, max_new_tokens=1, do_sample=False)
    res.append(time.perf_counter() - t)
print(json.dumps({"load_s": load, "ttft_s": sorted(res[1:])[len(res[1:]) // 2], "ttft_all_s": res[1:],
                  "prompt_tokens": int(ids.shape[1]), "peak_rss_bytes": rss()}))
""" % QUESTION,
}

EMBED_ENGINES = ["gemmalite/int8", "gemmalite/none", "egemma2/none", "transformers/none"]
TTFT_ENGINES = ["gemmalite/int8", "gemmalite/none", "transformers/bf16"]
FIGURES = {"embed": ("load_s", "clips_s", "peak_rss_bytes"), "ttft": ("load_s", "ttft_s", "peak_rss_bytes")}


def run(workers: dict, engine: str, model: str, quant: str, threads: int, n: int, seconds: float,
        timeout: float) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), NUMBA_NUM_THREADS=str(threads),
               OPENBLAS_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    try:
        p = subprocess.run([sys.executable, "-c", workers[engine], model, quant, str(threads), str(n), str(seconds)],
                           capture_output=True, text=True, env=env, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    if p.returncode:
        return {"error": (p.stderr.strip().splitlines() or [f"exit {p.returncode}"])[-1][:200]}
    return json.loads(p.stdout.strip().splitlines()[-1])


def medians(rs: list[dict], keys) -> dict:
    ok = [r for r in rs if "error" not in r]
    if not ok:
        return {"error": rs[0]["error"]}
    out = {k: statistics.median(r[k] for r in ok) for k in keys}
    if "profile_s" in ok[0]:
        out["profile_s"] = {k: statistics.median(r["profile_s"][k] for r in ok) for k in ok[0]["profile_s"]
                            if ok[0]["profile_s"][k] is not None}
    if "prompt_tokens" in ok[0]:
        out["prompt_tokens"] = ok[0]["prompt_tokens"]
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=("embed", "ttft"))
    ap.add_argument("model", help="EmbeddingGemma 2 folder (embed) or Gemma 4 E2B folder (ttft), with the audio tower")
    ap.add_argument("--converted-int8", default=None, metavar="DIR",
                    help="a `gemmalite convert --quant int8` output of MODEL: the int8 row runs it")
    ap.add_argument("--clips", type=int, default=8, help="embed: clips per timed call")
    ap.add_argument("--turns", type=int, default=3, help="ttft: timed chat turns per process (median)")
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--hf-float32", action="store_true", help="ttft: transformers float32 too")
    ap.add_argument("--engines", default=None, help="comma-separated ENGINE/QUANT list (default: "
                    f"embed {','.join(EMBED_ENGINES)}; ttft {','.join(TTFT_ENGINES)})")
    ap.add_argument("--timeout", type=float, default=3600, help="seconds one worker may take")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    workers = _EMBED if a.what == "embed" else _TTFT
    engines = (a.engines.split(",") if a.engines else
               list(EMBED_ENGINES if a.what == "embed" else TTFT_ENGINES + ["transformers/float32"] * a.hf_float32))
    n = a.clips if a.what == "embed" else a.turns
    raw: dict[str, list[dict]] = {e: [] for e in engines}
    for _ in range(a.rounds):
        for e in engines:
            eng, quant = e.split("/")
            model = a.model
            if eng == "gemmalite" and quant == "int8" and a.converted_int8:
                model, quant = a.converted_int8, "converted"
            r = run(workers, eng, model, quant, a.threads, n, a.seconds, a.timeout)
            raw[e].append(r)
            print(f"# {e}: {json.dumps(r)}", file=sys.stderr, flush=True)
    table = {e: medians(rs, FIGURES[a.what]) for e, rs in raw.items()}
    speed = "clips_s" if a.what == "embed" else "ttft_s"
    ratios = {}
    for e, r in table.items():
        if e.startswith("gemmalite") and "error" not in r:
            for p, q in table.items():
                if not p.startswith("gemmalite") and "error" not in q:
                    ratios[f"{e} vs {p}"] = r[speed] / q[speed]
    args = {k: v for k, v in vars(a).items() if k != "json"}
    if a.json:
        print(json.dumps({"what": a.what, "args": args, "median": table, "ratios": ratios, "raw": raw}))
        return 0
    unit = "clips/s" if a.what == "embed" else "TTFT s"
    print(f"{a.what}: {a.model}, {a.clips if a.what == 'embed' else 1} clip(s) of {a.seconds:g} s, "
          f"{a.threads} threads, {a.rounds} round(s), medians")
    print(f"{'engine':22s} {'load s':>8s} {unit:>10s} {'peak RSS GiB':>13s}")
    for e, r in table.items():
        if "error" in r:
            print(f"{e:22s} error: {r['error']}")
            continue
        print(f"{e:22s} {r['load_s']:8.2f} {r[speed]:10.4f} {r['peak_rss_bytes'] / 2**30:13.2f}")
    for k, v in ratios.items():
        what = "speed" if a.what == "embed" else "TTFT"
        print(f"{k}: {what} ratio {v:.2f}")
    for e, r in table.items():
        if "profile_s" in r:
            print(f"{e}, one clip (s): " + ", ".join(f"{k} {v:.3f}" for k, v in r["profile_s"].items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
