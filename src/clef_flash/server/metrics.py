"""The few Prometheus metrics the server keeps, written in the text exposition format (0.0.4).

Small enough to write by hand rather than depend on `prometheus_client`: counters and histograms
with fixed label names, updated from the event loop and the model worker under one lock.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Sequence

from ..state_cache import CacheStats

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
BATCH_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)
TOKEN_BUCKETS = (64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536)


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _labels(names: Sequence[str], values: Sequence[str], extra: str = "") -> str:
    pairs = [f'{name}="{_escape(value)}"' for name, value in zip(names, values)]
    if extra:
        pairs.append(extra)
    return "{" + ",".join(pairs) + "}" if pairs else ""


def _number(value: float) -> str:
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value)) if not float(value).is_integer() else str(int(value))


class Counter:
    def __init__(self, name: str, help_text: str, label_names: Sequence[str] = ()):
        self.name, self.help, self.label_names = name, help_text, tuple(label_names)
        self.values: dict[tuple[str, ...], float] = {}

    def inc(self, *labels: str, amount: float = 1.0) -> None:
        self.values[labels] = self.values.get(labels, 0.0) + amount

    def value(self, *labels: str) -> float:
        return self.values.get(labels, 0.0)

    def lines(self) -> list[str]:
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} counter"]
        if not self.values and not self.label_names:
            lines.append(f"{self.name} 0")
        for labels, value in sorted(self.values.items()):
            lines.append(f"{self.name}{_labels(self.label_names, labels)} {_number(value)}")
        return lines


class Histogram:
    def __init__(self, name: str, help_text: str, buckets: Sequence[float], label_names: Sequence[str] = ()):
        self.name, self.help, self.label_names = name, help_text, tuple(label_names)
        self.buckets = tuple(buckets)
        # labels -> (count per bucket, not cumulative; +Inf last), sum
        self.series: dict[tuple[str, ...], tuple[list[int], list[float]]] = {}

    def observe(self, value: float, *labels: str) -> None:
        counts, total = self.series.setdefault(labels, ([0] * (len(self.buckets) + 1), [0.0]))
        index = next((i for i, bound in enumerate(self.buckets) if value <= bound), len(self.buckets))
        counts[index] += 1
        total[0] += value

    def count(self, *labels: str) -> int:
        return sum(self.series.get(labels, ([0], [0.0]))[0])

    def lines(self) -> list[str]:
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
        for labels, (counts, total) in sorted(self.series.items()):
            cumulative = 0
            for bound, count in zip((*self.buckets, math.inf), counts):
                cumulative += count
                bucket = _labels(self.label_names, labels, f'le="{_number(bound)}"')
                lines.append(f"{self.name}_bucket{bucket} {cumulative}")
            lines.append(f"{self.name}_sum{_labels(self.label_names, labels)} {_number(total[0])}")
            lines.append(f"{self.name}_count{_labels(self.label_names, labels)} {cumulative}")
        return lines


class Gauge:
    """A value read when scraped (e.g. the queue depth); `kind` counter for a running total kept elsewhere."""

    def __init__(self, name: str, help_text: str, read: Callable[[], float], kind: str = "gauge"):
        self.name, self.help, self.read, self.kind = name, help_text, read, kind

    def lines(self) -> list[str]:
        return [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} {self.kind}", f"{self.name} {_number(self.read())}"]


class ServerMetrics:
    """Every metric of one app. `lock` guards updates; `render()` takes it too."""

    def __init__(self, queue_depth: Callable[[], float], cache_stats: Callable[[], CacheStats]):
        self.lock = threading.Lock()
        self.requests = Counter("clef_flash_requests_total", "HTTP requests by route and status.", ("route", "status"))
        self.latency = Histogram(
            "clef_flash_request_duration_seconds", "HTTP request latency by route.", LATENCY_BUCKETS, ("route",)
        )
        self.input_tokens = Counter("clef_flash_input_tokens_total", "Input tokens of answered records.")
        self.record_tokens = Histogram("clef_flash_record_tokens", "Tokens per answered record.", TOKEN_BUCKETS)
        self.batch_size = Histogram("clef_flash_batch_records", "Records per batch the worker ran.", BATCH_SIZE_BUCKETS)
        self.forwards = Counter("clef_flash_forwards_total", "Decoder forwards run (a batch may need several).")
        self.dropped = Counter("clef_flash_dropped_total", "Queued requests dropped because the client went away.")
        self.failures = Counter("clef_flash_inference_failures_total", "Records whose inference raised.")
        self.queue_depth = Gauge("clef_flash_queue_depth", "Records waiting for the model worker.", queue_depth)
        self.tokens_reused = Counter(
            "clef_flash_state_tokens_reused_total", "Prefix + state tokens read from a kept state instead of run."
        )
        self.cache = tuple(
            Gauge(f"clef_flash_state_cache_{name}", help_text, lambda field=field: getattr(cache_stats(), field), kind)
            for name, field, kind, help_text in (
                ("hits_total", "hits", "counter", "Records that started from a kept prefix + state."),
                ("misses_total", "misses", "counter", "Prefix + states run and kept."),
                ("evictions_total", "evictions", "counter", "Kept states dropped to stay within the bound."),
                ("bytes", "bytes", "gauge", "Bytes the state cache holds."),
                ("entries", "entries", "gauge", "States the state cache holds."),
                ("max_bytes", "max_bytes", "gauge", "The state cache's bound in bytes (0: off)."),
            )
        )

    def render(self) -> str:
        with self.lock:
            metrics = (
                self.requests,
                self.latency,
                self.input_tokens,
                self.record_tokens,
                self.batch_size,
                self.forwards,
                self.dropped,
                self.failures,
                self.queue_depth,
                self.tokens_reused,
                *self.cache,
            )
            return "\n".join(line for metric in metrics for line in metric.lines()) + "\n"
