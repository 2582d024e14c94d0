"""`clef-flash serve` under hostile clients, over loopback: the figures of the README's server section.

    python benchmarks/server_hostile.py [--model tiny] [--only memory,slow,sigterm,soak]
                                        [--soak-requests 2000] [--soak-clients 32]

Each part starts the real server as a subprocess on 127.0.0.1 (never another interface), with
`--threads 1`, and stops by itself:

- memory: 24 concurrent bodies of 1 MiB of nested JSON (a list of small objects: the most Python
  objects per byte); the server's resident memory before, and its peak (VmHWM) after; statuses.
- slow: 200 connections that trickle their headers a byte a second, held open; meanwhile ordinary
  requests are timed; reported: whether they were served, and when each slow one was closed.
- sigterm: 50 requests in flight (queued behind the model) and a stalled upload, then SIGTERM;
  reported: how long the process took to exit against --shutdown-timeout, and every status.
- soak: --soak-requests requests from --soak-clients clients; errors, and RSS after warm-up and at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import socket
import subprocess
import threading
import time
from collections import Counter
from pathlib import Path

import httpx
from server_load import load, rss_mb, start_server

from clef_flash.request.samples import random_request

TICKET = {
    "model": "clef-flash",
    "state": "My card was charged twice. Please refund me today.",
    "questions": {"refund": {"type": "noul", "instructions": "Does the customer ask for a refund?"}},
}


def peak_rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def start(model: str, *extra: str) -> tuple[subprocess.Popen, str, int]:
    process, url = start_server(model, extra=list(extra))
    return process, url, int(url.rsplit(":", 1)[1])


def stop(process: subprocess.Popen) -> None:
    process.terminate()
    process.wait(60)


def nested_body(size: int = 1 << 20) -> bytes:
    """A request whose state is 1 MiB of tiny nested objects: the most parsed objects (and, rendered,
    the most tokens) per byte."""
    head = json.dumps({**TICKET, "state": []}).encode()
    count = (size - len(head)) // len(b'{"a":[{}]},') 
    return json.dumps({**TICKET, "state": [{"a": [{}]}] * count}, separators=(",", ":")).encode()


def post_all(url: str, bodies: list[bytes], headers: dict[str, str] | None = None) -> Counter:
    statuses: Counter = Counter()
    lock = threading.Lock()

    def post(body: bytes) -> None:
        try:
            status: object = httpx.post(url + "/v1/systemone", content=body, headers=headers or {}, timeout=300).status_code
        except httpx.HTTPError as error:
            status = type(error).__name__
        with lock:
            statuses[status] += 1

    threads = [threading.Thread(target=post, args=(body,)) for body in bodies]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return statuses


def part_memory(model: str, extra: list[str]) -> dict:
    process, url, _ = start(model, *extra)
    try:
        before = rss_mb(process.pid)
        body = nested_body()
        start_time = time.perf_counter()
        statuses = post_all(url, [body] * 24, {"content-type": "application/json"})
        seconds = time.perf_counter() - start_time
        return {
            "body_bytes": len(body),
            "rss_before_mb": round(before),
            "peak_rss_mb": round(peak_rss_mb(process.pid)),
            "rss_after_mb": round(rss_mb(process.pid)),
            "statuses": dict(statuses),
            "seconds": round(seconds, 1),
        }
    finally:
        stop(process)


def part_slow(model: str, connections: int = 200, header_timeout: float = 10.0) -> dict:
    process, url, port = start(model, "--header-timeout", str(header_timeout))
    try:
        slow = [socket.create_connection(("127.0.0.1", port)) for _ in range(connections)]
        opened = time.monotonic()
        closed_at: dict[int, float] = {}
        served, latencies = 0, []
        request = b"GET /health HTTP/1.1\r\nhost: x\r\nx-slow: " + b"a" * 1000
        for position in range(int(header_timeout) + 5):  # one byte a second on each
            for index, sock in enumerate(slow):
                if index in closed_at:
                    continue
                try:
                    sock.sendall(request[position : position + 1])
                except OSError:
                    closed_at[index] = time.monotonic() - opened
            begin = time.perf_counter()
            served += httpx.post(url + "/v1/systemone", json=TICKET, timeout=30).status_code == 200
            latencies.append((time.perf_counter() - begin) * 1000)
            time.sleep(max(0.0, 1.0 - (time.perf_counter() - begin)))
        for index, sock in enumerate(slow):  # a closed socket reads b"" (after the 408)
            sock.settimeout(0.01)
            try:
                if index not in closed_at and sock.recv(4096) == b"":
                    closed_at[index] = time.monotonic() - opened
            except OSError:
                pass
            sock.close()
        after = sorted(closed_at.values())
        return {
            "slow_connections": connections,
            "header_timeout_s": header_timeout,
            "closed": len(after),
            "closed_after_s": [round(after[0], 1), round(after[-1], 1)] if after else None,
            "others_served": f"{served} of {len(latencies)}",
            "others_max_ms": round(max(latencies)),
        }
    finally:
        stop(process)


def part_sigterm(model: str, in_flight: int = 50, shutdown_timeout: float = 5.0) -> dict:
    process, url, port = start(model, "--shutdown-timeout", str(shutdown_timeout), "--max-batch", "1", "--batch-wait-ms", "0")
    statuses: Counter = Counter()
    state = "Subject: refund\n\n" + "I was charged twice for the annual plan and want a refund. " * 120
    body = json.dumps({**TICKET, "state": state}).encode()
    results = threading.Thread(target=lambda: statuses.update(post_all(url, [body] * in_flight, {"content-type": "application/json"})))
    results.start()
    time.sleep(1.0)
    stalled = socket.create_connection(("127.0.0.1", port))
    stalled.sendall(b"POST /v1/systemone HTTP/1.1\r\nhost: x\r\ncontent-length: 100000\r\n\r\n{")
    time.sleep(0.2)
    begin = time.monotonic()
    process.send_signal(signal.SIGTERM)
    code = process.wait(120)
    exited = time.monotonic() - begin
    results.join(60)
    stalled.close()
    return {
        "shutdown_timeout_s": shutdown_timeout,
        "exited_after_s": round(exited, 2),
        "exit_code": code,
        "statuses": {str(key): value for key, value in statuses.items()},
    }


def part_soak(model: str, requests: int, clients: int) -> dict:
    import random

    process, url, _ = start(model)
    try:
        rng = random.Random(0)
        bodies = [random_request(rng, state_words=rng.randint(5, 80)) for _ in range(64)]
        warm = asyncio.run(load(url, bodies, clients, min(500, requests)))
        early = rss_mb(process.pid)
        rest = asyncio.run(load(url, bodies, clients, requests - min(500, requests)))
        return {
            "requests": requests,
            "clients": clients,
            "errors": warm.errors + rest.errors,
            "statuses": {str(k): v for k, v in (warm.statuses + rest.statuses).items()},
            "rss_after_warm_up_mb": round(early),
            "rss_at_end_mb": round(rss_mb(process.pid)),
            "requests_per_s": round(rest.throughput, 1) if rest.requests else None,
        }
    finally:
        stop(process)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--only", default="memory,slow,sigterm,soak")
    parser.add_argument("--memory-extra", default="", help="extra serve flags for the memory part, e.g. '--max-parsing-bytes 4194304'")
    parser.add_argument("--soak-requests", type=int, default=2000)
    parser.add_argument("--soak-clients", type=int, default=32)
    args = parser.parse_args()
    parts = args.only.split(",")
    report = {}
    if "memory" in parts:
        report["memory"] = part_memory(args.model, args.memory_extra.split())
        print(json.dumps({"memory": report["memory"]}), flush=True)
    if "slow" in parts:
        report["slow"] = part_slow(args.model)
        print(json.dumps({"slow": report["slow"]}), flush=True)
    if "sigterm" in parts:
        report["sigterm"] = part_sigterm(args.model)
        print(json.dumps({"sigterm": report["sigterm"]}), flush=True)
    if "soak" in parts:
        report["soak"] = part_soak(args.model, args.soak_requests, args.soak_clients)
        print(json.dumps({"soak": report["soak"]}), flush=True)


if __name__ == "__main__":
    main()
