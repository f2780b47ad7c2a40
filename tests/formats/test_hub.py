"""Models by Hugging Face Hub id (`gemmalite.formats.hub`): downloads from a Hub on 127.0.0.1
(tests/formats/fake_hub.py) through huggingface_hub, into a cache of the test's own; the cache is
read back by huggingface_hub's own API (`scan_cache_dir`, `try_to_load_from_cache`), offline
resolution reaches no server, and a checkpoint loaded by Hub id gives the folder's own logits."""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys

import huggingface_hub
import numpy as np
import pytest
from fake_hub import FakeHub, Repo
from huggingface_hub import constants
from huggingface_hub.utils import validate_repo_id

from gemmalite.cli import main
from gemmalite.cli.serve import _name as serve_name
from gemmalite.errors import CheckpointError, HubError
from gemmalite.formats.hub import parse
from gemmalite.loader import resolve

RNG = np.random.default_rng(0)
GGUF_FILES = {  # contents: random bytes; resolution never reads them
    "README.md": b"# a model card",
    "tiny-Q4_K_M.gguf": RNG.bytes(3000),
    "tiny-Q4_K.gguf": RNG.bytes(2000),
    "tiny-Q8_0.gguf": RNG.bytes(5000),
    "tiny-Q6_K.gguf": RNG.bytes(4000),
    "mmproj-tiny-f16.gguf": RNG.bytes(1000),
    "mmproj-tiny-bf16.gguf": RNG.bytes(1000),
}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from gemmalite.tools.synth import synth

    return synth("tiny", tmp_path_factory.mktemp("tiny"), progress=False)


@pytest.fixture
def hub(monkeypatch, tmp_path):
    """A running fake Hub, huggingface_hub pointed at it and at an empty cache of this test, online, no token.
    (huggingface_hub reads HF_ENDPOINT / HF_HUB_CACHE / HF_HUB_OFFLINE when imported: its constants are set.)"""
    fake = FakeHub()
    endpoint = fake.start()
    monkeypatch.setattr(constants, "ENDPOINT", endpoint)
    monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", endpoint + "/{repo_id}/resolve/{revision}/{filename}")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf-cache"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.delenv("HUGGING_FACE_HUB_TOKEN", raising=False)
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(tmp_path / "no-token"))
    fake.repos["org/tiny-GGUF"] = Repo(dict(GGUF_FILES))
    yield fake
    fake.stop()


def offline(monkeypatch, hub: FakeHub) -> None:
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    hub.log.clear()


def snapshot_files(path) -> set[str]:
    root = path if path.is_dir() else path.parent
    return {p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file()}


# --- ids
@pytest.mark.parametrize("spec, want", [
    ("org/name", ("org/name", None, None)),
    ("google/gemma-4-E2B-it", ("google/gemma-4-E2B-it", None, None)),
    ("ggml-org/gemma-4-E2B-it-GGUF:Q4_K_M", ("ggml-org/gemma-4-E2B-it-GGUF", "Q4_K_M", None)),
    ("unsloth/x-GGUF:UD-Q4_K_XL", ("unsloth/x-GGUF", "UD-Q4_K_XL", None)),
    ("org/name/sub/model-Q8_0.gguf", ("org/name", None, "sub/model-Q8_0.gguf")),
    ("hf.co/org/name-GGUF:Q8_0", ("org/name-GGUF", "Q8_0", None)),  # as ollama pull takes it
    ("https://huggingface.co/org/name", ("org/name", None, None)),
])
def test_hub_ids_parse_into_repository_quant_and_file(spec, want):
    got = parse(spec)
    assert (got.repo, got.quant, got.file) == want
    validate_repo_id(got.repo)  # the oracle: huggingface_hub takes the repository id


@pytest.mark.parametrize("spec", ["gemma3-270m", "./org/name", "/org/name", "~/org/name", "org/name/weights",
                                  "org/name:", "a/b/c/d", "org--x/name", "org/na me", "org/name.gguf/", ""])
def test_paths_and_names_are_no_hub_ids(spec):
    assert parse(spec) is None


def test_huggingface_hub_is_imported_only_for_a_hub_id(tmp_path):
    code = ("import sys, gemmalite, gemmalite.cli\n"
            "from gemmalite.loader import resolve\n"
            f"resolve({str(tmp_path)!r}), resolve('no/such-thing/here')\n"
            "print('huggingface_hub' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    assert out.stdout.split() == ["False"]


# --- GGUF repositories: the one file asked for, its mmproj beside it
def test_quant_tag_picks_one_gguf_and_the_mmproj(hub):
    path = resolve("org/tiny-GGUF:q8_0")  # case-insensitive, as llama.cpp's -hf
    assert path.name == "tiny-Q8_0.gguf" and path.read_bytes() == GGUF_FILES["tiny-Q8_0.gguf"]
    assert snapshot_files(path) == {"tiny-Q8_0.gguf", "mmproj-tiny-f16.gguf"}  # only what the model needs
    assert path.parent.parent.parent.name == "models--org--tiny-GGUF"  # the Hub cache's own layout
    assert huggingface_hub.try_to_load_from_cache("org/tiny-GGUF", "tiny-Q8_0.gguf") == str(path)
    assert resolve("hf.co/org/tiny-GGUF:Q8_0") == path
    assert resolve("org/tiny-GGUF:Q4_K").name == "tiny-Q4_K.gguf"  # a whole tag: not tiny-Q4_K_M
    assert resolve("org/tiny-GGUF").name == "tiny-Q4_K_M.gguf"  # no tag: Q4_K_M
    assert resolve("org/tiny-GGUF/tiny-Q6_K.gguf").name == "tiny-Q6_K.gguf"
    with pytest.raises(HubError, match=r"no \.gguf file of org/tiny-GGUF is quantized Q2_K.*tiny-Q8_0\.gguf"):
        resolve("org/tiny-GGUF:Q2_K")
    with pytest.raises(HubError, match="org/tiny-GGUF has no file 'nope.gguf'"):
        resolve("org/tiny-GGUF/nope.gguf")


def test_cached_models_resolve_without_the_network(hub, monkeypatch, capsys):
    first = {spec: resolve(spec) for spec in ("org/tiny-GGUF:Q8_0", "org/tiny-GGUF")}
    hub.log.clear()
    assert {spec: resolve(spec) for spec in first} == first  # online, cached: the cache answers
    assert hub.log == []
    offline(monkeypatch, hub)
    assert {spec: resolve(spec) for spec in first} == first
    with pytest.raises(HubError, match="org/tiny-GGUF:Q6_K: not in the Hugging Face cache .* HF_HUB_OFFLINE"):
        resolve("org/tiny-GGUF:Q6_K")  # the repository is cached, this file is not
    with pytest.raises(HubError, match="HF_HUB_OFFLINE .* the cached listing says: .* no .gguf file of "
                                       "org/tiny-GGUF is quantized Q2_K"):
        resolve("org/tiny-GGUF:Q2_K")
    with pytest.raises(HubError, match="org/never: not in the Hugging Face cache .* HF_HUB_OFFLINE"):
        resolve("org/never")
    with pytest.raises(CheckpointError, match="org/never: not in the Hugging Face cache"):
        import gemmalite

        gemmalite.load("org/never")
    capsys.readouterr()
    assert main(["run", "org/never", "hi"]) == 1
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("gemmalite: error: org/never: not in the Hugging Face cache")
    assert hub.log == []


def test_a_cache_in_the_documented_layout_resolves_offline(hub, monkeypatch):
    """models--org--name/{blobs, refs/main, snapshots/<rev>/...}, laid out by hand (no tree listing)."""
    rev = "b" * 40
    storage = os.path.join(constants.HF_HUB_CACHE, "models--org--hand-GGUF")
    os.makedirs(os.path.join(storage, "blobs"))
    os.makedirs(os.path.join(storage, "refs"))
    os.makedirs(os.path.join(storage, "snapshots", rev))
    with open(os.path.join(storage, "refs", "main"), "w") as f:
        f.write(rev)
    for name in ("tiny-Q8_0.gguf", "mmproj-tiny-f16.gguf"):
        blob = os.path.join(storage, "blobs", hashlib.sha256(GGUF_FILES[name]).hexdigest())
        with open(blob, "wb") as f:
            f.write(GGUF_FILES[name])
        os.symlink(os.path.relpath(blob, os.path.join(storage, "snapshots", rev)),
                   os.path.join(storage, "snapshots", rev, name))
    offline(monkeypatch, hub)
    path = resolve("org/hand-GGUF:Q8_0")
    assert path.read_bytes() == GGUF_FILES["tiny-Q8_0.gguf"]
    assert resolve("org/hand-GGUF") == path  # no tag: the cached repository's only .gguf
    assert huggingface_hub.try_to_load_from_cache("org/hand-GGUF", "tiny-Q8_0.gguf") == str(path)
    assert hub.log == []


def test_a_local_path_wins_over_a_hub_id(hub, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "org" / "tiny-GGUF").mkdir(parents=True)
    assert resolve("org/tiny-GGUF") == tmp_path.joinpath("org", "tiny-GGUF").relative_to(tmp_path)
    assert (serve_name("org/tiny-GGUF"), serve_name("org/other-GGUF")) == ("tiny-GGUF", "org/other-GGUF")
    assert hub.log == []


# --- the Hub's answers
def test_a_missing_repository_or_file_is_a_clear_error(hub):
    with pytest.raises(HubError, match="org/nothing: no such local file or folder, and no model repository org/nothing"):
        resolve("org/nothing")
    hub.repos["org/empty"] = Repo({"README.md": b"x"})
    with pytest.raises(HubError, match="org/empty holds no checkpoint gemmalite runs"):
        resolve("org/empty")


def test_a_gated_repository_names_its_licence_page_until_a_token_is_given(hub, monkeypatch):
    hub.repos["org/gated-GGUF"] = Repo(dict(GGUF_FILES), token="hf_granted")
    page = f"{constants.ENDPOINT}/org/gated-GGUF"
    with pytest.raises(HubError, match=f"access to org/gated-GGUF was refused: it is gated, accept its licence at {page} "):
        resolve("org/gated-GGUF:Q8_0")
    assert hub.requests("HEAD")[-1].status == 401
    monkeypatch.setenv("HF_TOKEN", "hf_other")
    with pytest.raises(HubError, match=f"accept its licence at {page} .*HF_TOKEN"):
        resolve("org/gated-GGUF:Q8_0")
    assert hub.requests("HEAD")[-1].status == 403
    monkeypatch.setenv("HF_TOKEN", "hf_granted")
    assert resolve("org/gated-GGUF:Q8_0").read_bytes() == GGUF_FILES["tiny-Q8_0.gguf"]
    assert {r.auth for r in hub.requests("GET", "/org/gated-GGUF/resolve")} == {"Bearer hf_granted"}


@pytest.mark.parametrize("token, status", [(None, 401), ("hf_other", 403)])
def test_a_bare_refusal_names_the_licence_page_too(hub, monkeypatch, token, status):
    hub.repos["org/private-GGUF"] = Repo(dict(GGUF_FILES), token="hf_granted", error_code=None)
    if token:
        monkeypatch.setenv("HF_TOKEN", token)
    page = f"{constants.ENDPOINT}/org/private-GGUF"
    with pytest.raises(HubError, match=rf"access to org/private-GGUF was refused \(HTTP {status}\): .* accepted at {page} "):
        resolve("org/private-GGUF:Q8_0")
    assert hub.requests("HEAD")[-1].status == status


def test_an_interrupted_download_resumes_where_it_stopped(hub, monkeypatch):
    # huggingface_hub writes what it receives in chunks of DOWNLOAD_CHUNK_SIZE (10 MB): 1000 here, so that
    # the 3000 bytes sent before the connection drops reach the disk
    monkeypatch.setattr(constants, "DOWNLOAD_CHUNK_SIZE", 1000)
    hub.cut("tiny-Q8_0.gguf", after=3000, failed_resumes=0)
    path = resolve("org/tiny-GGUF:Q8_0")  # the second request completes the file from byte 3000
    assert path.read_bytes() == GGUF_FILES["tiny-Q8_0.gguf"]
    gets = [r for r in hub.requests("GET", "/org/tiny-GGUF/resolve/") if r.path.endswith("Q8_0.gguf")]
    assert [(r.range, r.status) for r in gets] == [(None, 200), ("bytes=3000-", 206)]


def test_a_failed_download_leaves_no_partial_file(hub, monkeypatch):
    """huggingface_hub 2.5 resumes within a download, not across them: what failed is fetched again whole."""
    monkeypatch.setattr(constants, "DOWNLOAD_CHUNK_SIZE", 1000)
    hub.cut("tiny-Q8_0.gguf", after=3000, failed_resumes=1)
    with pytest.raises(HubError, match="org/tiny-GGUF:Q8_0: the Hub answered with an error"):
        resolve("org/tiny-GGUF:Q8_0")
    gets = [r for r in hub.requests("GET", "/org/tiny-GGUF/resolve/") if r.path.endswith("Q8_0.gguf")]
    assert [(r.range, r.status) for r in gets] == [(None, 200), ("bytes=3000-", 500)]
    blobs = os.path.join(constants.HF_HUB_CACHE, "models--org--tiny-GGUF", "blobs")
    assert hashlib.sha256(GGUF_FILES["tiny-Q8_0.gguf"]).hexdigest() not in "".join(os.listdir(blobs))
    hub.log.clear()
    assert resolve("org/tiny-GGUF:Q8_0").read_bytes() == GGUF_FILES["tiny-Q8_0.gguf"]
    gets = [r for r in hub.requests("GET", "/org/tiny-GGUF/resolve/") if r.path.endswith("Q8_0.gguf")]
    assert [(r.range, r.status) for r in gets] == [(None, 200)]


# --- a checkpoint folder by Hub id
def test_load_by_hub_id_gives_the_folders_logits(hub, tiny, monkeypatch, gl):
    hub.add_folder("org/tiny", tiny, extra={"onnx/model.onnx": b"not needed", "README.md": b"# card"})
    model = gl.load("org/tiny", context=64)
    folder = resolve("org/tiny")
    assert snapshot_files(folder) == {"config.json", "generation_config.json", "tokenizer.json",
                                      "tokenizer_config.json", "chat_template.jinja", "model.safetensors"}
    assert folder.parent.parent.name == "models--org--tiny"
    oracle = gl.load(tiny, context=64)
    ids = oracle.tokenizer.encode("Hello from the Hub")
    assert model.tokenizer.encode("Hello from the Hub") == ids
    np.testing.assert_array_equal(model.logits(ids), oracle.logits(ids))
    offline(monkeypatch, hub)
    np.testing.assert_array_equal(gl.load("org/tiny", context=64).logits(ids), oracle.logits(ids))
    with pytest.raises(HubError, match="org/no-drafter: not in the Hugging Face cache"):
        gl.load(tiny, context=64, drafter="org/no-drafter")  # every MODEL argument takes a Hub id
    with pytest.raises(HubError, match="org/no-embedder: not in the Hugging Face cache"):
        gl.load_embedder("org/no-embedder")
    assert hub.log == []


def test_load_embedder_by_hub_id_gives_the_folders_embeddings(hub, tmp_path_factory, gl):
    from gemmalite.tools.synth_eg2 import synth_eg2

    folder = synth_eg2("eg2-tiny", tmp_path_factory.mktemp("eg2"), progress=False)
    hub.add_folder("org/eg2-tiny", folder, extra={"onnx/model.onnx": b"not needed"})
    emb = gl.load_embedder("org/eg2-tiny")
    got = snapshot_files(resolve("org/eg2-tiny"))
    assert got == {p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()}  # the pipeline's too
    texts = ["a query about the Hub", "a document"]
    np.testing.assert_array_equal(emb.embed(texts, prompt_name="SearchQuery"),
                                  gl.load_embedder(folder).embed(texts, prompt_name="SearchQuery"))


# --- pull, ls, rm
def test_pull_ls_rm(hub, tiny, capsys, monkeypatch):
    hub.add_folder("org/tiny", tiny)
    assert main(["pull", "org/tiny-GGUF:Q8_0"]) == 0
    assert capsys.readouterr().out.strip() == huggingface_hub.try_to_load_from_cache("org/tiny-GGUF", "tiny-Q8_0.gguf")
    assert main(["pull", "org/tiny"]) == 0
    folder = capsys.readouterr().out.strip()
    assert folder == os.path.dirname(huggingface_hub.try_to_load_from_cache("org/tiny", "config.json"))

    assert main(["pull", "no-such-folder"]) == 1
    assert "no-such-folder: no such file or folder, and not a Hub id" in capsys.readouterr().err

    scan = {r.repo_id: r for r in huggingface_hub.scan_cache_dir().repos}  # the oracle of sizes
    assert main(["ls", "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert [(m["model"], m["size"], m["gguf"]) for m in listed] == [
        ("org/tiny", scan["org/tiny"].size_on_disk, []),
        ("org/tiny-GGUF", scan["org/tiny-GGUF"].size_on_disk, ["tiny-Q8_0.gguf"])]
    assert main(["ls"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["MODEL", "SIZE", "FILES"] and lines[2].split()[0] == "org/tiny-GGUF"
    assert lines[2].split()[-1] == "tiny-Q8_0.gguf" and lines[1].endswith("checkpoint folder")

    assert main(["rm", "org/tiny-GGUF:Q8_0"]) == 1
    assert "deletes a whole repository from the cache: give org/tiny-GGUF" in capsys.readouterr().err
    assert main(["rm", "org/tiny-GGUF", "org/not-cached"]) == 1  # nothing deleted when one is not cached
    assert "org/not-cached: not in the Hugging Face cache" in capsys.readouterr().err
    assert {r.repo_id for r in huggingface_hub.scan_cache_dir().repos} == {"org/tiny", "org/tiny-GGUF"}
    assert main(["rm", "org/tiny-GGUF"]) == 0
    assert capsys.readouterr().out.startswith("removed org/tiny-GGUF")
    assert {r.repo_id for r in huggingface_hub.scan_cache_dir().repos} == {"org/tiny"}
    offline(monkeypatch, hub)
    with pytest.raises(HubError, match="not in the Hugging Face cache"):
        resolve("org/tiny-GGUF:Q8_0")


def test_pull_asks_the_hub_for_a_newer_revision(hub):
    first = resolve("org/tiny-GGUF:Q8_0")
    hub.repos["org/tiny-GGUF"].commit = "c" * 40
    hub.repos["org/tiny-GGUF"].files["tiny-Q8_0.gguf"] = b"a newer upload"
    assert resolve("org/tiny-GGUF:Q8_0") == first  # cached: the cache answers
    newer = resolve("org/tiny-GGUF:Q8_0", refresh=True)  # gemmalite pull
    assert newer.parent.name == "c" * 40 and newer.read_bytes() == b"a newer upload"
    assert resolve("org/tiny-GGUF:Q8_0") == newer  # refs/main follows
