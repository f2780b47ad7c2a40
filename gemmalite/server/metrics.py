"""Counters, gauges and histograms in Prometheus' text format (no client library needed)."""
from __future__ import annotations

import threading
from typing import Callable

TTFT_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)

HELP = {
    "gemmalite_requests_total": ("counter", "HTTP requests answered, by endpoint and status"),
    "gemmalite_rejected_total": ("counter", "requests refused because the queue was full"),
    "gemmalite_cancelled_total": ("counter", "generations cancelled, by cause (client_gone, shutdown, abandoned)"),
    "gemmalite_prompt_tokens_total": ("counter", "prompt tokens of admitted generations"),
    "gemmalite_cached_prompt_tokens_total": ("counter", "prompt tokens served from the prefix cache"),
    "gemmalite_prefix_cache_hits_total": ("counter", "requests that took a state from the prefix cache"),
    "gemmalite_prefix_cache_bytes": ("gauge", "bytes of K/V entries and checkpoints the prefix cache holds"),
    "gemmalite_completion_tokens_total": ("counter", "generated tokens"),
    "gemmalite_finished_total": ("counter", "generations ended, by reason (stop, length, cancelled, error)"),
    "gemmalite_decode_steps_total": ("counter", "batched decode steps"),
    "gemmalite_decode_step_sequences_total": ("counter", "sequences summed over decode steps (/ steps = mean batch)"),
    "gemmalite_decode_seconds_total": ("counter", "seconds spent in batched decode steps"),
    "gemmalite_embedding_inputs_total": ("counter", "texts embedded"),
    "gemmalite_time_to_first_token_seconds": ("histogram", "from submission to the first sampled token"),
    "gemmalite_active_sequences": ("gauge", "sequences in the running batch"),
    "gemmalite_queue_depth": ("gauge", "requests waiting to be admitted"),
}


def _labels(labels: dict[str, str] | None) -> str:
    if not labels:
        return ""
    return "{" + ",".join(f'{k}="{v}"' for k, v in sorted(labels.items())) + "}"


class Metrics:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._values: dict[tuple[str, str], float] = {}
        self._hist: dict[str, list[float]] = {}  # bucket counts, then sum, then count
        self._gauges: dict[str, Callable[[], float]] = {}

    def inc(self, name: str, value: float = 1.0, labels: dict[str, str] | None = None) -> None:
        key = (name, _labels(labels))
        with self._lock:
            self._values[key] = self._values.get(key, 0.0) + value

    def observe(self, name: str, value: float) -> None:
        with self._lock:
            h = self._hist.setdefault(name, [0.0] * (len(TTFT_BUCKETS) + 2))
            for i, b in enumerate(TTFT_BUCKETS):
                if value <= b:
                    h[i] += 1
            h[-2] += value
            h[-1] += 1

    def gauge(self, name: str, read: Callable[[], float]) -> None:
        self._gauges[name] = read

    def value(self, name: str, labels: dict[str, str] | None = None) -> float:
        return self._values.get((name, _labels(labels)), 0.0)

    def render(self) -> str:
        lines: list[str] = []
        with self._lock:
            values, hist = dict(self._values), {k: list(v) for k, v in self._hist.items()}
        names = sorted({n for n, _ in values} | set(hist) | set(self._gauges))
        for name in names:
            kind, text = HELP.get(name, ("untyped", name))
            lines += [f"# HELP {name} {text}", f"# TYPE {name} {kind}"]
            if name in self._gauges:
                lines.append(f"{name} {float(self._gauges[name]())}")
            for (n, lab), v in sorted(values.items()):
                if n == name:
                    lines.append(f"{name}{lab} {v}")
            if name in hist:
                h = hist[name]
                for b, c in zip(TTFT_BUCKETS, h):
                    lines.append(f'{name}_bucket{{le="{b}"}} {c}')
                lines += [f'{name}_bucket{{le="+Inf"}} {h[-1]}', f"{name}_sum {h[-2]}", f"{name}_count {h[-1]}"]
        return "\n".join(lines) + "\n"
