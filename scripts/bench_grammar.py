#!/usr/bin/env python3
"""The grammar mask's cost per decode step on the real 262144-token Gemma 4 vocabulary, for one
constrained sequence and eight (one llguidance batch call), against the model's own decode step
measured in the same run; then a JSON-schema reply (forced tokens riding as drafts) against
the same number of unconstrained tokens.

    python scripts/bench_grammar.py MODEL [--steps 60] [--threads N] [--json]

MODEL: a Gemma 4 checkpoint (e.g. an int8 E2B from `gemmalite synth --preset e2b` + `convert`).
Per step it times: the masks (`fill_masks`), the sampler with the mask against without it
(greedy and top-k/top-p sampling, on the step's real logits), and the matcher's consume; the
step itself is `Engine.decode_step` (one sequence) and `Engine.decode_batch` of eight.
"""
from __future__ import annotations

import argparse
import json
import time

import numpy as np

import gemmalite
from gemmalite.chat.tool_grammar import tool_grammar
from gemmalite.runtime.constrain import Grammar, fill_masks, ll_tokenizer
from gemmalite.runtime.sampling import Sampler, SamplingParams

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string"}, "age": {"type": "integer"}, "email": {"type": "string"},
    "tags": {"type": "array", "items": {"type": "string"}},
    "address": {"type": "object", "properties": {"street": {"type": "string"}, "city": {"type": "string"}},
                "required": ["street", "city"], "additionalProperties": False}},
    "required": ["name", "age", "email", "tags", "address"], "additionalProperties": False}
REPLY = ('{"name":"Ada Lovelace","age":36,"email":"ada@example.org","tags":["math","poetry","engines"],'
         '"address":{"street":"12 St James\'s Square","city":"London"}}')
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer", "minimum": 1,
                                                                        "maximum": 14}},
    "required": ["city", "days"]}}}]
CALL = '<|tool_call>call:get_weather{city:<|"|>Paris, France<|"|>,days:3}<tool_call|>'


def ms(t: float) -> float:
    return round(t * 1e3, 3)


def mask_costs(model, grammar: Grammar, trace: list[int], batch: int) -> dict:
    """Per step along ``trace`` (a valid reply): seconds of the masks of ``batch`` matchers (one
    call), of the sampler with the mask minus without it, and of consuming the token."""
    tok_vocab = model.config.vocab_size
    matchers = [grammar.matcher(model.defaults.stop_ids) for _ in range(batch)]
    rng = np.random.default_rng(0)
    t_mask, t_greedy, t_sample, t_consume = [], [], [], []
    greedy, sampling = Sampler(SamplingParams(temperature=0)), Sampler(SamplingParams(temperature=1.0, top_k=64,
                                                                                       top_p=0.95, seed=0))
    for tok in trace:
        t0 = time.perf_counter()
        masks = fill_masks([(m, []) for m in matchers], tok_vocab)
        t_mask.append(time.perf_counter() - t0)
        logits = rng.standard_normal(tok_vocab).astype(np.float32) * 3
        allowed = masks[0][0]
        for s, out in ((greedy, t_greedy), (sampling, t_sample)):
            t0 = time.perf_counter()
            s(logits, None, allowed)
            t1 = time.perf_counter()
            s(logits, None)
            t2 = time.perf_counter()
            out.append((t1 - t0) - (t2 - t1))
        t0 = time.perf_counter()
        for m in matchers:
            m.consume(tok)
        t_consume.append(time.perf_counter() - t0)
    med = lambda xs: float(np.median(xs))  # noqa: E731
    return {"mask": med(t_mask), "mask_max": float(np.max(t_mask)), "sampler_extra_greedy": med(t_greedy),
            "sampler_extra_topk_topp": med(t_sample), "consume": med(t_consume)}


def step_times(model, steps: int) -> dict:
    eng = model.engine
    ids = np.asarray(model.tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 4))
    out = {}
    for batch in (1, 8):
        states = [eng.new_state() for _ in range(batch)]
        for s in states:
            eng.prefill(s, ids)
        tok = int(ids[-1])
        times = []
        for i in range(steps):
            t0 = time.perf_counter()
            if batch == 1:
                eng.decode_step(states[0], tok)
            else:
                eng.decode_batch(states, [[tok]] * batch)
            times.append(time.perf_counter() - t0)
        out[batch] = float(np.median(times[2:]))
    return out


def replies(model, n: int) -> dict:
    """tokens/s of a greedy JSON-schema reply (forced tokens ride as drafts) and of the same
    number of unconstrained greedy tokens, same prompt."""
    msgs = [{"role": "user", "content": "Give a person as JSON."}]
    res = {}
    for rep in range(2):
        for name, kw in (("json_schema", {"json_schema": SCHEMA}), ("free", {})):
            s = model.session().chat(msgs, max_new_tokens=n, temperature=0, stream=True, **kw)
            list(s)
            st = s.stats
            res.setdefault(name, []).append({"tok_s": round(st.new_tokens / st.decode_s, 2), "tokens": st.new_tokens,
                                             "drafted": st.draft_tokens, "accepted": st.accepted_tokens})
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--reply-tokens", type=int, default=48)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    model = gemmalite.load(a.model, threads=a.threads)
    tok = model.tokenizer
    assert model.config.vocab_size == 262144, "the benchmark is about the real Gemma 4 vocabulary"
    model.generate("warm up", max_new_tokens=2, temperature=0)
    t0 = time.perf_counter()
    ll_tokenizer(tok)  # the tokenizer bridge, once per tokenizer
    t_bridge = time.perf_counter() - t0
    t0 = time.perf_counter()
    schema_g = Grammar.json_schema(tok, SCHEMA)
    t_compile = time.perf_counter() - t0
    tool_g = tool_grammar(tok, TOOLS, "required")
    steps = step_times(model, a.steps)
    report = {"model": a.model, "threads": model.engine.threads if hasattr(model.engine, "threads") else a.threads,
              "tokenizer_bridge_ms": ms(t_bridge), "compile_json_schema_ms": ms(t_compile), "step_ms": {str(k): ms(v) for k, v in steps.items()}}
    for name, g, text in (("json_schema", schema_g, REPLY), ("tool_call", tool_g, CALL)):
        trace = tok.encode(text, add_special_tokens=False)
        for batch in (1, 8):
            c = mask_costs(model, g, trace, batch)
            per_seq = (c["mask"] + batch * (c["sampler_extra_topk_topp"] + c["consume"] / batch)) / batch
            report[f"{name}_x{batch}"] = {**{k: ms(v) for k, v in c.items()}, "tokens": len(trace),
                                          "per_sequence_ms": ms(per_seq),
                                          "per_sequence_vs_step": round(per_seq / steps[batch], 4)}
    report["replies"] = replies(model, a.reply_tokens)
    print(json.dumps(report, indent=None if a.json else 1))


if __name__ == "__main__":
    main()
