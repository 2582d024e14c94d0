"""Request bodies: the content type, size limits on the wire and after decompression, zstd and gzip,
the budget of bytes being parsed at once, and `ApiError`.

A body is refused with 413 as soon as its `Content-Length` or the bytes read so far pass the limit,
and a compressed one as soon as its decompressed bytes would; nothing larger is ever held. Bodies
being read, decompressed, parsed and tokenized share one `ParseBudget`: a body that would take it
past its bytes gets 429 (parsed JSON takes tens of times its size in memory, so this bounds memory).
"""

from __future__ import annotations

import contextlib
import threading
import zlib
from collections.abc import Callable, Iterator
from typing import Protocol

from fastapi import Request
from starlette.requests import ClientDisconnect


class ApiError(Exception):
    """An error answered with `status` and `message`; `cf_code` is its Workers AI error code."""

    def __init__(self, status: int, message: str, *, cf_code: int, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.cf_code = status, message, cf_code
        self.headers = headers or {}


class ClientGone(Exception):
    """The client disconnected before its answer: nobody reads the response (499 in the metrics)."""


# What a browser may send cross-site without a CORS preflight (besides application/json, which needs one).
BROWSER_SIMPLE_TYPES = ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data")


def check_content_type(content_type: str | None) -> None:
    """JSON (any parameters, e.g. a charset) or none at all (non-browser clients); else 415.

    Refusing the types a web page can POST without a preflight is what keeps a page in a browser from
    driving a server that has no API key.
    """
    media_type = (content_type or "").split(";", 1)[0].strip().lower()
    if not media_type or media_type == "application/json" or (media_type.startswith("application/") and media_type.endswith("+json")):
        return
    raise ApiError(
        415,
        f"unsupported Content-Type {media_type!r}: send 'Content-Type: application/json' "
        "(the body may be zstd- or gzip-compressed, with Content-Encoding)",
        cf_code=6003,
    )


class ParseBudget:
    """Requests, and bytes of their bodies, being read, decompressed, parsed and tokenized at once.

    Never waits: a request past `max_requests`, or a body that would take the bytes past `max_bytes`,
    gets 429 with `Retry-After`, so a burst of large bodies is refused instead of parsed together.
    Shared by the event loop and the thread pool that parses.
    """

    def __init__(self, max_bytes: int, max_requests: int, retry_after_s: int = 1):
        self.max_bytes, self.max_requests, self.retry_after_s = max_bytes, max_requests, retry_after_s
        self.bytes = self.requests = 0
        self._lock = threading.Lock()

    def _busy(self, what: str) -> ApiError:
        return ApiError(
            429,
            f"the server is busy parsing other requests ({what}); retry after {self.retry_after_s} s",
            cf_code=3040,
            headers={"Retry-After": str(self.retry_after_s)},
        )

    @contextlib.contextmanager
    def reserve(self) -> Iterator[Reservation]:
        """One request's share, given back (bytes and the request) when the block ends."""
        with self._lock:
            if self.requests >= self.max_requests:
                raise self._busy(f"{self.requests} at once")
            self.requests += 1
        reservation = Reservation(self)
        try:
            yield reservation
        finally:
            with self._lock:
                self.requests -= 1
                self.bytes -= reservation.bytes

    def _take(self, size: int) -> None:
        with self._lock:
            if self.bytes + size > self.max_bytes:
                raise self._busy(f"{self.bytes} of {self.max_bytes} bytes")
            self.bytes += size


class Reservation:
    def __init__(self, budget: ParseBudget):
        self.budget, self.bytes = budget, 0

    def take(self, size: int) -> None:
        self.budget._take(size)
        self.bytes += size


class _Decompressor(Protocol):
    eof: bool
    unused_data: bytes

    def decompress(self, data: bytes, max_length: int = ..., /) -> bytes: ...


def _zstd() -> tuple[Callable[[], _Decompressor], type[Exception]] | None:
    try:  # Python 3.14+
        from compression.zstd import ZstdDecompressor, ZstdError  # type: ignore[import-not-found]
    except ImportError:
        try:
            from backports.zstd import ZstdDecompressor, ZstdError  # type: ignore[import-not-found]
        except ImportError:
            return None
    return ZstdDecompressor, ZstdError


def body_too_large(limit: int, what: str) -> ApiError:
    return ApiError(413, f"the request body is too large: {what} over the limit of {limit} bytes", cf_code=5021)


def _decompress(data: bytes, new: Callable[[], _Decompressor], error: type[Exception], name: str, limit: int) -> bytes:
    """All frames (members) of `data`, refusing more than `limit` bytes without producing them."""
    out = bytearray()
    try:
        while data:
            decompressor = new()
            out += decompressor.decompress(data, limit + 1 - len(out))
            if len(out) > limit:
                raise body_too_large(limit, f"{name}-decompressed to")
            if not decompressor.eof:
                raise ApiError(400, f"the {name} body is truncated", cf_code=6003)
            data = decompressor.unused_data
    except error as exc:
        raise ApiError(400, f"the body is not valid {name} data: {exc}", cf_code=6003) from None
    return bytes(out)


def decode_body(raw: bytes, content_encoding: str | None, limit: int) -> bytes:
    """Undo `Content-Encoding` (zstd, gzip, or a list of them, applied left to right)."""
    encodings = [part.strip().lower() for part in (content_encoding or "").split(",") if part.strip()]
    for encoding in reversed(encodings):
        if encoding == "identity":
            continue
        if encoding in ("gzip", "x-gzip"):
            raw = _decompress(raw, lambda: zlib.decompressobj(wbits=16 + zlib.MAX_WBITS), zlib.error, "gzip", limit)
        elif encoding == "zstd" and (zstd := _zstd()) is not None:
            raw = _decompress(raw, zstd[0], zstd[1], "zstd", limit)
        else:
            hint = " (zstd needs Python 3.14 or the backports.zstd package)" if encoding == "zstd" else ""
            raise ApiError(415, f"unsupported Content-Encoding {encoding!r}: send zstd, gzip or identity{hint}", cf_code=6003)
    return raw


async def read_body(request: Request, limit: int, reservation: Reservation) -> bytes:
    """The body, refused with 413 as soon as the header or the bytes read so far pass `limit`.

    Every byte read, and the decompressed body, is taken from `reservation` as it comes (429 past the
    budget). A client that goes away mid-upload raises `ClientGone`.
    """
    length = request.headers.get("content-length")
    if length is not None:
        if not length.strip().isdigit():
            raise ApiError(400, f"bad Content-Length header {length[:40]!r}", cf_code=6003)
        if int(length) > limit:
            raise body_too_large(limit, f"Content-Length {int(length)} is")
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise body_too_large(limit, "more than")
            reservation.take(len(chunk))
            chunks.append(chunk)
    except ClientDisconnect:
        raise ClientGone from None
    raw = b"".join(chunks)
    del chunks
    body = decode_body(raw, request.headers.get("content-encoding"), limit)
    if body is not raw:  # the decompressed copy counts too, until parsed
        reservation.take(len(body))
    return body
