"""A real uvicorn server (as `clef-flash serve` runs it) on a free loopback port, in a thread
(tests and benchmarks)."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any


@dataclass
class ServerThread:
    url: str  # e.g. http://127.0.0.1:41234
    port: int
    server: Any  # the DeadlineServer: `server.should_exit = True` is what SIGTERM does
    thread: threading.Thread


@contextlib.contextmanager
def server_thread(
    app: Any, *, ready_timeout: float = 60.0, wait_for_health: bool = True, make_server: Callable[..., Any] | None = None
) -> Iterator[ServerThread]:
    """Serve an app from `create_app` on 127.0.0.1 (a port the OS picks), with the deadlines of
    `clef-flash serve` (server/transport.py). With `wait_for_health`, waits until GET /health
    answers 200 (weights loaded, warm-up run). Stopped (as by SIGTERM) when the block ends.
    `make_server(app, log_level=...)`: another uvicorn server (the MCP app's: server/mcp_tools.py)."""
    import httpx

    from ..server.transport import uvicorn_server

    make_server = make_server or uvicorn_server

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = make_server(app, log_level="warning")
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="uvicorn", daemon=True)
    thread.start()
    running = ServerThread(f"http://127.0.0.1:{port}", port, server, thread)
    try:
        deadline = time.monotonic() + ready_timeout
        while not server.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.01)
        while wait_for_health and httpx.get(running.url + "/health", timeout=ready_timeout).status_code != 200:
            if time.monotonic() > deadline:
                raise RuntimeError("the server did not become ready (GET /health)")
            time.sleep(0.02)
        yield running
    finally:
        server.should_exit = True
        thread.join(60)
        sock.close()


@contextlib.contextmanager
def running_server(app: Any, *, ready_timeout: float = 60.0, wait_for_health: bool = True) -> Iterator[str]:
    """`server_thread`, yielding only its base URL."""
    with server_thread(app, ready_timeout=ready_timeout, wait_for_health=wait_for_health) as running:
        yield running.url
