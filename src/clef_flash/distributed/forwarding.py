"""A request forwarded whole to an app in another process, and the front that forwards it (`serve --ray`).

`Forwarded` is an HTTP request as plain values (its ASGI scope's and its body), `Answer` the response;
`call_app` runs one through an ASGI app in this process (the replica's side). `Forwarder` is the ASGI
app in front (the front deployment's side): it reads a request, forwards it, and when the process that
held it is lost (an error in `lost`, e.g. Ray's actor death) forwards it once more, as scoring is a
pure function of the request; if that fails too, or no answer comes within `deadline_s`, it answers
503 + Retry-After in the route's own error shape (`server.app.error_response`). An answer of the app,
whatever its status, is passed on as it is. Nothing here imports Ray.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ..server.app import error_response, request_id_of, unavailable

log = logging.getLogger("clef_flash.server")

FORWARDED_SCOPE_KEYS = ("type", "asgi", "http_version", "scheme", "method", "path", "raw_path", "root_path", "query_string", "headers", "client", "server")


@dataclass(frozen=True)
class Forwarded:
    scope: dict[str, Any]  # the plain values of the request's HTTP scope (FORWARDED_SCOPE_KEYS)
    body: bytes


@dataclass(frozen=True)
class Answer:
    status: int
    headers: list[tuple[bytes, bytes]]
    body: bytes


async def call_app(app: ASGIApp, request: Forwarded) -> Answer:
    """`request` through `app`, in this process. After the body, `receive` waits until this call is cancelled
    (the caller went away), never reporting `http.disconnect` early: the app would take that for a client gone."""
    pending: list[Message] = [{"type": "http.request", "body": request.body, "more_body": False}]
    started: Message | None = None
    chunks: list[bytes] = []

    async def receive() -> Message:
        if pending:
            return pending.pop()
        await asyncio.Future()  # until cancelled
        raise AssertionError("unreachable")

    async def send(message: Message) -> None:
        nonlocal started
        if message["type"] == "http.response.start":
            started = message
        elif message["type"] == "http.response.body":
            chunks.append(message.get("body", b""))

    scope = {**request.scope, "headers": list(request.scope["headers"])}
    try:
        await app(scope, receive, send)
    except Exception:
        if started is None:
            raise
        log.exception("the app raised after answering %s", started["status"])  # as a server logs it, answer kept
    if started is None:
        raise RuntimeError(f"the app answered nothing to {request.scope['method']} {request.scope['path']}")
    return Answer(started["status"], [(bytes(name), bytes(value)) for name, value in started.get("headers", [])], b"".join(chunks))


async def read_request(scope: Scope, receive: Receive, limit: int) -> Forwarded | None:
    """The request with its body, of which at most `limit` + 1 bytes (enough for the app to refuse it with its own
    413) and none when its Content-Length passes `limit` (the app refuses it from the header). None: the client went."""
    headers = dict(scope["headers"])
    length = headers.get(b"content-length", b"").strip()
    chunks, size = [], 0
    more = not (length.isdigit() and int(length) > limit)
    while more and size <= limit:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunks.append(message.get("body", b""))
        size += len(chunks[-1])
        more = message.get("more_body", False)
    plain = {key: scope[key] for key in FORWARDED_SCOPE_KEYS if key in scope}
    return Forwarded(plain, b"".join(chunks)[: limit + 1])


class Forwarder:
    """The ASGI app of the front: each request forwarded whole by `forward`; one lost in flight (`lost`) forwarded
    once more; then, or past `deadline_s` an attempt, 503 + `Retry-After: retry_after_s`."""

    def __init__(
        self,
        forward: Callable[[Forwarded], Awaitable[Answer]],
        lost: tuple[type[BaseException], ...],
        *,
        body_limit: int,
        deadline_s: float,
        retry_after_s: int,
    ):
        self.forward, self.lost = forward, lost
        self.body_limit, self.deadline_s, self.retry_after_s = body_limit, deadline_s, retry_after_s
        self.retried = 0  # requests forwarded a second time
        self.unavailable = 0  # requests answered 503 here
        self.errors: Counter[str] = Counter()  # what the attempts that failed raised, by type

    def stats(self) -> dict[str, Any]:
        return {"retried": self.retried, "unavailable": self.unavailable, "errors": dict(self.errors)}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":  # nothing to start or stop
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        if scope["type"] != "http":  # the app has no websocket routes
            await send({"type": "websocket.close", "code": 1000})
            return
        request = await read_request(scope, receive, self.body_limit)
        if request is None:
            return  # nobody to answer
        answer = await self.answer(request)
        await send({"type": "http.response.start", "status": answer.status, "headers": answer.headers})
        await send({"type": "http.response.body", "body": answer.body})

    async def answer(self, request: Forwarded) -> Answer:
        request_id = request_id_of(request.scope)
        for attempt in (1, 2):
            try:
                return await asyncio.wait_for(self.forward(request), self.deadline_s)
            except self.lost as error:
                self.errors[type(error).__name__] += 1
                log.warning("request id %s: the replica answering it was lost (attempt %d: %s)", request_id, attempt, type(error).__name__)
                reason = "the replica answering this request was lost, and so was the one it was retried on"
                if attempt == 1:
                    self.retried += 1
            except TimeoutError:
                self.errors["TimeoutError"] += 1
                reason = f"no replica answered within {self.deadline_s:g} s"
                break
            except Exception as error:
                log.exception("request id %s: forwarding failed", request_id)
                return self.respond(request, error, request_id)
        self.unavailable += 1
        return self.respond(request, unavailable(reason, self.retry_after_s), request_id)

    def respond(self, request: Forwarded, error: Exception, request_id: str) -> Answer:
        response = error_response(request.scope, error, request_id)
        return Answer(response.status_code, response.raw_headers, bytes(response.body))


__all__ = ["Answer", "Forwarded", "Forwarder", "call_app", "read_request"]
