"""The decoder graph: transformer layers and their KV cache, behind a small interface.

This is the part a second backend (ONNX Runtime, an NPU, a GPU) would take over. The host
hands it *scaled token embeddings* and *PLE token rows* (both plain row lookups) and gets
back *final-normed hidden states* for the positions it asks for; tokenization, table
lookups, the LM head and sampling stay on the host.

    state = graph.new_state(context)
    h = graph.forward(state, x0, ple_rows, keep=[T - 1])   # prefill, keep the last position
    h = graph.forward(state, x1, ple_rows1)                # one decode step
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ...errors import ContextError
from ...kernels import common
from ...kernels.ops import apply_rope, attention, gelu_tanh_mul, rms_norm, rope_tables
from ...runtime.cache import SPARE_SLOTS, KVRing, KVState
from ...weights.matrix import Matrix, matmul_alike_all, matmul_all, matmul_each_all
from .compiled import CompiledLayers
from .config import ModelConfig
from .contract import PROJECTIONS


@dataclass
class LayerWeights:
    """One decoder layer. Norm weights already include the family's offset (Gemma 3: 1 + w)."""

    ln_in: np.ndarray
    ln_post_attn: np.ndarray
    ln_pre_ff: np.ndarray
    ln_post_ff: np.ndarray
    q: Matrix
    q_norm: np.ndarray
    o: Matrix
    gate: Matrix
    up: Matrix
    down: Matrix
    k: Matrix | None = None  # None on KV-shared layers
    v: Matrix | None = None  # None on KV-shared layers and with attention_k_eq_v
    k_norm: np.ndarray | None = None
    bias: dict[str, np.ndarray] | None = None  # q/k/v/o biases when attention_bias
    ple_gate: Matrix | None = None
    ple_proj: Matrix | None = None
    ple_norm: np.ndarray | None = None
    layer_scalar: np.float32 | None = None

    def matrices(self) -> list[Matrix]:
        """Every projection of the layer (those it has), in the order a decode step reads them."""
        return [m for attr in PROJECTIONS if (m := getattr(self, attr)) is not None]


@dataclass
class PLEWeights:
    """The context part of per-layer embeddings, computed inside the graph from x0."""

    projection: Matrix  # [L*P, H]
    norm: np.ndarray  # [P]


class DecoderGraph:
    def __init__(self, cfg: ModelConfig, layers: list[LayerWeights], final_norm: np.ndarray, ple: PLEWeights | None):
        self.cfg = cfg
        self.layers = layers
        self.final_norm = final_norm
        self.ple = ple
        self._inv_freq = {s.rope: s.rope.inv_freq() for s in cfg.layers}
        self.compiled_step = True  # decode steps run `compiled.decode_layer` where they qualify (tests compare both)
        self._compiled = CompiledLayers(cfg, layers)

    def new_state(self, context: int) -> KVState:
        """Empty caches: ``sliding_window + SPARE_SLOTS`` entries per sliding layer, ``context`` per full layer."""
        rings = {}
        for s in self.cfg.layers:
            if s.owns_kv:
                window = min(self.cfg.sliding_window, context) if s.sliding else None
                size = min(window + SPARE_SLOTS, context) if window else context
                rings[s.index] = KVRing(size, s.num_kv_heads, s.head_dim, window)
        return KVState(rings, context)

    def forward(
        self,
        state: KVState,
        x0: np.ndarray,
        ple_rows: np.ndarray | None,
        keep: np.ndarray | None = None,
        capture: list[np.ndarray] | None = None,
    ) -> np.ndarray:
        """Run positions ``state.length ..`` through all layers, appending their K/V to ``state``.

        ``x0`` ``[T, H]`` scaled embeddings; ``ple_rows`` ``[T, L*P]`` scaled PLE token rows
        (None without PLE); ``keep`` the row indices whose outputs are wanted (default all):
        KV-shared layers run only for those rows, since no other layer reads their output.
        ``capture`` (debugging) receives the input and each layer's output, all rows.
        Returns final-normed hidden states ``[len(keep), H]``.
        """
        T = x0.shape[0]
        start = state.length
        _check_room(state, T)
        rows = np.arange(T) if keep is None else np.asarray(keep, dtype=np.int64)
        h = self._run([_Group(state, slice(None), start)], x0, ple_rows, np.arange(start, start + T), rows,
                      capture, False)
        state.length = start + T
        return h

    def forward_batch(self, states: list[KVState], x0: np.ndarray, ple_rows: np.ndarray | None,
                      counts: list[int] | None = None) -> np.ndarray:
        """New tokens of B sequences in one decode step: ``counts[b]`` rows each (default one; more
        for a prompt-lookup step's drafts, at most FEW_ROWS), concatenated in ``x0`` ``[R, H]``
        and ``ple_rows`` ``[R, L*P]``.

        The projections run on the ``[R, ·]`` stack with `Matrix.matmul_each`, so each weight is
        read once for the batch while every row gets exactly the numbers of a one-token step
        (sequence ``b``'s row ``i`` is bit for bit ``forward`` of its token ``i`` alone, after the
        ones before it); attention and K/V writes are per sequence. Returns ``[R, H]``: every row, since a
        verification step needs the logits of each."""
        counts = [1] * len(states) if counts is None else [int(n) for n in counts]
        for s, n in zip(states, counts):
            if not 1 <= n <= common.FEW_ROWS:
                raise ValueError(f"a batched decode step takes 1 to {common.FEW_ROWS} tokens per sequence, got {n}")
            _check_room(s, n)
        ends = np.cumsum(counts)
        pos = np.concatenate([np.arange(s.length, s.length + n) for s, n in zip(states, counts)])
        groups = [_Group(s, slice(int(e - n), int(e)), s.length) for s, n, e in zip(states, counts, ends)]
        h = self._run(groups, x0, ple_rows, pos, None, None, True)
        for s, n in zip(states, counts):
            s.length += n
        return h

    def forward_many(self, states: list[KVState], x0: np.ndarray, ple_rows: np.ndarray | None,
                     counts: list[int]) -> np.ndarray:
        """The new tokens of several sequences in one pass (prompts: ``counts[b]`` rows each,
        concatenated in ``x0``); the final-normed hidden state of each one's last row ``[B, H]``,
        row ``b`` bit for bit ``forward(states[b], its rows, keep=[its last])``'s.

        Each product computes every sequence's rows as that sequence's own product would
        (`_mm_parts`: one call for all of them where the format computes rows independently);
        attention and K/V writes are per sequence; from the first KV-shared layer on, one row
        per sequence, each as in a one-row step."""
        for s, n in zip(states, counts):
            if n < 1:
                raise ValueError("every sequence needs at least one new token")
            _check_room(s, n)
        ends = np.cumsum(counts)
        parts = [slice(int(e - n), int(e)) for e, n in zip(ends, counts)]
        pos = np.concatenate([np.arange(s.length, s.length + n) for s, n in zip(states, counts)])
        groups = [_Group(s, p, s.length) for s, p in zip(states, parts)]
        h = self._run(groups, x0, ple_rows, pos, ends - 1, None, parts if len(parts) > 1 else False)
        for s, n in zip(states, counts):
            s.length += n
        return h

    def _run(self, groups: list["_Group"], x0: np.ndarray, ple_rows: np.ndarray | None, pos: np.ndarray,
             rows: np.ndarray | None, capture: list | None, each) -> np.ndarray:
        """All layers over the rows of ``x0`` (each group's rows attend to its own state); the
        final-normed outputs of ``rows`` (all by default). ``each``: how products treat the rows
        (`_mm`). KV-shared layers run only on ``rows``: one per group when there are several."""
        cfg = self.cfg
        h = np.ascontiguousarray(x0, dtype=np.float32)
        ple = self._ple_inputs(h, ple_rows, each) if self.ple is not None else None
        ropes = {r: rope_tables(f, pos) for r, f in self._inv_freq.items()}
        rows = np.arange(h.shape[0]) if rows is None else rows
        if self._compiles(groups, h.shape[0], rows, capture, each):
            counts = [len(range(*g.rows.indices(h.shape[0]))) for g in groups]
            h = self._compiled.run([g.state for g in groups], counts, h, ple, pos, ropes)
            return rms_norm(h, self.final_norm, cfg.rms_norm_eps)
        if capture is not None:
            capture.append(h.copy())
        # The last layer that owns K/V is the last that needs every row, and only for its K/V:
        # from its queries on, only the kept rows (the KV-shared layers after it read nothing else)
        trim = cfg.first_shared_layer - 1 if capture is None and len(rows) < h.shape[0] else None
        for spec, w in zip(cfg.layers, self.layers):
            if spec.index != trim:
                h = self._layer(spec, w, h, ple, pos, ropes[spec.rope], groups, each)
                if capture is not None:
                    capture.append(h.copy())
                continue
            # one row left per sequence: products as one-row steps
            kept_each = True if len(groups) > 1 else each
            h = self._layer(spec, w, h, ple, pos, ropes[spec.rope], groups, each, rows, kept_each)
            pos = pos[rows]
            ple = ple[rows] if ple is not None else None
            ropes = {r: (c[rows], s[rows]) for r, (c, s) in ropes.items()}
            rows = np.arange(len(rows))
            if len(groups) > 1:
                groups = [_Group(g.state, slice(b, b + 1), g.start, g.shared) for b, g in enumerate(groups)]
            each = kept_each
        h = h[rows] if len(rows) < h.shape[0] else h
        return rms_norm(h, self.final_norm, cfg.rms_norm_eps)

    def _compiles(self, groups: list["_Group"], n: int, rows: np.ndarray, capture: list | None, each) -> bool:
        """Does this call take the compiled step? A decode step (each row as alone, or one row)
        of at most FEW_ROWS rows per sequence, every output row kept, no capture, every matrix
        with an operand."""
        if not self.compiled_step or capture is not None or len(rows) != n or not (each is True or n == 1):
            return False
        counts = [len(range(*g.rows.indices(n))) for g in groups]
        return self._compiled.takes(counts) and self._compiled.ops() is not None

    def _ple_inputs(self, x0: np.ndarray, tok_rows: np.ndarray, each=False) -> np.ndarray:
        """``(rms(x0·W_projᵀ·H^-½ per layer slice) + token rows) · 2^-½`` → ``[T, L, P]``."""
        cfg, T = self.cfg, x0.shape[0]
        ctx = _mm(self.ple.projection, x0, each) * np.float32(cfg.hidden_size**-0.5)
        ctx = rms_norm(ctx.reshape(T, cfg.num_hidden_layers, cfg.ple_dim), self.ple.norm, cfg.rms_norm_eps)
        tok = tok_rows.reshape(T, cfg.num_hidden_layers, cfg.ple_dim)
        return (ctx + tok) * np.float32(2.0**-0.5)

    def _layer(self, spec, w: LayerWeights, h, ple, pos, rope, groups: list["_Group"], each=False,
               keep: np.ndarray | None = None, kept_each=False) -> np.ndarray:
        """One decoder layer over the rows of ``h``; each group's rows attend to its own state.
        ``each``: how products treat the rows (`_mm`). With ``keep`` (row indices, in group order)
        every row's K/V and only the kept rows' output (products on them as ``kept_each`` says)."""
        cfg = self.cfg
        window = cfg.sliding_window if spec.sliding else None
        qpos = pos if keep is None else pos[keep]

        def attend(q, k, v):
            outs = []
            for g in groups:
                if spec.owns_kv:
                    kv = _write_kv(g.state.rings[spec.index], k[g.rows], v[g.rows], pos[g.rows], g.start)
                    g.shared[spec.index] = kv
                else:
                    kv = g.shared[spec.kv_source]
                mine = g.rows if keep is None or len(groups) == 1 else _kept_of(keep, g.rows, pos.shape[0])
                outs.append(attention(q[mine], kv[0], kv[1], qpos[mine], kv[2], window, cfg.attn_scale))
            return outs[0] if len(outs) == 1 else np.concatenate(outs)

        return layer_step(cfg, spec, w, h, None if ple is None else ple[:, spec.index, :], rope, attend, each,
                          keep, kept_each)


def layer_step(cfg: ModelConfig, spec, w: LayerWeights, h: np.ndarray, ple: np.ndarray | None,
               rope: tuple[np.ndarray, np.ndarray], attend, each: "bool | list[slice] | str" = False,
               keep: np.ndarray | None = None, kept_each: "bool | list[slice] | str" = False) -> np.ndarray:
    """One Gemma layer on rows ``h [T, H]`` (the decoder's and the encoder's): ``ple`` this layer's
    PLE slice ``[T, P]`` or None; ``attend(q, k, v) -> [len(q), nq*D]`` runs attention (and keeps a
    cache if the caller has one), ``k``/``v`` None on KV-shared layers. ``each``: how products treat
    the rows (`_mm`: one product, each row alone, each sequence's rows as its own product, or
    ALIKE). ``keep`` (row indices): K/V of every row, but queries and everything after them only
    for the kept rows (products as ``kept_each``), whose outputs are returned: the last layer any
    later layer reads K/V from, when only some rows' outputs are wanted."""
    eps, T, nq, D = cfg.rms_norm_eps, h.shape[0], cfg.num_attention_heads, spec.head_dim
    cos, sin = rope
    bias = w.bias or {}

    a = rms_norm(h, w.ln_in, eps)
    names = (("q", "k") if spec.k_eq_v else ("q", "k", "v")) if spec.owns_kv else ("q",)
    if keep is None:
        qkv = [_bias(y, bias.get(n)) for n, y in zip(names, _mm_all([getattr(w, n) for n in names], a, each))]
        cq, sq = cos, sin
    else:
        kv = _mm_all([getattr(w, n) for n in names[1:]], a, each)
        qkv = [_bias(y, bias.get(n)) for n, y in zip(names, [_mm(w.q, a[keep], kept_each)] + kv)]
        h, cq, sq, each = h[keep], cos[keep], sin[keep], kept_each
        ple = ple[keep] if ple is not None else None
    q = apply_rope(rms_norm(qkv[0].reshape(h.shape[0], nq, D), w.q_norm, eps), cq, sq)
    k = v = None
    if spec.owns_kv:
        kr = qkv[1].reshape(T, spec.num_kv_heads, D)
        vr = kr if spec.k_eq_v else qkv[2].reshape(T, spec.num_kv_heads, D)
        k = apply_rope(rms_norm(kr, w.k_norm, eps), cos, sin)
        v = rms_norm(vr, None, eps) if cfg.v_norm else vr
    o = attend(q, k, v)
    h = h + rms_norm(_proj(w.o, o, bias.get("o"), each), w.ln_post_attn, eps)

    m = rms_norm(h, w.ln_pre_ff, eps)
    m = _mm(w.down, gelu_tanh_mul(*_mm_all([w.gate, w.up], m, each)), each)
    h = h + rms_norm(m, w.ln_post_ff, eps)

    if ple is not None:
        g = gelu_tanh_mul(_mm(w.ple_gate, h, each), ple)
        h = h + rms_norm(_mm(w.ple_proj, g, each), w.ple_norm, eps)
    if w.layer_scalar is not None:
        h = h * w.layer_scalar
    return h


@dataclass
class _Group:
    """The rows of a step that belong to one sequence, and the K/V its layers produced."""

    state: KVState
    rows: slice
    start: int  # the sequence's position of its first row
    shared: dict = field(default_factory=dict)  # layer index -> (K, V, positions) for KV-shared layers


def _write_kv(ring: KVRing, k: np.ndarray, v: np.ndarray, pos: np.ndarray, start: int):
    """Append K/V at ``start..``; returns what the new queries attend to (K, V, positions)."""
    if ring.evicts(k.shape[0]):  # the new queries still need entries this write would overwrite
        pk, pv, pp = ring.view()
        kv = (np.concatenate([pk, k]), np.concatenate([pv, v]), np.concatenate([pp, pos]))
        ring.write(k, v, start)
        return kv
    ring.write(k, v, start)
    return ring.view()


def _kept_of(keep: np.ndarray, rows: slice, n: int) -> np.ndarray:
    """Positions in ``keep`` of the kept rows that lie in ``rows`` (a group's slice of ``n`` rows)."""
    lo, hi, _ = rows.indices(n)
    return np.flatnonzero((keep >= lo) & (keep < hi))


def _check_room(state: KVState, n: int) -> None:
    if state.length + n > state.context:
        raise ContextError(f"sequence of {state.length + n} tokens exceeds the context of {state.context}")


ALIKE = "alike"  # `_mm`'s mode for products whose rows must not depend on their company (`Matrix.matmul_alike`)


def _mm(m: Matrix, x: np.ndarray, each: "bool | list[slice] | str") -> np.ndarray:
    """``x @ W.T``: one product (``each`` False), each row as alone (True: `Matrix.matmul_each`),
    each part's rows (a list of slices: several sequences' prompts) as that part's own product,
    or (ALIKE) each row as among any other rows (`Matrix.matmul_alike`: the encoder)."""
    if isinstance(each, str):
        return m.matmul_alike(x)
    if each is True:
        return m.matmul_each(x)
    if not each:
        return m.matmul(x)
    return _mm_parts(m, x, each)


def _mm_parts(m: Matrix, x: np.ndarray, parts: list[slice]) -> np.ndarray:
    """Rows of several sequences, each part's rows bit for bit ``m.matmul(x[part])``, weights read
    as few times as that allows: one-row parts share a `matmul_each`; parts of more than FEW_ROWS
    rows share one `matmul` where the format computes such rows independently of each other
    (`Matrix.independent_rows`); the rest (2..FEW_ROWS rows, other formats) one product each."""
    sizes = [p.stop - p.start for p in parts]
    many = [p for p, n in zip(parts, sizes) if n > common.FEW_ROWS] if m.independent_rows else []
    if len(many) == len(parts):
        return m.matmul(x)
    out = np.empty((x.shape[0], m.shape[0]), dtype=np.float32)
    ones = [p.start for p, n in zip(parts, sizes) if n == 1]
    if ones:
        out[ones] = m.matmul_each(x[ones])
    if many:
        idx = np.concatenate([np.arange(p.start, p.stop) for p in many])
        out[idx] = m.matmul(x[idx])
    for p, n in zip(parts, sizes):
        if n != 1 and not (many and n > common.FEW_ROWS):
            out[p] = m.matmul(x[p])
    return out


def _mm_all(mats: list[Matrix], x: np.ndarray, each: "bool | list[slice] | str") -> list[np.ndarray]:
    """Products of one input (q/k/v, gate/up) as `_mm` gives them; a plain product and ALIKE share
    the input's conversion between the matrices (`matmul_all`, `matmul_alike_all`), rows as alone
    share a parallel region where the format allows (`matmul_each_all`, as the compiled step)."""
    if each is False:
        return matmul_all(mats, x)
    if each is True:
        return matmul_each_all(mats, x)
    if isinstance(each, str):
        return matmul_alike_all(mats, x)
    return [_mm(m, x, each) for m in mats]


def _bias(y: np.ndarray, b: np.ndarray | None) -> np.ndarray:
    return y + b if b is not None else y


def _proj(m: Matrix, x: np.ndarray, b: np.ndarray | None, each: "bool | list[slice] | str" = False) -> np.ndarray:
    return _bias(_mm(m, x, each), b)
