"""The exported graphs on ONNX Runtime, behind the `Graph` interface the engine calls.

`OrtGraph` has `new_state` / `forward` / `forward_batch` / `forward_many`; its `OrtState` holds
the caches as numpy arrays (zeroed: masked slots must hold finite numbers, since a masked
score's weight is an exact 0 times the slot's value).

Two ways to run an export (`export.py`): the graph with a free row count (``dynamic.onnx``), one
session for prompts and steps, so ONNX Runtime holds (and prepacks) the weights once: the
default; or the static pair an NPU compiles (``static=True``, the default for `STATIC_PROVIDERS`):
prompts through ``prefill.onnx`` a chunk at a time (the last one padded), single rows through
``decoder.onnx``, two sessions and so two copies of the weights. Batched and prompt-lookup rows
(`forward_batch`) each run as a one-row call, so each is exactly the step it stands for.
"""
from __future__ import annotations

import tempfile
import weakref
from pathlib import Path

import numpy as np

import onnx
from onnx import numpy_helper

from ...errors import ConfigError, ContextError
from ...models.gemma.config import ModelConfig
from ...models.gemma.graph import DecoderGraph, LayerWeights, PLEWeights
from ...runtime.cache import KVState
from ...weights.matrix import Matrix
from .export import CacheSpec, cache_specs, export_graphs, read_manifest


class OrtState(KVState):
    """One sequence's caches for the ONNX graph: ``caches[layer] = (K, V)``, ``[S, kv, D]`` each."""

    def __init__(self, specs: list[CacheSpec], context: int, caches: dict | None = None):
        super().__init__({}, context)
        self.specs = specs
        self.caches = caches if caches is not None else {
            c.layer: (np.zeros((c.size, c.kv_heads, c.head_dim), np.float32),
                      np.zeros((c.size, c.kv_heads, c.head_dim), np.float32)) for c in specs}

    def _can_truncate(self, n: int) -> bool:
        """A ring of S entries that wrapped keeps what position ``n`` needs only for ``n >= length - 1``
        (the slot it overwrites next); full caches and unwrapped rings keep everything."""
        if n > self.length:
            return False
        return all(not c.sliding or self.length <= c.size or n >= self.length - 1 for c in self.specs)

    can_truncate = _can_truncate  # (`KVState.reach` asks; this state keeps no checkpoints)

    def truncate(self, n: int) -> bool:
        """Roll back to the first ``n`` tokens (slots past ``n`` are masked by position, then rewritten)."""
        if not self._can_truncate(n):
            return False
        self.length = n
        del self.tokens[n:]
        return True

    def clone(self, n: int | None = None) -> "OrtState | None":
        n = self.length if n is None else n
        if not self._can_truncate(n):
            return None
        state = OrtState(self.specs, self.context, {i: (k.copy(), v.copy()) for i, (k, v) in self.caches.items()})
        state.length, state.tokens = self.length, list(self.tokens)
        state.truncate(n)
        return state

    def reset(self) -> None:
        for k, v in self.caches.values():
            k[:] = 0
            v[:] = 0
        self.length = 0
        self.tokens.clear()

    @property
    def nbytes(self) -> int:
        return sum(k.nbytes + v.nbytes for k, v in self.caches.values())


STATIC_PROVIDERS = ("QNNExecutionProvider", "VitisAIExecutionProvider", "NnapiExecutionProvider")
DYNAMIC_ROWS = 256  # prompt rows per call of the dynamic graph (its attention scores are rows x (cache + rows))
_NORMS = ("ln_in", "ln_post_attn", "ln_pre_ff", "ln_post_ff", "q_norm", "k_norm", "ple_norm")


class ExportedMatrix(Matrix):
    """What an exported projection is made of (inspect, bench's bytes per token); ONNX Runtime computes it."""

    def __init__(self, shape: list[int], storage: str, nbytes: int, quant_format: str | None):
        self.shape = (int(shape[0]), int(shape[1]))
        self._nbytes = int(nbytes)
        self.qtype = storage if storage == "float32" else f"{storage} ({quant_format})"

    @property
    def nbytes(self) -> int:
        return self._nbytes

    def rows(self, ids):
        raise NotImplementedError("an exported weight is computed by ONNX Runtime")

    def matmul(self, x):
        raise NotImplementedError("an exported weight is computed by ONNX Runtime")


def session_options(manifest: dict, threads: int | None):
    """ONNX Runtime's options for an export: threads; for QDQ graphs the accuracy level its fusion of
    DequantizeLinear + MatMul into MatMulNBits uses (the one the export records)."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    if threads:
        opts.intra_op_num_threads = threads
    if manifest.get("quant_format") == "qdq":
        opts.add_session_config_entry("session.qdq_matmulnbits_accuracy_level", str(manifest["accuracy_level"]))
    return opts


def open_session(path: Path, opts, providers: list | None):
    """An ``InferenceSession`` on ``providers`` (default CPU); `ConfigError` naming those ONNX Runtime lacks here."""
    import onnxruntime as ort

    avail = ort.get_available_providers()
    providers = list(providers) if providers else ["CPUExecutionProvider"]
    missing = [p for p in provider_names(providers) if p not in avail]
    if missing:
        raise ConfigError(f"ONNX Runtime providers {missing} are not available here (available: {avail})")
    return ort.InferenceSession(str(path), opts, providers=providers)


def provider_names(providers: list | None) -> list[str]:
    """Provider names of a ``providers`` list (names, or (name, options) pairs)."""
    return [p[0] if isinstance(p, tuple) else p for p in (providers or ["CPUExecutionProvider"])]


class OrtGraph:
    """An export folder's graphs (`export.read_manifest`), each run by an ``onnxruntime.InferenceSession``."""

    def __init__(self, folder: str | Path, cfg: ModelConfig, providers: list | None = None,
                 threads: int | None = None, static: bool | None = None):
        self.path = Path(folder)
        self.manifest = m = read_manifest(self.path)
        if m.get("family") != cfg.family:
            raise ConfigError(f"{self.path}: exported from a {m.get('family')} model, not {cfg.family}")
        self.cfg = cfg
        self.context = m["context"]
        self.specs = cache_specs(cfg, self.context)
        self.has_ple = bool(cfg.ple_dim)
        self.static = any(n in STATIC_PROVIDERS for n in provider_names(providers)) if static is None else bool(static)
        opts = session_options(m, threads)
        graphs = m["graphs"]
        if self.static:
            self.session = open_session(self.path / graphs["decode"], opts, providers)
            self.prefill = open_session(self.path / graphs["prefill"], opts, providers)
            self.chunk = int(self.prefill.get_inputs()[0].shape[0])
        else:
            self.session = self.prefill = open_session(self.path / graphs["dynamic"], opts, providers)
            self.chunk = DYNAMIC_ROWS
        self.layers, self.ple, self.final_norm = _describe(self.path / graphs["dynamic"], cfg, m)

    @classmethod
    def export(cls, graph: DecoderGraph, context: int, providers: list | None = None, threads: int | None = None,
               chunk: int | None = None, static: bool | None = None) -> "OrtGraph":
        """Export ``graph`` into a temporary folder (removed with the returned object) and open it."""
        tmp = tempfile.TemporaryDirectory(prefix="gemmalite-onnx-")
        try:
            export_graphs(graph, tmp.name, context, *(() if chunk is None else (chunk,)))
            out = cls(tmp.name, graph.cfg, providers, threads, static)
        except BaseException:
            tmp.cleanup()
            raise
        weakref.finalize(out, tmp.cleanup)
        return out

    def new_state(self, context: int) -> OrtState:
        if context != self.context:
            raise ContextError(f"this ONNX graph was exported for a context of {self.context}, not {context}")
        return OrtState(self.specs, context)

    def _call(self, state: OrtState, x: np.ndarray, ple: np.ndarray | None) -> np.ndarray:
        """Rows at ``state.length`` through one graph call (static: the decode graph for one row, the
        prefill graph padded for more): their final-normed hidden states ``[n, H]``; caches replaced."""
        n = x.shape[0]
        static_prefill = self.static and n > 1
        sess = self.prefill if n > 1 else self.session
        T = self.chunk if static_prefill else n
        feeds = {"x0": _pad(x, T), "position": np.array([state.length], np.int64)}
        if static_prefill:
            feeds["count"] = np.array([n], np.int64)
        if self.has_ple:
            feeds["ple_rows"] = _pad(ple, T)
        for c in self.specs:
            feeds[c.names[0]], feeds[c.names[1]] = state.caches[c.layer]
        out = sess.run(None, feeds)
        for j, c in enumerate(self.specs):
            state.caches[c.layer] = (out[1 + 2 * j], out[2 + 2 * j])
        state.length += n
        return out[0][:n]

    def _rows(self, state: OrtState, x0: np.ndarray, ple_rows: np.ndarray | None, step: int) -> np.ndarray:
        """The rows ``step`` at a time (1: each through the decode graph)."""
        if state.length + x0.shape[0] > state.context:
            raise ContextError(f"sequence of {state.length + x0.shape[0]} tokens exceeds the context of {state.context}")
        return np.concatenate([self._call(state, x0[t:t + step], None if ple_rows is None else ple_rows[t:t + step])
                               for t in range(0, x0.shape[0], step)])

    def forward(self, state: OrtState, x0: np.ndarray, ple_rows: np.ndarray | None, keep: np.ndarray | None = None,
                capture: list[np.ndarray] | None = None) -> np.ndarray:
        """`DecoderGraph.forward`: the rows through the prefill graph a chunk at a time; the final hidden
        states of ``keep``."""
        if capture is not None:
            raise ConfigError("per-layer hidden states (capture) are not available on the onnxruntime backend")
        h = self._rows(state, x0, ple_rows, self.chunk)
        return h if keep is None else h[np.asarray(keep, dtype=np.int64)]

    def forward_batch(self, states: list[OrtState], x0: np.ndarray, ple_rows: np.ndarray | None,
                      counts: list[int] | None = None) -> np.ndarray:
        counts = [1] * len(states) if counts is None else [int(n) for n in counts]
        for s, n in zip(states, counts):
            if n < 1 or s.length + n > s.context:
                raise ContextError(f"a step of {n} tokens does not fit a sequence of {s.length} in {s.context}")
        ends = np.cumsum(counts)
        return np.concatenate([self._rows(s, x0[e - n:e], None if ple_rows is None else ple_rows[e - n:e], 1)
                               for s, n, e in zip(states, counts, ends)])

    def forward_many(self, states: list[OrtState], x0: np.ndarray, ple_rows: np.ndarray | None,
                     counts: list[int]) -> np.ndarray:
        ends = np.cumsum(counts)
        return np.concatenate([self.forward(s, x0[e - n:e], None if ple_rows is None else ple_rows[e - n:e],
                                            keep=np.array([n - 1])) for s, n, e in zip(states, counts, ends)])


def _pad(a: np.ndarray, rows: int) -> np.ndarray:
    """``a`` as float32 ``[rows, ...]``, zero rows after its own (finite padding)."""
    a = np.asarray(a, np.float32).reshape(a.shape[0], -1)
    if a.shape[0] == rows:
        return np.ascontiguousarray(a)
    out = np.zeros((rows, a.shape[1]), np.float32)
    out[:a.shape[0]] = a
    return out


def _describe(path: Path, cfg: ModelConfig, manifest: dict) -> tuple[list[LayerWeights], PLEWeights | None, np.ndarray]:
    """The layers as the export holds them (`ExportedMatrix` projections, the norms read from the
    graph), for what describes a model: inspect, bench's bytes per token."""
    proto = onnx.load(str(path), load_external_data=False)
    inits = {t.name: t for t in proto.graph.initializer}

    def arr(name: str) -> np.ndarray | None:
        return numpy_helper.to_array(inits[name], str(path.parent)) if name in inits else None

    weights = manifest["weights"]
    fmt = manifest.get("quant_format")

    def mat(name: str) -> ExportedMatrix | None:
        w = weights.get(name)
        return None if w is None else ExportedMatrix(w["shape"], w["storage"], w["nbytes"], fmt)

    layers = []
    for s in cfg.layers:
        p = f"layers.{s.index}."
        mats = {a: mat(p + a) for a in ("q", "k", "v", "o", "gate", "up", "down", "ple_gate", "ple_proj")}
        norms = {n: arr(p + n) for n in _NORMS}
        layers.append(LayerWeights(**{n: v for n, v in norms.items() if v is not None}, **mats))
    ple = PLEWeights(mat("ple.projection"), arr("ple.norm")) if "ple.projection" in weights else None
    return layers, ple, arr("final_norm")
