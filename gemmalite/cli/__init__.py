"""The ``gemmalite`` command. Each group of subcommands is a module with ``add_parsers``; the
table below is the whole list (a module that fails to import is an error, never a missing command)."""
from __future__ import annotations

import argparse
import sys
from typing import Sequence

from . import generate, tools

GROUPS = (generate, tools)  # run, chat | inspect, synth, convert, bench


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="gemmalite", description="Gemma 4 / Gemma 3 text generation on the CPU.")
    sub = ap.add_subparsers(dest="command", required=True)
    for group in GROUPS:
        group.add_parsers(sub)
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
    except KeyboardInterrupt:  # Ctrl-C: a clean stop, not a traceback
        print("\ngemmalite: interrupted", file=sys.stderr)
        return 130
