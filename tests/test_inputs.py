"""The API checks its inputs at the call, before any work: a table of bad arguments, each an
`InputError` (a ValueError) naming the argument and not one engine step run; good arguments of
the welcome types (numpy integers, tuples) still work. Also truncation keeping <bos>, non-finite
logits, and the command line's one-line errors."""
from __future__ import annotations

import math

import numpy as np
import pytest

from small_checkpoint import VOCAB, write_small_checkpoint

import gemmalite
from gemmalite.errors import CheckpointError, ContextError, InputError, NumericalError

CONTEXT = 32


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_small_checkpoint(tmp_path_factory.mktemp("inputs") / "model")


@pytest.fixture(scope="module")
def model(folder):
    return gemmalite.load(folder, context=CONTEXT)


@pytest.fixture
def steps(model, monkeypatch):
    """Counts engine steps: a refused call must not have run any."""
    calls = []
    real = model.engine.forward
    monkeypatch.setattr(model.engine, "forward", lambda *a, **k: calls.append(1) or real(*a, **k))
    return calls


IDS = [2, 10, 11, 12]
BAD_IDS = {
    "float": [2, 1.0], "string": ["a"], "bool": [2, True], "str_not_list": "abc", "bytes": b"ab",
    "float_array": np.array([1.5]), "2d": [[1, 2]], "empty": [], "too_big": [2, VOCAB], "negative": [-1],
    "uint_too_big": np.array([VOCAB + 1], dtype=np.uint16), "none": None, "int_not_list": 5,
    "huge": [2**70], "bool_array": np.array([True]),
}


@pytest.mark.parametrize("case", list(BAD_IDS))
def test_bad_token_ids(model, steps, case):
    for call in (lambda: model.generate_tokens(BAD_IDS[case], max_new_tokens=2), lambda: model.logits(BAD_IDS[case]),
                 lambda: model.hidden_states(BAD_IDS[case])):
        with pytest.raises(InputError):
            call()
    assert steps == []


@pytest.mark.parametrize("case", [c for c in BAD_IDS if c != "empty"])
def test_decode_refuses_bad_ids(model, case):
    """``decode`` of an id outside the vocabulary (negative included) or not an integer raises
    instead of returning ``''``."""
    with pytest.raises(InputError):
        model.tokenizer.decode(BAD_IDS[case])


def test_decode_takes_the_welcome_types(model):
    tk = model.tokenizer
    text = tk.decode(IDS)
    assert text and tk.decode(tuple(IDS)) == text == tk.decode(np.array(IDS, dtype=np.int32))
    assert tk.decode([np.int64(i) for i in IDS]) == text and tk.decode([]) == ""
    assert tk.decode([tk.vocab_size - 1]) is not None


BAD_OPTIONS = {
    "max_new_tokens": [2.0, "3", -1, True, None],
    "temperature": [math.nan, math.inf, -1.0, "0.5", True],
    "top_k": [1.9, -1, "5", True],
    "top_p": [0, 1.5, math.nan, "0.9"],
    "min_p": [-0.1, 2, math.nan],
    "repetition_penalty": [math.nan, 0, -1, math.inf, "1.1"],
    "seed": [1.5, "1", -1, True],
    "stop": [b"x", [1.5], "", [""], [b"x"], {"a"}, VOCAB, [True], [None], ["\ud800"]],
    "stream": ["yes", 1],
    "truncate": [1, "no"],
    "prompt_lookup": [-1, 1.5, "yes", [2]],
}
CASES = [(k, v) for k, vs in BAD_OPTIONS.items() for v in vs]


@pytest.mark.parametrize("option, value", CASES, ids=[f"{k}={v!r}" for k, v in CASES])
def test_bad_options_refused_by_every_method(model, steps, option, value):
    calls = {"generate_tokens": lambda kw: model.generate_tokens(IDS, **kw),
             "generate": lambda kw: model.generate("hi", **kw),
             "chat": lambda kw: model.session().chat([{"role": "user", "content": "hi"}], **kw)}
    for name, call in calls.items():
        with pytest.raises(InputError, match=option.rstrip("s") if option != "stop" else "stop"):
            call({"max_new_tokens": 2, option: value})
    assert steps == []


def test_stop_ids_only_for_generate_tokens(model, steps):
    with pytest.raises(InputError, match="stop"):
        model.generate("hi", stop=[5])
    with pytest.raises(InputError, match="stop"):
        model.chat([{"role": "user", "content": "hi"}], stop=5)
    assert steps == []
    assert isinstance(model.generate_tokens(IDS, max_new_tokens=2, stop=[5, "x"]), list)


@pytest.mark.parametrize("prompt", [5, b"hi", None, ["hi"], "ok \ud800 then"])
def test_bad_prompts(model, steps, prompt):
    with pytest.raises(InputError, match="prompt"):
        model.generate(prompt, max_new_tokens=2)
    assert steps == []


BAD_CHATS = {
    "empty": [], "string": "hi", "role_int": [{"role": 1, "content": "x"}], "role_empty": [{"role": "", "content": "x"}],
    "content_int": [{"role": "user", "content": 5}], "content_none": [{"role": "user", "content": None}],
    "no_content": [{"role": "user"}], "not_a_dict": ["hi"], "surrogate": [{"role": "user", "content": "\udcff"}],
    "part_text_int": [{"role": "user", "content": [{"type": "text", "text": 5}]}],
    "part_no_type": [{"role": "user", "content": [{"text": "hi"}]}], "part_string": [{"role": "user", "content": ["hi"]}],
}


@pytest.mark.parametrize("case", list(BAD_CHATS))
def test_bad_chats(model, steps, case):
    with pytest.raises(InputError, match="messages"):
        model.chat(BAD_CHATS[case], max_new_tokens=2)
    assert steps == []


def test_good_inputs_of_the_welcome_types(model):
    ref = model.generate_tokens(IDS, max_new_tokens=3, temperature=0)
    assert model.generate_tokens(np.array(IDS, dtype=np.int32), max_new_tokens=np.int64(3), temperature=0) == ref
    assert model.generate_tokens(tuple(np.int16(i) for i in IDS), max_new_tokens=3, temperature=0.0, top_k=np.int8(5),
                                 seed=np.uint8(1)) == ref
    np.testing.assert_array_equal(model.logits(np.array(IDS, dtype=np.uint32)), model.logits(IDS))
    assert isinstance(model.chat([{"role": "user", "content": "hi"}], max_new_tokens=2, temperature=0), str)


@pytest.mark.parametrize("kw", [{"context": 2.5}, {"context": "8"}, {"context": 0}, {"context": True},
                                {"context": 10**9}, {"quant": "int3"}])
def test_bad_load_arguments(folder, kw):
    with pytest.raises(InputError):
        gemmalite.load(folder, **kw)
    with pytest.raises(InputError, match="path"):
        gemmalite.load(5)


def test_truncate_keeps_bos_and_refuses_when_nothing_fits(model):
    body = [int(i) for i in np.random.RandomState(0).randint(5, VOCAB, size=50)]
    s = model.generate_tokens([2] + body, max_new_tokens=4, temperature=0, truncate=True, stream=True)
    out = list(s)
    assert s.stats.prompt_tokens == CONTEXT - 4
    assert out == model.generate_tokens([2] + body[-(CONTEXT - 5):], max_new_tokens=4, temperature=0)
    s = model.generate_tokens(body, max_new_tokens=4, temperature=0, truncate=True, stream=True)  # no <bos>: none added
    list(s)
    assert s.stats.prompt_tokens == CONTEXT - 4
    for n in (CONTEXT - 1, CONTEXT, CONTEXT + 10):
        with pytest.raises(ContextError, match="no room"):
            model.generate_tokens([2] + body, max_new_tokens=n, truncate=True)


def test_non_finite_logits_stop_generation_naming_the_step(folder, tmp_path, model, monkeypatch):
    from gemmalite.formats.safetensors import read_safetensors, save_arrays
    import shutil

    bad = shutil.copytree(folder, tmp_path / "nan")
    arrays = {k: np.array(v) for k, v in read_safetensors(bad / "model.safetensors").items()}
    arrays["model.norm.weight"][3] = np.nan
    save_arrays(bad, arrays)
    with pytest.raises(NumericalError, match="step 0.*not finite"):
        gemmalite.load(bad).generate_tokens(IDS, max_new_tokens=4)
    monkeypatch.setattr(model.engine, "decode_step", lambda state, tok: np.full(VOCAB, np.inf, np.float32))
    with pytest.raises(NumericalError, match="step 1"):
        model.generate_tokens(IDS, max_new_tokens=4, temperature=0)


def test_malformed_side_files_name_the_file(folder, tmp_path):
    import shutil

    for name, text, err in [("tokenizer_config.json", "[1", gemmalite.TokenizerError),
                            ("tokenizer_config.json", "[1]", gemmalite.TokenizerError),
                            ("generation_config.json", '{"do_sample": true, "temperature": "hot"}', CheckpointError),
                            ("generation_config.json", "[" * 5000, CheckpointError)]:
        bad = shutil.copytree(folder, tmp_path / f"{name}{len(text)}")
        (bad / name).write_text(text)
        with pytest.raises(err, match=name):
            gemmalite.load(bad)


# --------------------------------------------------------------------------------------------
# command line
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("args, needle", [
    (["inspect", "/no/such/model"], "no such file"),
    (["run", "{folder}", "hi", "--temperature", "nan"], "temperature"),
    (["run", "{folder}", "hi", "--context", "0"], "context"),
    (["run", "{folder}", "hi", "--stop", ""], "stop"),
    (["convert", "{folder}", "{folder}", "--quant", "int8"], "source"),
    (["run", "{folder}/config.json", "hi"], "not a GGUF file"),
])
def test_cli_errors_are_one_line_with_status_1(folder, capsys, args, needle):
    from gemmalite.cli import main

    args = [a.format(folder=folder) for a in args]
    assert main(args) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("gemmalite: error: ") and needle in err[0], err
    with pytest.raises(ValueError):
        main(args + ["--debug"])  # the traceback, for whoever needs it
