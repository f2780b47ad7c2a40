"""The compiled decode step: one numba call per layer instead of Python driving its kernels.

A decode step (`DecoderGraph.forward` of one token, `forward_batch` of a few rows per sequence)
otherwise runs each layer as ~20 Python-level kernel calls (norms, products, RoPE, K/V writes,
attention, GELU, residuals): on a small model (real Gemma 3 270M) a quarter of the step went to
Python between the kernels. `decode_layer` does a layer's whole work in compiled code. It calls
the kernels the uncompiled step calls, with the same arguments, by address (`kernels.calls`):
the very machine code (never a copy compiled into it, whose sums could round otherwise), so every
output is the uncompiled step's to the bit; and it compiles in seconds, once per layer type and
CPU (cached on disk). The products are the operands' `run_product` (q/k/v and gate/up fused into
one parallel region each where the format allows and they are small: `operands.fusable`,
`run_products3` / `run_products2`, which the uncompiled step runs too, `matrix.matmul_each_all`).
What is left in `decode_layer` is exact float32 arithmetic (residual adds, biases, the layer
scalar) and the K/V writes.

The host/graph boundary stays: `DecoderGraph` decides per call whether the step qualifies; the PLE
inputs, RoPE tables, final norm and LM head stay in Python (one call each per step).
"""
from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np
from numba import get_num_threads, njit, typeof, types
from numba.extending import overload

from ...kernels import common
from ...kernels.calls import NO_KERNEL, Kernel, call0, call1, call2, call3, kernel
from ...kernels.numba_ops import attention_decode, attention_rows, gelu_tanh_mul_flat, rms_norm_rows, rope_rows
from ...kernels.ops import MASKED
from ...runtime.cache import KVState
from ...weights.operands import fusable, products_kernel
from .config import ModelConfig

GROUPS_MAX = 8  # sequences per compiled batched step (more take the uncompiled step)
_EMPTY = np.zeros(0, np.float32)
_NO_RING = (np.zeros((0, 0, 0), np.float32), np.zeros((0, 0, 0), np.float32), np.zeros(0, np.int64))


class Kernels(NamedTuple):
    """The format-free kernels of a layer, as the uncompiled step calls them (`kernels.ops`)."""

    norm: Kernel  # rms_norm_rows(x [n, d], w [d] or empty, eps, out)
    rope: Kernel  # rope_rows(x [T, h, D], cos, sin, out)
    gelu: Kernel  # gelu_tanh_mul_flat(a, b, out)
    sliding: Kernel  # attention_rows(q, k, v, q_pos, k_pos, window, scale, masked, out, causal)
    full: Kernel  # attention_decode(q, k, v, q_pos, k_pos, window, scale, out, causal, workers)


def _fixed_kernels() -> Kernels:
    f1, f2, f3 = (types.Array(types.float32, n, "C") for n in (1, 2, 3))
    i1 = types.Array(types.int64, 1, "C")
    i64, f32, f64, b = types.int64, types.float32, types.float64, types.boolean
    return Kernels(kernel(rms_norm_rows, (f2, f1, f64, f2)), kernel(rope_rows, (f3, f2, f2, f3)),
                   kernel(gelu_tanh_mul_flat, (f1, f1, f1)),
                   kernel(attention_rows, (f3, f3, f3, i1, i1, i64, f32, f32, f2, b)),
                   kernel(attention_decode, (f3, f3, f3, i1, i1, i64, f32, f2, b, i64)))


class LayerOps(NamedTuple):
    """A layer's weights as compiled code takes them: norms (float32; ``k_norm`` / ``ple_norm``
    empty where absent), operands, the fused products' kernels (NO_KERNEL: products one by one),
    biases (empty where absent) and the layer scalar (None where absent). A KV-shared layer holds
    q's operand as k and v, a layer whose V is its raw K holds k's as v (never multiplied): the
    layers of one format are values of one type, one compiled specialisation for a whole model.
    Without PLE, ``ple_gate`` / ``ple_proj`` are None."""

    ln_in: np.ndarray
    ln_post_attn: np.ndarray
    ln_pre_ff: np.ndarray
    ln_post_ff: np.ndarray
    q_norm: np.ndarray
    k_norm: np.ndarray
    ple_norm: np.ndarray
    no_weight: np.ndarray  # empty: a scale-free norm (V's)
    q: Any
    k: Any
    v: Any
    o: Any
    gate: Any
    up: Any
    down: Any
    ple_gate: Any
    ple_proj: Any
    qkv: Kernel  # run_products3(q, k, v, x)
    qk: Kernel  # run_products2(q, k, x): layers whose V is their raw K
    gate_up: Kernel  # run_products2(gate, up, x)
    bq: np.ndarray
    bk: np.ndarray
    bv: np.ndarray
    bo: np.ndarray
    scalar: Any


class LayerConsts(NamedTuple):
    """A layer's shapes and settings, and the format-free kernels."""

    index: int
    heads: int
    kv_heads: int
    head_dim: int
    eps: float  # float64, as `ops.rms_norm` passes it
    scale: np.float32
    window: int  # 0: full attention
    owns_kv: bool
    k_eq_v: bool
    bias: bool
    v_norm: bool
    causal: bool  # True (a variable, not a literal: kernels get the argument types a Python call gives)
    masked: np.float32
    kernels: Kernels


_JIT = dict(cache=True, fastmath=False, error_model="python", boundscheck=False)


@njit(inline="always", **_JIT)
def _norm(k, x, w, eps):  # pragma: no cover - compiled
    """`ops.rms_norm` of ``x [n, d]``."""
    out = np.empty_like(x)
    call0(k.norm, (x, w, eps, out))
    return out


@njit(inline="always", **_JIT)
def _norm_rope(k, x, w, eps, cos, sin):  # pragma: no cover - compiled
    """`ops.apply_rope` of `ops.rms_norm` of ``x [T, heads, D]`` per head."""
    T, nh, D = x.shape
    n = _norm(k, x.reshape(T * nh, D), w, eps).reshape(T, nh, D)
    out = np.empty((T, nh, D), np.float32)
    call0(k.rope, (n, cos, sin, out))
    return out


@njit(inline="always", **_JIT)
def _gelu_mul(k, a, b):  # pragma: no cover - compiled
    """`ops.gelu_tanh_mul` of ``a``, ``b`` (C-contiguous, one shape)."""
    out = np.empty_like(a)
    call0(k.gelu, (a.reshape(-1), b.reshape(-1), out.reshape(-1)))
    return out


@njit(inline="always", **_JIT)
def _plus(a, b):  # pragma: no cover - compiled
    """``a + b`` of two ``[n, d]`` arrays in float32, as numpy adds (a loop: numba's array
    expressions compile error messages with shapes, which took seconds)."""
    out = np.empty_like(a)
    for i in range(a.shape[0]):
        for j in range(a.shape[1]):
            out[i, j] = a[i, j] + b[i, j]
    return out


@njit(inline="always", **_JIT)
def _plus_row(a, b):  # pragma: no cover - compiled
    """``a + b`` of ``[n, d]`` and a row ``[d]`` (a bias)."""
    out = np.empty_like(a)
    for i in range(a.shape[0]):
        for j in range(a.shape[1]):
            out[i, j] = a[i, j] + b[j]
    return out


def _ple(k, h, gate, proj, norm, ple, index, eps):  # pragma: no cover - replaced by the overload
    raise NotImplementedError


@overload(_ple, inline="always", jit_options=dict(fastmath=False))
def _ple_impl(k, h, gate, proj, norm, ple, index, eps):
    """``h + rms(proj(gelu(gate(h)) * ple[:, index]))`` (per-layer embeddings), or ``h`` without."""
    if isinstance(gate, types.NoneType):
        return lambda k, h, gate, proj, norm, ple, index, eps: h

    def with_ple(k, h, gate, proj, norm, ple, index, eps):
        rows = np.empty((h.shape[0], ple.shape[2]), np.float32)
        for i in range(h.shape[0]):
            for j in range(ple.shape[2]):
                rows[i, j] = ple[i, index, j]
        g = _gelu_mul(k, call1(gate, (gate, h)), rows)
        return _plus(h, _norm(k, call1(proj, (proj, g)), norm, eps))
    return with_ple


def _scaled(h, s):  # pragma: no cover - replaced by the overload
    raise NotImplementedError


@overload(_scaled, inline="always", jit_options=dict(fastmath=False))
def _scaled_impl(h, s):
    """``h * s`` in place (the layer scalar), or ``h`` where ``s`` is None."""
    if isinstance(s, types.NoneType):
        return lambda h, s: h

    def scaled(h, s):
        for i in range(h.shape[0]):
            for j in range(h.shape[1]):
                h[i, j] *= s
        return h
    return scaled


@njit(**_JIT)
def decode_layer(h, w, c, ple, cos, sin, pos, bounds, starts, rings, threads):  # pragma: no cover - compiled
    """One decoder layer on the rows ``h [R, H]`` of a decode step, as `graph.layer_step` with each
    row computed as alone. ``ple [R, L, P]`` (PLE inputs; ``[R, 0, 0]`` without), ``cos`` / ``sin``
    this layer's RoPE tables ``[R, D/2]``, ``pos [R]`` positions; sequence ``g`` owns rows
    ``bounds[g] .. bounds[g+1]``, starting at position ``starts[g]``, and ``rings[g]`` = (K, V,
    positions) of the ring this layer attends to, as far as it will be filled after the step (the
    layer writes its new entries there when it owns its K/V); ``threads`` numba's thread count (the
    full-context attention's split). Returns the layer's output rows."""
    R = h.shape[0]
    nq, kv, D, eps, k = c.heads, c.kv_heads, c.head_dim, c.eps, c.kernels
    a = _norm(k, h, w.ln_in, eps)
    if not c.owns_kv:
        yq = call1(w.q, (w.q, a))
        yk = yv = yq
    elif w.qkv.addr != 0:
        yq, yk, yv = call3(w.qkv, (w.q, w.k, w.v, a))
    elif w.qk.addr != 0:
        yq, yk = call2(w.qk, (w.q, w.k, a))
        yv = yk
    else:
        yq = call1(w.q, (w.q, a))
        yk = call1(w.k, (w.k, a))
        yv = yk if c.k_eq_v else call1(w.v, (w.v, a))
    if c.bias:
        yq = _plus_row(yq, w.bq)
        if c.owns_kv:
            yk = _plus_row(yk, w.bk)
            yv = yk if c.k_eq_v else _plus_row(yv, w.bv)
    q = _norm_rope(k, yq.reshape(R, nq, D), w.q_norm, eps, cos, sin)
    if c.owns_kv:
        kn = _norm_rope(k, yk.reshape(R, kv, D), w.k_norm, eps, cos, sin)
        vn = _norm(k, yv.reshape(R * kv, D), w.no_weight, eps).reshape(R, kv, D) if c.v_norm else yv.reshape(R, kv, D)
    o = np.empty((R, nq * D), np.float32)
    for g in range(bounds.shape[0] - 1):
        r0, r1 = bounds[g], bounds[g + 1]
        ks, vs, ps = rings[g]
        if c.owns_kv:  # (element loops: numba's array assignments compile error messages that took seconds)
            for t in range(r0, r1):
                p = starts[g] + t - r0
                slot = p % ks.shape[0]
                for i in range(kv):
                    for d in range(D):
                        ks[slot, i, d] = kn[t, i, d]
                        vs[slot, i, d] = vn[t, i, d]
                ps[slot] = p
        og = np.empty((r1 - r0, nq * D), np.float32)
        if c.window:
            call0(k.sliding, (q[r0:r1], ks, vs, pos[r0:r1], ps, c.window, c.scale, c.masked, og, c.causal))
        else:
            call0(k.full, (q[r0:r1], ks, vs, pos[r0:r1], ps, c.window, c.scale, og, c.causal, threads))
        for t in range(r1 - r0):
            for d in range(nq * D):
                o[r0 + t, d] = og[t, d]
    yo = call1(w.o, (w.o, o))
    if c.bias:
        yo = _plus_row(yo, w.bo)
    h = _plus(h, _norm(k, yo, w.ln_post_attn, eps))
    m = _norm(k, h, w.ln_pre_ff, eps)
    if w.gate_up.addr != 0:
        yg, yu = call2(w.gate_up, (w.gate, w.up, m))
    else:
        yg, yu = call1(w.gate, (w.gate, m)), call1(w.up, (w.up, m))
    h = _plus(h, _norm(k, call1(w.down, (w.down, _gelu_mul(k, yg, yu))), w.ln_post_ff, eps))
    h = _ple(k, h, w.ple_gate, w.ple_proj, w.ple_norm, ple, c.index, eps)
    return _scaled(h, w.scalar)


class CompiledLayers:
    """`decode_layer` over a graph's layers: each layer's `LayerOps` (rebuilt when the CPU
    features `kernels.common` reports change: tests force the portable paths) and the step's
    per-sequence ring views. After a layer's first step, its compiled specialisation's entry point
    is called directly: numba's dispatch, which types every argument anew, took 30-80 us a call
    (the arguments' types stay the same: the layer's values, and arrays this module makes). The
    rings are always padded to GROUPS_MAX sequences: one specialisation per weight format whatever
    the batch (unboxing the empty rings costs ~1 us a layer; a second specialisation took as long to
    compile as the first, 10-40 s)."""

    def __init__(self, cfg: ModelConfig, layers: list) -> None:
        self.cfg = cfg
        self.layers = layers
        self._ops: tuple[Any, list[LayerOps] | None] = (None, None)
        self._consts: list[LayerConsts] | None = None
        self._entries: dict[int, Any] = {}

    def ops(self) -> list[LayerOps] | None:
        """Every layer's `LayerOps`, or None where a matrix has no operand (that graph keeps the
        uncompiled step)."""
        key = (common.HAVE_AVX2, common.HAVE_VNNI)
        if self._ops[0] != key:
            self._ops = (key, _layer_ops(self.layers))
            self._entries = {}
        return self._ops[1]

    def consts(self) -> list[LayerConsts]:
        if self._consts is None:
            cfg, kernels = self.cfg, _fixed_kernels()
            self._consts = [LayerConsts(s.index, cfg.num_attention_heads, s.num_kv_heads, s.head_dim,
                                        float(cfg.rms_norm_eps), np.float32(cfg.attn_scale),
                                        int(cfg.sliding_window) if s.sliding else 0, s.owns_kv, s.k_eq_v,
                                        bool(cfg.attention_bias), bool(cfg.v_norm), True, MASKED, kernels)
                            for s in cfg.layers]
        return self._consts

    @staticmethod
    def takes(counts: list[int]) -> bool:
        """Does a step of these rows per sequence qualify (each at most FEW_ROWS, few sequences)?"""
        return 0 < len(counts) <= GROUPS_MAX and all(1 <= n <= common.FEW_ROWS for n in counts)

    def run(self, states: list[KVState], counts: list[int], h: np.ndarray, ple: np.ndarray | None,
            pos: np.ndarray, ropes: dict) -> np.ndarray:
        """All layers over ``h [R, H]`` (sequence ``b``'s ``counts[b]`` rows in order), writing each
        owning ring's new entries and advancing the rings; the last layer's output (before the
        final norm). The states' own lengths are left to the caller."""
        ops = self.ops()
        assert ops is not None
        bounds = np.zeros(len(counts) + 1, np.int64)
        bounds[1:] = np.cumsum(counts)
        starts = np.array([s.length for s in states], np.int64)
        ple3 = ple if ple is not None else np.zeros((h.shape[0], 0, 0), np.float32)
        views: dict[int, tuple] = {}
        threads = get_num_threads()
        h = h if h.flags.writeable else h.copy()
        for spec, w, c in zip(self.cfg.layers, ops, self.consts()):
            src = spec.kv_source
            if src not in views:
                views[src] = _ring_views(states, counts, src)
            cos, sin = ropes[spec.rope]
            args = (h, w, c, ple3, cos, sin, pos, bounds, starts, views[src], threads)
            entry = self._entries.get(spec.index)
            if entry is None:  # the first step: numba's dispatch (and compile), then its entry point
                h = decode_layer(*args)
                self._entries[spec.index] = decode_layer.overloads[tuple(typeof(v) for v in args)].entry_point
            else:
                h = entry(*args)
        for s, n in zip(states, counts):
            for ring in s.rings.values():
                ring.length = s.length + n
        return h


def _ring_views(states: list[KVState], counts: list[int], layer: int) -> tuple:
    """Each sequence's (K, V, positions) of ``layer``'s ring as far as the step will fill it, padded
    with empty rings to GROUPS_MAX entries (one tuple type, so one compiled specialisation, for
    every batch size)."""
    out = []
    for s, n in zip(states, counts):
        r = s.rings[layer]
        m = min(r.length + n, r.capacity)
        out.append((r.k[:m], r.v[:m], r.pos[:m]))
    return tuple(out) + (_NO_RING,) * (GROUPS_MAX - len(out))


def _layer_ops(layers: list) -> list[LayerOps] | None:
    result = []
    for w in layers:
        if any(m.operand() is None for m in w.matrices()):
            return None
        q = w.q.operand()
        k = w.k.operand() if w.k is not None else q  # (stand-ins of one type, see LayerOps)
        v = w.v.operand() if w.v is not None else k
        gate, up = w.gate.operand(), w.up.operand()
        bias = w.bias or {}
        ple = w.ple_gate is not None
        result.append(LayerOps(
            w.ln_in, w.ln_post_attn, w.ln_pre_ff, w.ln_post_ff, w.q_norm,
            _EMPTY if w.k_norm is None else w.k_norm, _EMPTY if w.ple_norm is None else w.ple_norm, _EMPTY,
            q, k, v, w.o.operand(), gate, up, w.down.operand(),
            w.ple_gate.operand() if ple else None, w.ple_proj.operand() if ple else None,
            products_kernel([q, k, v]) if w.v is not None and fusable([q, k, v]) else NO_KERNEL,
            products_kernel([q, k]) if w.k is not None and w.v is None and fusable([q, k]) else NO_KERNEL,
            products_kernel([gate, up]) if fusable([gate, up]) else NO_KERNEL,
            *(bias.get(n, _EMPTY) for n in "qkvo"), w.layer_scalar))
    return result
