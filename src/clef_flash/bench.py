"""Speed of a model at a precision and a batch size: latency per record, throughput, peak memory.

Requests come from a JSONL file or are generated at about a given token length
(`request.samples.request_of_tokens`). They are answered `batch_size` at a time through
`Clef.answer_many` (encode, one decoder forward, the head, the answer bodies), after one untimed
warm-up batch. A record's latency is its batch's wall time: every record of a batch is answered
when the batch is. Peak RSS is the process's, loading included (`getrusage`). The state cache is off
while measuring: every record runs in full, as a record never seen before does.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from .errors import ClefError
from .machine import peak_rss_mb

if TYPE_CHECKING:
    from .clef import Clef

PERCENTILES = (50, 90, 99)


def generated_requests(model: Clef, *, records: int, tokens: int, seed: int = 0) -> list[dict[str, Any]]:
    from .request.samples import request_of_tokens

    def count_tokens(request: dict[str, Any]) -> int:
        return model.encode(request).token_count

    return [request_of_tokens(count_tokens, tokens, seed=seed + index) for index in range(records)]


def bench(model: Clef, requests: Sequence[Any], *, batch_size: int = 1, warmup: int = 1) -> dict[str, Any]:
    """Answer `requests` in batches of `batch_size` (each batch one forward) and measure."""
    if batch_size < 1 or not requests:
        raise ClefError("bench needs at least one request and a batch size of at least 1")
    tokens = [model.encode(request).token_count for request in requests]  # also validates every request
    batches = [list(requests[start : start + batch_size]) for start in range(0, len(requests), batch_size)]
    saved_budget, saved_cache = model.batch_tokens, model.state_cache.max_bytes
    model.batch_tokens = max(saved_budget, batch_size * max(tokens))  # one forward per batch
    model.state_cache.max_bytes = 0  # no reuse between the warm-up and the batches
    try:
        for _ in range(warmup):
            model.answer_many(batches[0])
        latencies_ms, forwards = [], 0
        start = time.perf_counter()
        for batch in batches:
            batch_start = time.perf_counter()
            model.answer_many(batch)
            latencies_ms += [(time.perf_counter() - batch_start) * 1000] * len(batch)
            forwards += model.last_timings.forwards
        seconds = time.perf_counter() - start
    finally:
        model.batch_tokens, model.state_cache.max_bytes = saved_budget, saved_cache
    result = {
        "model": model.source,
        "random_weights": model.is_random,
        "precision": model.precision,
        "device": str(model.device),
        "batch_size": batch_size,
        "records": len(requests),
        "forwards": forwards,
        "tokens_per_record": sum(tokens) / len(tokens),
        "latency_ms": dict(zip((f"p{q}" for q in PERCENTILES), np.percentile(latencies_ms, PERCENTILES).tolist())),
        "records_per_s": len(requests) / seconds,
        "tokens_per_s": sum(tokens) / seconds,
        "peak_rss_mb": peak_rss_mb(),
    }
    if model.device.type == "cuda":
        import torch

        result["peak_cuda_mb"] = torch.cuda.max_memory_allocated(model.device) / 2**20
    return result


def format_bench(result: dict[str, Any]) -> str:
    random = " (random weights)" if result["random_weights"] else ""
    latency = "  ".join(f"{name} {value:.1f} ms" for name, value in result["latency_ms"].items())
    lines = [
        (
            f"{result['model']}{random}, {result['precision']} on {result['device']}, batch size {result['batch_size']}: "
            f"{result['records']} records of {result['tokens_per_record']:.0f} tokens on average, {result['forwards']} forwards"
        ),
        f"latency per record  {latency}",
        f"throughput          {result['records_per_s']:.2f} records/s  {result['tokens_per_s']:,.0f} tokens/s",
        f"peak RSS            {result['peak_rss_mb']:,.0f} MB",
    ]
    if "peak_cuda_mb" in result:
        lines.append(f"peak CUDA memory    {result['peak_cuda_mb']:,.0f} MB")
    return "\n".join(lines)
