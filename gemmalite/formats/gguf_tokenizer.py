"""The tokenizer a GGUF file's metadata describes, reproducing llama.cpp's ids.

* ``tokenizer.ggml.model == "llama"`` (Gemma 3, SentencePiece): `spm.SPMTokenizer`, llama.cpp's
  own algorithm on the vocabulary and scores (see that module).
* ``"gemma4"`` (BPE): a `tokenizers.Tokenizer`. llama.cpp first cuts every token typed CONTROL,
  USER_DEFINED or UNKNOWN out of the raw text (``parse_special=True``); here they are added
  tokens matched on the raw text (``normalized=False``): control/unknown ones special,
  user-defined ones not (llama.cpp cuts the longest first, tokenizers matches leftmost-longest:
  the same pieces unless two such tokens overlap in the text, which none in the vocabulary can).
  Each remaining fragment, with every ``' '`` replaced by ``'▁'``, is split into runs of
  newlines and runs of anything else; a newline run that is a token is taken whole, everything
  else goes through the file's merges (ranked by position), with ``<0xNN>`` byte fallback. That
  is a ``\\n+`` split and BPE with byte fallback: the merges already build every newline-run
  token (1 to 31 newlines) whole, so no whole-word lookup is needed -- and none may be used,
  since some tokens (``[multimodal]``) are in the vocabulary but unreachable by merges, and
  llama.cpp spells them out piece by piece.

BOS is prepended when the file says so (llama.cpp forces it on for gemma4).
"""
from __future__ import annotations

import hashlib
import json
import lzma
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import TokenizerError
from ..settings import VERSION, cache_root
from ..tokenizer import Tokenizer as GemmaTokenizer
from .gguf import read_gguf
from .spm import CONTROL, NORMAL, UNKNOWN, USER_DEFINED, SPMTokenizer

if TYPE_CHECKING:  # tokenizers loads only for BPE vocabularies
    from tokenizers import Tokenizer

# llama.cpp marks these end-of-generation by their text (llama_vocab::impl::load)
_EOG_TEXTS = ("<end_of_turn>", "<eos>", "<turn|>", "<|tool_response>")
_DATA = Path(__file__).resolve().parent.parent / "data"
GEMMA4_VOCAB_XZ = _DATA / "gemma4-vocab.gguf.xz"


def _bpe_merges(merges: list[str], vocab: dict[str, int]) -> list[tuple[str, str]]:
    """The file's merges split as llama.cpp does (at the first space after position 0)."""
    out = []
    for m in merges:
        pos = m.find(" ", 1)
        if pos < 0:
            continue
        a, b = m[:pos], m[pos + 1:]
        if a in vocab and b in vocab and a + b in vocab:  # tokenizers rejects anything else
            out.append((a, b))
    return out


def tokenizer_from_gguf(meta: dict[str, Any], info: dict[str, Any] | None = None
                        ) -> tuple[Tokenizer | SPMTokenizer, dict[str, Any]]:
    """Build the tokenizer a GGUF file's metadata describes (an `SPMTokenizer` for "llama"
    vocabularies, a `tokenizers.Tokenizer` for "gemma4"), plus facts the runtime needs:
    ``bos/eos/pad/unk_token_id``, ``add_bos``, ``add_eos``, ``eog_token_ids`` (llama.cpp's
    end-of-generation set), ``chat_template`` and ``model`` ("llama" or "gemma4"); ``info``: those
    facts when the caller already has them from `special_token_info`."""
    info = info or special_token_info(meta)
    model = info["model"]
    tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
    n = len(tokens)
    types = np.asarray(meta.get("tokenizer.ggml.token_type", np.full(n, NORMAL)), dtype=np.int64)
    if model == "llama":
        scores = np.asarray(meta.get("tokenizer.ggml.scores", -np.arange(n, dtype=np.float32)))
        return SPMTokenizer(tokens, scores, types, add_space_prefix=bool(meta.get("tokenizer.ggml.add_space_prefix", False)),
                            bos_id=info["bos_token_id"], eos_id=info["eos_token_id"], add_bos=info["add_bos"],
                            add_eos=info["add_eos"], unk_id=info["unk_token_id"]), info
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers, processors
    from tokenizers.models import BPE

    vocab = {t: i for i, t in enumerate(tokens)}
    if len(vocab) != n:  # duplicates: keep the first id
        vocab = {}
        for i, t in enumerate(tokens):
            vocab.setdefault(t, i)
    merges = _bpe_merges(list(meta["tokenizer.ggml.merges"]), vocab)
    unk_id = info["unk_token_id"]
    tok = Tokenizer(BPE(vocab=vocab, merges=merges, byte_fallback=True,
                        unk_token=tokens[unk_id] if unk_id is not None else None, fuse_unk=False))
    tok.normalizer = normalizers.Replace(" ", "\u2581")
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("\n+"), behavior="isolated")
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    added = [AddedToken(tokens[i], special=types[i] != USER_DEFINED, normalized=False)
             for i in np.flatnonzero(np.isin(types, (CONTROL, USER_DEFINED, UNKNOWN)))]
    tok.add_special_tokens([a for a in added if a.special])
    tok.add_tokens([a for a in added if not a.special])
    if info["add_bos"] and info["bos_token_id"] is not None:
        bos = tokens[info["bos_token_id"]]
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A $B:1", special_tokens=[(bos, info["bos_token_id"])])
    return tok, info


def check_tokenizer_metadata(meta: dict[str, Any]) -> None:
    """TokenizerError naming the first malformed ``tokenizer.ggml.*`` key (a missing vocabulary too)."""
    tokens = meta.get("tokenizer.ggml.tokens")
    if not isinstance(tokens, list) or not tokens or not _all_str(tokens):
        raise TokenizerError("GGUF metadata has no tokenizer.ggml.tokens list (no vocabulary)")
    n = len(tokens)
    if meta.get("tokenizer.ggml.model") not in ("llama", "gemma4"):
        raise TokenizerError(f"unsupported GGUF tokenizer model {meta.get('tokenizer.ggml.model')!r} "
                             "(expected 'llama' or 'gemma4')")
    for key in ("token_type", "scores"):
        v = meta.get(f"tokenizer.ggml.{key}")
        if v is not None and not (isinstance(v, (list, np.ndarray)) and np.asarray(v).shape == (n,)
                                  and np.asarray(v).dtype.kind in "iuf"):
            raise TokenizerError(f"GGUF metadata tokenizer.ggml.{key} must be {n} numbers, one per token")
    merges = meta.get("tokenizer.ggml.merges")
    if meta.get("tokenizer.ggml.model") == "gemma4" and not (
            isinstance(merges, list) and _all_str(merges)):
        raise TokenizerError("GGUF metadata tokenizer.ggml.merges must be a list of strings")
    for key in ("bos_token_id", "eos_token_id", "padding_token_id", "unknown_token_id"):
        v = meta.get(f"tokenizer.ggml.{key}")
        if v is not None and not (isinstance(v, int) and not isinstance(v, bool) and 0 <= v < n):
            raise TokenizerError(f"GGUF metadata tokenizer.ggml.{key} = {v!r} is not a token id below {n}")


def _all_str(items: list) -> bool:
    return set(map(type, items)) <= {str}  # a vocabulary is 262k items: no Python-level loop


def _indices(items: list[str], value: str) -> list[int]:
    """Every position of ``value`` (list.index scans in C)."""
    out: list[int] = []
    try:
        while True:
            out.append(items.index(value, out[-1] + 1 if out else 0))
    except ValueError:
        return out


def special_token_info(meta: dict[str, Any]) -> dict[str, Any]:
    """The special-token facts of `tokenizer_from_gguf`, without building the tokenizer."""
    check_tokenizer_metadata(meta)
    model = meta.get("tokenizer.ggml.model")
    tokens = meta["tokenizer.ggml.tokens"]

    def tid(key: str) -> int | None:
        v = meta.get(f"tokenizer.ggml.{key}")
        return None if v is None else int(v)

    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", True))
    if model == "gemma4":
        add_bos = True  # llama.cpp overrides it to true for the gemma4 pre-tokenizer (PR 21500)
    eos = tid("eos_token_id")
    eog = sorted({i for t in _EOG_TEXTS for i in _indices(tokens, t)} | ({eos} if eos is not None else set()))
    return {
        "model": model,
        "bos_token_id": tid("bos_token_id"),
        "eos_token_id": eos,
        "pad_token_id": tid("padding_token_id"),
        "unk_token_id": tid("unknown_token_id"),
        "add_bos": add_bos,
        "add_eos": bool(meta.get("tokenizer.ggml.add_eos_token", False)),
        "eog_token_ids": eog,
        "chat_template": meta.get("tokenizer.chat_template"),
    }


def tokenizer_from_gguf_metadata(meta: dict[str, Any], cache_key: str | None = None,
                                 info: dict[str, Any] | None = None) -> GemmaTokenizer:
    """The gemmalite `Tokenizer` a GGUF file's (already parsed) metadata describes. A BPE
    ("gemma4") vocabulary with a ``cache_key`` (naming the file's identity) is kept as
    tokenizer.json in the user's cache folder: reading it back skips checking 500k merges. A
    SentencePiece ("llama") one needs no cache: it is a dict of the tokens."""
    spm = meta.get("tokenizer.ggml.model") == "llama"
    tk, cached_info = _cached(cache_key) if cache_key and not spm else (None, None)
    if tk is not None:
        info = cached_info
    else:
        tk, info = tokenizer_from_gguf(meta, info)
        if cache_key and not isinstance(tk, SPMTokenizer):
            _store(cache_key, tk, info)
    special = {k: tk.id_to_token(info[k + "_token_id"]) for k in ("bos", "eos", "pad", "unk")
               if info.get(k + "_token_id") is not None}
    return GemmaTokenizer(tk, chat_template=info.get("chat_template"), add_bos=info.get("add_bos", True),
                          special_tokens={k + "_token": v for k, v in special.items() if v is not None})


def file_cache_key(path: str | os.PathLike) -> str:
    """A key that changes when the file, gemmalite or tokenizers change."""
    import tokenizers

    st = os.stat(path)
    ident = f"{os.path.abspath(path)}|{st.st_size}|{st.st_mtime_ns}|{VERSION}|{tokenizers.__version__}"
    return hashlib.sha256(ident.encode()).hexdigest()[:20]


def _cache_paths(key: str) -> tuple[Path, Path]:
    base = cache_root() / "tokenizers"
    return base / f"{key}.tokenizer.json", base / f"{key}.info.json"


def _cached(key: str) -> tuple[Tokenizer | None, dict | None]:
    from tokenizers import Tokenizer

    tok_path, info_path = _cache_paths(key)
    try:
        return Tokenizer.from_file(str(tok_path)), json.loads(info_path.read_text())
    except Exception:  # noqa: BLE001 - absent, partial or from another version: rebuild
        return None, None


def _store(key: str, tk: Tokenizer, info: dict) -> None:
    """Write both files atomically (tmp + rename); a read-only cache folder only costs speed."""
    tok_path, info_path = _cache_paths(key)
    try:
        tok_path.parent.mkdir(parents=True, exist_ok=True)
        for path, write in ((tok_path, lambda p: tk.save(str(p))),
                            (info_path, lambda p: p.write_text(json.dumps(info)))):
            tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
            write(tmp)
            os.replace(tmp, path)
    except OSError:
        pass


def tokenizer_from_gguf_file(path: str | os.PathLike) -> GemmaTokenizer:
    """The tokenizer stored in a GGUF file's metadata (a vocabulary-only GGUF too; tensors untouched)."""
    try:
        return tokenizer_from_gguf_metadata(read_gguf(path, load_tensors=False).metadata)
    except TokenizerError as e:
        raise TokenizerError(f"{os.fspath(path)}: {e}") from None


def save_tokenizer_json(tok: Tokenizer | SPMTokenizer, path: str | os.PathLike) -> None:
    """Write ``tokenizer.json`` (loadable by ``Tokenizer.from_file`` or transformers)."""
    tok.save(os.fspath(path))


def gemma4_tokenizer_gguf_path(cache_dir: str | os.PathLike | None = None) -> Path:
    """The real Gemma 4 tokenizer (tensor-free GGUF shipped compressed in the package),
    decompressed once into gemmalite's cache folder (``~/.cache/gemmalite/``)."""
    data = GEMMA4_VOCAB_XZ.read_bytes()
    digest = hashlib.sha256(data).hexdigest()[:12]
    base = Path(cache_dir) if cache_dir else cache_root()
    out = base / f"gemma4-vocab-{digest}.gguf"
    if not out.exists():
        base.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(f".tmp{os.getpid()}")
        tmp.write_bytes(lzma.decompress(data))
        os.replace(tmp, out)
    return out
