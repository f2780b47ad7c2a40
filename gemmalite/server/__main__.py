"""``python -m gemmalite.server MODEL ...`` (the same as ``gemmalite serve``)."""
import argparse
import sys

from .cli import add_parser

ap = argparse.ArgumentParser(prog="python -m gemmalite.server")
sub = ap.add_subparsers(dest="command")
add_parser(sub)
args = ap.parse_args(["serve", *sys.argv[1:]])
sys.exit(args.func(args))
