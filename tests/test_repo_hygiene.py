"""No tracked file names a path outside the repository on the machine it was written on (a home
folder, a work or scratch folder, the temporary folder): such a path means nothing on another
machine. Inputs are named by their folders (`e2b-int8`), by placeholders (`LLAMA_BIN/`, `DIR`) or
by environment variables (`$GEMMALITE_SYNTH`); the temporary folder through `tempfile`; user
folders as `~/...`. Paths of the operating system's own interfaces (`/proc`, `/sys`, `/dev`,
`/usr/bin`) are not the machine's and stay allowed."""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# a root folder of a machine's own files, as a path's start: not inside a word, a URL, `~/`, `$VAR/`
OUTSIDE = re.compile(r"(?<![\w.~:/$}\\-])/(?:work|tmp|root|home|Users|mnt|media|opt|srv|scratch)(?=/|\b)"
                     r"|\b[A-Za-z]:\\(?:Users|Windows|Temp)\\")


def outside_paths(text: str) -> list[tuple[int, str]]:
    """(line number, line) of each line of ``text`` that names such a path."""
    return [(n, line.strip()) for n, line in enumerate(text.splitlines(), 1) if OUTSIDE.search(line)]


def tracked_files() -> list[Path]:
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout (the check reads git's list of tracked files)")
    return [ROOT / p for p in out.decode().split("\0") if p]


# the machine's paths are built here so that this file names none of them itself
HOME, WORK, TMP = "/" + "home", "/" + "work", "/" + "tmp"


@pytest.mark.parametrize("text", [f"{WORK}/exp/s44/plp.py", f"see `{TMP}/e2b-int8`", f"--gguf {HOME}/me/x.gguf",
                                  "(/" + "root/.cache/x)", f"PYTHONPATH={WORK}/old", f"into {TMP} when absent",
                                  "C:" + "\\Users\\me\\model", f'open("{TMP}/ids.npy")'])
def test_a_machine_path_is_found(text):
    assert outside_paths(text) == [(1, text.strip())]


@pytest.mark.parametrize("text", ["https://example.com/home/page", "~/.cache/gemmalite/numba/", "$GEMMALITE_SYNTH/e2b",
                                  "tests/data/tokenize_gemma4.json", "/proc/cpuinfo", "#!/usr/bin/env python3",
                                  ">/dev/null", "/sys/kernel/mm/transparent_hugepage/enabled", "LLAMA_BIN/llama-server",
                                  "/v1/chat/completions", "/nonexistent/clip.wav", "e2b-gguf/e2b-Q4_0.gguf",
                                  "${cache}/tmp/x", "a/tmp/b"])
def test_other_paths_are_not(text):
    assert outside_paths(text) == []


def test_no_tracked_file_names_a_path_outside_the_repository():
    found = []
    for path in tracked_files():
        if not path.is_file():
            continue  # deleted in the work tree, not yet in the index
        data = path.read_bytes()
        if b"\0" in data:
            continue  # binary (arrays, compressed vocabularies)
        text = data.decode("utf-8", errors="replace")
        found += [f"{path.relative_to(ROOT)}:{n}: {line[:160]}" for n, line in outside_paths(text)]
    assert not found, "paths outside the repository:\n" + "\n".join(found)
