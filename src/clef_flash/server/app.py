"""The HTTP app: System One and Workers AI routes, limits, errors, health, metrics, the demo page.

    POST /v1/systemone                                            System One body -> answers
    POST /client/v4/accounts/{account}/ai/run/@cf/cloudflare/clef-flash   the same, in Cloudflare's
    POST /accounts/{account}/ai/run/@cf/cloudflare/clef-flash             {result, success, errors, messages}
    GET  /v1/models     {"models": [{name, description, release_date}]} (TypeSafe's shape)
    GET  /health        503 until the warm-up request has run, then 200 {"status": "ready", ...}
    GET  /metrics       Prometheus text
    GET  /              the support-ticket triage demo

A request goes: API key -> body (size limits, zstd/gzip) -> `parse_request_json` -> model name ->
`Clef.encode` (over-length records refused here, before inference) -> the batcher's queue (bounded:
429) -> one `Clef.score` batch in the worker thread -> `shape_response`. Errors on `/v1` are
FastAPI-shaped (`{"detail": [...]}` for 422, `{"detail": "..."}` otherwise); on the Workers AI
routes they are `{"success": false, "errors": [{"code", "message"}]}` with Cloudflare's codes.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import importlib.resources
import logging
import time
import uuid
import zlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse, Response
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .. import __version__
from ..engine import Prepared
from ..errors import InferenceError, RequestInvalid
from ..request.protocol import parse_request_json
from .batcher import Batcher, Job, QueueFull
from .metrics import ServerMetrics

if TYPE_CHECKING:
    from ..engine import Clef

log = logging.getLogger("clef_flash.server")

MODEL_ALIASES = ("clef-flash", "@cf/cloudflare/clef-flash", "clef")
"""Names a request's `model` may give for the served model (besides none at all)."""
WORKERS_AI_MODEL = "@cf/cloudflare/clef-flash"
DEFAULT_MAX_BODY_BYTES = 1 << 20
REQUEST_ID_HEADERS = ("x-request-id", "x-typesafe-request-id")  # ours; the one typesafe-sdk reads
WARM_UP_REQUEST = {
    "state": "warm-up",
    "questions": {"warm_up": {"type": "choice", "instructions": "warm-up", "criteria": {"a": None, "b": None}}},
}


@dataclass(frozen=True)
class ServerSettings:
    api_key: str | None = None  # when set, a matching `Authorization: Bearer` is required
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES  # on the wire and after decompression
    batch_tokens: int | None = None  # padded tokens per batch; None: the model's batch_tokens
    batch_wait_ms: float = 5.0  # how long the oldest queued record waits for company
    max_batch: int = 64  # records per batch
    max_queue: int = 256  # queued records; one more gets 429
    retry_after_s: int = 1
    warm_up: bool = True


class ApiError(Exception):
    """An error answered with `status` and `message`; `cf_code` is its Workers AI error code."""

    def __init__(self, status: int, message: str, *, cf_code: int, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.cf_code = status, message, cf_code
        self.headers = headers or {}


# -- bodies ----------------------------------------------------------------------------------------


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


# -- request ids and metrics (plain ASGI, so that disconnects reach the routes untouched) ----------


def _valid_request_id(value: str | None) -> bool:
    return value is not None and 0 < len(value) <= 128 and value.isascii() and value.isprintable()


class RequestContext:
    """Gives every response a request id (an incoming `x-request-id` is echoed) and counts it."""

    def __init__(self, app: ASGIApp, metrics: ServerMetrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        incoming = next((value.decode("latin-1") for key, value in scope["headers"] if key == b"x-request-id"), None)
        request_id = incoming if _valid_request_id(incoming) else uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = request_id
        status, start = 500, time.perf_counter()

        async def send_with_id(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                headers = MutableHeaders(scope=message)
                for name in REQUEST_ID_HEADERS:
                    headers[name] = request_id
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        finally:
            route = scope.get("route")
            name = getattr(route, "path", None) or "unmatched"  # templates only: bounded label values
            with self.metrics.lock:
                self.metrics.requests.inc(name, str(status))
                self.metrics.latency.observe(time.perf_counter() - start, name)


# -- the app ----------------------------------------------------------------------------------------


class _ClientGone(Exception):
    pass


async def _wait_for_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _cf_failure(status: int, code: int, message: str) -> tuple[int, dict[str, Any]]:
    return status, {"result": None, "success": False, "errors": [{"code": code, "message": message}], "messages": []}


def _cf_validation(error: RequestInvalid) -> tuple[int, dict[str, Any]]:
    """Cloudflare's codes: 6003 not JSON, 5006 no questions / unknown type (400), else 5012 (422)."""
    items = error.errors
    message = "; ".join(
        f"{'.'.join(str(part) for part in item['loc'][1:]) or 'body'}: {item['msg']}" for item in items[:5]
    )
    if any(item["type"] == "json_invalid" or item["loc"] == ["body"] for item in items):
        return _cf_failure(400, 6003, message)
    if any(item["loc"] == ["body", "questions"] or item["loc"][-1:] == ["type"] for item in items):
        return _cf_failure(400, 5006, message)
    return _cf_failure(422, 5012, message)


def create_app(model: Clef, **settings: Any) -> FastAPI:
    """The server app around a loaded model. `settings`: the fields of `ServerSettings`."""
    config = ServerSettings(**settings)
    metrics = ServerMetrics(queue_depth=lambda: batcher.depth)
    batcher = Batcher(
        model,
        metrics,
        batch_tokens=config.batch_tokens or model.batch_tokens,
        max_batch=config.max_batch,
        batch_wait_s=config.batch_wait_ms / 1000,
        max_queue=config.max_queue,
    )
    checkpoint = model.checkpoint
    served_names = tuple(dict.fromkeys((model.model_name, *MODEL_ALIASES)))
    identity = {
        "model": model.model_name,
        "source": model.source,
        "fingerprint": {"config": checkpoint.fingerprint, "weights": checkpoint.weights_fingerprint},
        "precision": model.precision,
        "device": str(model.device),
        "random_weights": model.is_random,
        "max_length": model.max_length,
        "api_key_required": config.api_key is not None,
        "version": __version__,
    }
    description = (
        "Cloudflare's clef-flash decision model (Qwen3.5 decoder + joint schema head), "
        f"served by clef-flash {__version__} in {model.precision} on {model.device}"
        + (" - RANDOM WEIGHTS: the answers mean nothing" if model.is_random else "")
    )
    models_body = {
        "models": [
            {"name": name, "description": description, "release_date": checkpoint.release_date} for name in served_names
        ]
    }
    demo_page = importlib.resources.files(__package__).joinpath("demo.html").read_text(encoding="utf-8")
    state: dict[str, Any] = {"status": "starting", "warm_up_error": None}

    async def warm_up() -> None:
        try:
            if config.warm_up:
                await batcher.submit(model.prepare(WARM_UP_REQUEST).record).future
            state["status"] = "ready"
        except Exception as error:
            state["status"], state["warm_up_error"] = "failed", f"{type(error).__name__}: {error}"
            log.exception("the warm-up request failed")

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        batcher.start()
        state["status"] = "warming_up"
        warming = asyncio.create_task(warm_up())
        try:
            yield
        finally:
            warming.cancel()
            await asyncio.to_thread(batcher.stop)

    app = FastAPI(
        title="clef-flash",
        version=__version__,
        description="A local System One server for Cloudflare's clef-flash decision model.",
        lifespan=lifespan,
        redoc_url=None,
    )
    app.add_middleware(RequestContext, metrics=metrics)
    app.state.batcher, app.state.metrics, app.state.settings = batcher, metrics, config

    # -- one request, whatever the route ------------------------------------------------------

    def check_api_key(request: Request) -> None:
        if config.api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), config.api_key.encode()):
            raise ApiError(
                401,
                "a valid API key is required: send 'Authorization: Bearer <key>'",
                cf_code=10000,
                headers={"WWW-Authenticate": "Bearer"},
            )

    def prepare(raw: bytes) -> Prepared:
        """Parse, check the model name and encode; raises RequestInvalid (422)."""
        parsed = parse_request_json(raw)
        if parsed.model and parsed.model not in served_names:
            names = ", ".join(repr(name) for name in served_names)
            raise RequestInvalid(
                [
                    {
                        "type": "model_not_served",
                        "loc": ["body", "model"],
                        "msg": f"this server serves {model.model_name!r}; 'model' must be one of {names} "
                        f"or left out; got {parsed.model[:100]!r}",
                        "input": parsed.model,
                        "ctx": {"served": list(served_names)},
                    }
                ]
            )
        return model.prepare(parsed)  # RecordTooLong: token count and limit, before inference

    async def wait_for(job: Job, request: Request) -> list[Any]:
        """The job's result; if the client goes first, the job leaves the queue."""
        disconnect = asyncio.ensure_future(_wait_for_disconnect(request))
        try:
            await asyncio.wait((job.future, disconnect), return_when=asyncio.FIRST_COMPLETED)
        finally:
            disconnect.cancel()
            if not job.future.done():  # the client went away, or this task was cancelled
                batcher.cancel(job)
        if job.future.cancelled():
            raise _ClientGone
        return job.future.result()  # may raise InferenceError

    async def answer(request: Request) -> tuple[dict[str, Any], dict[str, str]]:
        check_api_key(request)
        raw = await read_body(request, config.max_body_bytes)
        prepared = await run_in_threadpool(prepare, raw)  # tokenizing a 1 MiB state takes a while
        try:
            job = batcher.submit(prepared.record)
        except QueueFull:
            raise ApiError(
                429,
                f"the server is busy: {batcher.max_queue} records are queued; retry after {config.retry_after_s} s",
                cf_code=3040,
                headers={"Retry-After": str(config.retry_after_s)},
            ) from None
        results = await wait_for(job, request)
        body = model.respond(prepared, results)
        timing = f"queue;dur={job.queue_ms():.1f}, model;dur={job.model_ms():.1f}"
        return body, {"Server-Timing": timing}

    async def run_route(request: Request) -> tuple[int, Any, dict[str, str]] | Exception:
        """(200, body, headers), or the error to answer in the route's own shape."""
        try:
            body, headers = await answer(request)
            return 200, body, headers
        except (ApiError, RequestInvalid, InferenceError, _ClientGone) as error:
            return error
        except Exception as error:
            log.exception("unexpected error answering a request")
            return error

    # -- routes -----------------------------------------------------------------------------

    @app.post("/v1/systemone", summary="Answer a System One request")
    async def systemone(request: Request) -> Response:
        outcome = await run_route(request)
        if isinstance(outcome, tuple):
            status, body, headers = outcome
            return JSONResponse(body, status, headers)
        if isinstance(outcome, RequestInvalid):
            return JSONResponse(outcome.detail(), 422)
        if isinstance(outcome, ApiError):
            return JSONResponse({"detail": outcome.message}, outcome.status, outcome.headers)
        if isinstance(outcome, _ClientGone):
            return Response(status_code=499)  # nginx's "client closed request"; nobody reads it
        if isinstance(outcome, InferenceError):
            return JSONResponse({"detail": str(outcome)}, 500)
        return JSONResponse({"detail": f"internal error: {type(outcome).__name__}: {outcome}"}, 500)

    async def workers_ai(request: Request, account: str, model_path: str) -> Response:
        if model_path != WORKERS_AI_MODEL:
            status, body = _cf_failure(400, 7000, f"No route for that URI: this server runs {WORKERS_AI_MODEL}")
            return JSONResponse(body, status)
        outcome = await run_route(request)
        headers: dict[str, str] = {}
        if isinstance(outcome, tuple):
            _, result, headers = outcome
            status, body = 200, {"result": result, "success": True, "errors": [], "messages": []}
        elif isinstance(outcome, RequestInvalid):
            status, body = _cf_validation(outcome)
        elif isinstance(outcome, ApiError):
            status, body = _cf_failure(outcome.status, outcome.cf_code, outcome.message)
            headers = outcome.headers
        elif isinstance(outcome, _ClientGone):
            return Response(status_code=499)
        else:  # Cloudflare answers a failed inference with 529 / 5012
            status = 529 if isinstance(outcome, InferenceError) else 500
            status, body = _cf_failure(status, 5012, f"Clef inference failed: {outcome}")
        return JSONResponse(body, status, {**headers, "cf-ai-req-id": request.state.request_id})

    for prefix in ("/client/v4", ""):
        app.add_api_route(
            prefix + "/accounts/{account}/ai/run/{model_path:path}",
            workers_ai,
            methods=["POST"],
            summary="Workers AI: run @cf/cloudflare/clef-flash",
            include_in_schema=bool(prefix),
        )

    @app.get("/v1/models", summary="The served model and its aliases")
    async def list_models(request: Request) -> Response:
        try:
            check_api_key(request)
        except ApiError as error:
            return JSONResponse({"detail": error.message}, error.status, error.headers)
        return JSONResponse(models_body)

    @app.get("/health", summary="Readiness, model identity and fingerprints")
    async def health() -> Response:
        body = {"status": state["status"], **identity, "queue_depth": batcher.depth}
        if state["warm_up_error"]:
            body["error"] = state["warm_up_error"]
        return JSONResponse(body, 200 if state["status"] == "ready" else 503)

    @app.get("/metrics", summary="Prometheus metrics", response_class=PlainTextResponse)
    async def prometheus() -> Response:
        return PlainTextResponse(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/", summary="The support-ticket triage demo", response_class=HTMLResponse)
    async def demo() -> Response:
        return HTMLResponse(demo_page)

    return app


def serve(model: Clef, *, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info", **settings: Any) -> None:
    """Run the app with uvicorn until interrupted (what `clef-flash serve` does)."""
    import uvicorn

    uvicorn.run(create_app(model, **settings), host=host, port=port, log_level=log_level, access_log=log_level == "debug")
