"""Tokenizer and chat template.

Tokenization is the `tokenizers` library on the checkpoint's tokenizer.json, or (GGUF
SentencePiece vocabularies) `formats.spm.SPMTokenizer`, which offers the same methods. The chat
template is rendered with jinja2 the way transformers renders it (sandboxed environment,
``trim_blocks``/``lstrip_blocks``, ``raise_exception``, ``strftime_now``, a ``tojson`` that
does not escape HTML, the special tokens as variables), so the prompt text is identical.
"""
from __future__ import annotations

import json
import re
from collections.abc import Iterable
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, cast

import numpy as np

from .errors import InputError, TokenizerError

if TYPE_CHECKING:  # jinja2 and tokenizers load when first needed: a GGUF model's first token needs neither
    import jinja2
    from tokenizers import Tokenizer as HFTokenizer

# Used when a checkpoint carries no chat template: the family's turn format.
GEMMA4_FALLBACK_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "<|turn>{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n{{ m['content'] | trim }}<turn|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|turn>model\n{% endif %}"
)
GEMMA3_FALLBACK_TEMPLATE = (  # Gemma 3 has no system role: a system message is prepended to the first user turn
    "{{ bos_token }}{% set ns = namespace(sys='') %}{% for m in messages %}"
    "{% if m['role'] == 'system' %}{% set ns.sys = m['content'] | trim ~ '\n\n' %}{% else %}"
    "<start_of_turn>{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n{{ ns.sys }}{{ m['content'] | trim }}"
    "<end_of_turn>\n{% set ns.sys = '' %}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
FALLBACK_TEMPLATES = {"gemma4": GEMMA4_FALLBACK_TEMPLATE, "gemma3": GEMMA3_FALLBACK_TEMPLATE}
SPECIAL_KEYS = ("bos_token", "eos_token", "pad_token", "unk_token")


class Backend(Protocol):
    """The part of `tokenizers.Tokenizer` that `Tokenizer` uses (``encode(...).ids``)."""

    def encode(self, text: str, add_special_tokens: bool = True) -> Any: ...
    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str: ...
    def token_to_id(self, token: str) -> int | None: ...
    def id_to_token(self, tid: int) -> str | None: ...
    def get_vocab_size(self, with_added_tokens: bool = True) -> int: ...
    def save(self, path: str) -> None: ...


class Tokenizer:
    """Text <-> ids, plus the chat template. ``encode`` adds ``<bos>`` like transformers does."""

    def __init__(self, tk: HFTokenizer | Backend, *, chat_template: str | None = None, special_tokens: dict[str, str] | None = None,
                 add_bos: bool | None = None):
        self.tk = tk
        self.chat_template = chat_template  # the checkpoint's own, or None
        self.fallback_template = GEMMA4_FALLBACK_TEMPLATE  # the loader sets the family's
        self.special_tokens = dict(special_tokens or {})
        bos = self.special_tokens.get("bos_token")
        self.bos_id = tk.token_to_id(bos) if bos else None
        # A tokenizer.json whose post-processor already adds <bos> needs no help.
        adds_itself = self.bos_id is not None and self.bos_id in tk.encode("a", add_special_tokens=True).ids[:1]
        self._prepend_bos = bool(add_bos) and not adds_itself and self.bos_id is not None
        self._template: jinja2.Template | None = None

    @property
    def vocab_size(self) -> int:
        return self.tk.get_vocab_size(with_added_tokens=True)

    @property
    def prepends_bos(self) -> bool:
        """Does `encode` add ``<bos>`` itself (the tokenizer's post-processor does not)?"""
        return self._prepend_bos

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if not isinstance(text, str):
            raise InputError(f"text to encode must be a str, got {type(text).__name__}")
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise InputError(f"text contains a lone surrogate at position {e.start}, which is not text") from None
        ids = self.tk.encode(text, add_special_tokens=add_special_tokens).ids
        if add_special_tokens and self._prepend_bos:
            ids = [self.bos_id, *ids]
        return ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        """The text of ``ids``: integers in ``[0, vocab_size)`` (else `InputError`, not a silent ``''``)."""
        if isinstance(ids, (str, bytes, bytearray, dict)) or not isinstance(ids, (Iterable, np.ndarray)):
            raise InputError(f"ids to decode must be a list of token ids, got {type(ids).__name__}")
        items = ids.tolist() if isinstance(ids, np.ndarray) else list(ids)
        n = self.vocab_size
        for i in items:
            if not isinstance(i, (int, np.integer)) or isinstance(i, (bool, np.bool_)):
                raise InputError(f"ids to decode must be integers, got {type(i).__name__} {i!r:.40}")
            if not 0 <= i < n:
                raise InputError(f"token id {int(i)} is outside the vocabulary [0, {n})")
        return self.tk.decode([int(i) for i in items], skip_special_tokens=skip_special_tokens)

    def decode_generated(self, ids: list[int]) -> str:
        """The text of ids a model produced (unchecked, for streaming): an id past the tokenizer's
        vocabulary -- a model's padded embedding rows -- has no text, as in transformers."""
        return self.tk.decode(ids, skip_special_tokens=False)

    def token_id(self, token: str) -> int | None:
        return self.tk.token_to_id(token)

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **kwargs: Any) -> str:
        """The prompt text for a conversation (transformers' ``apply_chat_template(tokenize=False)``)."""
        if not isinstance(messages, list) or not all(isinstance(m, dict) and "role" in m for m in messages):
            raise InputError("messages must be a list of {'role': ..., 'content': ...} dicts")
        if self._template is None:
            self._template = compile_template(self.chat_template or self.fallback_template)
        tools, documents = kwargs.pop("tools", None), kwargs.pop("documents", None)
        import jinja2

        try:
            return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt, tools=tools,
                                         documents=documents, **{**self.special_tokens, **kwargs})
        except jinja2.TemplateError as e:  # raise_exception() in the template: it refuses these messages
            raise InputError(f"the chat template refused the messages: {e}") from None

    def chat_ids(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **kwargs: Any) -> list[int]:
        """Token ids of the rendered conversation (the template writes <bos> itself: none is added)."""
        return self.encode(self.apply_chat_template(messages, add_generation_prompt, **kwargs), add_special_tokens=False)

    def stream(self) -> TextStream:
        return TextStream(self)


class TextStream:
    """Incremental detokenizer: turns a token stream into text pieces, never splitting a
    UTF-8 character (text ending in U+FFFD waits for the bytes that complete it). Each
    piece is decoded together with the token before it, so leading spaces come out right."""

    def __init__(self, tok: Tokenizer):
        self.tok = tok
        self.ids: list[int] = []
        self.prefix = 0  # start of the context window that is decoded
        self.read = 0  # ids before this are already emitted

    def push(self, token: int) -> str:
        self.ids.append(token)
        if _is_byte_token(self.tok.tk.id_to_token(token)):
            return ""  # a run of byte tokens decodes as a whole (invalid runs become U+FFFD each)
        done = self.tok.decode_generated(self.ids[self.prefix : self.read])
        text = self.tok.decode_generated(self.ids[self.prefix :])
        if len(text) <= len(done) or text.endswith("\ufffd"):
            return ""
        self.prefix, self.read = self.read, len(self.ids)
        return text[len(done) :]

    def flush(self) -> str:
        """Whatever is still held back (an incomplete character at the very end)."""
        done = self.tok.decode_generated(self.ids[self.prefix : self.read])
        text = self.tok.decode_generated(self.ids[self.prefix :])
        self.prefix = self.read = len(self.ids)
        return text[len(done) :]


def _is_byte_token(piece: str | None) -> bool:
    """SentencePiece-style byte fallback pieces look like ``<0xAB>``."""
    return piece is not None and len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">")


def compile_template(source: str) -> jinja2.Template:
    import jinja2
    import jinja2.ext
    import jinja2.sandbox

    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                       extensions=[jinja2.ext.loopcontrols])

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None, sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise TokenizerError(f"chat template does not compile: {e}") from None


def _token_str(v: Any) -> str | None:
    if isinstance(v, dict):  # {"content": "<bos>", ...} in older tokenizer_config files
        return v.get("content")
    return v if isinstance(v, str) else None


def load_tokenizer_folder(folder: Path) -> Tokenizer | None:
    """The tokenizer of a checkpoint folder, or None when it has no tokenizer.json."""
    path = folder / "tokenizer.json"
    if not path.exists():
        return None
    tk: Any = cached_bpe(path)
    if tk is None:
        from tokenizers import Tokenizer as HFTokenizer

        try:
            tk = HFTokenizer.from_file(str(path))
        except Exception as e:  # noqa: BLE001 - the tokenizers library raises a bare Exception on parse errors
            raise TokenizerError(f"{path}: cannot be read ({e})") from None
    conf: dict[str, Any] = {}
    if (folder / "tokenizer_config.json").exists():
        conf = _json_object(folder / "tokenizer_config.json")
    template = None
    if (folder / "chat_template.jinja").exists():
        try:
            template = (folder / "chat_template.jinja").read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise TokenizerError(f"{folder / 'chat_template.jinja'}: cannot be read ({e})") from None
    elif (folder / "chat_template.json").exists():
        template = _json_object(folder / "chat_template.json").get("chat_template")
        if not isinstance(template, str):
            raise TokenizerError(f"{folder / 'chat_template.json'}: chat_template must be a string")
    elif isinstance(conf.get("chat_template"), str):
        template = conf["chat_template"]
    special = {k: s for k in SPECIAL_KEYS if (s := _token_str(conf.get(k)))}
    if "bos_token" not in special and tk.token_to_id("<bos>") is not None:
        special["bos_token"] = "<bos>"
    if "eos_token" not in special and tk.token_to_id("<eos>") is not None:
        special["eos_token"] = "<eos>"
    add_bos = conf.get("add_bos_token", True)
    if not isinstance(add_bos, bool):
        raise TokenizerError(f"{folder / 'tokenizer_config.json'}: add_bos_token must be true or false, got {add_bos!r}")
    return Tokenizer(tk, chat_template=template, special_tokens=special, add_bos=add_bos)


def _json_object(path: Path) -> dict[str, Any]:
    """A JSON object from a tokenizer file; TokenizerError naming the file otherwise."""
    try:
        value = json.loads(path.read_bytes())
    except OSError as e:
        raise TokenizerError(f"{path}: cannot be read ({e.strerror})") from None
    except (ValueError, RecursionError) as e:
        raise TokenizerError(f"{path}: not valid JSON ({str(e) or 'nested too deeply'})") from None
    if not isinstance(value, dict):
        raise TokenizerError(f"{path}: must be a JSON object, got {type(value).__name__}")
    return value


def save_tokenizer(tok: Tokenizer, out: Path) -> None:
    """Write tokenizer.json, tokenizer_config.json and chat_template.jinja (Hugging Face layout)."""
    tok.tk.save(str(out / "tokenizer.json"))
    conf = {"tokenizer_class": "GemmaTokenizer", "add_bos_token": tok.prepends_bos, "add_eos_token": False,
            **tok.special_tokens}
    (out / "tokenizer_config.json").write_text(json.dumps(conf, indent=2))
    if tok.chat_template:
        (out / "chat_template.jinja").write_text(tok.chat_template)


def fallback_tokenizer() -> Tokenizer:
    """A small byte-level tokenizer with the Gemma special ids, for when no real vocabulary is at hand."""
    from tokenizers import AddedToken, decoders, models
    from tokenizers import Tokenizer as HFTokenizer

    vocab = {"<pad>": 0, "<eos>": 1, "<bos>": 2, "<unk>": 3, "<mask>": 4, "<|turn>": 105, "<turn|>": 106}
    vocab |= {f"<unused{i}>": i for i in range(5, 105)}
    vocab |= {f"<0x{b:02X}>": 107 + b for b in range(256)}
    tk = HFTokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    tk.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Fuse()])
    tk.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in ("<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<|turn>", "<turn|>")])
    return Tokenizer(tk, chat_template=GEMMA4_FALLBACK_TEMPLATE, special_tokens={"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>", "unk_token": "<unk>"}, add_bos=True)


# ---------------------------------------------------------------------------- cached BPE
# `tokenizers` takes ~1 s to load Gemma 4's tokenizer.json (a 262k-entry vocabulary and 515k
# merges parsed from 32 MB of JSON into hash maps), at every start. For the BPE layout Gemma's
# checkpoints use, `CachedBPE` gives the same ids from a few arrays kept in gemmalite's cache
# folder (written once, on the first load of a file): ~0.05 s to load.

_BPE_CACHE_FORMAT = 1
_SPACE = "\u2581"
_NORMALIZER = {"type": "Replace", "pattern": {"String": " "}, "content": _SPACE}
_PRE_TOKENIZER = {"type": "Split", "pattern": {"Regex": "\n+"}, "behavior": "Isolated", "invert": False}
_DECODER = {"type": "Sequence", "decoders": [{"type": "Replace", "pattern": {"String": _SPACE}, "content": " "},
                                             {"type": "ByteFallback"}, {"type": "Fuse"}]}
_HEX = "0123456789abcdefABCDEF"


class _Encoding:
    """The ids of one text (the part of `tokenizers.Encoding` gemmalite reads)."""

    __slots__ = ("ids",)

    def __init__(self, ids: list[int]):
        self.ids = ids


class CachedBPE:
    """`tokenizers`' BPE for one tokenizer.json layout, from arrays (`cached_bpe`): added tokens
    cut out of the raw text first (leftmost-longest), ``' '`` -> ``'▁'``, pieces split into runs
    of newlines and runs of anything else, each piece one character per symbol (``<0xNN>``
    bytes for characters without a token) merged by `kernels.bpe.bpe_merge`; decoding ``'▁'`` ->
    ``' '``, byte tokens joined into UTF-8 (U+FFFD per byte of an invalid run). The methods
    gemmalite uses of `tokenizers.Tokenizer`, with the same results."""

    def __init__(self, arrays: dict[str, np.ndarray], meta: dict[str, Any], source: str):
        self._a = arrays
        self._meta = meta
        self._source = source
        blob = arrays["tokens"].tobytes().decode("utf-8")
        self._tokens = blob.split("\0")
        self._vocab: dict[str, int] | None = None  # built on first use of token_to_id
        self._added = {t: i for t, i, _ in meta["added"]}
        self._special_ids = {i for _, i, s in meta["added"] if s}
        self._split = meta["split_newlines"]
        self._normalize = meta["normalize"]
        self._prefix, self._suffix = meta["prefix"], meta["suffix"]
        pats = sorted(self._added, key=len, reverse=True)  # alternatives longest first: leftmost-longest
        self._added_re = re.compile("|".join(map(re.escape, pats))) if pats else None

    # -- the tokenizers.Tokenizer interface ----------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = True) -> _Encoding:
        ids: list[int] = list(self._prefix) if add_special_tokens else []
        start = 0
        if self._added_re is not None:
            for m in self._added_re.finditer(text):
                if m.start() > start:
                    ids += self._encode_plain(text[start:m.start()])
                ids.append(self._added[m.group()])
                start = m.end()
        if start < len(text):
            ids += self._encode_plain(text[start:])
        if add_special_tokens:
            ids += self._suffix
        return _Encoding(ids)

    def encode_batch(self, texts: Iterable[str], add_special_tokens: bool = True) -> list[_Encoding]:
        return [self.encode(t, add_special_tokens) for t in texts]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        parts: list[str] = []
        run = bytearray()
        tokens, n = self._tokens, len(self._tokens)
        for i in ids:
            i = int(i)
            if not 0 <= i < n or (skip_special_tokens and i in self._special_ids):
                continue
            tok = tokens[i].replace(_SPACE, " ")
            if len(tok) == 6 and tok.startswith("<0x") and tok.endswith(">") and (b := _hex_byte(tok[3:5])) is not None:
                run.append(b)
                continue
            if run:
                parts.append(_utf8_or_replacement(run))
                run = bytearray()
            parts.append(tok)
        if run:
            parts.append(_utf8_or_replacement(run))
        return "".join(parts)

    def token_to_id(self, token: str) -> int | None:
        if token in self._added:
            return self._added[token]
        if self._vocab is None:
            self._vocab = dict(zip(self._tokens, range(len(self._tokens))))
        return self._vocab.get(token)

    def id_to_token(self, tid: int) -> str | None:
        return self._tokens[tid] if 0 <= tid < len(self._tokens) else None

    def get_vocab_size(self, with_added_tokens: bool = True) -> int:
        return len(self._tokens)

    def added_ids(self) -> set[int]:
        """Ids of the added tokens (whole tokens cut out of the text before BPE, special or not)."""
        return set(self._added.values())

    def save(self, path: str) -> None:
        import shutil

        shutil.copyfile(self._source, path)

    def to_str(self) -> str:
        return Path(self._source).read_text(encoding="utf-8")

    # -- encoding ---------------------------------------------------------------------------
    def _encode_plain(self, text: str) -> list[int]:
        """Ids of text without added tokens: normalize, split, merge."""
        from .kernels.bpe import bpe_merge

        if self._normalize:
            text = text.replace(" ", _SPACE)
        cps = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
        a = self._a
        idx = np.minimum(np.searchsorted(a["char_cp"], cps), len(a["char_cp"]) - 1)
        found = a["char_cp"][idx] == cps
        syms = a["char_id"][idx].astype(np.int32)
        if self._split:  # a new word wherever a newline run starts or ends
            nl = cps == 10
            bounds = np.flatnonzero(nl[1:] != nl[:-1]) + 1
        else:
            bounds = np.zeros(0, np.int64)
        if not found.all():  # characters without a token: their UTF-8 bytes, one symbol each
            pieces, cuts, pos = [], [], 0
            missing = set(np.flatnonzero(~found).tolist())
            bset = set(bounds.tolist())
            for i, s in enumerate(syms.tolist()):
                if i in bset:
                    cuts.append(pos)
                if i in missing:
                    bs = chr(cps[i]).encode("utf-8", "surrogatepass")
                    pieces += [int(a["byte_id"][b]) for b in bs]
                    pos += len(bs)
                else:
                    pieces.append(s)
                    pos += 1
            syms = np.asarray(pieces, dtype=np.int32)
            bounds = np.asarray(cuts, dtype=np.int64)
        starts = np.concatenate([[0], bounds, [len(syms)]]).astype(np.int64)
        out = np.empty(len(syms), dtype=np.int32)
        n = bpe_merge(syms, starts, a["keys"], a["ranks"], a["new_ids"], out)
        return out[:n].tolist()


def _hex_byte(s: str) -> int | None:
    """Two characters as Rust's ``u8::from_str_radix(s, 16)`` reads them (a leading '+' allowed)."""
    if len(s) == 2 and s[1] in _HEX and (s[0] in _HEX or s[0] == "+"):
        return int(s, 16)
    return None


def _utf8_or_replacement(run: bytearray) -> str:
    try:
        return run.decode("utf-8")
    except UnicodeDecodeError:
        return "\ufffd" * len(run)


def _bpe_layout(conf: dict[str, Any]) -> dict[str, Any] | None:
    """What `CachedBPE` needs from a parsed tokenizer.json, or None when it uses anything else."""
    model = conf.get("model") or {}
    if (model.get("type") != "BPE" or model.get("dropout") is not None or model.get("continuing_subword_prefix")
            or model.get("end_of_word_suffix") or model.get("ignore_merges") or not model.get("byte_fallback")
            or conf.get("truncation") is not None or conf.get("padding") is not None
            or conf.get("normalizer") not in (None, _NORMALIZER) or conf.get("pre_tokenizer") not in (None, _PRE_TOKENIZER)
            or conf.get("decoder") != _DECODER):
        return None
    added = conf.get("added_tokens") or []
    if any(a.get("single_word") or a.get("lstrip") or a.get("rstrip") or a.get("normalized") for a in added):
        return None
    prefix: list[int] = []
    suffix: list[int] = []
    post = conf.get("post_processor")
    if post is not None:
        if post.get("type") != "TemplateProcessing":
            return None
        specials = post.get("special_tokens") or {}
        seen = False
        for item in post.get("single") or []:
            if "Sequence" in item:
                if seen or item["Sequence"].get("id") != "A":
                    return None
                seen = True
            elif "SpecialToken" in item:
                ids = (specials.get(item["SpecialToken"].get("id")) or {}).get("ids")
                if not ids:
                    return None
                (suffix if seen else prefix).extend(int(i) for i in ids)
            else:
                return None
        if not seen:
            return None
    return {"added": [[a["content"], int(a["id"]), bool(a.get("special"))] for a in added],
            "split_newlines": conf.get("pre_tokenizer") is not None, "normalize": conf.get("normalizer") is not None,
            "prefix": prefix, "suffix": suffix}


def _bpe_arrays(model: dict[str, Any]) -> dict[str, np.ndarray]:
    vocab: dict[str, int] = model["vocab"]
    n = max(vocab.values()) + 1
    if n != len(vocab):
        raise ValueError("vocabulary ids are not 0..n-1")
    tokens = [""] * n
    for t, i in vocab.items():
        tokens[i] = t
    if any("\0" in t for t in tokens):
        raise ValueError("a token contains NUL")
    byte_id = np.array([vocab.get(f"<0x{b:02X}>", -1) for b in range(256)], dtype=np.int32)
    if (byte_id < 0).any():
        raise ValueError("byte fallback without all 256 byte tokens")
    chars = sorted((ord(t), i) for t, i in vocab.items() if len(t) == 1)
    merges = [m.split(" ", 1) if isinstance(m, str) else m for m in model["merges"]]
    left = np.array([vocab[a] for a, _ in merges], dtype=np.int64)
    right = np.array([vocab[b] for _, b in merges], dtype=np.int64)
    new_ids = np.array([vocab[a + b] for a, b in merges], dtype=np.int32)
    keys = (left << 32) | right
    # one rank per pair: the last of duplicates, as in tokenizers' map (later inserts win)
    order = np.argsort(keys, kind="stable")
    sk = keys[order]
    last = np.append(sk[1:] != sk[:-1], True)
    return {"tokens": np.frombuffer("\0".join(tokens).encode("utf-8"), dtype=np.uint8),
            "char_cp": np.array([c for c, _ in chars], dtype=np.uint32), "char_id": np.array([i for _, i in chars], dtype=np.int32),
            "byte_id": byte_id, "keys": sk[last], "ranks": order[last].astype(np.int32), "new_ids": new_ids}


def cached_bpe(path: Path) -> CachedBPE | None:
    """A `CachedBPE` for ``path`` (tokenizer.json) from gemmalite's cache folder, building the cache
    on first use; None when the file uses something `CachedBPE` does not reproduce (the caller
    then loads it with `tokenizers`). The cache is keyed by the file's path, size and time stamp."""
    import hashlib
    import os

    from .settings import VERSION, cache_root

    st = path.stat()
    key = hashlib.sha256(f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}|{VERSION}|{_BPE_CACHE_FORMAT}".encode()).hexdigest()[:20]
    base = cache_root() / "tokenizers"
    npz, info = base / f"{key}.bpe.npz", base / f"{key}.bpe.json"
    try:
        meta = json.loads(info.read_text())
        if meta is None:
            return None  # known not to fit
        with np.load(npz) as z:
            return CachedBPE({k: z[k] for k in z.files}, meta, str(path))
    except Exception:  # noqa: BLE001, S110 - absent, partial or from another version: rebuild
        pass
    conf = _json_object(path)
    meta = _bpe_layout(conf)
    arrays = None
    if meta is not None:
        try:
            arrays = _bpe_arrays(conf["model"])
            vocab = conf["model"]["vocab"]
            if any(vocab.get(t) != i for t, i, _ in meta["added"]):  # added tokens outside the vocabulary
                arrays = meta = None
        except (ValueError, KeyError, TypeError):
            arrays = meta = None
    try:  # atomically (tmp + rename); a read-only cache folder only costs speed
        base.mkdir(parents=True, exist_ok=True)
        if arrays is not None:
            tmp = npz.with_name(f"{npz.stem}.tmp{os.getpid()}.npz")
            np.savez(tmp, **cast(dict[str, Any], arrays))  # (the stub would match a key to allow_pickle)
            os.replace(tmp, npz)
        tmp = info.with_name(f"{info.name}.tmp{os.getpid()}")
        tmp.write_text(json.dumps(meta))
        os.replace(tmp, info)
    except OSError:
        pass
    return CachedBPE(arrays, meta, str(path)) if arrays is not None and meta is not None else None
