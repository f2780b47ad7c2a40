"""The ``gemmalite`` command. Each group of subcommands is a module with ``add_parsers``; the
table below is the whole list (a module that fails to import is an error, never a missing command)."""
from __future__ import annotations

import argparse
import sys
from typing import Sequence

from . import embed, generate, hub, serve, tools

GROUPS = (generate, tools, embed, serve, hub)  # run, chat | inspect, synth, convert, bench | embed | serve | pull, ls, rm


class IntermixedParser(argparse.ArgumentParser):
    """A subcommand's parser that takes options before, between or after its positional
    arguments (``gemmalite embed MODEL --threads 1 "text"``: argparse's `parse_intermixed_args`)."""

    _intermixing = False

    def parse_known_args(self, args=None, namespace=None):  # type: ignore[override]
        if self._intermixing:  # (parse_known_intermixed_args calls back here: the plain parse)
            return super().parse_known_args(args, namespace)
        self._intermixing = True
        try:
            return super().parse_known_intermixed_args(args, namespace)
        finally:
            self._intermixing = False


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="gemmalite", description="Gemma 4 / Gemma 3 text generation on the CPU.")
    ap.add_argument("--debug", action="store_true", help="show the full traceback of an error")
    sub = ap.add_subparsers(dest="command", required=True, parser_class=IntermixedParser)
    for group in GROUPS:
        group.add_parsers(sub)
    for p in sub.choices.values():  # `gemmalite run ... --debug` as well as `gemmalite --debug run ...`
        p.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    return ap


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__


def main(argv: Sequence[str] | None = None) -> int:
    """Run one subcommand. Errors print as one ``gemmalite: error: ...`` line with exit status 1
    (``--debug``: the traceback instead)."""
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except BrokenPipeError:
        return 0
    except KeyboardInterrupt:
        if args.debug:
            raise
        print("\ngemmalite: interrupted", file=sys.stderr)
        return 130
    except (ValueError, OSError) as e:  # the project's errors are ValueErrors with a clear message
        if args.debug:
            raise
        print(f"gemmalite: error: {_one_line(e)}", file=sys.stderr)
        return 1
    except Exception as e:  # a bug: still one line, the traceback with --debug
        if args.debug:
            raise
        print(f"gemmalite: internal error: {type(e).__name__}: {_one_line(e)} (run with --debug for the "
              "traceback)", file=sys.stderr)
        return 1
