"""`gemmalite pull / ls / rm`: models in the Hugging Face Hub cache (`gemmalite.formats.hub`)."""
from __future__ import annotations

import argparse
import json


def cmd_pull(a: argparse.Namespace) -> int:
    from ..errors import CheckpointError
    from ..loader import resolve

    path = resolve(a.model, refresh=True)  # a local path or the bundled name: printed as it is
    if not path.exists():
        raise CheckpointError(f"{a.model}: no such file or folder, and not a Hub id (org/name, org/name:QUANT, "
                              "org/name/file.gguf)")
    print(path)
    return 0


def cmd_ls(a: argparse.Namespace) -> int:
    from ..formats.hub import cached_models

    models = cached_models()
    if a.json:
        print(json.dumps([{"model": m.repo, "size": m.size, "gguf": m.ggufs, "path": str(m.path)} for m in models]))
        return 0
    width = max([len(m.repo) for m in models] + [5])
    print(f"{'MODEL':<{width}}  {'SIZE':>9}  FILES")
    for m in models:
        print(f"{m.repo:<{width}}  {m.size_str:>9}  {', '.join(m.ggufs) or 'checkpoint folder'}")
    return 0


def cmd_rm(a: argparse.Namespace) -> int:
    from ..formats.hub import remove

    print(f"removed {', '.join(a.models)} ({remove(a.models)} freed)")
    return 0


def add_parsers(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("pull", help="download a model by Hugging Face Hub id into the Hub cache; print its local path")
    p.add_argument("model", help="org/name, org/name:QUANT (a GGUF repository's Q4_K_M, Q8_0...) or org/name/file.gguf")
    p.set_defaults(func=cmd_pull)

    p = sub.add_parser("ls", help="the models in the Hugging Face Hub cache gemmalite can run, with their sizes")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=cmd_ls)

    p = sub.add_parser("rm", help="delete models from the Hugging Face Hub cache (every revision; asks nothing)")
    p.add_argument("models", nargs="+", metavar="MODEL", help="org/name of a cached repository")
    p.set_defaults(func=cmd_rm)
