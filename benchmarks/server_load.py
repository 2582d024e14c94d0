"""Load test of `clef-flash serve` over loopback: throughput, latency, batching speed-up, memory.

    python benchmarks/server_load.py [--model tiny|9b-heads|DIR] [--requests 200] [--concurrency 1,16,64]
                                     [--memory-requests 10000] [--threads 1]

Starts the real server twice as a subprocess on 127.0.0.1 (never another interface): once with
dynamic batching (the defaults: wait up to 5 ms, 64 records per batch) and once one at a time
(`--batch-wait-ms 0 --max-batch 1`). For each, N requests (varied generated tickets, fixed seed)
are sent by C concurrent clients; reported: requests/s, p50 and p99 latency, 429s (intended: the
queue is bounded) and any other error. Then the batching server is taken to `--memory-requests`
requests in all, at 16 clients, and its resident memory after 100 is compared with that at the end.

`--model 9b-heads` (or any random config name) writes that random release to a temp dir first.
The clients run on the same machine as the server and take CPU from it: on a small machine the
absolute numbers are a floor; the ratio between the two servers is the figure to read.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx

from clef_flash.request.samples import random_request

RANDOM_CONFIGS = ("9b-heads", "9b-part")  # generated here; "tiny" is cached by the package itself


@dataclass
class Run:
    requests: int
    seconds: float
    latencies_ms: list[float]
    statuses: Counter

    @property
    def throughput(self) -> float:
        return self.requests / self.seconds

    def percentile(self, q: float) -> float:
        ordered = sorted(self.latencies_ms)
        return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))] if ordered else float("nan")

    @property
    def errors(self) -> int:
        """Anything but 200, not counting 429 (the bounded queue refusing on purpose)."""
        return sum(count for status, count in self.statuses.items() if status not in (200, 429))


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def start_server(model: str, *, precision: str | None = None, threads: int = 1, extra: list[str] = ()) -> tuple[subprocess.Popen, str]:
    """`clef-flash serve` in a subprocess on a free loopback port: (the process, its base URL), once /health is ready."""
    port = _free_port()
    command = [sys.executable, "-m", "clef_flash.cli", "serve", "--model", model, "--host", "127.0.0.1"]
    command += ["--port", str(port), "--log-level", "warning", *(["--precision", precision] if precision else []), *extra]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "HF_HUB_OFFLINE": "1"}
    process = subprocess.Popen(command, env=env)
    base_url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while True:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited with {process.returncode}")
        try:
            if httpx.get(base_url + "/health", timeout=5).status_code == 200:
                return process, base_url
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            process.terminate()
            raise RuntimeError("the server did not become ready")
        time.sleep(0.1)


@contextmanager
def server(model: str, *, precision: str | None, threads: int, extra: list[str]) -> Iterator[tuple[str, int]]:
    """`start_server` as a context: (base URL, pid); stopped when the block ends."""
    process, base_url = start_server(model, precision=precision, threads=threads, extra=extra)
    try:
        yield base_url, process.pid
    finally:
        process.terminate()
        process.wait(30)


async def load(base_url: str, bodies: list[dict], concurrency: int, count: int) -> Run:
    """`count` requests (cycling through `bodies`) from `concurrency` clients at once."""
    latencies: list[float] = []
    statuses: Counter = Counter()
    next_index = iter(range(count))
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=base_url, limits=limits, timeout=300) as client:

        async def one_client() -> None:
            for index in next_index:
                start = time.perf_counter()
                try:
                    response = await client.post("/v1/systemone", json=bodies[index % len(bodies)])
                    statuses[response.status_code] += 1
                except httpx.HTTPError as error:
                    statuses[type(error).__name__] += 1
                latencies.append((time.perf_counter() - start) * 1000)

        start = time.perf_counter()
        await asyncio.gather(*(one_client() for _ in range(concurrency)))
        seconds = time.perf_counter() - start
    return Run(count, seconds, latencies, statuses)


def resolve_model(model: str) -> str:
    if model not in RANDOM_CONFIGS:
        return model
    from clef_flash.checkpoint.random_release import write_random_release

    out = Path(tempfile.gettempdir()) / f"clef-flash-bench-{model}"
    if not (out / "config.json").is_file():
        print(f"writing a random {model!r} release to {out} ...", file=sys.stderr)
        write_random_release(out, model, seed=0)
    return str(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny", help="tiny, 9b-heads, 9b-part, or a release / bundle directory")
    parser.add_argument("--precision", help="fp32, bf16 or int8 (default: the server's)")
    parser.add_argument("--requests", type=int, default=200, help="requests per concurrency level (default 200)")
    parser.add_argument("--concurrency", default="1,16,64", help="client counts, comma-separated (default 1,16,64)")
    parser.add_argument("--memory-requests", type=int, default=10_000, help="requests for the memory check (default 10000; 0 skips)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads in the server (OMP_NUM_THREADS, default 1)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    model = resolve_model(args.model)
    levels = [int(level) for level in args.concurrency.split(",")]
    rng = random.Random(args.seed)
    bodies = [{"model": "clef-flash", **random_request(rng, state_words=rng.randint(20, 120))} for _ in range(256)]
    modes = {"one at a time": ["--batch-wait-ms", "0", "--max-batch", "1"], "dynamic batching": []}
    results: dict[tuple[str, int], Run] = {}
    memory: tuple[int, float, int, float] | None = None  # (requests served, RSS MB) twice

    for mode, extra in modes.items():
        with server(model, precision=args.precision, threads=args.threads, extra=extra) as (base_url, pid):
            asyncio.run(load(base_url, bodies, 4, 16))  # warm the server and the connections
            for level in levels:
                results[mode, level] = asyncio.run(load(base_url, bodies, level, args.requests))
                run = results[mode, level]
                print(
                    f"{mode:>16}  {level:>3} clients: {run.throughput:8.1f} req/s  p50 {run.percentile(0.5):8.1f} ms  "
                    f"p99 {run.percentile(0.99):8.1f} ms  429s {run.statuses.get(429, 0)}  other errors {run.errors}",
                    file=sys.stderr,
                )
            if mode == "dynamic batching" and args.memory_requests > 0:
                served = 16 + args.requests * len(levels)
                asyncio.run(load(base_url, bodies, 16, max(0, 100 - served)))
                served, early = max(served, 100), rss_mb(pid)
                results["memory", 16] = asyncio.run(load(base_url, bodies, 16, max(0, args.memory_requests - served)))
                memory = (served, early, max(served, args.memory_requests), rss_mb(pid))

    print(f"\nserver load test: --model {args.model}, {args.requests} requests per level, {args.threads} torch thread(s)")
    print("| clients | one at a time: req/s, p50, p99 | dynamic batching: req/s, p50, p99 | speed-up | 429s | other errors |")
    print("|---|---|---|---|---|---|")
    for level in levels:
        single, batched = results["one at a time", level], results["dynamic batching", level]
        print(
            f"| {level} | {single.throughput:.1f}, {single.percentile(0.5):.0f} ms, {single.percentile(0.99):.0f} ms "
            f"| {batched.throughput:.1f}, {batched.percentile(0.5):.0f} ms, {batched.percentile(0.99):.0f} ms "
            f"| {batched.throughput / single.throughput:.2f}x "
            f"| {single.statuses.get(429, 0) + batched.statuses.get(429, 0)} | {single.errors + batched.errors} |"
        )
    if memory is not None:
        run = results["memory", 16]
        print(
            f"\nserver RSS after {memory[0]} requests: {memory[1]:.0f} MB; after {memory[2]}: {memory[3]:.0f} MB "
            f"({memory[3] - memory[1]:+.0f} MB); the requests between: other errors {run.errors}"
        )


if __name__ == "__main__":
    main()
