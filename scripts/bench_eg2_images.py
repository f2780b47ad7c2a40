#!/usr/bin/env python3
"""EmbeddingGemma 2 image embeddings side by side: gemmalite (int8, float32) vs egemma2 (CPU) vs
transformers (float32 CPU), the workload of issue 13: images/s for ``--images`` 768 x 768 images,
one embedding each, plus each engine's peak RSS.

    python scripts/bench_eg2_images.py MODEL [--rounds 1] [--threads 2] [--images 8] [--json]

MODEL: a full multimodal folder (``gemmalite synth --preset eg2 OUT``). Each engine runs in its
own process with ``--threads`` threads, engines interleaved within each round; after a warm-up
image the ``--images`` images are embedded in one call and timed. Peak RSS is the worker's
``ru_maxrss`` (egemma2: its server process's). gemmalite's worker also reports where one
image's time goes (preprocessing, vision tower with its attention share, text encoder).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

_COMMON = """
import json, resource, sys, time
import numpy as np
model, quant, threads, n = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
rng = np.random.default_rng(0)
yy, xx = np.mgrid[0:768, 0:768]
def image(i):
    base = np.stack([xx * 255 / 768, yy * 255 / 768, (xx + yy + 97 * i) % 256], -1)
    return np.clip(base + rng.normal(0, 30, (768, 768, 3)), 0, 255).astype(np.uint8)
images = [image(i) for i in range(n + 2)]  # warm-up, n timed, one for the profile
def rss():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
"""

_WORKERS = {
    "gemmalite": _COMMON + """
from gemmalite import load_embedder
t0 = time.perf_counter()
emb = load_embedder(model, quant=None if quant == "none" else quant)
load = time.perf_counter() - t0
emb.embed(images[0])
t = time.perf_counter(); emb.embed(images[1:-1]); d = time.perf_counter() - t
# where one (new) image's time goes
import cProfile, pstats
from gemmalite.vision.preprocess import preprocess
t = time.perf_counter(); emb.embed(images[-1]); one = time.perf_counter() - t
t = time.perf_counter(); p = preprocess(images[-1], emb.vision.processor); pre = time.perf_counter() - t
prof = cProfile.Profile(); t = time.perf_counter(); prof.enable(); emb.vision.tower(p); prof.disable()
tower = time.perf_counter() - t
st = pstats.Stats(prof)
attn = sum(v[3] for k, v in st.stats.items() if k[2] == "attention")  # cumulative time in kernels.ops.attention
print(json.dumps({"load_s": load, "images_s": n / d, "peak_rss_bytes": rss(),
                  "profile_s": {"one_image": one, "preprocess": pre, "tower": tower, "tower_attention": attn,
                                "text_encoder_and_rest": one - pre - tower}}))
""",
    "transformers": _COMMON + """
import torch
from PIL import Image
torch.set_num_threads(threads)
from transformers import AutoModel, AutoTokenizer
from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil
t0 = time.perf_counter()
m = AutoModel.from_pretrained(model, dtype=torch.float32, attn_implementation="eager").eval()
tok = AutoTokenizer.from_pretrained(model)
conf = json.load(open(model + "/processor_config.json"))["image_processor"]
proc = Gemma4ImageProcessorPil(**{k: v for k, v in conf.items() if k != "image_processor_type"})
load = time.perf_counter() - t0
@torch.no_grad()
def embed(ims):
    out = []
    for im in ims:  # the processor's layout for an image alone: <bos><|image>N x <|image|><image|><eos>
        f = proc([Image.fromarray(im)], return_tensors="pt")
        n_soft = int(f["num_soft_tokens_per_image"][0])
        ids = tok("<|image>" + "<|image|>" * n_soft + "<image|>", return_tensors="pt")["input_ids"]
        h = m(input_ids=ids, attention_mask=torch.ones_like(ids), pixel_values=f["pixel_values"],
              image_position_ids=f["image_position_ids"]).last_hidden_state.mean(1)
        out.append(torch.nn.functional.normalize(h, dim=-1))
    return torch.cat(out)
embed(images[:1])
t = time.perf_counter(); embed(images[1:-1]); d = time.perf_counter() - t
print(json.dumps({"load_s": load, "images_s": n / d, "peak_rss_bytes": rss()}))
""",
    "egemma2": _COMMON + """
from egemma2 import Egemma2
t0 = time.perf_counter()
with Egemma2(model_dir=model, device="cpu", args=["--threads", str(threads), "--small-threads", str(threads)],
             stderr=open(os.devnull, "w")) as e:
    e.embed(images[0]); load = time.perf_counter() - t0
    t = time.perf_counter(); e.embed(images[1:-1]); d = time.perf_counter() - t
print(json.dumps({"load_s": load, "images_s": n / d,
                  "peak_rss_bytes": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024}))
""".replace("from egemma2", "import os\nfrom egemma2"),
}

ENGINES = [("gemmalite", "int8"), ("gemmalite", "none"), ("egemma2", "none"), ("transformers", "none")]


def run(engine: str, model: str, quant: str, threads: int, n: int) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), NUMBA_NUM_THREADS=str(threads),
               OPENBLAS_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    p = subprocess.run([sys.executable, "-c", _WORKERS[engine], model, quant, str(threads), str(n)],
                       capture_output=True, text=True, env=env)
    if p.returncode:
        return {"error": (p.stderr.strip().splitlines() or ["failed"])[-1][:200]}
    return json.loads(p.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--images", type=int, default=8)
    ap.add_argument("--engines", default=",".join(f"{e}/{q}" for e, q in ENGINES),
                    help="comma-separated ENGINE/QUANT list (default: all four)")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    engines = [tuple(x.split("/")) for x in a.engines.split(",")]
    raw: dict[str, list[dict]] = {f"{e}/{q}": [] for e, q in engines}
    for _ in range(a.rounds):
        for e, q in engines:
            r = run(e, a.model, q, a.threads, a.images)
            raw[f"{e}/{q}"].append(r)
            print(f"# {e}/{q}: {json.dumps(r)}", file=sys.stderr, flush=True)
    table = {}
    for name, rs in raw.items():
        ok = [r for r in rs if "error" not in r]
        table[name] = ({k: statistics.median(r[k] for r in ok) for k in ("load_s", "images_s", "peak_rss_bytes")}
                       if ok else {"error": rs[0]["error"]})
    if a.json:
        print(json.dumps({"median": table, "raw": raw}))
        return 0
    print(f"{'engine':22s} {'load s':>8s} {'images/s':>10s} {'peak RSS GiB':>13s}")
    for name, r in table.items():
        if "error" in r:
            print(f"{name:22s} error: {r['error']}")
        else:
            print(f"{name:22s} {r['load_s']:8.2f} {r['images_s']:10.4f} {r['peak_rss_bytes'] / 2**30:13.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
