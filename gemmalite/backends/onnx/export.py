"""The decoder graph as two static-shape ONNX graphs, built with ``onnx.helper``: a decode graph
(one token, ``decoder.onnx``) and a prefill graph (a fixed chunk of T tokens, ``prefill.onnx``).

They are cut at `DecoderGraph.forward`'s boundary, as an NPU build takes it:

    inputs   x0 [T, H] (scaled embeddings), ple_rows [T, L*P] (scaled PLE token rows, with PLE),
             position [1] int64 (the first row's), count [1] int64 (prefill: the real rows, the
             rest padding), past_key_<i> / past_value_<i> [S_i, kv, D] per layer owning K/V
    outputs  hidden [T, H] (final-normed), present_key_<i> / present_value_<i> (the updated caches)

Sliding layers keep a ring of ``min(sliding_window, context)`` entries, full layers ``context``;
the slots written (the last real row landing on each) and the masks (which position each slot
holds, which rows each row sees) are computed inside the graph from the position and count, so
the host only feeds the caches back; padding rows write nothing. Attention runs over the past
slots followed by the call's own rows (a chunk longer than a ring needs its rows that the ring
cannot hold). KV-shared layers attend to their source's keys. Masks are finite (`MASKED`).
Weights are stored as float32 (bf16 / f16 widened) in one external data file both graphs share,
written as they come, so memory stays flat whatever the model's size.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from ...errors import ConfigError
from ...kernels.ops import MASKED
from ...models.gemma.config import ModelConfig
from ...models.gemma.graph import DecoderGraph
from ...weights.matrix import F32Matrix, HalfMatrix, Matrix

OPSET = 18
IR_VERSION = 9  # ONNX Runtime >= 1.18 reads IR 9
GRAPH_FILE = "decoder.onnx"
PREFILL_FILE = "prefill.onnx"
PREFILL_CHUNK = 64  # tokens a prefill call takes (the last chunk of a prompt padded)
DATA_FILE = "decoder.onnx.data"
ALIGN = 4096  # external tensors start on page boundaries (providers may map them)
INLINE_BYTES = 1024  # smaller constants stay in the graph file


@dataclass(frozen=True)
class CacheSpec:
    """One K/V cache the graph takes and returns."""

    layer: int
    size: int  # entries: the ring length (sliding) or the context (full)
    kv_heads: int
    head_dim: int
    sliding: bool

    @property
    def names(self) -> tuple[str, str, str, str]:
        i = self.layer
        return f"past_key_{i}", f"past_value_{i}", f"present_key_{i}", f"present_value_{i}"


def cache_specs(cfg: ModelConfig, context: int) -> list[CacheSpec]:
    """The caches of a decode graph for ``context`` positions, in input order."""
    return [CacheSpec(s.index, min(cfg.sliding_window, context) if s.sliding else context, s.num_kv_heads,
                      s.head_dim, s.sliding) for s in cfg.layers if s.owns_kv]


def check_exportable(graph: DecoderGraph) -> None:
    """ConfigError naming what the exporter does not handle (nothing else is refused)."""
    cfg = graph.cfg
    if cfg.family not in ("gemma4", "gemma3"):
        raise ConfigError(f"ONNX export supports gemma4 / gemma3 decoders, not family {cfg.family!r}")
    for s, w in zip(cfg.layers, graph.layers):
        for m in w.matrices():
            if not isinstance(m, (F32Matrix, HalfMatrix)):
                raise ConfigError(f"ONNX export takes float weights (as stored); layer {s.index} has "
                                  f"{type(m).__name__} weights (load without quant / export the unquantized checkpoint)")
    if graph.ple is not None and not isinstance(graph.ple.projection, (F32Matrix, HalfMatrix)):
        raise ConfigError(f"ONNX export takes float weights; the PLE projection is {type(graph.ple.projection).__name__}")


class _Store:
    """The external data file the graphs of one export share: a weight is written once, by name."""

    def __init__(self, data_path: Path):
        self._data = open(data_path, "wb")
        self._location = data_path.name
        self.tensors: dict[str, TensorProto] = {}

    def close(self) -> None:
        self._data.close()

    def put(self, name: str, a: np.ndarray) -> TensorProto:
        a = np.asarray(a, order="C")  # (not ascontiguousarray: it makes a scalar 1-d)
        if a.nbytes <= INLINE_BYTES:
            t = numpy_helper.from_array(a, name)
        else:
            pos = self._data.tell()
            pad = -pos % ALIGN
            self._data.write(b"\0" * pad)
            t = TensorProto(name=name, data_type=helper.np_dtype_to_tensor_dtype(a.dtype), dims=a.shape)
            for k, v in (("location", self._location), ("offset", str(pos + pad)), ("length", str(a.nbytes))):
                t.external_data.add(key=k, value=v)
            t.data_location = TensorProto.EXTERNAL
            self._data.write(a.tobytes())
        self.tensors[name] = t
        return t


class _Builder:
    """Nodes and initializers of one graph (weights from the shared `_Store`; ``tag`` keeps the
    graph's own constants apart from the other graph's)."""

    def __init__(self, store: _Store, tag: str):
        self.nodes: list = []
        self.inits: list = []
        self._have: set[str] = set()
        self._n = 0
        self._store = store
        self._tag = tag
        self._consts: dict = {}

    def name(self, hint: str) -> str:
        self._n += 1
        return f"{self._tag}{hint}_{self._n}"

    def has(self, name: str) -> bool:
        return name in self._store.tensors

    def weight(self, name: str, a: np.ndarray | None = None) -> str:
        """An initializer (written to the store unless it holds ``name`` already; then ``a`` may be None)."""
        if name not in self._have:
            t = self._store.tensors.get(name) or self._store.put(name, a)
            self.inits.append(t)
            self._have.add(name)
        return name

    def const(self, value, dtype=np.float32) -> str:
        """A small constant (deduplicated by value)."""
        a = np.asarray(value, dtype=dtype)
        key = (a.dtype.str, a.shape, a.tobytes())
        if key not in self._consts:
            self._consts[key] = self.weight(self.name("c"), a)
        return self._consts[key]

    def op(self, kind: str, *inputs: str, out: str | None = None, **attrs) -> str:
        out = out or self.name(kind.lower())
        self.nodes.append(helper.make_node(kind, list(inputs), [out], **attrs))
        return out

    # -- the layer's pieces ------------------------------------------------------------------

    def matmul(self, x: str, m: Matrix, name: str) -> str:
        """``x @ W.T`` with ``W.T`` stored float32 ``[in, out]``."""
        w = None if self.has(name) else np.ascontiguousarray(m.dense().T, dtype=np.float32)
        return self.op("MatMul", x, self.weight(name, w))

    def rms(self, x: str, w: np.ndarray | None, eps: float, name: str = "") -> str:
        """``x / sqrt(mean(x^2) + eps) * w`` over the last axis."""
        ms = self.op("ReduceMean", self.op("Mul", x, x), self.const([-1], np.int64), keepdims=1)
        y = self.op("Div", x, self.op("Sqrt", self.op("Add", ms, self.const(eps))))
        return y if w is None else self.op("Mul", y, self.weight(name, np.asarray(w, np.float32)))

    def gelu_mul(self, a: str, b: str) -> str:
        """``gelu_tanh(a) * b`` in its tanh form (the CPU kernel computes the same function as ``a * sigmoid(2u)``)."""
        cube = self.op("Mul", self.op("Mul", a, a), a)
        inner = self.op("Mul", self.op("Add", self.op("Mul", cube, self.const(0.044715)), a),
                        self.const(0.7978845608028654))
        t = self.op("Mul", self.op("Add", self.op("Tanh", inner), self.const(1.0)), a)
        return self.op("Mul", self.op("Mul", t, self.const(0.5)), b)

    def rope(self, x: str, cos: str, sin: str, d: int) -> str:
        """Rotate-half RoPE on ``x [T, heads, D]`` with ``cos``/``sin`` ``[T, 1, D/2]``."""
        h = d // 2
        x1 = self.op("Slice", x, self.const([0], np.int64), self.const([h], np.int64), self.const([-1], np.int64))
        x2 = self.op("Slice", x, self.const([h], np.int64), self.const([d], np.int64), self.const([-1], np.int64))
        a = self.op("Sub", self.op("Mul", x1, cos), self.op("Mul", x2, sin))
        b = self.op("Add", self.op("Mul", x2, cos), self.op("Mul", x1, sin))
        return self.op("Concat", a, b, axis=-1)

    def reshape(self, x: str, shape) -> str:
        return self.op("Reshape", x, self.const(list(shape), np.int64))


def export_graphs(graph: DecoderGraph, out_dir: str | Path, context: int, chunk: int = PREFILL_CHUNK) -> Path:
    """Write ``decoder.onnx`` (one token), ``prefill.onnx`` (``chunk`` tokens) and the weights they
    share, ``decoder.onnx.data``, into ``out_dir`` (which must exist), for caches of ``context``
    positions (the chunk at most ``context``). Returns the decode graph's path."""
    check_exportable(graph)
    cfg = graph.cfg
    if not 1 <= context <= cfg.max_position_embeddings:
        raise ConfigError(f"context must be 1..{cfg.max_position_embeddings}, got {context}")
    if chunk < 2:
        raise ConfigError(f"the prefill chunk must be at least 2 tokens, got {chunk}")
    chunk = max(2, min(chunk, context))  # no longer than a prompt can be
    out_dir = Path(out_dir)
    store = _Store(out_dir / DATA_FILE)
    try:
        models = {f: _build(_Builder(store, tag), graph, context, t)
                  for f, tag, t in ((GRAPH_FILE, "d", 1), (PREFILL_FILE, "p", chunk))}
    finally:
        store.close()
    for f, model in models.items():
        onnx.save_model(model, str(out_dir / f))
    return out_dir / GRAPH_FILE


def _build(b: _Builder, graph: DecoderGraph, context: int, T: int) -> onnx.ModelProto:
    """The graph for ``T`` rows at positions ``position + 0..T-1``; the first ``count`` rows are
    real (``T > 1``: the last chunk of a prompt is padded), only they are written to the caches."""
    cfg = graph.cfg
    H, L, P, nq, eps = cfg.hidden_size, cfg.num_hidden_layers, cfg.ple_dim, cfg.num_attention_heads, cfg.rms_norm_eps
    f32, i64 = TensorProto.FLOAT, TensorProto.INT64
    inputs = [helper.make_tensor_value_info("x0", f32, [T, H])]
    if graph.ple is not None:
        inputs.append(helper.make_tensor_value_info("ple_rows", f32, [T, L * P]))
    inputs.append(helper.make_tensor_value_info("position", i64, [1]))
    if T > 1:
        inputs.append(helper.make_tensor_value_info("count", i64, [1]))
    outputs = [helper.make_tensor_value_info("hidden", f32, [T, H])]
    specs = {c.layer: c for c in cache_specs(cfg, context)}
    for c in specs.values():
        shape = [c.size, c.kv_heads, c.head_dim]
        pk, pv, nk, nv = c.names
        inputs += [helper.make_tensor_value_info(pk, f32, shape), helper.make_tensor_value_info(pv, f32, shape)]
        outputs += [helper.make_tensor_value_info(nk, f32, shape), helper.make_tensor_value_info(nv, f32, shape)]

    pos = "position"
    count = "count" if T > 1 else b.const([1], np.int64)
    rows = b.const(np.arange(T), np.int64)
    tpos = b.op("Add", pos, rows)  # [T] each row's position
    posf = b.reshape(b.op("Cast", tpos, to=f32), [T, 1])
    ropes = {}
    for r, inv in graph._inv_freq.items():
        ang = b.op("Mul", posf, b.weight(b.name("inv_freq"), inv.reshape(1, -1).astype(np.float32)))
        ropes[r] = (b.reshape(b.op("Cos", ang), [T, 1, -1]), b.reshape(b.op("Sin", ang), [T, 1, -1]))

    masks: dict[int, tuple] = {}

    def cache_plan(c: CacheSpec):
        """For a cache of S slots (a ring, or the context for full layers, where the formulas
        reduce to slot = position): the visible keys ``[T, S + T]`` (past slots, then the rows),
        and per slot whether a real row writes it (``[S, 1, 1]``) and which (``[S]``, the last)."""
        S = c.size
        if S not in masks:
            slots, size = b.const(np.arange(S), np.int64), b.const([S], np.int64)
            one = b.const([1], np.int64)

            def last_at_or_before(p: str) -> str:  # the last position <= p that slot s holds
                return b.op("Sub", p, b.op("Mod", b.op("Add", b.op("Sub", p, slots), size), size))

            held = last_at_or_before(b.op("Sub", pos, one))  # before this call; < 0: never written
            past = b.op("And", b.op("Not", b.op("Less", held, b.const([0], np.int64))),
                        b.op("Less", b.op("Sub", b.reshape(tpos, [T, 1]), held), size))
            d = np.arange(T)[:, None] - np.arange(T)[None, :]
            near = b.const((d >= 0) & (d < S), np.bool_)  # causal, within the window
            own = b.op("And", near, b.op("Less", b.reshape(rows, [1, T]), count))
            last = last_at_or_before(b.op("Sub", b.op("Add", pos, count), one))
            writes = b.reshape(b.op("Not", b.op("Less", last, pos)), [S, 1, 1])
            which = b.op("Max", b.op("Sub", last, pos), b.const([0], np.int64))
            masks[S] = (b.op("Concat", past, own, axis=1), writes, which)
        return masks[S]

    h = "x0"
    ple = None
    if graph.ple is not None:
        ctx = b.op("Mul", b.matmul(h, graph.ple.projection, "ple.projection"), b.const(H ** -0.5))
        ctx = b.rms(b.reshape(ctx, [T, L, P]), graph.ple.norm, eps, "ple.norm")
        ple = b.op("Mul", b.op("Add", ctx, b.reshape("ple_rows", [T, L, P])), b.const(2.0 ** -0.5))

    caches: dict[int, tuple[str, str]] = {}  # layer -> its keys / values: past slots, then the rows
    for s, w in zip(cfg.layers, graph.layers):
        p, D, kv = f"layers.{s.index}.", s.head_dim, s.num_kv_heads
        bias = w.bias or {}
        cos, sin = ropes[s.rope]

        def proj(x: str, attr: str) -> str:
            y = b.matmul(x, getattr(w, attr), p + attr)
            return b.op("Add", y, b.weight(p + attr + ".bias", bias[attr])) if attr in bias else y

        a = b.rms(h, w.ln_in, eps, p + "ln_in")
        q = b.rope(b.rms(b.reshape(proj(a, "q"), [T, nq, D]), w.q_norm, eps, p + "q_norm"), cos, sin, D)
        c = specs.get(s.kv_source)
        vis, writes, which = cache_plan(c)
        if s.owns_kv:
            kraw = b.reshape(proj(a, "k"), [T, kv, D])
            vraw = kraw if s.k_eq_v else b.reshape(proj(a, "v"), [T, kv, D])
            k = b.rope(b.rms(kraw, w.k_norm, eps, p + "k_norm"), cos, sin, D)
            v = b.rms(vraw, None, eps) if cfg.v_norm else vraw
            pk, pv, nk, nv = c.names
            b.op("Where", writes, b.op("Gather", k, which, axis=0), pk, out=nk)
            b.op("Where", writes, b.op("Gather", v, which, axis=0), pv, out=nv)
            caches[s.index] = (b.op("Concat", pk, k, axis=0), b.op("Concat", pv, v, axis=0))
        K, V = caches[s.kv_source]
        n = c.size + T
        qh = b.reshape(b.op("Transpose", q, perm=[1, 0, 2]), [kv, nq // kv, T, D])
        scores = b.op("MatMul", qh, b.reshape(b.op("Transpose", K, perm=[1, 2, 0]), [kv, 1, D, n]))
        if cfg.attn_scale != 1.0:
            scores = b.op("Mul", scores, b.const(cfg.attn_scale))
        scores = b.op("Where", vis, scores, b.const(MASKED))
        o = b.op("MatMul", b.op("Softmax", scores, axis=-1),
                 b.reshape(b.op("Transpose", V, perm=[1, 0, 2]), [kv, 1, n, D]))
        o = b.reshape(b.op("Transpose", b.reshape(o, [nq, T, D]), perm=[1, 0, 2]), [T, nq * D])
        o = proj(o, "o")
        h = b.op("Add", h, b.rms(o, w.ln_post_attn, eps, p + "ln_post_attn"))

        m = b.rms(h, w.ln_pre_ff, eps, p + "ln_pre_ff")
        m = b.matmul(b.gelu_mul(b.matmul(m, w.gate, p + "gate"), b.matmul(m, w.up, p + "up")), w.down, p + "down")
        h = b.op("Add", h, b.rms(m, w.ln_post_ff, eps, p + "ln_post_ff"))
        if ple is not None:
            row = b.op("Gather", ple, b.const(s.index, np.int64), axis=1)  # [T, P]
            g = b.gelu_mul(b.matmul(h, w.ple_gate, p + "ple_gate"), row)
            h = b.op("Add", h, b.rms(b.matmul(g, w.ple_proj, p + "ple_proj"), w.ple_norm, eps, p + "ple_norm"))
        if w.layer_scalar is not None:
            h = b.op("Mul", h, b.const(w.layer_scalar))
    b.rms(h, graph.final_norm, eps, "final_norm")
    b.nodes[-1].output[0] = "hidden"

    g = helper.make_graph(b.nodes, "gemmalite_decode" if T == 1 else "gemmalite_prefill", inputs, outputs, b.inits)
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", OPSET)], producer_name="gemmalite")
    model.ir_version = IR_VERSION
    model.metadata_props.add(key="gemmalite.context", value=str(context))
    model.metadata_props.add(key="gemmalite.rows", value=str(T))
    model.metadata_props.add(key="gemmalite.family", value=cfg.family)
    return model


def check_file(path: str | Path) -> None:
    """``onnx.checker`` on an exported graph file (external data resolved beside it)."""
    onnx.checker.check_model(str(path), full_check=True)


def check_folder(out_dir: str | Path) -> None:
    """The checker on both graphs of an export."""
    for f in (GRAPH_FILE, PREFILL_FILE):
        check_file(Path(out_dir) / f)


__all__ = ["export_graphs", "cache_specs", "check_exportable", "check_file", "check_folder", "CacheSpec",
           "GRAPH_FILE", "PREFILL_FILE", "DATA_FILE", "PREFILL_CHUNK"]
