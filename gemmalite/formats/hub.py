"""Models named by Hugging Face Hub id: ``org/name``, ``org/name:QUANT``, ``org/name/file.gguf``.

`resolve_hub` turns an id into a local path in the Hub's own cache (``huggingface_hub``, imported
only here and only when an id is resolved): the checkpoint folder of a safetensors repository
(only the files gemmalite reads), or the chosen ``.gguf`` of a GGUF repository (with its
``mmproj*.gguf`` beside it when the repository has one). A repository already cached is used
without reaching the network; otherwise it is downloaded with huggingface_hub's progress bars,
``HF_TOKEN`` for gated repositories, ``HF_ENDPOINT`` / ``HF_HUB_CACHE`` / ``HF_HUB_OFFLINE``
honoured. Every failure is a `HubError` naming the id. `cached_models` and `remove` are the cache's
listing and deletion (``gemmalite ls`` / ``rm``).
"""
from __future__ import annotations

import fnmatch
import glob
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from ..errors import HubError

_PART = r"[A-Za-z0-9](?:[A-Za-z0-9_.-]{0,94}[A-Za-z0-9])?"
_ID = re.compile(rf"(?P<repo>{_PART}/{_PART})(?::(?P<quant>[A-Za-z0-9][A-Za-z0-9_.-]*)"
                 rf"|/(?P<file>(?:[^/\\:]+/)*[^/\\:]+\.gguf))?")
_HOST = re.compile(r"^(?:https://)?(?:hf\.co|huggingface\.co)/")
_SHARD = re.compile(r"-\d{5}-of-\d{5}\.gguf$", re.IGNORECASE)
DEFAULT_QUANT = "Q4_K_M"  # llama.cpp's -hf default, then the repository's first .gguf
# the files of a safetensors checkpoint gemmalite reads (root; sentence-transformers modules' configs)
FOLDER_FILES = ("*.json", "*.jinja", "tokenizer.model", "*.safetensors")
MODULE_FILES = re.compile(r"\d+_[^/]+/config\.json")


@dataclass(frozen=True)
class HubId:
    """A parsed Hub id: the repository, and the ``:QUANT`` tag or the ``/file.gguf`` asked for."""

    repo: str
    quant: str | None = None
    file: str | None = None

    def __str__(self) -> str:
        return self.repo + (f":{self.quant}" if self.quant else "") + (f"/{self.file}" if self.file else "")


def parse(spec: str) -> HubId | None:
    """The Hub id ``spec`` spells, or None where it is not one (callers check local paths first).
    Ollama's ``hf.co/org/name:QUANT`` and a ``https://huggingface.co/org/name`` address name it too."""
    m = _ID.fullmatch(_HOST.sub("", spec, count=1))
    if m is None or "--" in m["repo"] or ".." in m["repo"]:
        return None
    return HubId(m["repo"], m["quant"], m["file"])


def _hub():
    """huggingface_hub, imported on first use (a clear error where it is missing)."""
    try:
        import huggingface_hub
        import huggingface_hub.constants
        import huggingface_hub.errors
        import huggingface_hub.file_download  # the submodules used here, as attributes
    except ImportError as e:
        raise HubError(f"models by Hub id need huggingface_hub: pip install huggingface_hub ({e})") from None
    return huggingface_hub


def _page(repo: str) -> str:
    return f"{_hub().constants.ENDPOINT}/{repo}"


def _is_mmproj(path: str) -> bool:
    return PurePosixPath(path).name.lower().startswith("mmproj") and path.lower().endswith(".gguf")


def _quant_matches(path: str, quant: str) -> bool:
    """llama.cpp's ``:QUANT``: the tag, case-insensitively, as a whole ``-`` / ``.`` / ``/`` part of the path
    (``Q4_K`` does not match ``...-Q4_K_M.gguf``)."""
    return re.search(rf"(?:^|[-./]){re.escape(quant.lower())}(?:[-./]|$)", path.lower()) is not None


def plan(hub_id: HubId, files: list[str]) -> tuple[list[str], str]:
    """(the files to fetch, the one to load: ``""`` for the folder) of a repository holding ``files``.
    A repository with ``config.json`` and ``.safetensors`` is a checkpoint folder; one with ``.gguf``
    files gives the ``.gguf`` asked for (``/file.gguf``, ``:QUANT``, else Q4_K_M, else the first)."""
    ggufs = sorted(f for f in files if f.lower().endswith(".gguf") and not _is_mmproj(f))
    if hub_id.file is not None:
        if hub_id.file not in files:
            raise HubError(f"{hub_id}: {hub_id.repo} has no file {hub_id.file!r} (its .gguf files: "
                           f"{', '.join(ggufs) or 'none'})")
        chosen = hub_id.file
    elif hub_id.quant is not None:
        found = [f for f in ggufs if _quant_matches(f, hub_id.quant)]
        if not found:
            raise HubError(f"{hub_id}: no .gguf file of {hub_id.repo} is quantized {hub_id.quant} (its .gguf "
                           f"files: {', '.join(ggufs) or 'none'})")
        if len(found) > 1 and not all(_SHARD.search(f) for f in found):
            raise HubError(f"{hub_id}: more than one .gguf file matches {hub_id.quant} ({', '.join(found)}): "
                           f"name one as {hub_id.repo}/FILE.gguf")
        chosen = found[0]
    elif "config.json" in files and any("/" not in f and f.endswith(".safetensors") for f in files):
        need = [f for f in files if ("/" not in f and any(fnmatch.fnmatchcase(f, p) for p in FOLDER_FILES))
                or MODULE_FILES.fullmatch(f)]
        return sorted(need), ""
    elif ggufs:
        chosen = next((f for f in ggufs if _quant_matches(f, DEFAULT_QUANT)), ggufs[0])
    else:
        raise HubError(f"{hub_id}: {hub_id.repo} holds no checkpoint gemmalite runs (config.json with .safetensors "
                       "weights, or .gguf files)")
    if _SHARD.search(chosen):
        raise HubError(f"{hub_id}: {chosen} is one part of a split GGUF file, which gemmalite does not read")
    return [chosen] + _mmproj(chosen, files), chosen


def _mmproj(chosen: str, files: list[str]) -> list[str]:
    """The multimodal projector to fetch with ``chosen``: an ``mmproj*.gguf`` in its folder (else the
    root), an F16 one where there are several, else the first by name."""
    folder = str(PurePosixPath(chosen).parent)
    for where in dict.fromkeys((folder, ".")):
        found = sorted(f for f in files if _is_mmproj(f) and str(PurePosixPath(f).parent) == where)
        if found:
            return [next((f for f in found if "f16" in PurePosixPath(f).name.lower()
                          and "bf16" not in PurePosixPath(f).name.lower()), found[0])]
    return []


def _storage(repo: str) -> Path:
    hf = _hub()
    return Path(hf.constants.HF_HUB_CACHE) / hf.file_download.repo_folder_name(repo_id=repo, repo_type="model")


def _cached(hub_id: HubId) -> Path | HubError | None:
    """The local path of ``hub_id`` where the cache holds every file it needs (no network); else None,
    or the `plan` error of the repository's cached listing. That listing is the tree huggingface_hub
    cached with the snapshot, or failing that the snapshot's own files."""
    hf = _hub()
    ref = _storage(hub_id.repo) / "refs" / "main"
    if not ref.is_file():
        return None
    snapshot = ref.parent.parent / "snapshots" / ref.read_text().strip()
    try:
        files = [f.path for f in hf.get_cached_repo_tree(hub_id.repo)]
    except hf.errors.CachedRepoTreeNotFoundError:
        files = [p.relative_to(snapshot).as_posix() for p in snapshot.rglob("*") if p.is_file()]
    try:
        need, entry = plan(hub_id, files)
    except HubError as e:
        return e  # online, the Hub's own listing decides
    if not need or not all(isinstance(hf.try_to_load_from_cache(hub_id.repo, f), str) for f in need):
        return None
    return snapshot / entry if entry else snapshot


def local_path(path: str | os.PathLike, *, refresh: bool = False) -> Path:
    """``path`` as a `Path` where it exists or is no Hub id (a `str` spelling one); else the Hub cache's
    copy of that id (`resolve_hub`). A local path always wins."""
    p = Path(path)
    if p.exists() or not isinstance(path, str) or parse(path) is None:
        return p
    return resolve_hub(path, refresh=refresh)


def resolve_hub(spec: str, *, refresh: bool = False) -> Path:
    """The local path of the Hub id ``spec`` (`parse`), downloaded into the Hub cache unless it is there
    already. ``refresh``: ask the Hub for the repository's latest revision even when one is cached
    (``gemmalite pull``). `HubError` for an id that is no Hub id, a repository or file that does not
    exist, access refused (a gated repository's licence page named), no network or ``HF_HUB_OFFLINE``
    with the model not cached."""
    hub_id = parse(spec)
    if hub_id is None:
        raise HubError(f"{spec!r} is not a Hub id (org/name, org/name:QUANT or org/name/file.gguf)")
    hf = _hub()
    cached = _cached(hub_id)
    offline = hf.constants.is_offline_mode()
    if isinstance(cached, Path) and (not refresh or offline):
        return cached
    if offline:
        raise HubError(f"{spec}: not in the Hugging Face cache ({hf.constants.HF_HUB_CACHE}) and HF_HUB_OFFLINE is "
                       f"set: download it where the Hub is reachable (gemmalite pull {spec})"
                       + (f"; the cached listing says: {cached}" if isinstance(cached, HubError) else ""))
    try:
        info = hf.HfApi().model_info(hub_id.repo)
        need, entry = plan(hub_id, [s.rfilename for s in info.siblings or []])
        folder = Path(hf.snapshot_download(hub_id.repo, allow_patterns=[glob.escape(f) for f in need]))
    except Exception as e:
        _raise_hub_error(spec, hub_id.repo, e, isinstance(cached, Path))
        raise
    path = folder / entry if entry else folder
    if not path.exists():
        raise HubError(f"{spec}: {hub_id.repo} changed while it downloaded ({entry or 'its files'} missing): "
                       "run it again")
    return path


def _raise_hub_error(spec: str, repo: str, e: Exception, cached: bool) -> None:
    """A `HubError` for huggingface_hub's (and its HTTP client's) errors; returns for anything else."""
    hf = _hub()
    errors = hf.errors
    if isinstance(e, errors.LocalEntryNotFoundError) and isinstance(e.__cause__, errors.HfHubHTTPError):
        e = e.__cause__  # a refused file: huggingface_hub says it is not cached, its cause says why
    if isinstance(e, errors.GatedRepoError):
        raise HubError(f"{spec}: access to {repo} was refused: it is gated, accept its licence at {_page(repo)} "
                       "while logged in, then set HF_TOKEN to a token of that account") from None
    if (isinstance(e, errors.HfHubHTTPError) and not isinstance(e, errors.RepositoryNotFoundError)
            and e.response is not None and e.response.status_code in (401, 403)):
        raise HubError(f"{spec}: access to {repo} was refused (HTTP {e.response.status_code}): a gated repository's "
                       f"licence is accepted at {_page(repo)} while logged in, and HF_TOKEN must be a token of that "
                       "account that may read it") from None
    if isinstance(e, errors.RepositoryNotFoundError):
        raise HubError(f"{spec}: no such local file or folder, and no model repository {repo} on the Hub "
                       f"({_page(repo)}; a private one needs HF_TOKEN)") from None
    if isinstance(e, (errors.RevisionNotFoundError, errors.RemoteEntryNotFoundError)):
        raise HubError(f"{spec}: {repo} has no such revision or file ({_one_line(e)})") from None
    if isinstance(e, (errors.LocalEntryNotFoundError, ConnectionError)) or type(e).__module__.startswith("httpx"):
        held = "" if cached else ", and the cache does not hold the model"
        raise HubError(f"{spec}: cannot reach the Hub at {hf.constants.ENDPOINT}{held} ({_one_line(e)})") from None
    if isinstance(e, errors.HfHubHTTPError):
        raise HubError(f"{spec}: the Hub answered with an error ({_one_line(e)})") from None


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split())[:300] or type(e).__name__


@dataclass(frozen=True)
class CachedModel:
    """A repository of the Hub cache gemmalite can run: its id, bytes on disk (and as text), the files
    to load (``.gguf`` names, or ``[]`` for a checkpoint folder) and the snapshot folder."""

    repo: str
    size: int
    size_str: str
    ggufs: list[str]
    path: Path


def cached_models() -> list[CachedModel]:
    """The Hub cache's model repositories holding a Gemma checkpoint folder or ``.gguf`` files, by id."""
    hf = _hub()
    try:
        cache = hf.scan_cache_dir()
    except hf.errors.CacheNotFound:
        return []
    out = []
    for repo in sorted(cache.repos, key=lambda r: r.repo_id):
        if repo.repo_type != "model" or not repo.revisions:
            continue
        rev = max(repo.revisions, key=lambda r: r.last_modified)
        names = {f.file_path.relative_to(rev.snapshot_path).as_posix() for f in rev.files}
        ggufs = sorted(n for n in names if n.lower().endswith(".gguf") and not _is_mmproj(n))
        if ggufs or _gemma_folder(rev.snapshot_path, names):
            out.append(CachedModel(repo.repo_id, repo.size_on_disk, repo.size_on_disk_str, ggufs, rev.snapshot_path))
    return out


def _gemma_folder(snapshot: Path, names: set[str]) -> bool:
    if "config.json" not in names or not any(n.endswith(".safetensors") for n in names):
        return False
    try:
        model_type = json.loads((snapshot / "config.json").read_text()).get("model_type", "")
    except (OSError, ValueError, AttributeError):
        return False
    return isinstance(model_type, str) and "gemma" in model_type


def remove(specs: list[str]) -> str:
    """Delete every cached revision of the repositories ``specs`` name (``org/name``); the size freed, as text.
    `HubError`, before anything is deleted, where one is not cached or names a file or quantization
    (a repository's files share its blobs: a whole repository goes)."""
    hf = _hub()
    try:
        cache = hf.scan_cache_dir()
    except hf.errors.CacheNotFound:
        cache = None
    repos = {r.repo_id: r for r in cache.repos if r.repo_type == "model"} if cache else {}
    hashes: list[str] = []
    for spec in specs:
        hub_id = parse(spec)
        if hub_id is None:
            raise HubError(f"{spec!r} is not a Hub id (org/name)")
        if hub_id.quant or hub_id.file:
            raise HubError(f"{spec}: gemmalite rm deletes a whole repository from the cache: give {hub_id.repo}")
        if hub_id.repo not in repos:
            raise HubError(f"{spec}: not in the Hugging Face cache ({hf.constants.HF_HUB_CACHE})")
        hashes += [r.commit_hash for r in repos[hub_id.repo].revisions]
    if cache is None:
        return "0"
    strategy = cache.delete_revisions(*dict.fromkeys(hashes))
    strategy.execute()
    return strategy.expected_freed_size_str
