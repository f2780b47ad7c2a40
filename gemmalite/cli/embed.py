"""`gemmalite embed`: embeddings of a few texts and images, or of a JSONL corpus into Parquet."""
from __future__ import annotations

import argparse
import json
import sys

from .generate import backend_args, threads_arg, use_threads


def cmd_embed(a: argparse.Namespace) -> int:
    from ..loader import load_embedder

    if bool(a.input) != bool(a.output):
        raise ValueError("corpus mode needs both --input and --output")
    if a.input and (a.texts or a.image or a.audio):
        raise ValueError("give TEXT / --image / --audio arguments or --input, not both")
    if not a.input and not a.texts and not a.image and not a.audio:
        raise ValueError("nothing to embed: give TEXT, --image or --audio arguments, or --input corpus.jsonl "
                         "--output vectors.parquet")
    use_threads(a)
    emb = load_embedder(a.model, quant=a.quant, threads=a.threads, backend=a.backend,
                        **({"providers": a.providers} if a.backend != "gemmalite" else {}))
    kw = dict(prompt_name=a.prompt_name, prompt=a.prompt, dimensions=a.dimensions, batch_size=a.batch_size,
              truncate=a.truncate)
    if a.input:
        from ..embeddings.corpus import embed_corpus

        r = embed_corpus(emb, a.input, a.output, text_field=a.text_field, id_field=a.id_field,
                         image_field=a.image_field or None, audio_field=a.audio_field or None, chunk_size=a.chunk_size, progress=not a.quiet, **kw)
        if a.json:
            print(json.dumps(r))
        else:
            resumed = f" ({r['resumed_rows']} from an earlier run)" if r["resumed_rows"] else ""
            print(f"wrote {r['rows']} embeddings{resumed} to {r['output']} ({r['texts_per_s']:.1f} texts/s)",
                  file=sys.stderr)
        return 0
    from pathlib import Path

    # one embedding per TEXT, then per --image, then per --audio
    inputs = list(a.texts) + [Path(p) for p in a.image] + [{"audio": Path(p)} for p in a.audio]
    labels = ([repr(t if len(t) <= 50 else t[:47] + "...") for t in a.texts] + [f"image {p}" for p in a.image]
              + [f"audio {p}" for p in a.audio])
    vecs = emb.embed(inputs, max_soft_tokens=a.max_soft_tokens, **kw)
    if a.json:
        print(json.dumps({"model": a.model, "dimensions": int(vecs.shape[1]),
                          "embeddings": [[float(x) for x in v] for v in vecs]}))
        return 0
    import numpy as np

    np.set_printoptions(precision=4, suppress=True, linewidth=120)
    for i, (label, v) in enumerate(zip(labels, vecs)):
        print(f"[{i}] {label}: {v.shape[0]} dims  {' '.join(f'{x:+.4f}' for x in v[:6])} ...")
    if len(vecs) > 1:
        print("cosine similarity:")
        print(emb.similarity(vecs, vecs))
    return 0


def add_parsers(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("embed", help="sentence embeddings (EmbeddingGemma 2) of texts or of a JSONL corpus")
    p.add_argument("model", help="EmbeddingGemma 2 checkpoint folder or Hub id (or its gemmalite export, with --backend onnxruntime)")
    p.add_argument("texts", nargs="*", metavar="TEXT")
    p.add_argument("--image", action="append", default=[], metavar="PATH",
                   help="embed this image (repeatable; one embedding each, after the TEXTs)")
    p.add_argument("--audio", action="append", default=[], metavar="PATH",
                   help="embed this sound clip, WAV / FLAC / OGG / MP3 (repeatable; one embedding each, after the images)")
    p.add_argument("--max-soft-tokens", type=int, default=None, choices=[70, 140, 280, 560, 1120],
                   help="image budget in soft tokens (default: the checkpoint's processor setting)")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--prompt-name", default=None, help="task prompt from the model's table (e.g. SearchQuery, Document)")
    g.add_argument("--prompt", default=None, help="a literal prefix instead of a named prompt")
    p.add_argument("--dimensions", type=int, default=None, help="Matryoshka size (cut, then re-normalised)")
    p.add_argument("--quant", choices=["int8", "int4"], default=None, help="quantize weights on load")
    p.add_argument("--batch-size", type=int, default=32)
    threads_arg(p)
    backend_args(p, "encoder", static=False)
    p.add_argument("--truncate", action="store_true",
                   help="cut texts longer than the model's maximum, and clips to their first 30 s")
    p.add_argument("--json", action="store_true", help="print JSON")
    c = p.add_argument_group("corpus mode")
    c.add_argument("--input", default=None, help="JSONL: objects with a text (and id) field, or strings")
    c.add_argument("--output", default=None, help="Parquet file (id, embedding); the run resumes if interrupted")
    c.add_argument("--text-field", default="text")
    c.add_argument("--id-field", default="id")
    c.add_argument("--image-field", default="image",
                   help="field with an image path or a list of paths, relative to the JSONL file ('' for none)")
    c.add_argument("--audio-field", default="audio",
                   help="field with an audio path or a list of paths, relative to the JSONL file ('' for none)")
    c.add_argument("--chunk-size", type=int, default=1024, help="records per resumable part")
    c.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_embed)
