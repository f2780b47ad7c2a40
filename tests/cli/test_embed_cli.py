"""`gemmalite embed` takes its options before, between or after the texts (argparse's intermixed
parsing for every subcommand); the vectors are `Embedder.embed`'s."""
from __future__ import annotations

import json

import numpy as np
import pytest


@pytest.fixture(scope="module")
def eg2(tmp_path_factory):
    from gemmalite.tools.synth_eg2 import synth_eg2

    return synth_eg2("eg2-tiny", tmp_path_factory.mktemp("eg2"), progress=False)


def test_options_after_the_texts(eg2, gl, capsys):
    from gemmalite.cli import main

    assert main(["embed", str(eg2), "--threads", "1", "a cat", "--dimensions", "16", "a dog", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    want = gl.load_embedder(eg2).embed(["a cat", "a dog"], dimensions=16)
    np.testing.assert_array_equal(np.array(got["embeddings"], np.float32), want)


def test_a_misplaced_option_is_still_an_error(capsys):
    from gemmalite.cli import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args(["embed", "M", "text", "--no-such-option"])
    assert "--no-such-option" in capsys.readouterr().err
