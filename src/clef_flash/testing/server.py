"""A real uvicorn server on a free loopback port, in a thread (tests and benchmarks)."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any


@contextlib.contextmanager
def running_server(app: Any, *, ready_timeout: float = 60.0, wait_for_health: bool = True) -> Iterator[str]:
    """Serve `app` on 127.0.0.1 (a port the OS picks) and yield its base URL, e.g. http://127.0.0.1:41234.

    With `wait_for_health`, waits until GET /health answers 200 (weights loaded, warm-up run).
    """
    import httpx
    import uvicorn

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False, lifespan="on"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="uvicorn", daemon=True)
    thread.start()
    base_url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + ready_timeout
        while not server.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.01)
        while wait_for_health and httpx.get(base_url + "/health", timeout=ready_timeout).status_code != 200:
            if time.monotonic() > deadline:
                raise RuntimeError("the server did not become ready (GET /health)")
            time.sleep(0.02)
        yield base_url
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()
