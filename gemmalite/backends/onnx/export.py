"""The decoder graph as ONNX graphs built with ``onnx.helper``, cut at `DecoderGraph.forward`'s
boundary as an NPU build takes it, in three row shapes over one set of weights:

    decoder.onnx    one token (static shapes: what an NPU compiles for decode)
    prefill.onnx    a fixed chunk of T tokens (static; the last chunk of a prompt padded)
    dynamic.onnx    any number of rows (CPU / GPU providers: one session serves prompts and steps,
                    so ONNX Runtime holds one copy of the weights)

    inputs   x0 [T, H] (scaled embeddings), ple_rows [T, L*P] (scaled PLE token rows, with PLE),
             position [1] int64 (the first row's), count [1] int64 (prefill.onnx: the real rows,
             the rest padding), past_key_<i> / past_value_<i> [S_i, kv, D] per layer owning K/V
    outputs  hidden [T, H] (final-normed), present_key_<i> / present_value_<i> (the updated caches)

Sliding layers keep a ring of ``min(sliding_window, context)`` entries, full layers ``context``;
the slots written (the last real row landing on each) and the masks (which position each slot
holds, which rows each row sees) are computed inside the graph from the position and count, so
the host only feeds the caches back; padding rows write nothing. Attention runs over the past
slots followed by the call's own rows (a chunk longer than a ring needs its rows that the ring
cannot hold). KV-shared layers attend to their source's keys. Masks are finite (`MASKED`).

Weights go into one external data file all graphs share, written as they come (memory stays
flat whatever the model's size): float ones (bf16 / f16 widened) as float32 ``MatMul``
weights, int8 / symmetric int4 ones (``quant=`` on load, or a converted checkpoint) as
``MatMulNBits`` or ``DequantizeLinear`` + ``MatMul`` (`layouts`: the same values as ours).
``onnx.json`` beside them says what the folder holds (`read_manifest`).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper

from ...errors import CheckpointError, ConfigError
from ...kernels.ops import MASKED
from ...models.gemma.config import ModelConfig
from ...models.gemma.graph import DecoderGraph
from ...weights.matrix import Matrix
from . import MANIFEST
from .layouts import QUANT_FORMATS, nbits_attrs, nbits_tensors, qdq_attrs, qdq_tensors, weight_kind

OPSET = 18  # 21 where int4 DequantizeLinear needs it
MS_DOMAIN = "com.microsoft"
GRAPH_FILE = "decoder.onnx"
PREFILL_FILE = "prefill.onnx"
DYNAMIC_FILE = "dynamic.onnx"
GRAPH_FILES = (GRAPH_FILE, PREFILL_FILE, DYNAMIC_FILE)
PREFILL_CHUNK = 64  # tokens a prefill call takes (the last chunk of a prompt padded)
DATA_FILE = "decoder.onnx.data"
MANIFEST_FORMAT = "gemmalite-onnx"
ALIGN = 4096  # external tensors start on page boundaries (providers may map them)
INLINE_BYTES = 1024  # smaller constants stay in the graph file
# MatMulNBits' accuracy_level: 0 computes in float32 from the dequantized weights; 4 rounds the
# activations to int8 per block and takes integer dot products (ONNX Runtime's fast CPU path,
# as gemmalite's own int8 prefill / int4 kernels do). For QDQ graphs ONNX Runtime applies it
# when it fuses DequantizeLinear + MatMul (the session option the backend sets).
ACCURACY_LEVELS = (0, 1, 2, 3, 4)
DEFAULT_ACCURACY = 4


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


def graph_matrices(graph: DecoderGraph) -> dict[str, Matrix]:
    """Every projection the exported graph holds, by its name there."""
    out = {} if graph.ple is None else {"ple.projection": graph.ple.projection}
    for s, w in zip(graph.cfg.layers, graph.layers):
        out |= {f"layers.{s.index}.{attr}": m for attr in ("q", "k", "v", "o", "gate", "up", "down", "ple_gate",
                                                          "ple_proj") if (m := getattr(w, attr)) is not None}
    return out


def check_exportable(graph: DecoderGraph, quant_format: str = "matmulnbits") -> None:
    """ConfigError naming what the exporter does not handle (nothing else is refused)."""
    cfg = graph.cfg
    if cfg.family not in ("gemma4", "gemma3"):
        raise ConfigError(f"ONNX export supports gemma4 / gemma3 decoders, not family {cfg.family!r}")
    if quant_format not in QUANT_FORMATS:
        raise ConfigError(f"quant_format must be one of {QUANT_FORMATS}, got {quant_format!r}")
    for name, m in graph_matrices(graph).items():
        weight_kind(m, name)


class _Store:
    """The external data file the graphs of one export share: a weight is written once, by name."""

    def __init__(self, data_path: Path):
        self._data = open(data_path, "wb")
        self._location = data_path.name
        self.tensors: dict[str, TensorProto] = {}
        self.nbytes: dict[str, int] = {}

    def close(self) -> None:
        self._data.close()

    def put(self, name: str, a: np.ndarray, data_type: int | None = None, dims: list[int] | None = None) -> TensorProto:
        """``a``'s bytes as tensor ``name`` (of ``data_type`` and ``dims`` when they are not ``a``'s own: packed int4)."""
        a = np.asarray(a, order="C")  # (not ascontiguousarray: it makes a scalar 1-d)
        t = TensorProto(name=name, data_type=helper.np_dtype_to_tensor_dtype(a.dtype) if data_type is None else data_type,
                        dims=a.shape if dims is None else dims)
        if a.nbytes <= INLINE_BYTES:
            t.raw_data = a.tobytes()
        else:
            pos = self._data.tell()
            pad = -pos % ALIGN
            self._data.write(b"\0" * pad)
            for k, v in (("location", self._location), ("offset", str(pos + pad)), ("length", str(a.nbytes))):
                t.external_data.add(key=k, value=v)
            t.data_location = TensorProto.EXTERNAL
            self._data.write(a.data if a.ndim else a.tobytes())
        self.tensors[name] = t
        self.nbytes[name] = a.nbytes
        return t


class _Builder:
    """Nodes and initializers of one graph (weights from the shared `_Store`; ``tag`` keeps the
    graph's own constants apart from the other graphs')."""

    def __init__(self, store: _Store, tag: str, quant_format: str = "matmulnbits", accuracy_level: int = 0):
        self.nodes: list = []
        self.inits: list = []
        self._have: set[str] = set()
        self._n = 0
        self._store = store
        self._tag = tag
        self._consts: dict = {}
        self.quant_format = quant_format
        self.accuracy_level = accuracy_level
        self.opset = OPSET
        self.domains: set[str] = set()
        self.matrices: dict[str, dict] = {}  # what each projection became (the manifest's "weights")

    def name(self, hint: str) -> str:
        self._n += 1
        return f"{self._tag}{hint}_{self._n}"

    def has(self, name: str) -> bool:
        return name in self._store.tensors

    def weight(self, name: str, a: np.ndarray | None = None, data_type: int | None = None,
               dims: list[int] | None = None) -> str:
        """An initializer (written to the store unless it holds ``name`` already; then ``a`` may be None)."""
        if name not in self._have:
            t = self._store.tensors.get(name) or self._store.put(name, a, data_type, dims)
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

    def op(self, kind: str, *inputs: str, out: str | None = None, domain: str = "", **attrs) -> str:
        out = out or self.name(kind.lower())
        self.nodes.append(helper.make_node(kind, list(inputs), [out], domain=domain or None, **attrs))
        if domain:
            self.domains.add(domain)
        return out

    # -- the layer's pieces ------------------------------------------------------------------

    def matmul(self, x: str, m: Matrix, name: str) -> str:
        """``x @ W.T``: float weights as ``W.T`` float32 ``[in, out]``; int8 / int4 ones as `layouts` encodes them."""
        kind = weight_kind(m, name)
        if kind == "float":
            w = None if self.has(name) else np.ascontiguousarray(m.dense().T, dtype=np.float32)
            y = self.op("MatMul", x, self.weight(name, w))
            names = [name]
        elif self.quant_format == "matmulnbits":
            names = [name + ".q", name + ".scales"]
            if not self.has(names[0]):
                for n, a in zip(names, nbits_tensors(m)):
                    self._store.put(n, a)
            y = self.op("MatMulNBits", x, *map(self.weight, names), domain=MS_DOMAIN,
                        accuracy_level=self.accuracy_level, **nbits_attrs(m))
        else:
            names = [name + ".q", name + ".scale"]
            if not self.has(names[0]):
                packed, dtype, dims, scale = qdq_tensors(m)
                self._store.put(names[0], packed, dtype, dims)
                self._store.put(names[1], scale)
            if kind == "int4":
                self.opset = max(self.opset, 21)  # int4 tensors, blocked DequantizeLinear
            y = self.op("MatMul", x, self.op("DequantizeLinear", *map(self.weight, names), **qdq_attrs(m)))
        self.matrices[name] = {"shape": list(m.shape), "storage": "float32" if kind == "float" else kind,
                               "nbytes": sum(self._store.nbytes[n] for n in names)}
        return y

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
        """Reshape to ``shape``, where None stands for the row count (static or not: -1)."""
        return self.op("Reshape", x, self.const([-1 if d is None else d for d in shape], np.int64))

    def attention(self, q: str, K: str, V: str, visible: str, T: int | None, n: int | None, nq: int, kv: int,
                  D: int, scale: float) -> str:
        """Grouped-query attention of ``q [T, nq, D]`` over ``K``/``V`` ``[n, kv, D]`` where ``visible``
        ``[T, n]`` (finite `MASKED` scores elsewhere): ``[T, nq * D]``."""
        qh = self.reshape(self.op("Transpose", q, perm=[1, 0, 2]), [kv, nq // kv, T, D])
        scores = self.op("MatMul", qh, self.reshape(self.op("Transpose", K, perm=[1, 2, 0]), [kv, 1, D, n]))
        if scale != 1.0:
            scores = self.op("Mul", scores, self.const(scale))
        scores = self.op("Where", visible, scores, self.const(MASKED))
        o = self.op("MatMul", self.op("Softmax", scores, axis=-1),
                    self.reshape(self.op("Transpose", V, perm=[1, 0, 2]), [kv, 1, n, D]))
        return self.reshape(self.op("Transpose", self.reshape(o, [nq, T, D]), perm=[1, 0, 2]), [T, nq * D])

    def layer(self, cfg: ModelConfig, s, w, h: str, ple: str | None, rope: tuple[str, str], T: int | None,
              attend) -> str:
        """One Gemma layer on rows ``h [T, H]``, as `graph.layer_step` (the decoder's and the encoder's):
        ``ple`` this layer's PLE rows ``[T, P]`` or None; ``attend(q, k, v) -> [T, nq * D]``, ``k``/``v``
        None on KV-shared layers."""
        p, D, kv, eps, nq = f"layers.{s.index}.", s.head_dim, s.num_kv_heads, cfg.rms_norm_eps, cfg.num_attention_heads
        bias = w.bias or {}
        cos, sin = rope

        def proj(x: str, attr: str) -> str:
            y = self.matmul(x, getattr(w, attr), p + attr)
            return self.op("Add", y, self.weight(p + attr + ".bias", bias[attr])) if attr in bias else y

        a = self.rms(h, w.ln_in, eps, p + "ln_in")
        q = self.rope(self.rms(self.reshape(proj(a, "q"), [T, nq, D]), w.q_norm, eps, p + "q_norm"), cos, sin, D)
        k = v = None
        if s.owns_kv:
            kraw = self.reshape(proj(a, "k"), [T, kv, D])
            vraw = kraw if s.k_eq_v else self.reshape(proj(a, "v"), [T, kv, D])
            k = self.rope(self.rms(kraw, w.k_norm, eps, p + "k_norm"), cos, sin, D)
            v = self.rms(vraw, None, eps) if cfg.v_norm else vraw
        h = self.op("Add", h, self.rms(proj(attend(q, k, v), "o"), w.ln_post_attn, eps, p + "ln_post_attn"))

        m = self.rms(h, w.ln_pre_ff, eps, p + "ln_pre_ff")
        m = self.matmul(self.gelu_mul(self.matmul(m, w.gate, p + "gate"), self.matmul(m, w.up, p + "up")), w.down,
                        p + "down")
        h = self.op("Add", h, self.rms(m, w.ln_post_ff, eps, p + "ln_post_ff"))
        if ple is not None:
            g = self.gelu_mul(self.matmul(h, w.ple_gate, p + "ple_gate"), ple)
            h = self.op("Add", h, self.rms(self.matmul(g, w.ple_proj, p + "ple_proj"), w.ple_norm, eps, p + "ple_norm"))
        if w.layer_scalar is not None:
            h = self.op("Mul", h, self.const(w.layer_scalar))
        return h

    def model(self, nodes_name: str, inputs: list, outputs: list, meta: dict[str, str]) -> onnx.ModelProto:
        g = helper.make_graph(self.nodes, nodes_name, inputs, outputs, self.inits)
        opsets = [helper.make_opsetid("", self.opset)] + [helper.make_opsetid(d, 1) for d in sorted(self.domains)]
        model = helper.make_model(g, opset_imports=opsets, producer_name="gemmalite")
        model.ir_version = 10 if self.opset >= 21 else 9  # ONNX Runtime >= 1.18 reads IR 9, >= 1.20 IR 10
        for k, v in meta.items():
            model.metadata_props.add(key=f"gemmalite.{k}", value=v)
        return model


def export_graphs(graph: DecoderGraph, out_dir: str | Path, context: int, chunk: int = PREFILL_CHUNK, *,
                  quant_format: str = "matmulnbits", accuracy_level: int = DEFAULT_ACCURACY,
                  meta: dict[str, Any] | None = None) -> Path:
    """Write the graphs (``decoder.onnx``: one token, ``prefill.onnx``: ``chunk`` tokens,
    ``dynamic.onnx``: any number), the weights they share (``decoder.onnx.data``) and
    ``onnx.json`` (with ``meta`` merged in) into ``out_dir`` (which must exist), for caches of
    ``context`` positions. ``quant_format`` / ``accuracy_level``: how int8 / int4 weights are
    written and computed (`layouts`, `DEFAULT_ACCURACY`). Returns the manifest's path."""
    check_exportable(graph, quant_format)
    cfg = graph.cfg
    if not 1 <= context <= cfg.max_position_embeddings:
        raise ConfigError(f"context must be 1..{cfg.max_position_embeddings}, got {context}")
    if chunk < 2:
        raise ConfigError(f"the prefill chunk must be at least 2 tokens, got {chunk}")
    if accuracy_level not in ACCURACY_LEVELS:
        raise ConfigError(f"accuracy_level must be one of {ACCURACY_LEVELS}, got {accuracy_level!r}")
    chunk = max(2, min(chunk, context))  # no longer than a prompt can be
    out_dir = Path(out_dir)
    store = _Store(out_dir / DATA_FILE)
    builders = {f: _Builder(store, tag, quant_format, accuracy_level) for f, tag in zip(GRAPH_FILES, "dpr")}
    try:
        models = {f: _build(builders[f], graph, context, t) for f, t in zip(GRAPH_FILES, (1, chunk, None))}
    finally:
        store.close()
    for f, model in models.items():
        onnx.save_model(model, str(out_dir / f))
    b = builders[GRAPH_FILE]
    kinds = {w["storage"] for w in b.matrices.values()}
    manifest = {"format": MANIFEST_FORMAT, "version": 1, "kind": "decoder", "family": cfg.family, "context": context,
                "chunk": chunk,
                "graphs": {"decode": GRAPH_FILE, "prefill": PREFILL_FILE, "dynamic": DYNAMIC_FILE}, "data": DATA_FILE,
                "quant_format": quant_format if kinds - {"float32"} else None,
                "accuracy_level": accuracy_level if kinds - {"float32"} else None,
                "opset": b.opset, "weights": b.matrices, **(meta or {})}
    path = out_dir / MANIFEST
    path.write_text(json.dumps(manifest, indent=1))
    return path


def read_manifest(folder: str | Path, kind: str = "decoder") -> dict:
    """An export folder's ``onnx.json`` (`CheckpointError` when it is missing, not ours, or of another ``kind``)."""
    path = Path(folder) / MANIFEST
    try:
        m = json.loads(path.read_text())
    except OSError as e:
        raise CheckpointError(f"{path}: cannot be read ({e.strerror})") from None
    except (ValueError, RecursionError) as e:
        raise CheckpointError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(m, dict) or m.get("format") != MANIFEST_FORMAT or m.get("version") != 1:
        raise CheckpointError(f"{path}: not a gemmalite ONNX export manifest (format {MANIFEST_FORMAT!r}, version 1)")
    if m.get("kind", "decoder") != kind:
        raise CheckpointError(f"{path}: an export of an {m.get('kind')}, not of a {kind}")
    need = {"graphs": dict, "weights": dict} | ({"context": int, "chunk": int} if kind == "decoder" else {})
    for key, t in need.items():
        if not isinstance(m.get(key), t):
            raise CheckpointError(f"{path}: {key!r} is missing or malformed")
    return m


def _build(b: _Builder, graph: DecoderGraph, context: int, T: int | None) -> onnx.ModelProto:
    """The graph for ``T`` rows (None: any number) at positions ``position + 0..T-1``; with a
    static ``T > 1`` the first ``count`` rows are real (the last chunk of a prompt is padded),
    only they are written to the caches."""
    cfg = graph.cfg
    H, L, P, nq, eps = cfg.hidden_size, cfg.num_hidden_layers, cfg.ple_dim, cfg.num_attention_heads, cfg.rms_norm_eps
    f32, i64 = TensorProto.FLOAT, TensorProto.INT64
    R = "rows" if T is None else T  # the row dimension as declared
    inputs = [helper.make_tensor_value_info("x0", f32, [R, H])]
    if graph.ple is not None:
        inputs.append(helper.make_tensor_value_info("ple_rows", f32, [R, L * P]))
    inputs.append(helper.make_tensor_value_info("position", i64, [1]))
    if T is not None and T > 1:
        inputs.append(helper.make_tensor_value_info("count", i64, [1]))
    outputs = [helper.make_tensor_value_info("hidden", f32, [R, H])]
    specs = {c.layer: c for c in cache_specs(cfg, context)}
    for c in specs.values():
        shape = [c.size, c.kv_heads, c.head_dim]
        pk, pv, nk, nv = c.names
        inputs += [helper.make_tensor_value_info(pk, f32, shape), helper.make_tensor_value_info(pv, f32, shape)]
        outputs += [helper.make_tensor_value_info(nk, f32, shape), helper.make_tensor_value_info(nv, f32, shape)]

    pos = "position"
    if T is None:  # every row is real: count and the row indices from x0's shape
        count = b.op("Shape", "x0", start=0, end=1)
        rows = b.op("Range", b.const(0, np.int64), b.op("Squeeze", count), b.const(1, np.int64))
    else:
        count = "count" if T > 1 else b.const([1], np.int64)
        rows = b.const(np.arange(T), np.int64)
    tpos = b.op("Add", pos, rows)  # [T] each row's position
    posf = b.reshape(b.op("Cast", tpos, to=f32), [T, 1])
    ropes = {}
    for r, inv in graph._inv_freq.items():
        ang = b.op("Mul", posf, b.weight(b.name("inv_freq"), inv.reshape(1, -1).astype(np.float32)))
        ropes[r] = (b.reshape(b.op("Cos", ang), [T, 1, inv.size]), b.reshape(b.op("Sin", ang), [T, 1, inv.size]))
    zero = b.const([0], np.int64)
    if T is None:
        d = b.op("Sub", b.reshape(rows, [None, 1]), b.reshape(rows, [1, None]))  # row i - row j
        causal = b.op("Not", b.op("Less", d, zero))
    else:
        d = np.arange(T)[:, None] - np.arange(T)[None, :]

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
            past = b.op("And", b.op("Not", b.op("Less", held, zero)),
                        b.op("Less", b.op("Sub", b.reshape(tpos, [T, 1]), held), size))
            if T is None:  # causal, within the window
                near = b.op("And", causal, b.op("Less", d, size))
            else:
                near = b.const((d >= 0) & (d < S), np.bool_)
            own = b.op("And", near, b.op("Less", b.reshape(rows, [1, T]), count))
            last = last_at_or_before(b.op("Sub", b.op("Add", pos, count), one))
            writes = b.reshape(b.op("Not", b.op("Less", last, pos)), [S, 1, 1])
            which = b.op("Max", b.op("Sub", last, pos), zero)
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
        c = specs.get(s.kv_source)
        vis, writes, which = cache_plan(c)

        def attend(q: str, k: str | None, v: str | None, s=s, c=c, vis=vis, writes=writes, which=which) -> str:
            if k is not None:
                pk, pv, nk, nv = c.names
                b.op("Where", writes, b.op("Gather", k, which, axis=0), pk, out=nk)
                b.op("Where", writes, b.op("Gather", v, which, axis=0), pv, out=nv)
                caches[s.index] = (b.op("Concat", pk, k, axis=0), b.op("Concat", pv, v, axis=0))
            K, V = caches[s.kv_source]
            return b.attention(q, K, V, vis, T, None if T is None else c.size + T, nq, s.num_kv_heads, s.head_dim,
                               cfg.attn_scale)

        row = None if ple is None else b.op("Gather", ple, b.const(s.index, np.int64), axis=1)  # [T, P]
        h = b.layer(cfg, s, w, h, row, ropes[s.rope], T, attend)
    b.rms(h, graph.final_norm, eps, "final_norm")
    b.nodes[-1].output[0] = "hidden"

    kind = "dynamic" if T is None else "decode" if T == 1 else "prefill"
    return b.model(f"gemmalite_{kind}", inputs, outputs,
                   {"context": str(context), "rows": "any" if T is None else str(T), "family": cfg.family})


def check_file(path: str | Path) -> None:
    """``onnx.checker`` on an exported graph file (external data resolved beside it)."""
    onnx.checker.check_model(str(path), full_check=True)


def check_folder(out_dir: str | Path) -> None:
    """The checker on every graph of an export."""
    for f in GRAPH_FILES:
        check_file(Path(out_dir) / f)


__all__ = ["export_graphs", "read_manifest", "cache_specs", "check_exportable", "check_file", "check_folder",
           "graph_matrices", "CacheSpec", "GRAPH_FILE", "PREFILL_FILE", "DYNAMIC_FILE", "GRAPH_FILES", "DATA_FILE",
           "MANIFEST", "PREFILL_CHUNK", "DEFAULT_ACCURACY", "QUANT_FORMATS"]
