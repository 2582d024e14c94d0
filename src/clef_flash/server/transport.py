"""uvicorn with the deadlines it lacks: reading a request's headers, reading its body, shutting down.

uvicorn's own timeouts do not cover a slow client: its keep-alive timer is reset by every byte
received, so a client that trickles its headers a byte a second, or promises a longer body than it
sends, holds a connection for ever; ASGI middleware runs only once the headers are in, and cannot
help. `DeadlineH11Protocol` is uvicorn's h11 protocol with two timers read off h11's state of the
client (`their_state`): IDLE with bytes arriving (headers: `header_timeout_s` from the first byte, or
from the connection) and SEND_BODY (the body: `body_timeout_s` from the end of the headers). When
one runs out the connection is closed (headers: with a 408 first). Once a request is read, no timer
runs: answering may take as long as the model needs (the app has its own deadline for that).
Connections past `max_connections` get a 503 and are closed at once.

`DeadlineServer` adds the shutdown deadline: on SIGTERM it stops taking requests, lets the queue
drain, and `shutdown_timeout_s` after the signal fails what is still queued or running with 503,
closes connections still sending a request, and exits.

Built on uvicorn's `H11Protocol` (the `data_received`, `on_response_complete` and `connection_made`
hooks, stable across uvicorn releases); `tests/test_server.py` holds each deadline to its behaviour.
"""

from __future__ import annotations

import asyncio
import logging
import resource
import socket
from typing import Any, Protocol

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol



class Served(Protocol):
    """What the transport needs of the app it serves (server/app.py's SystemOneServer): its limits, and
    the two steps of a shutdown."""

    settings: Any  # ServerSettings: header/body/shutdown deadlines, max_connections

    def begin_shutdown(self, worker_join_s: float) -> None: ...

    def abandon_queue(self, reason: str) -> int: ...

log = logging.getLogger("clef_flash.server")

_TIMEOUT_408 = b"HTTP/1.1 408 Request Timeout\r\ncontent-type: text/plain\r\ncontent-length: %d\r\nconnection: close\r\n\r\n%s"
_BUSY_503 = (
    b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: text/plain\r\nretry-after: 1\r\n"
    b"content-length: %d\r\nconnection: close\r\n\r\n%s"
)


def _response(template: bytes, text: str) -> bytes:
    body = text.encode()
    return template % (len(body), body)


class DeadlineH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with header and body read deadlines and a cap on open connections.

    The limits are class attributes, set by `protocol_class` on a subclass per server.
    """

    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    max_connections: int = 1024

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._deadline: asyncio.TimerHandle | None = None
        self._phase: str | None = None  # "headers" or "body" while a deadline runs
        self._draining = False  # the server is shutting down

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self.max_connections:
            log.warning("%d connections open: refusing one more (the cap is %d)", len(self.connections) - 1, self.max_connections)
            transport.write(_response(_BUSY_503, f"too many open connections (over {self.max_connections}); retry\n"))
            transport.close()
            return
        self._follow(receiving=True)  # a fresh connection must send its headers in time

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._follow(receiving=True)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self._draining:
            self.close_now()
            return
        self._follow(receiving=False)  # idle between requests: uvicorn's keep-alive timer runs

    def connection_lost(self, exc: Exception | None) -> None:
        self._arm(None)
        super().connection_lost(exc)

    @property
    def reading_request(self) -> bool:
        """A request is being read (headers or body): what a shutdown closes at its deadline."""
        return self._phase is not None

    def _follow(self, *, receiving: bool) -> None:
        """Arm the deadline of the part of the request being read, or none once it is read."""
        state = self.conn.their_state
        if state is h11.IDLE:
            self._arm("headers" if receiving or self._phase == "headers" else None)
        elif state is h11.SEND_BODY:
            self._arm("body")
        else:  # DONE (answering), MUST_CLOSE, CLOSED, ERROR
            self._arm(None)

    def _arm(self, phase: str | None) -> None:
        if phase == self._phase:
            return  # a deadline runs from the start of its part, not from the latest byte
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None
        self._phase = phase
        if phase is not None and not self.transport.is_closing():
            timeout = self.header_timeout_s if phase == "headers" else self.body_timeout_s
            self._deadline = self.loop.call_later(timeout, self._expired, phase, timeout)

    def _expired(self, phase: str, timeout: float) -> None:
        self._deadline = None
        if self.transport.is_closing():
            return
        log.info("closing a connection whose request %s took over %.3g s to arrive", phase, timeout)
        if phase == "headers" and (self.cycle is None or self.cycle.response_complete):
            self.transport.write(_response(_TIMEOUT_408, f"the request headers took over {timeout:g} s\n"))
        self.close_now()

    def shutdown(self) -> None:
        """Called by uvicorn on SIGTERM. A connection between requests is closed a moment later, not
        at once, and one whose request is arriving is left to finish it: that request gets its 503
        (or is closed at the shutdown deadline); every connection closes after its next response."""
        self._draining = True
        self.loop.call_later(0.05, self._shutdown_unless_reading)

    def _shutdown_unless_reading(self) -> None:
        if self._phase is None:
            super().shutdown()

    def close_now(self) -> None:
        """Close the connection; a request being read sees a disconnect."""
        self._arm(None)
        self.transport.close()


def protocol_class(header_timeout_s: float, body_timeout_s: float, max_connections: int) -> type[DeadlineH11Protocol]:
    limits = {"header_timeout_s": header_timeout_s, "body_timeout_s": body_timeout_s, "max_connections": max_connections}
    return type("ClefH11Protocol", (DeadlineH11Protocol,), limits)


class DeadlineServer(uvicorn.Server):
    """uvicorn's server with a shutdown deadline tied to the app's queue (see the module's doc)."""

    def __init__(self, config: uvicorn.Config, system_one: Served):
        super().__init__(config)
        self.system_one = system_one

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        timeout = self.system_one.settings.shutdown_timeout_s
        # The queue's jobs are failed (503) a little before the deadline, so that their answers are
        # written before uvicorn cancels what is left; a forward still running is waited for briefly.
        margin = min(1.0, timeout / 4)
        self.system_one.begin_shutdown(worker_join_s=margin)  # new requests on open connections: 503
        deadline = asyncio.get_running_loop().call_later(timeout - 2 * margin, self._deadline_passed)
        self.config.timeout_graceful_shutdown = timeout - margin  # type: ignore[assignment]
        try:
            await super().shutdown(sockets)
        finally:
            deadline.cancel()

    def _deadline_passed(self) -> None:
        failed = self.system_one.abandon_queue("the server is shutting down")
        closed = 0
        for connection in list(self.server_state.connections):
            if getattr(connection, "reading_request", False):
                connection.close_now()
                closed += 1
        log.warning("shutdown deadline: %d queued or running requests answered 503, %d uploads closed", failed, closed)


def raise_open_file_limit(wanted: int) -> None:
    """Let this process hold `wanted` sockets and some files (the soft limit, up to the hard one)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = wanted + 256
    if soft != resource.RLIM_INFINITY and soft < target:
        new = target if hard == resource.RLIM_INFINITY else min(target, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))


def uvicorn_server(app: Any, *, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info") -> uvicorn.Server:
    """The uvicorn server of an app. One from `create_app` gets a `DeadlineServer`, its limits read from the app's
    settings; any other (the MCP app, whose sessions hold streams open) a plain one whose shutdown waits 5 s at most."""
    system_one: Served | None = getattr(getattr(app, "state", None), "system_one", None)
    if system_one is None:
        return uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan="on", timeout_graceful_shutdown=5))
    settings = system_one.settings
    raise_open_file_limit(settings.max_connections)
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        access_log=log_level == "debug",
        http=protocol_class(settings.header_timeout_s, settings.body_timeout_s, settings.max_connections),
        timeout_graceful_shutdown=settings.shutdown_timeout_s,  # type: ignore[arg-type]
        lifespan="on",
    )
    return DeadlineServer(config, system_one)
