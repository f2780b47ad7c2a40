"""The EmbeddingGemma 2 encoder as an ONNX graph (``encoder.onnx``), and `OrtEncoder`, which runs it on
ONNX Runtime behind `EncoderGraph`'s interface, so `Embedder` (prompts, pictures, clips, pooling,
Matryoshka cuts) works unchanged.

The cut is `EncoderGraph.run`'s: the host looks up and scales the token embeddings (pictures' and
clips' soft tokens put in place: the towers stay ours) and mean-pools, projects and normalises
the outputs; the graph takes one sequence's input embeddings ``x0 [rows, H]`` and returns its
final-normed hidden states ``hidden [rows, H]``: projection-only PLE, the decoder's layer body,
bidirectional attention (sliding layers see keys within ``sliding_window`` positions either side,
full layers the whole sequence). Rows are free (one session for every length); each sequence is
its own call, so a vector does not depend on the batch it came in (ONNX Runtime's products of
different row counts may round differently, so packing sequences as our kernels do would not
keep that). Weights as in the decoder's export (float32, or int8 / int4 as `layouts` encodes them).
"""
from __future__ import annotations

import json
import tempfile
import weakref
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper

from ...errors import ConfigError
from ...models.gemma.encoder import EncoderConfig, EncoderGraph
from ...weights.matrix import Matrix
from . import MANIFEST
from .export import ACCURACY_LEVELS, DEFAULT_ACCURACY, MANIFEST_FORMAT, _Builder, _Store, read_manifest
from .layouts import QUANT_FORMATS, weight_kind
from .ort import open_session, session_options

ENCODER_FILE = "encoder.onnx"
ENCODER_DATA = "encoder.onnx.data"


def encoder_matrices(graph: EncoderGraph) -> dict[str, Matrix]:
    """Every projection the exported encoder holds, by its name there (the output projection stays the host's)."""
    out = {"ple.projection": graph.ple.projection}
    for s, w in zip(graph.cfg.layers, graph.layers):
        out |= {f"layers.{s.index}.{a}": m for a in ("q", "k", "v", "o", "gate", "up", "down", "ple_gate", "ple_proj")
                if (m := getattr(w, a)) is not None}
    return out


def export_encoder(graph: EncoderGraph, out_dir: str | Path, *, quant_format: str = "matmulnbits",
                   accuracy_level: int = DEFAULT_ACCURACY, meta: dict[str, Any] | None = None) -> Path:
    """Write ``encoder.onnx``, its weights (``encoder.onnx.data``) and ``onnx.json`` into ``out_dir``
    (which must exist); the manifest's path."""
    if quant_format not in QUANT_FORMATS:
        raise ConfigError(f"quant_format must be one of {QUANT_FORMATS}, got {quant_format!r}")
    if accuracy_level not in ACCURACY_LEVELS:
        raise ConfigError(f"accuracy_level must be one of {ACCURACY_LEVELS}, got {accuracy_level!r}")
    for name, m in encoder_matrices(graph).items():
        weight_kind(m, name)
    out_dir = Path(out_dir)
    store = _Store(out_dir / ENCODER_DATA)
    b = _Builder(store, "e", quant_format, accuracy_level)
    try:
        model = _build(b, graph)
    finally:
        store.close()
    onnx.save_model(model, str(out_dir / ENCODER_FILE))
    quantized = {w["storage"] for w in b.matrices.values()} - {"float32"}
    manifest = {"format": MANIFEST_FORMAT, "version": 1, "kind": "encoder", "family": graph.cfg.family,
                "graphs": {"encoder": ENCODER_FILE}, "data": ENCODER_DATA,
                "quant_format": quant_format if quantized else None,
                "accuracy_level": accuracy_level if quantized else None, "opset": b.opset, "weights": b.matrices,
                **(meta or {})}
    path = out_dir / MANIFEST
    path.write_text(json.dumps(manifest, indent=1))
    return path


def _build(b: _Builder, graph: EncoderGraph) -> onnx.ModelProto:
    cfg = graph.cfg
    H, L, P, nq, eps = cfg.hidden_size, cfg.num_hidden_layers, cfg.ple_dim, cfg.num_attention_heads, cfg.rms_norm_eps
    f32 = TensorProto.FLOAT
    inputs = [helper.make_tensor_value_info("x0", f32, ["rows", H])]
    outputs = [helper.make_tensor_value_info("hidden", f32, ["rows", H])]
    n = b.op("Shape", "x0", start=0, end=1)
    pos = b.op("Range", b.const(0, np.int64), b.op("Squeeze", n), b.const(1, np.int64))
    posf = b.reshape(b.op("Cast", pos, to=f32), [None, 1])
    ropes = {}
    for r, inv in graph._inv_freq.items():
        ang = b.op("Mul", posf, b.weight(b.name("inv_freq"), inv.reshape(1, -1).astype(np.float32)))
        ropes[r] = (b.reshape(b.op("Cos", ang), [None, 1, inv.size]), b.reshape(b.op("Sin", ang), [None, 1, inv.size]))
    dist = b.op("Abs", b.op("Sub", b.reshape(pos, [None, 1]), b.reshape(pos, [1, None])))
    near = b.op("Not", b.op("Less", b.const([cfg.sliding_window], np.int64), dist))  # |i - j| <= window
    everything = b.op("Not", b.op("Less", dist, b.const([0], np.int64)))  # all true

    ctx = b.op("Mul", b.matmul("x0", graph.ple.projection, "ple.projection"), b.const(H ** -0.5))
    ple = b.rms(b.reshape(ctx, [None, L, P]), graph.ple.norm, eps, "ple.norm")
    h = "x0"
    for s, w in zip(cfg.layers, graph.layers):
        vis = near if s.sliding else everything

        def attend(q: str, k: str, v: str, s=s, vis=vis) -> str:
            return b.attention(q, k, v, vis, None, None, nq, s.num_kv_heads, s.head_dim, cfg.attn_scale)

        row = b.op("Gather", ple, b.const(s.index, np.int64), axis=1)
        h = b.layer(cfg, s, w, h, row, ropes[s.rope], None, attend)
    b.rms(h, graph.final_norm, eps, "final_norm")
    b.nodes[-1].output[0] = "hidden"
    return b.model("gemmalite_encoder", inputs, outputs, {"family": cfg.family, "rows": "any"})


class OrtEncoder(EncoderGraph):
    """An encoder export (`export_encoder`) run by ONNX Runtime; the host's table and projection are ours."""

    def __init__(self, folder: str | Path, cfg: EncoderConfig, embed: Matrix, projection: Matrix,
                 providers: list | None = None, threads: int | None = None):
        self.cfg, self.embed, self.projection = cfg, embed, projection
        self.path = Path(folder)
        self.manifest = m = read_manifest(self.path, kind="encoder")
        if m.get("family") != cfg.family:
            raise ConfigError(f"{self.path}: exported from a {m.get('family')} model, not {cfg.family}")
        self.session = open_session(self.path / m["graphs"]["encoder"], session_options(m, threads), providers)

    @classmethod
    def export(cls, graph: EncoderGraph, providers: list | None = None, threads: int | None = None) -> "OrtEncoder":
        """Export ``graph`` into a temporary folder (removed with the returned object) and open it."""
        tmp = tempfile.TemporaryDirectory(prefix="gemmalite-onnx-")
        try:
            export_encoder(graph, tmp.name)
            out = cls(tmp.name, graph.cfg, graph.embed, graph.projection, providers, threads)
        except BaseException:
            tmp.cleanup()
            raise
        weakref.finalize(out, tmp.cleanup)
        return out

    def run(self, h: np.ndarray, pos: np.ndarray, bounds: np.ndarray) -> np.ndarray:
        """Each packed sequence through the graph on its own."""
        x0 = np.ascontiguousarray(h, np.float32)
        return np.concatenate([self.session.run(None, {"x0": x0[a:b]})[0]
                               for a, b in zip(bounds[:-1].tolist(), bounds[1:].tolist())])
