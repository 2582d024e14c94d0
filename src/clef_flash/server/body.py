"""Request bodies: size limits on the wire and after decompression, zstd and gzip, and `ApiError`.

A body is refused with 413 as soon as its `Content-Length` or the bytes read so far pass the limit,
and a compressed one as soon as its decompressed bytes would; nothing larger is ever held.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from typing import Protocol

from fastapi import Request


class ApiError(Exception):
    """An error answered with `status` and `message`; `cf_code` is its Workers AI error code."""

    def __init__(self, status: int, message: str, *, cf_code: int, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.cf_code = status, message, cf_code
        self.headers = headers or {}


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


def _too_large(limit: int, what: str) -> ApiError:
    return ApiError(413, f"the request body is too large: {what} over the limit of {limit} bytes", cf_code=5021)


def _decompress(data: bytes, new: Callable[[], _Decompressor], error: type[Exception], name: str, limit: int) -> bytes:
    """All frames (members) of `data`, refusing more than `limit` bytes without producing them."""
    out = bytearray()
    try:
        while data:
            decompressor = new()
            out += decompressor.decompress(data, limit + 1 - len(out))
            if len(out) > limit:
                raise _too_large(limit, f"{name}-decompressed to")
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


async def read_body(request: Request, limit: int) -> bytes:
    """The body, refused with 413 as soon as the header or the bytes read so far pass `limit`."""
    length = request.headers.get("content-length")
    if length is not None:
        if not length.strip().isdigit():
            raise ApiError(400, f"bad Content-Length header {length[:40]!r}", cf_code=6003)
        if int(length) > limit:
            raise _too_large(limit, f"Content-Length {int(length)} is")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise _too_large(limit, "more than")
        chunks.append(chunk)
    return decode_body(b"".join(chunks), request.headers.get("content-encoding"), limit)
