"""`gemmalite inspect / synth / convert / export / bench`: look into, make, quantize, export and time checkpoints."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from ..weights import pages
from .generate import backend_args, huge_pages_arg, load_args, load_model, threads_arg, use_threads


def cmd_inspect(a: argparse.Namespace) -> int:
    from ..tools.inspect import describe

    print(describe(load_model(a)))
    return 0


def cmd_synth(a: argparse.Namespace) -> int:
    if a.preset.startswith("eg2"):  # EmbeddingGemma 2 encoders
        from ..tools.synth_eg2 import synth_eg2 as synth
    elif a.preset.endswith("-assistant"):  # MTP drafters
        from ..tools.synth import synth_assistant as synth
    else:
        from ..tools.synth import synth

    use_threads(a)
    out = synth(a.preset, a.out, tokenizer=a.tokenizer, layout=a.layout, seed=a.seed, progress=not a.quiet,
                force=a.force, vision=False if a.no_vision else None, audio=False if a.no_audio else None)
    print(f"wrote {a.preset} checkpoint to {out}")
    return 0


def cmd_convert(a: argparse.Namespace) -> int:
    from ..tools.convert import convert

    use_threads(a)
    out = convert(a.model, a.out, a.quant, progress=not a.quiet, force=a.force)
    print(f"wrote {a.out}")
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    if qc.get("tied_lm_head"):
        from ..loader import resolve

        mib = [sum(f.stat().st_size for f in Path(d).glob("*.safetensors")) / 2**20 for d in (resolve(a.model), out)]
        print(f"{mib[1]:.0f} MiB (source {mib[0]:.0f} MiB): the tied embedding is stored twice, as stored for token "
              f"lookups and as {a.quant} for the LM head")
    return 0


def cmd_export(a: argparse.Namespace) -> int:
    from ..tools.export import export

    use_threads(a)
    out = export(a.model, a.out, a.format, context=a.context, quant=a.quant, quant_format=a.quant_format,
                 accuracy_level=a.accuracy_level, chunk=a.chunk, force=a.force)
    print(f"wrote {out}")
    return 0


def cmd_bench(a: argparse.Namespace) -> int:
    from ..loader import resolve
    from ..tools.bench import bench, format_table

    model = str(resolve(a.model))  # a Hub id's download is no part of the load time
    if _is_encoder_folder(model):  # EmbeddingGemma 2: query latency and documents/s instead
        from ..tools.bench_embed import bench_embedder, format_embed_table

        r = bench_embedder(model, quant=a.quant, runs=a.runs)
        print(json.dumps(r) if a.json else format_embed_table(r))
        return 0
    r = bench(model, prompt_tokens=a.prompt_tokens, new_tokens=a.new_tokens, runs=a.runs, quant=a.quant,
              context=a.context, progress=not a.json, threads=a.threads, backend=a.backend,
              providers=a.providers, static_shapes=a.static_shapes, huge_pages=pages.SETTINGS[a.huge_pages])
    print(json.dumps(r) if a.json else format_table(r))
    return 0


def _is_encoder_folder(path: str) -> bool:
    from ..models.gemma.encoder import is_encoder_config

    cfg = Path(path) / "config.json"
    try:
        return cfg.is_file() and is_encoder_config(json.loads(cfg.read_text()))
    except ValueError:
        return False


def add_parsers(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("inspect", help="config summary, parameter counts and bytes per part")
    load_args(p)
    p.set_defaults(func=cmd_inspect)

    p = sub.add_parser("synth", help="write a random-weight checkpoint of a real shape")
    p.add_argument("--preset", choices=["tiny", "e2b", "e4b", "e2b-assistant", "e4b-assistant", "eg2", "eg2-tiny"],
                   required=True, help="Gemma 4 decoders (tiny, e2b, e4b), their MTP drafters (e2b-assistant, "
                                       "e4b-assistant) or EmbeddingGemma 2 encoders (eg2, eg2-tiny)")
    p.add_argument("out")
    p.add_argument("--tokenizer", default=None, help="tokenizer.json, checkpoint folder or GGUF vocabulary")
    p.add_argument("--layout", choices=["conditional", "causal"], default="conditional",
                   help="Gemma4ForConditionalGeneration (published) or Gemma4ForCausalLM key layout "
                        "(eg2: EmbeddingGemma2Model or EmbeddingGemma2TextModel)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-vision", action="store_true",
                   help="leave the vision (and, for eg2, audio) tower out (e2b, e4b and eg2 carry the real ones)")
    p.add_argument("--no-audio", action="store_true", help="leave the audio tower out (e2b, e4b and eg2 carry the real one)")
    p.add_argument("--force", action="store_true", help="replace OUT if it already exists")
    p.add_argument("-q", "--quiet", action="store_true")
    threads_arg(p)
    p.set_defaults(func=cmd_synth)

    p = sub.add_parser("convert", help="write an int8/int4 checkpoint that loads instantly")
    p.add_argument("model", help="Hugging Face checkpoint folder or Hub id (a GGUF file is already quantized: run it directly)")
    p.add_argument("out")
    p.add_argument("--quant", choices=["int8", "int4"], required=True)
    p.add_argument("--force", action="store_true", help="replace OUT if it is not empty")
    p.add_argument("-q", "--quiet", action="store_true")
    threads_arg(p)
    p.set_defaults(func=cmd_convert)

    p = sub.add_parser("export", help="the decoder graph as ONNX (static decode / prefill graphs and one with a free "
                                      "row count, weights beside them) in a folder that loads with --backend onnxruntime")
    p.add_argument("model", help="checkpoint folder or Hub id (float, or a gemmalite convert output)")
    p.add_argument("out", help="folder to write the graphs, their weights and the host side's files into")
    p.add_argument("--format", choices=["onnx"], default="onnx")
    p.add_argument("--context", type=int, default=None, help="positions the full layers' caches hold")
    p.add_argument("--quant", choices=["int8", "int4"], default=None,
                   help="weight-only int8 / int4, quantized on load as --quant does (a converted checkpoint exports its own)")
    p.add_argument("--quant-format", choices=["matmulnbits", "qdq"], default="matmulnbits",
                   help="int8 / int4 weights as ONNX Runtime's MatMulNBits (CPU / GPU providers) or as "
                        "DequantizeLinear + MatMul (QDQ, for NPU toolchains)")
    p.add_argument("--accuracy-level", type=int, choices=[0, 1, 2, 3, 4], default=None,
                   help="MatMulNBits' accuracy_level: 4 (default) rounds activations to int8 per block, 0 computes in float32")
    p.add_argument("--chunk", type=int, default=None, help="rows of the static prefill graph (default 64)")
    p.add_argument("--force", action="store_true", help="replace OUT if it is not empty")
    threads_arg(p)
    p.set_defaults(func=cmd_export)

    p = sub.add_parser("bench", help="prefill/decode tokens/s, load time, peak memory (embedders: query ms, texts/s)")
    p.add_argument("model")
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--quant", choices=["int8", "int4"], default=None)
    p.add_argument("--context", type=int, default=None)
    huge_pages_arg(p)
    backend_args(p)
    threads_arg(p)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=cmd_bench)
