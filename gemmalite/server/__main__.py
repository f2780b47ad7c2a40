"""``python -m gemmalite.server MODEL ...``: the same as ``gemmalite serve MODEL ...``."""
import sys

from ..cli import main

sys.exit(main(["serve", *sys.argv[1:]]))
