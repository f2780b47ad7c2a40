"""`gemmalite run` and `gemmalite chat`: text generation from the command line."""
from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from ..weights import pages


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
    g.add_argument("--truncate", action="store_true",
                   help="keep the end of a prompt longer than the context instead of stopping with an error")
    g.add_argument("--prompt-lookup", action="store_true",
                   help="prompt-lookup decoding: draft tokens from the prompt's n-grams, same output, faster on replies that quote it")


def threads_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--threads", type=int, default=None,
                   help="compute threads (default: every CPU this process may use while the machine gives them, one while it is busy)")


def use_threads(a: argparse.Namespace) -> None:
    """--threads for commands that compute without a loaded model (synth, convert)."""
    from ..runtime.threads import check_threads, limit_blas_threads
    from ..runtime.threads import use_threads as set_numba

    set_numba(check_threads(a.threads))
    limit_blas_threads(a.threads)


def load_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="checkpoint folder, .gguf file, Hugging Face Hub id (org/name, org/name:QUANT, "
                                 "org/name/file.gguf; see docs/models.md), or gemma3-270m (the bundled demo model)")
    p.add_argument("--context", type=int, default=None, help="KV cache length in tokens")
    p.add_argument("--quant", choices=["int8", "int4"], default=None, help="quantize weights on load")
    p.add_argument("--drafter", default=None,
                   help="gemma4_assistant folder or Hub id: MTP speculative decoding (the same text, fewer target steps)")
    p.add_argument("--gguf-prefill", choices=["float", "int8"], default="float",
                   help="a .gguf's prompts on Q4_0 / Q5_0 / Q8_0 weights: float32 math (default), or activations "
                        "rounded to int8 per 32 values as llama.cpp does (VNNI CPUs: faster, logits ~0.5 off)")
    p.add_argument("--gguf-q5-0", dest="gguf_q5_0", choices=["auto", "int8", "blocks"], default="auto",
                   help="a .gguf's Q5_0 projections: expanded at load to Q8_0 blocks of the same values (int8: the "
                        "same logits, faster decode, 34 bytes a block instead of 22), kept (blocks), or expanded "
                        "when that takes at most 256 MiB (auto, the default)")
    huge_pages_arg(p)
    backend_args(p)
    threads_arg(p)


def huge_pages_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--huge-pages", dest="huge_pages", choices=list(pages.SETTINGS), default="auto",
                   help="copy the weights each decode step streams into 2 MiB pages (same values, faster decode): "
                        "where the kernel offers them (auto, the default), always (on), or keep them file-mapped (off)")


def backend_args(p: argparse.ArgumentParser, what: str = "decoder graph", static: bool = True) -> None:
    p.add_argument("--backend", choices=["gemmalite", "onnxruntime"], default="gemmalite",
                   help=f"who runs the {what}: our CPU kernels, or its ONNX export on ONNX Runtime")
    p.add_argument("--provider", dest="providers", action="append", default=None,
                   help="ONNX Runtime execution provider, in order of preference (repeatable; default CPU)")
    if static:
        p.add_argument("--static-shapes", dest="static_shapes", action="store_const", const=True, default=None,
                       help="onnxruntime: run the static decode / prefill graphs an NPU compiles (default for NPU "
                            "providers) instead of the one with a free row count")


def _gen_kwargs(a: argparse.Namespace) -> dict[str, Any]:
    return dict(max_new_tokens=a.max_new_tokens, temperature=a.temperature, top_k=a.top_k, top_p=a.top_p,
                min_p=a.min_p, repetition_penalty=a.repetition_penalty, seed=a.seed, stop=a.stop,
                truncate=a.truncate, prompt_lookup=a.prompt_lookup)


def load_model(a: argparse.Namespace):
    import gemmalite

    return gemmalite.load(a.model, context=a.context, quant=a.quant, threads=a.threads, drafter=getattr(a, "drafter", None),
                          gguf_prefill=getattr(a, "gguf_prefill", "float"), gguf_q5_0=getattr(a, "gguf_q5_0", "auto"),
                          huge_pages=pages.SETTINGS[getattr(a, "huge_pages", "auto")], **_backend_kwargs(a))


def _backend_kwargs(a: argparse.Namespace) -> dict[str, Any]:
    backend = getattr(a, "backend", "gemmalite")
    if backend == "gemmalite":
        return {}
    return {"backend": backend, "providers": getattr(a, "providers", None), "static_shapes": getattr(a, "static_shapes", None)}


def stream_out(pieces) -> tuple[str, bool]:
    """Write a stream of text pieces to stdout as they come; (the text, whether Ctrl-C cut it)."""
    out: list[str] = []
    try:
        for piece in pieces:
            sys.stdout.write(piece)
            sys.stdout.flush()
            out.append(piece)
    except KeyboardInterrupt:
        pieces.close()
        sys.stdout.write("\n")
        sys.stdout.flush()
        print("[stopped]", file=sys.stderr)
        return "".join(out), True
    sys.stdout.write("\n")
    sys.stdout.flush()
    return "".join(out), False


def stream_reply(events):
    """Write a chat reply's events as they come: its thought to stderr (dimmed on a terminal), apart
    from the answer on stdout; (the `ChatReply`, whether Ctrl-C cut it)."""
    from ..chat import ChatReply, Content, Reasoning

    think_out = sys.stderr
    reply = ChatReply()
    dim, undim = ("\033[2m", "\033[0m") if think_out.isatty() else ("", "")
    thinking = False
    try:
        for ev in events:
            reply.add(ev)
            if isinstance(ev, Reasoning):
                if not thinking:
                    think_out.write(f"{dim}[thinking] ")
                    thinking = True
                think_out.write(ev.text)
                think_out.flush()
                continue
            if thinking:
                think_out.write(f"{undim}\n")
                think_out.flush()
                thinking = False
            if isinstance(ev, Content):
                sys.stdout.write(ev.text)
                sys.stdout.flush()
    except KeyboardInterrupt:
        events.close()
        if thinking:
            think_out.write(undim)
        sys.stdout.write("\n")
        sys.stdout.flush()
        print("[stopped]", file=sys.stderr)
        return reply, True
    if thinking:
        think_out.write(f"{undim}\n")
    sys.stdout.write("\n")
    sys.stdout.flush()
    return reply, False


def _structured(model) -> bool:
    """Does the model speak Gemma 4's chat format (its replies are read apart: thought, answer)?"""
    from ..chat import ChatTokens

    return ChatTokens.find(model.tokenizer) is not None


def _thinks(a: argparse.Namespace) -> bool:
    return a.think or a.think_budget is not None


def _think_kwargs(a: argparse.Namespace) -> dict[str, Any]:
    """--think / --think-budget N as `Model.chat` options (a budget turns thinking on)."""
    return {"thinking": _thinks(a), "thinking_budget": a.think_budget}


def _user(text: str, images: list[str], audio: list[str] = ()) -> dict[str, Any]:
    """A user message; with images or audio, in the content-part form (pictures, then clips, then the text)."""
    if not images and not audio:
        return {"role": "user", "content": text}
    return {"role": "user", "content": [{"type": "image", "path": p} for p in images]
            + [{"type": "audio", "path": p} for p in audio] + [{"type": "text", "text": text}]}


def cmd_run(a: argparse.Namespace) -> int:
    model = load_model(a)
    kw = _gen_kwargs(a)
    use_chat = not a.raw and model.tokenizer.chat_template is not None
    if (a.image or a.audio) and not use_chat:
        raise ValueError(f"--{'image' if a.image else 'audio'} needs the chat template (not --raw)")
    if not a.raw and not use_chat:
        print(f"gemmalite: {a.model} has no chat template (a base model): continuing the prompt as plain text",
              file=sys.stderr)
    t0 = time.perf_counter()
    if use_chat and (_thinks(a) or _structured(model)):
        pieces = model.chat([_user(a.prompt, a.image, a.audio)], stream=True, **_think_kwargs(a), **kw)
        _, stopped = stream_reply(pieces)
    else:
        pieces = model.chat([_user(a.prompt, a.image, a.audio)], stream=True, **kw) if use_chat else \
            model.generate(a.prompt, stream=True, **kw)
        _, stopped = stream_out(pieces)
    if stopped:
        return 130
    if a.verbose:
        st = pieces.stats
        drafts = f"; {st.accepted_tokens}/{st.draft_tokens} draft tokens kept" if st.draft_tokens else ""
        print(f"[{st.prompt_tokens} prompt tokens: {st.prefill_s:.2f} s; {st.new_tokens} new tokens: "
              f"{st.decode_s:.2f} s{drafts}; total {time.perf_counter() - t0:.2f} s]", file=sys.stderr)
    return 0


def cmd_chat(a: argparse.Namespace) -> int:
    model = load_model(a)
    kw = _gen_kwargs(a)
    messages: list[dict[str, Any]] = [{"role": "system", "content": a.system}] if a.system else []
    images: list[str] = []  # attached to the next message
    audio: list[str] = []
    if model.tokenizer.chat_template is None:
        print(f"gemmalite: warning: {a.model} has no chat template of its own (a base model?): using the generic "
              "Gemma template, and replies may be poor; `gemmalite run` continues plain text", file=sys.stderr)
    print("gemmalite chat: type a message; /image PATH attaches a picture to the next one, /audio PATH a sound clip, "
          "/reset starts over, /quit or Ctrl-D leaves, Ctrl-C stops a reply.", file=sys.stderr)
    prompt = "> " if sys.stdin.isatty() else ""
    structured = _thinks(a) or _structured(model)
    while True:
        try:
            line = input(prompt)
        except (EOFError, KeyboardInterrupt):
            print(file=sys.stderr)
            return 0
        if line.strip() in ("/quit", "/exit"):
            return 0
        if line.strip() == "/reset":
            messages = messages[:1] if a.system else []
            images, audio = [], []
            model.reset_chat()
            continue
        if line.startswith("/image "):
            images.append(line[len("/image "):].strip())
            continue
        if line.startswith("/audio "):
            audio.append(line[len("/audio "):].strip())
            continue
        if not line.strip():
            continue
        messages.append(_user(line, images, audio))
        images, audio = [], []
        try:
            if structured:  # the thought apart from the answer (and out of the history: the template drops it)
                reply, stopped = stream_reply(model.chat(messages, stream=True, **_think_kwargs(a), **kw))
                answer = reply.content
            else:
                answer, stopped = stream_out(model.chat(messages, stream=True, **kw))
        except ValueError as e:  # a bad picture or clip (or too long a conversation): say so, keep chatting
            print(f"gemmalite: error: {e}", file=sys.stderr)
            messages.pop()
            continue
        messages.append({"role": "assistant", "content": answer})
        if stopped:  # a step may have been cut halfway: the next turn re-reads the conversation
            model.reset_chat()


def _budget_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--think-budget", type=int, default=None, metavar="N",
                   help="think (as --think) for at most N tokens: then the thought is closed and the answer begins")


def add_parsers(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("run", help="generate a reply to PROMPT, streamed to stdout (a base model without a chat "
                                   "template, like the demo gemma3-270m, continues the text instead)")
    load_args(p)
    p.add_argument("prompt")
    p.add_argument("--raw", action="store_true", help="continue the prompt text as is (no chat template even when there is one)")
    p.add_argument("--image", action="append", default=[], metavar="PATH",
                   help="a picture for the prompt (repeatable; needs a checkpoint with a vision tower)")
    p.add_argument("--audio", action="append", default=[], metavar="PATH",
                   help="a sound clip for the prompt: WAV, FLAC, OGG or MP3 (repeatable; needs a checkpoint with an audio tower)")
    p.add_argument("-v", "--verbose", action="store_true")
    p.add_argument("--think", action="store_true", help="let the model think first (Gemma 4); the thought goes to stderr")
    _budget_arg(p)
    _sampling_args(p)
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("chat", help="interactive multi-turn chat")
    load_args(p)
    p.add_argument("--system", default=None, help="system prompt")
    p.add_argument("--think", action="store_true", help="let the model think first (Gemma 4); thoughts show apart, on stderr")
    _budget_arg(p)
    _sampling_args(p)
    p.set_defaults(func=cmd_chat)
