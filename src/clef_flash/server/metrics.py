"""The server's Prometheus metrics, kept by `prometheus_client` in one registry per app.

One registry per app (not the process-wide default), so that several apps in one process (tests)
count apart. A new metric is one line in `ServerMetrics.__init__`: `self.counter(...)`,
`self.histogram(...)` or `self.gauge(...)`, named without the `clef_flash_` prefix. prometheus_client
is thread-safe: the event loop and the model worker update metrics without a lock of ours.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import choose_encoder

from ..state_cache import CacheStats

PREFIX = "clef_flash_"
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
BATCH_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)
TOKEN_BUCKETS = (64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536)


class ServerMetrics:
    """Every metric of one app; `render(accept)` is the /metrics body and its content type."""

    def __init__(self, queue_depth: Callable[[], float], cache_stats: Callable[[], CacheStats]):
        self.registry = CollectorRegistry()
        self.requests = self.counter("requests", "HTTP requests by route and status.", "route", "status")
        self.latency = self.histogram("request_duration_seconds", "HTTP request latency by route.", LATENCY_BUCKETS, "route")
        self.input_tokens = self.counter("input_tokens", "Input tokens of answered records.")
        self.record_tokens = self.histogram("record_tokens", "Tokens per answered record.", TOKEN_BUCKETS)
        self.batch_size = self.histogram("batch_records", "Records per batch the worker ran.", BATCH_SIZE_BUCKETS)
        self.forwards = self.counter("forwards", "Decoder forwards run (a batch may need several).")
        self.dropped = self.counter("dropped", "Queued requests dropped: the client went away or its deadline passed.")
        self.failures = self.counter("inference_failures", "Records whose inference raised.")
        self.queue_depth = self.gauge("queue_depth", "Records waiting for the model worker.", queue_depth)
        self.tokens_reused = self.counter("state_tokens_reused", "Prefix + state tokens read from a kept state instead of run.")
        self.registry.register(StateCacheCollector(cache_stats))

    def counter(self, name: str, help_text: str, *label_names: str) -> Counter:
        return Counter(PREFIX + name, help_text, label_names, registry=self.registry)

    def histogram(self, name: str, help_text: str, buckets: Sequence[float], *label_names: str) -> Histogram:
        return Histogram(PREFIX + name, help_text, label_names, buckets=buckets, registry=self.registry)

    def gauge(self, name: str, help_text: str, read: Callable[[], float]) -> Gauge:
        """A value read when scraped (e.g. the queue depth)."""
        gauge = Gauge(PREFIX + name, help_text, registry=self.registry)
        gauge.set_function(read)
        return gauge

    def value(self, name: str, **labels: str) -> float:
        """A sample's current value (0 when it has none yet), by its exposed name: `forwards_total`."""
        return self.registry.get_sample_value(PREFIX + name, labels) or 0.0

    def render(self, accept: str | None = None) -> tuple[bytes, str]:
        """The exposition in the format `accept` asks for (the text format 0.0.4 by default)."""
        encode, content_type = choose_encoder(accept or "")
        return encode(self.registry), content_type


class StateCacheCollector:
    """The engine's state cache counters, read when scraped (the cache keeps them, not this registry)."""

    FIELDS = (
        ("hits", CounterMetricFamily, "Records that started from a kept prefix + state."),
        ("misses", CounterMetricFamily, "Prefix + states run and kept."),
        ("evictions", CounterMetricFamily, "Kept states dropped to stay within the bound."),
        ("bytes", GaugeMetricFamily, "Bytes the state cache holds."),
        ("entries", GaugeMetricFamily, "States the state cache holds."),
        ("max_bytes", GaugeMetricFamily, "The state cache's bound in bytes (0: off)."),
    )

    def __init__(self, cache_stats: Callable[[], CacheStats]):
        self.cache_stats = cache_stats

    def collect(self):
        stats = self.cache_stats()
        for field, family, help_text in self.FIELDS:
            yield family(f"{PREFIX}state_cache_{field}", help_text, value=getattr(stats, field))
