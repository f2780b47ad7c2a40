"""Gemma 4's MTP drafter (``gemma4_assistant``): a small Q-only stack that reads the target's K/V.

One draft step (transformers' `Gemma4AssistantForCausalLM` with its
`SinglePositionMultiTokenCandidateGenerator`): the input is ``[E_target[token]·√H ; h]`` (``h``: the
target's final-normed hidden state of the last verified position, or the previous step's
projected state), ``pre_projection`` to the drafter's width, its layers -- each attends with
its own queries to the K/V of the target's last non-shared layer of its type, at the fixed
position ``p = state.length`` (the current token's), full layers to every cached position,
sliding ones to the latest ``sliding_window + 1`` -- the final norm, then the logits (the tied
embedding as LM head, or with ordered embeddings only the rows of the top-k centroids' tokens,
every other logit ``min - 1``) and ``post_projection`` back to the target's width as the next
step's ``h``. No softcap: transformers applies none.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import numpy as np

from ...errors import CheckpointError, ConfigError, InputError
from ...kernels.ops import attention, rms_norm, rope_tables
from ...runtime.cache import KVState
from ...runtime.threads import compute
from ...weights.matrix import Matrix, as_matrix
from .build import build_weights, matrix_factory
from .config import FULL, SLIDING, ModelConfig, _int
from .contract import check_tensors, expected_shapes
from .graph import LayerWeights, layer_step

TEXT_PREFIX = "model."


@dataclass
class AssistantConfig:
    text: ModelConfig  # the drafter's own stack; no layer owns K/V (kv_source -1)
    backbone_hidden_size: int
    ordered: bool  # use_ordered_embeddings: the centroid head
    num_centroids: int
    top_k: int  # centroid_intermediate_top_k

    @classmethod
    def from_hf(cls, raw: Any) -> "AssistantConfig":
        """From a ``gemma4_assistant`` config.json dict; a bad field raises `ConfigError` naming it."""
        if not isinstance(raw, dict) or raw.get("model_type") != "gemma4_assistant":
            got = raw.get("model_type") if isinstance(raw, dict) else type(raw).__name__
            raise ConfigError(f"a drafter must be a gemma4_assistant checkpoint, got model_type {got!r}")
        text = raw.get("text_config")
        if not isinstance(text, dict):
            raise ConfigError("gemma4_assistant config has no text_config object")
        for key in ("hidden_size_per_layer_input", "vocab_size_per_layer_input"):
            if text.get(key):
                raise ConfigError(f"gemma4_assistant: text_config.{key} must be 0, got {text[key]!r}")
        if text.get("use_double_wide_mlp"):
            raise ConfigError("gemma4_assistant: text_config.use_double_wide_mlp must be false")
        n = text.get("num_hidden_layers")
        if text.get("num_kv_shared_layers") not in (None, 0, n):
            raise ConfigError(f"gemma4_assistant: every layer reads the target's K/V (num_kv_shared_layers must be "
                              f"num_hidden_layers={n!r}), got {text.get('num_kv_shared_layers')!r}")
        parsed = ModelConfig.from_hf({**text, "model_type": "gemma4_text", "num_kv_shared_layers": 0})
        parsed.layers = [dataclasses.replace(s, kv_source=-1) for s in parsed.layers]
        ordered = bool(raw.get("use_ordered_embeddings", False))
        centroids = _int(raw, "num_centroids", 1, parsed.vocab_size, 2048)
        top_k = _int(raw, "centroid_intermediate_top_k", 1, centroids, 32)
        if ordered and parsed.vocab_size % centroids:
            raise ConfigError(f"gemma4_assistant: vocab_size {parsed.vocab_size} is not a multiple of "
                              f"num_centroids {centroids}")
        return cls(parsed, _int(raw, "backbone_hidden_size", 1, 1 << 17, 1536), ordered, centroids, top_k)

    def expected_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every tensor the drafter needs, by its stored name."""
        t, H, Hb = self.text, self.text.hidden_size, self.backbone_hidden_size
        shapes = {TEXT_PREFIX + k: v for k, v in expected_shapes(t).items()}
        shapes |= {"pre_projection.weight": (H, 2 * Hb), "post_projection.weight": (Hb, H)}
        if self.ordered:
            shapes |= {"masked_embedding.centroids.weight": (self.num_centroids, H),
                       "masked_embedding.token_ordering": (t.vocab_size,)}
        return shapes


class Assistant:
    """The drafter's weights and its step over K/V it is handed (no state of its own)."""

    def __init__(self, cfg: AssistantConfig, tensors: dict[str, Any], quant: str | None = None, where: str = ""):
        check_tensors(cfg.text, tensors, where or "drafter", shapes=cfg.expected_shapes())
        self.cfg = cfg
        text = {k[len(TEXT_PREFIX):]: v for k, v in tensors.items() if k.startswith(TEXT_PREFIX)}
        w = build_weights(cfg.text, text, quant)
        self.layers: list[LayerWeights] = w.graph.layers
        self.final_norm = w.graph.final_norm
        self.lm_head: Matrix = w.lm_head  # the tied embedding (quantized copy with ``quant``)
        mat = matrix_factory(quant)
        self.pre = mat(tensors["pre_projection.weight"])
        self.post = mat(tensors["post_projection.weight"])
        self._inv_freq = {s.rope: s.rope.inv_freq() for s in cfg.text.layers}
        self.centroids = self.ordering = None
        if cfg.ordered:
            self.centroids = mat(tensors["masked_embedding.centroids.weight"])
            order = np.asarray(tensors["masked_embedding.token_ordering"]).astype(np.int64)
            V = cfg.text.vocab_size
            if order.min() < 0 or order.max() >= V:
                raise CheckpointError(f"{where or 'drafter'}: masked_embedding.token_ordering holds ids outside "
                                      f"the vocabulary of {V}")
            self.ordering = order.reshape(cfg.num_centroids, V // cfg.num_centroids)
            # the tied embedding's rows in centroid order, held in memory as stored (bf16: 134 MB at
            # E2B's shape): a step reads its top-k centroids' rows as k contiguous blocks instead of
            # faulting in thousands of scattered rows of the mapped file
            emb = text["embed_tokens.weight"]
            rows = emb.rows(order) if isinstance(emb, Matrix) else np.asarray(emb)[order]
            self.by_centroid = rows.reshape(cfg.num_centroids, V // cfg.num_centroids, -1)

    def forward(self, x: np.ndarray, pos: int, kv: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]]
                ) -> tuple[np.ndarray, np.ndarray]:
        """One step for the input ``x [1, 2·Hb]`` at position ``pos``, each layer attending to
        ``kv[its layer type]`` (K, V, positions): (final-normed hidden ``[1, H]``, projected next
        state ``[1, Hb]``)."""
        cfg = self.cfg.text
        h = self.pre.matmul(np.ascontiguousarray(x, dtype=np.float32))
        p = np.array([pos], dtype=np.int64)
        for spec, w in zip(cfg.layers, self.layers):
            k, v, kpos = kv[spec.layer_type]
            # keys strictly before ``pos``; sliding: the latest window + 1 of them (pos_j > pos - (W + 2))
            window = cfg.sliding_window + 2 if spec.sliding else None

            def attend(q, _k, _v, k=k, v=v, kpos=kpos, window=window):
                return attention(q, k, v, p, kpos, window, cfg.attn_scale)

            h = layer_step(cfg, spec, w, h, None, rope_tables(self._inv_freq[spec.rope], p), attend)
        h = rms_norm(h, self.final_norm, cfg.rms_norm_eps)
        return h, self.post.matmul(h)

    def candidates(self, h: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Centroid head: the token ids of the top-k centroids ``[k · V/C]`` and their logits."""
        c = self.centroids.matmul(h)[0]
        top = np.argpartition(-c, self.cfg.top_k - 1)[: self.cfg.top_k]
        ids = self.ordering[top].reshape(-1)
        # the candidate rows as stored, through the numba product (no float32 copy, no BLAS call:
        # OpenBLAS's threads would spin on into the target's next step)
        rows = as_matrix(self.by_centroid[top].reshape(ids.size, -1), keep_half=True)
        return ids, rows.matmul(h)[0]

    def logits(self, h: np.ndarray) -> np.ndarray:
        """Full-vocabulary logits ``[V]`` as transformers gives them (the centroid head's
        non-candidates at ``min - 1``)."""
        if not self.cfg.ordered:
            return self.lm_head.matmul(h)[0]
        ids, sel = self.candidates(h)
        out = np.full(self.cfg.text.vocab_size, sel.min() - np.float32(1), dtype=np.float32)
        out[ids] = sel
        return out

    def top_token(self, h: np.ndarray) -> int:
        """The argmax token (lowest id among equal logits, as ``logits(h).argmax()``)."""
        if not self.cfg.ordered:
            return int(self.lm_head.matmul(h)[0].argmax())
        ids, sel = self.candidates(h)
        best = sel.max()
        return int(ids[sel == best].min())


class MTPDrafter:
    """An `Assistant` bound to a target `Engine`: the drafter's public step over a target
    `KVState`, and greedy drafts for `generate_ids` / the server (the `Drafter` protocol)."""

    def __init__(self, assistant: Assistant, engine, target: ModelConfig):
        a = assistant.cfg
        self.assistant, self.engine = assistant, engine
        if a.backbone_hidden_size != target.hidden_size:
            raise ConfigError(f"the drafter's backbone_hidden_size {a.backbone_hidden_size} is not the target's "
                              f"hidden_size {target.hidden_size}")
        if a.text.vocab_size != target.vocab_size:
            raise ConfigError(f"the drafter's vocabulary ({a.text.vocab_size}) is not the target's ({target.vocab_size})")
        # the K/V each drafter layer type reads: the target's last K/V-owning layer of that type
        self.sources: dict[str, int] = {}
        for t in (SLIDING, FULL):
            owners = [s for s in target.layers if s.owns_kv and s.layer_type == t]
            if owners:
                self.sources[t] = owners[-1].index
        for s in a.text.layers:
            if s.layer_type not in self.sources:
                raise ConfigError(f"drafter layer {s.index} ({s.layer_type}) has no target layer of its type to read")
            src = target.layers[self.sources[s.layer_type]]
            if (s.head_dim, s.num_kv_heads) != (src.head_dim, src.num_kv_heads):
                raise ConfigError(f"drafter layer {s.index}: head size {s.head_dim} x {s.num_kv_heads} KV heads does "
                                  f"not match the target's layer {src.index} ({src.head_dim} x {src.num_kv_heads})")
        if SLIDING in self.sources and a.text.sliding_window > target.sliding_window:
            raise ConfigError(f"the drafter's sliding_window {a.text.sliding_window} exceeds the target's "
                              f"{target.sliding_window} (its K/V ring keeps no more)")
        self.window = a.text.sliding_window

    def _kv(self, state: KVState) -> dict | None:
        """The target K/V each layer type reads, or None where the sliding ring no longer holds the
        whole window the drafter reads (after a deep rollback)."""
        kv = {t: state.rings[i].view() for t, i in self.sources.items()}
        if SLIDING in kv:
            pos, p = kv[SLIDING][2], state.length
            if np.count_nonzero((pos >= p - 1 - self.window) & (pos < p)) < min(p, self.window + 1):
                return None
        return kv

    def _input(self, token: int, hidden: np.ndarray) -> np.ndarray:
        e = self.engine.embed.rows(np.array([token], dtype=np.int64)) * self.engine.embed_scale
        return np.concatenate([e, np.asarray(hidden, dtype=np.float32).reshape(1, -1)], axis=1)

    def _check(self, state: KVState, token: int, hidden: np.ndarray) -> None:
        if state.length < 1:
            raise InputError("the drafter needs a target state holding at least one position")
        if not 0 <= int(token) < self.assistant.cfg.text.vocab_size:
            raise InputError(f"token {token} is outside the vocabulary")
        if np.asarray(hidden).size != self.assistant.cfg.backbone_hidden_size:
            raise InputError(f"hidden must hold {self.assistant.cfg.backbone_hidden_size} values, "
                             f"got {np.asarray(hidden).size}")

    def step(self, state: KVState, token: int, hidden: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """One draft step at position ``state.length``: ``token`` is the current token (not yet in
        ``state``), ``hidden`` the target's final-normed hidden state of the position before it (or
        the previous step's next state). Returns (logits ``[V]``, next hidden ``[Hb]``)."""
        self._check(state, token, hidden)
        kv = self._kv(state)
        if kv is None:
            raise InputError("the state's sliding K/V no longer holds the window the drafter reads")
        with compute(self.engine.threads):
            h, nxt = self.assistant.forward(self._input(token, hidden), state.length, kv)
            return self.assistant.logits(h), nxt[0]

    def draft(self, state: KVState, token: int, hidden: np.ndarray, k: int) -> list[int]:
        """``k`` greedy drafts after ``token`` (chained steps at the fixed position); [] where the
        state cannot be drafted from."""
        kv = self._kv(state) if k > 0 else None
        if kv is None:
            return []
        out: list[int] = []
        with compute(self.engine.threads):  # the engine's thread count and lock, as its steps
            for _ in range(k):
                h, hidden = self.assistant.forward(self._input(token, hidden), state.length, kv)
                token = self.assistant.top_token(h)
                out.append(token)
        return out

