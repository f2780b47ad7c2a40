"""llama.cpp's SentencePiece ("llama" GGUF vocabulary) tokenizer, run directly on the vocabulary.

Why not the `tokenizers` library: expressing llama.cpp's score-driven merging as BPE needs one
merge rule per way of splitting a token in two (513,511 for Gemma 3), and building that takes
~1 s per load even from a cached tokenizer.json. This needs a token -> id dict and the scores.

Encoding mirrors src/llama-vocab.cpp (``tokenize_impl``, ``llm_tokenizer_spm_session``):

1. *Special partition*: tokens typed CONTROL, USER_DEFINED or UNKNOWN are cut out of the raw
   text first. llama.cpp cuts the longest tokens first everywhere; this matches leftmost-longest.
   The two differ only where two such tokens overlap in the text, and in the Gemma vocabularies
   none can except runs of one character (newlines, spaces, tabs: every run length 1-31 is a
   token), where both give the same pieces.
2. Each remaining fragment (``' '`` prefixed when ``add_space_prefix`` and it starts the text or
   follows a special token), with every ``' '`` replaced by ``'▁'``, is split into characters;
   then, over and over, the adjacent pair whose concatenation is the highest-score token is
   merged (ties: the leftmost). A piece left without a token becomes its UTF-8 bytes as
   ``<0xNN>`` tokens. A heap of candidate pairs keeps this O(n log n).

Decoding follows llama.cpp's ``token_to_piece`` (``'▁'`` -> ``' '`` in normal tokens, byte
tokens joined into UTF-8) with the byte-run rule of `tokenizers`' ByteFallback decoder that
gemmalite's streaming relies on: a run of byte tokens that is not valid UTF-8 gives one U+FFFD
per byte. The object offers the part of the `tokenizers.Tokenizer` interface gemmalite uses.
"""
from __future__ import annotations

import heapq
import os
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
_SPACE = "\u2581"


@dataclass
class Encoding:
    """The ids of one text and their token strings (like `tokenizers.Encoding`)."""
    ids: list[int]
    tokens: list[str]


class SPMTokenizer:
    """Text <-> ids for a SentencePiece vocabulary, as llama.cpp tokenizes it (see module doc)."""

    def __init__(self, tokens: list[str], scores: Sequence[float] | np.ndarray, types: Sequence[int] | np.ndarray, *,
                 add_space_prefix: bool = False, bos_id: int | None = None, eos_id: int | None = None,
                 add_bos: bool = True, add_eos: bool = False, unk_id: int | None = None):
        # llama.cpp renames empty tokens and, for duplicates, keeps the last id (token_to_id[word] = i)
        if "" in tokens:
            tokens = [t if t else f"[EMPTY_{i}]" for i, t in enumerate(tokens)]
        self.tokens = tokens
        self.vocab = dict(zip(self.tokens, range(len(self.tokens))))
        self.scores: list[float] = np.asarray(scores, dtype=np.float32).tolist()
        self.types = np.asarray(types, dtype=np.int64)
        self.add_space_prefix, self.add_bos, self.add_eos = add_space_prefix, add_bos, add_eos
        self.bos_id, self.eos_id, self.unk_id = bos_id, eos_id, unk_id
        self._special_ids = {int(i) for i in np.flatnonzero(np.isin(self.types, (CONTROL, UNKNOWN)))}
        self._byte_ids = [self.vocab.get(f"<0x{b:02X}>", self.vocab.get(chr(b), unk_id)) for b in range(256)]
        # special partition: token text -> id, and per first character the lengths to try, longest first
        self._specials: dict[str, int] = {}
        lengths: dict[str, set[int]] = {}
        for i in np.flatnonzero(np.isin(self.types, (CONTROL, USER_DEFINED, UNKNOWN))):
            text = self.tokens[i]
            self._specials.setdefault(text, int(i))
            lengths.setdefault(text[0], set()).add(len(text))
        self._lengths = {c: sorted(ls, reverse=True) for c, ls in lengths.items()}
        self._first = re.compile("[" + "".join(re.escape(c) for c in sorted(lengths)) + "]") if lengths else None

    # -- encoding -------------------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = True) -> Encoding:
        ids = [self.bos_id] if add_special_tokens and self.add_bos and self.bos_id is not None else []
        prev_special = True
        for piece, tid in self._partition(text):
            if tid is not None:
                ids.append(tid)
                prev_special = True
                continue
            if self.add_space_prefix and prev_special:
                piece = " " + piece
            self._merge(piece.replace(" ", _SPACE), ids)
            prev_special = False
        if add_special_tokens and self.add_eos and self.eos_id is not None:
            ids.append(self.eos_id)
        return Encoding(ids, [self.tokens[i] for i in ids])

    def encode_batch(self, texts: Iterable[str], add_special_tokens: bool = True) -> list[Encoding]:
        return [self.encode(t, add_special_tokens) for t in texts]

    def _partition(self, text: str) -> Iterable[tuple[str, int | None]]:
        """(text, None) fragments and ("", id) special tokens, in order, leftmost-longest."""
        start = pos = 0
        first, lengths, specials = self._first, self._lengths, self._specials
        while first is not None and (m := first.search(text, pos)):
            p = m.start()
            for n in lengths[text[p]]:
                tid = specials.get(text[p:p + n])
                if tid is not None:
                    if p > start:
                        yield text[start:p], None
                    yield "", tid
                    start = pos = p + n
                    break
            else:
                pos = p + 1
        if start < len(text):
            yield text[start:], None

    def _merge(self, s: str, out: list[int]) -> None:
        """llm_tokenizer_spm_session::tokenize on one fragment: symbol i starts at character i."""
        n = len(s)
        if n == 0:
            return
        vocab, scores = self.vocab, self.scores
        size = [1] * n  # characters in symbol i (0: merged into its left neighbour)
        nxt = list(range(1, n + 1))
        nxt[-1] = -1
        prev = list(range(-1, n - 1))
        heap = []
        for i in range(n - 1):
            tid = vocab.get(s[i:i + 2])
            if tid is not None:
                heap.append((-scores[tid], i, i + 1, 2))
        heapq.heapify(heap)
        pop, push = heapq.heappop, heapq.heappush
        while heap:
            _, left, right, total = pop(heap)
            if size[left] == 0 or size[right] == 0 or size[left] + size[right] != total:
                continue  # one side changed since this pair was queued
            size[left] = total
            size[right] = 0
            nxt[left] = after = nxt[right]
            if after >= 0:
                prev[after] = left
            before = prev[left]
            if before >= 0:
                tid = vocab.get(s[before:before + size[before] + total])
                if tid is not None:
                    push(heap, (-scores[tid], before, left, size[before] + total))
            if after >= 0:
                tid = vocab.get(s[left:left + total + size[after]])
                if tid is not None:
                    push(heap, (-scores[tid], left, after, total + size[after]))
        i = 0
        while i >= 0:
            piece = s[i:i + size[i]]
            tid = vocab.get(piece)
            if tid is not None:
                out.append(tid)
            else:  # a character without a token (merged pieces always are tokens): its bytes
                out.extend(self._byte_ids[b] for b in piece.encode("utf-8"))
            i = nxt[i]

    # -- decoding -------------------------------------------------------------------------
    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        """Like `tokenizers.Tokenizer.decode` (special tokens skipped unless asked for)."""
        parts: list[str] = []
        run = bytearray()
        tokens, types, n = self.tokens, self.types, len(self.tokens)
        for i in ids:
            i = int(i)
            if not 0 <= i < n:
                continue  # like tokenizers: ids outside the vocabulary decode to nothing
            kind = types[i]
            if kind == BYTE:
                run.append(_byte_of(tokens[i]))
                continue
            if run:
                parts.append(_bytes_text(run))
                run = bytearray()
            if kind == NORMAL:
                parts.append(tokens[i].replace(_SPACE, " "))
            elif kind == USER_DEFINED or (kind in (CONTROL, UNKNOWN) and not skip_special_tokens):
                parts.append(tokens[i])
            # UNUSED (and special tokens when skipped): nothing, as in llama.cpp
        if run:
            parts.append(_bytes_text(run))
        return "".join(parts)

    # -- lookups --------------------------------------------------------------------------
    def token_to_id(self, token: str) -> int | None:
        return self.vocab.get(token)

    def id_to_token(self, tid: int) -> str | None:
        return self.tokens[tid] if 0 <= tid < len(self.tokens) else None

    def get_vocab_size(self, with_added_tokens: bool = True) -> int:
        return len(self.tokens)

    def added_ids(self) -> set[int]:
        """Ids of the control, user-defined and unknown tokens (whole tokens, never pieces of text)."""
        return {int(i) for i in np.flatnonzero(np.isin(self.types, (CONTROL, USER_DEFINED, UNKNOWN)))}

    def save(self, path: str | os.PathLike) -> None:
        """Write an equivalent Hugging Face tokenizer.json (export only: see `hf_tokenizer`)."""
        self.hf_tokenizer().save(os.fspath(path))

    def hf_tokenizer(self):
        """The same tokenization as a `tokenizers` BPE (for tokenizer.json export): one merge
        rule per way of splitting a normal token into two tokens, ranked by the token's score;
        special tokens added, byte fallback, BOS by the post-processor."""
        from tokenizers import AddedToken, Tokenizer, decoders, normalizers, processors
        from tokenizers.models import BPE

        ranked = []
        for tid, tok in enumerate(self.tokens):
            if self.types[tid] != NORMAL or len(tok) < 2:
                continue
            for k in range(1, len(tok)):
                a, b = tok[:k], tok[k:]
                if a in self.vocab and b in self.vocab:
                    ranked.append((-self.scores[tid], tid, k, a, b))
        ranked.sort()
        unk = self.tokens[self.unk_id] if self.unk_id is not None else None
        tk = Tokenizer(BPE(vocab=self.vocab, merges=[(a, b) for *_, a, b in ranked], byte_fallback=True,
                           unk_token=unk, fuse_unk=False))
        tk.normalizer = normalizers.Replace(" ", _SPACE)
        if self.add_space_prefix:
            tk.normalizer = normalizers.Sequence([normalizers.Prepend(_SPACE), tk.normalizer])
        tk.decoder = decoders.Sequence([decoders.Replace(_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()])
        added = [AddedToken(self.tokens[i], special=self.types[i] != USER_DEFINED, normalized=False)
                 for i in sorted(self._specials.values())]
        tk.add_special_tokens([a for a in added if a.special])
        tk.add_tokens([a for a in added if not a.special])
        if self.add_bos and self.bos_id is not None:
            bos = self.tokens[self.bos_id]
            tk.post_processor = processors.TemplateProcessing(
                single=f"{bos} $A", pair=f"{bos} $A $B:1", special_tokens=[(bos, self.bos_id)])
        return tk


def _byte_of(token: str) -> int:
    try:
        return int(token[3:5], 16)  # "<0xNN>"
    except ValueError:
        return ord(token[0]) & 0xFF if token else 0


def _bytes_text(run: bytearray) -> str:
    try:
        return run.decode("utf-8")
    except UnicodeDecodeError:
        return "\ufffd" * len(run)
