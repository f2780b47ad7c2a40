"""The ``gemmalite`` command: run, chat, inspect, synth (and bench, convert, serve)."""
from __future__ import annotations

import argparse
import sys
import time
from typing import Any, Sequence


def _sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("generation")
    g.add_argument("--max-new-tokens", type=int, default=256)
    g.add_argument("--temperature", type=float, default=None, help="0 = greedy (default: the checkpoint's generation_config)")
    g.add_argument("--top-k", type=int, default=None)
    g.add_argument("--top-p", type=float, default=None)
    g.add_argument("--min-p", type=float, default=None)
    g.add_argument("--repetition-penalty", type=float, default=None)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")


def _load_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="checkpoint folder or .gguf file")
    p.add_argument("--context", type=int, default=None, help="KV cache length in tokens")
    p.add_argument("--quant", choices=["int8", "int4"], default=None, help="quantize weights on load")


def _gen_kwargs(a: argparse.Namespace) -> dict[str, Any]:
    return dict(max_new_tokens=a.max_new_tokens, temperature=a.temperature, top_k=a.top_k, top_p=a.top_p,
                min_p=a.min_p, repetition_penalty=a.repetition_penalty, seed=a.seed, stop=a.stop)


def _load(a: argparse.Namespace):
    import gemmalite

    return gemmalite.load(a.model, context=a.context, quant=a.quant)


def cmd_run(a: argparse.Namespace) -> int:
    model = _load(a)
    kw = _gen_kwargs(a)
    use_chat = not a.raw and model.tokenizer.chat_template is not None
    t0 = time.perf_counter()
    pieces = model.chat([{"role": "user", "content": a.prompt}], stream=True, **kw) if use_chat else \
        model.generate(a.prompt, stream=True, **kw)
    for piece in pieces:
        sys.stdout.write(piece)
        sys.stdout.flush()
    sys.stdout.write("\n")
    if a.verbose:
        st = model.stats
        print(f"[{st['prompt_tokens']} prompt tokens: {st['prefill_s']:.2f} s; {st['new_tokens']} new tokens: "
              f"{st['decode_s']:.2f} s; total {time.perf_counter() - t0:.2f} s]", file=sys.stderr)
    return 0


def cmd_chat(a: argparse.Namespace) -> int:
    model = _load(a)
    kw = _gen_kwargs(a)
    messages: list[dict[str, str]] = [{"role": "system", "content": a.system}] if a.system else []
    print("gemmalite chat: type a message; /reset starts over, /quit or Ctrl-D leaves.", file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except (EOFError, KeyboardInterrupt):
            print(file=sys.stderr)
            return 0
        if line.strip() in ("/quit", "/exit"):
            return 0
        if line.strip() == "/reset":
            messages = messages[:1] if a.system else []
            model.reset_chat()
            continue
        if not line.strip():
            continue
        messages.append({"role": "user", "content": line})
        reply = []
        for piece in model.chat(messages, stream=True, **kw):
            sys.stdout.write(piece)
            sys.stdout.flush()
            reply.append(piece)
        sys.stdout.write("\n")
        messages.append({"role": "assistant", "content": "".join(reply)})


def cmd_inspect(a: argparse.Namespace) -> int:
    from .summary import describe

    print(describe(_load(a)))
    return 0


def cmd_synth(a: argparse.Namespace) -> int:
    from .synth import synth

    out = synth(a.preset, a.out, tokenizer=a.tokenizer, layout=a.layout, seed=a.seed, progress=not a.quiet)
    print(f"wrote {a.preset} checkpoint to {out}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="gemmalite", description="Gemma 4 / Gemma 3 text generation on the CPU.")
    sub = ap.add_subparsers(dest="command", required=True)

    p = sub.add_parser("run", help="generate a reply to PROMPT, streamed to stdout")
    _load_args(p)
    p.add_argument("prompt")
    p.add_argument("--raw", action="store_true", help="continue the prompt text as is (no chat template)")
    p.add_argument("-v", "--verbose", action="store_true")
    _sampling_args(p)
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("chat", help="interactive multi-turn chat")
    _load_args(p)
    p.add_argument("--system", default=None, help="system prompt")
    _sampling_args(p)
    p.set_defaults(func=cmd_chat)

    p = sub.add_parser("inspect", help="config summary, parameter counts and bytes per part")
    _load_args(p)
    p.set_defaults(func=cmd_inspect)

    p = sub.add_parser("synth", help="write a random-weight checkpoint of a real shape")
    p.add_argument("--preset", choices=["tiny", "e2b", "e4b"], required=True)
    p.add_argument("out")
    p.add_argument("--tokenizer", default=None, help="tokenizer.json, checkpoint folder or GGUF vocabulary")
    p.add_argument("--layout", choices=["conditional", "causal"], default="conditional",
                   help="Gemma4ForConditionalGeneration (published) or Gemma4ForCausalLM key layout")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("-q", "--quiet", action="store_true")
    p.set_defaults(func=cmd_synth)

    for extra in ("bench", "convert", "serve"):
        try:
            mod = __import__(f"gemmalite.{extra}", fromlist=["add_parser"])
        except ImportError:
            continue
        mod.add_parser(sub)
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as e:  # our errors are ValueErrors with a clear message
        print(f"gemmalite: error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        return 0


if __name__ == "__main__":
    sys.exit(main())
