"""Tokenizer and chat template.

Tokenization is the `tokenizers` library on the checkpoint's tokenizer.json, or (GGUF
SentencePiece vocabularies) `formats.spm.SPMTokenizer`, which offers the same methods. The chat
template is rendered with jinja2 the way transformers renders it (sandboxed environment,
``trim_blocks``/``lstrip_blocks``, ``raise_exception``, ``strftime_now``, a ``tojson`` that
does not escape HTML, the special tokens as variables), so the prompt text is identical.
"""
from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Protocol

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
        return self.tk.decode(list(ids), skip_special_tokens=skip_special_tokens)

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

    def stream(self) -> "TextStream":
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
        done = self.tok.decode(self.ids[self.prefix : self.read])
        text = self.tok.decode(self.ids[self.prefix :])
        if len(text) <= len(done) or text.endswith("\ufffd"):
            return ""
        self.prefix, self.read = self.read, len(self.ids)
        return text[len(done) :]

    def flush(self) -> str:
        """Whatever is still held back (an incomplete character at the very end)."""
        done = self.tok.decode(self.ids[self.prefix : self.read])
        text = self.tok.decode(self.ids[self.prefix :])
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
    from tokenizers import Tokenizer as HFTokenizer

    try:
        tk = HFTokenizer.from_file(str(path))
    except Exception as e:  # the tokenizers library raises a bare Exception on parse errors
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
