"""The HTTP app: System One and Workers AI routes, limits, errors, health, metrics, the demo page.

    POST /v1/systemone                                            System One body -> answers
    POST /v1/explain                                              the same body (+ how to explain) -> each part's
                                                                  contribution to every option (explain/)
    POST /v1/sets/{name}                                          {"state": ...} -> the saved set's answers
    POST /client/v4/accounts/{account}/ai/run/@cf/cloudflare/clef-flash   the same, in Cloudflare's
    POST /accounts/{account}/ai/run/@cf/cloudflare/clef-flash             {result, success, errors, messages}
                        (any other model after ai/run/: 400, Cloudflare's 7000 "no route")
    GET  /v1/models     {"models": [{name, description, release_date}]} (TypeSafe's shape)
    GET  /health        503 until the warm-up request has run, then 200 {"status": "ready", ...};
                        503 again if the model worker dies or a forward runs past the request deadline
    GET  /metrics       Prometheus text (prometheus_client)
    GET  /              the support-ticket triage demo
    GET  /openapi.json  every route above but the bare Workers AI alias, its statuses and bodies (schemas.py)

A request goes: API key -> Content-Type (JSON or none, else 415) -> body (size limits, zstd/gzip,
the parse budget: body.py) -> `parse_request_json` (a set's route: `decode_body`, then the saved
questions, sets.py; 404 when there is no such set) -> model name -> `Clef.encode` (over-length
records refused here, before inference) -> the batcher's queue (bounded: 429) -> one `Clef.score`
batch in the worker thread -> `shape_response`, all within `request_timeout_s` (then 503). Errors on
`/v1` are FastAPI-shaped (`{"detail": [...]}` for 422, `{"detail": "..."}` otherwise); on the Workers
AI routes they are `{"success": false, "errors": [{"code", "message"}]}` with Cloudflare's codes. A
500 names the request id, never the exception: the cause is in the server's log under that id.

`SystemOneServer` holds the model, settings, batcher, metrics and readiness; its `routes()` is the
table above, one method per route. `create_app(model, **settings)` is the entry point; `serve` runs
it under uvicorn with the read and shutdown deadlines of transport.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.resources
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Annotated, Any, NamedTuple

from fastapi import FastAPI, Path, Request
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse, Response
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .. import __version__
from ..clef import Prepared
from ..errors import InferenceError, QuestionSetError, RequestInvalid
from ..explain import ExplainJob, explain_request, options_of
from ..request.protocol import decode_body, parse_request, parse_request_json, served_request
from ..sets import SetStore
from . import schemas
from .batcher import Batcher, Job, QueueFull, WorkerUnavailable, build_batcher
from .body import ApiError, ClientGone, ParseBudget, body_too_large, check_content_type, read_body
from .metrics import ServerMetrics
from .settings import API_KEY_REQUIRED, ServerSettings, bearer_matches, served_names

if TYPE_CHECKING:
    from ..clef import Clef

log = logging.getLogger("clef_flash.server")

WORKERS_AI_MODEL = "@cf/cloudflare/clef-flash"
REQUEST_ID_HEADERS = ("x-request-id", "x-typesafe-request-id")  # ours; the one typesafe-sdk reads
WARM_UP_REQUEST = {
    "state": "warm-up",
    "questions": {"warm_up": {"type": "choice", "instructions": "warm-up", "criteria": {"a": None, "b": None}}},
}


# -- request ids and metrics (plain ASGI, so that disconnects reach the routes untouched) ----------


def _valid_request_id(value: str | None) -> bool:
    return value is not None and 0 < len(value) <= 128 and value.isascii() and value.isprintable()


def request_id_of(scope: Scope) -> str:
    """The request's `x-request-id` when it is a fit one to echo (printable ASCII, 1-128 characters), else a new id."""
    incoming = next((value.decode("latin-1") for key, value in scope["headers"] if key == b"x-request-id"), None)
    return incoming if _valid_request_id(incoming) else uuid.uuid4().hex


class RequestContext:
    """Gives every response a request id (an incoming `x-request-id` is echoed) and counts it."""

    def __init__(self, app: ASGIApp, metrics: ServerMetrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = request_id_of(scope)
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
        except asyncio.CancelledError:  # the connection went, or a shutdown's deadline passed: no answer
            status = 499
            raise
        finally:
            route = scope.get("route")
            name = getattr(route, "path", None) or "unmatched"  # templates only: bounded label values
            self.metrics.requests.labels(name, str(status)).inc()
            self.metrics.latency.labels(name).observe(time.perf_counter() - start)


# -- errors in each route's shape -------------------------------------------------------------------


Outcome = tuple[dict[str, Any], dict[str, str]] | Exception
"""What a request came to: (body, headers) to answer 200 with, or the error to answer in the route's shape."""


def internal_error_message(outcome: Exception, request_id: str) -> str:
    """What a 500 says: the request id to find the cause in the log, never the exception's text."""
    what = "inference failed" if isinstance(outcome, InferenceError) else "internal error"
    return f"{what}; request id {request_id} (the server's log has the cause)"


def systemone_response(outcome: Outcome, request_id: str) -> Response:
    """`/v1`'s shape: the body, or FastAPI's `{"detail": [...]}` (422) and `{"detail": "..."}`."""
    if isinstance(outcome, tuple):
        body, headers = outcome
        return JSONResponse(body, 200, headers)
    if isinstance(outcome, RequestInvalid):
        return JSONResponse(outcome.detail(), 422)
    if isinstance(outcome, ApiError):
        return JSONResponse({"detail": outcome.message}, outcome.status, outcome.headers)
    if isinstance(outcome, ClientGone):
        return Response(status_code=499)  # nginx's "client closed request"; nobody reads it
    return JSONResponse({"detail": internal_error_message(outcome, request_id)}, 500)


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


def workers_ai_response(outcome: Outcome, request_id: str) -> Response:
    """Cloudflare's shape: `{result, success, errors, messages}`, with a `cf-ai-req-id` header."""
    headers: dict[str, str] = {}
    if isinstance(outcome, tuple):
        result, headers = outcome
        status, body = 200, {"result": result, "success": True, "errors": [], "messages": []}
    elif isinstance(outcome, RequestInvalid):
        status, body = _cf_validation(outcome)
    elif isinstance(outcome, ApiError):
        status, body = _cf_failure(outcome.status, outcome.cf_code, outcome.message)
        headers = outcome.headers
    elif isinstance(outcome, ClientGone):
        return Response(status_code=499)
    else:  # Cloudflare answers a failed inference with 529 / 5012
        status = 529 if isinstance(outcome, InferenceError) else 500
        status, body = _cf_failure(status, 5012, f"Clef {internal_error_message(outcome, request_id)}")
    return JSONResponse(body, status, {**headers, "cf-ai-req-id": request_id})


def unavailable(reason: str, retry_after_s: int) -> ApiError:
    return ApiError(503, f"{reason}; retry after {retry_after_s} s", cf_code=3040, headers={"Retry-After": str(retry_after_s)})


WORKERS_AI_ROUTE = re.compile(r"(/client/v4)?/accounts/[^/]+/ai/run/.+")


def error_response(scope: Scope, error: Exception, request_id: str) -> Response:
    """`error` as the route of `scope` would answer it (Workers AI's shape under `.../ai/run/`, else /v1's, which
    is FastAPI's), with the request id headers: for what answers in front of the app (distributed/forwarding.py)."""
    route_path = scope["path"][len(scope.get("root_path", "")) :]
    shape = workers_ai_response if WORKERS_AI_ROUTE.fullmatch(route_path) else systemone_response
    response = shape(error, request_id)
    for name in REQUEST_ID_HEADERS:
        response.headers[name] = request_id
    return response


# -- the server -------------------------------------------------------------------------------------


async def _wait_for_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


class Route(NamedTuple):
    path: str
    method: str
    handler: Callable[..., Awaitable[Response]]
    summary: str
    response_class: type[Response] = JSONResponse
    in_schema: bool = True  # the bare Workers AI path is an alias: left out of the OpenAPI page
    openapi: dict[str, Any] | None = None  # request body and responses (schemas.py) of a raw-Request route


class SystemOneServer:
    """A loaded model behind HTTP: settings, the batcher and its metrics, readiness, and the routes."""

    def __init__(self, model: Clef, settings: ServerSettings, make_batcher: Callable[..., Batcher] = build_batcher):
        self.model, self.settings = model, settings
        self.metrics = ServerMetrics(queue_depth=lambda: self.batcher.depth, cache_stats=lambda: model.state_cache.stats)
        self.parse_budget = ParseBudget(settings.max_parsing_bytes, settings.max_parsing, settings.retry_after_s)
        self.batcher = make_batcher(model, self.metrics, settings)
        self.served_names = served_names(model)
        self.request_type = served_request(self.served_names, model.adapters)  # validates bodies; /openapi.json publishes it
        self.explain_type = explain_request(self.request_type)  # /v1/explain's: the same, and how to explain
        self.sets = SetStore(settings.sets_dir)
        self.status = "starting"  # -> warming_up -> ready -> shutting_down, or failed (warm_up_error says why)
        self.warm_up_error: str | None = None
        self.worker_join_s = 5.0  # how long stopping waits for a forward in progress
        self.identity, self.models_body = self.describe()
        self.demo_page = importlib.resources.files(__package__).joinpath("demo.html").read_text(encoding="utf-8")
        self.app = self.build_app()

    def routes(self) -> list[Route]:
        run = "/accounts/{account}/ai/run/"
        cloudflare = f"Workers AI: run {WORKERS_AI_MODEL}"
        settings = self.settings
        rules = {
            "description": schemas.request_rules(
                settings.max_body_bytes, self.model.max_length, settings.max_image_body_bytes, settings.max_video_body_bytes
            )
        }
        return [
            Route("/v1/systemone", "POST", self.systemone, "Answer a System One request", openapi={**schemas.SYSTEMONE, **rules}),
            Route("/v1/explain", "POST", self.explain, "Explain a System One request's answers, part by part of its state",
                  openapi={**schemas.EXPLAIN, "description": schemas.EXPLAIN_RULES + rules["description"]}),
            Route("/v1/sets/{name}", "POST", self.question_set, "Ask a saved question set about a state", openapi={**schemas.QUESTION_SET, **rules}),
            Route("/client/v4" + run + WORKERS_AI_MODEL, "POST", self.workers_ai, cloudflare, openapi={**schemas.WORKERS_AI, **rules}),
            Route(run + WORKERS_AI_MODEL, "POST", self.workers_ai, cloudflare, in_schema=False),
            # Any other model: Cloudflare's "no route" (400 / 7000); not an operation of this API.
            Route("/client/v4" + run + "{model_path:path}", "POST", self.other_model, cloudflare, in_schema=False),
            Route(run + "{model_path:path}", "POST", self.other_model, cloudflare, in_schema=False),
            Route("/v1/models", "GET", self.list_models, "The served model and its aliases", openapi=schemas.MODELS),
            Route("/health", "GET", self.health, "Readiness, model identity and fingerprints", openapi=schemas.HEALTH),
            Route("/metrics", "GET", self.prometheus, "Prometheus metrics", PlainTextResponse, openapi=schemas.METRICS),
            Route("/", "GET", self.demo, "The support-ticket triage demo", HTMLResponse),
        ]

    def build_app(self) -> FastAPI:
        app = FastAPI(
            title="clef-flash",
            version=__version__,
            description="A local System One server for Cloudflare's clef-flash decision model.",
            lifespan=self.lifespan,
            redoc_url=None,
        )
        app.add_middleware(RequestContext, metrics=self.metrics)
        app.state.batcher, app.state.metrics, app.state.settings = self.batcher, self.metrics, self.settings
        app.state.system_one = self
        for route in self.routes():
            app.add_api_route(
                route.path,
                route.handler,
                methods=[route.method],
                summary=route.summary,
                response_class=route.response_class,
                include_in_schema=route.in_schema,
                **(route.openapi or {}),
            )
        schemas.publish_models(app, self.request_type, self.explain_type)
        return app

    def describe(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """What /health says about the model, and the /v1/models body; fixed once the model is loaded."""
        model, checkpoint = self.model, self.model.checkpoint
        identity = {
            "model": model.model_name,
            "source": model.source,
            "fingerprint": {"config": checkpoint.fingerprint, "weights": checkpoint.weights_fingerprint},
            "precision": model.precision,
            "precision_reason": model.precision_policy.reason,
            "device": str(model.device),
            **model.describe(),  # the plan (backend, kernel, dtypes), state reuse and why not, the backend's shape
            "random_weights": model.is_random,
            "max_length": model.max_length,
            "api_key_required": self.settings.api_key is not None,
            "version": __version__,
        }
        description = (
            "Cloudflare's clef-flash decision model (Qwen3.5 decoder + joint schema head), "
            f"served by clef-flash {__version__} in {model.precision} on {model.device}"
            + (" - RANDOM WEIGHTS: the answers mean nothing" if model.is_random else "")
        )
        models = [
            {"name": name, "description": description, "release_date": checkpoint.release_date}
            for name in self.served_names
        ]
        return identity, {"models": models}

    # -- the worker's lifetime ----------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def lifespan(self, app: FastAPI) -> AsyncIterator[None]:
        self.batcher.start()
        self.status = "warming_up"
        warming = asyncio.create_task(self.warm_up())
        try:
            yield
        finally:
            warming.cancel()
            # A forward cannot be interrupted: past the shutdown deadline, the daemon thread is left to the exit.
            await asyncio.to_thread(self.batcher.stop, self.worker_join_s)

    async def warm_up(self) -> None:
        try:
            if self.settings.warm_up:
                job = self.batcher.submit(self.model.prepare(WARM_UP_REQUEST).record, "warm-up")
                await asyncio.wait_for(job.future, self.settings.request_timeout_s)
            if self.status == "warming_up":
                self.status = "ready"
        except Exception as error:
            self.status, self.warm_up_error = "failed", f"{type(error).__name__}: {error}"
            log.exception("the warm-up request failed")

    def current_status(self) -> tuple[str, str | None]:
        """(status, why not ready): the watchdog's view of the model worker, read on every /health."""
        if self.status in ("ready", "warming_up"):
            if not self.batcher.alive:
                return "failed", self.batcher.death or "the model worker is not running"
            busy = self.batcher.busy_for()
            if busy > self.settings.request_timeout_s:
                return "stalled", f"a forward has run for {busy:.0f} s, past the request deadline"
        return self.status, self.warm_up_error

    def begin_shutdown(self, worker_join_s: float) -> None:
        """From now on, API requests get 503 (SIGTERM: the queue drains, transport.py); at the end,
        the model worker is waited for `worker_join_s` at most."""
        self.status, self.worker_join_s = "shutting_down", worker_join_s

    def abandon_queue(self, reason: str) -> int:
        """Answer every queued and running request 503 now (the shutdown deadline)."""
        return self.batcher.abandon(reason)

    # -- one request, whatever the route ------------------------------------------------------

    def check_api_key(self, request: Request) -> None:
        api_key = self.settings.api_key
        if api_key is not None and not bearer_matches(request.headers.get("authorization"), api_key):
            raise ApiError(401, API_KEY_REQUIRED, cf_code=10000, headers={"WWW-Authenticate": "Bearer"})

    def prepare(self, raw: bytes) -> Prepared:
        """Parse, check the model name and encode; raises RequestInvalid (422)."""
        parsed = parse_request_json(raw, self.request_type)  # `model`: one of the served names
        self.check_body_size(raw, parsed)
        return self.model.prepare(parsed)  # RecordTooLong: token count and limit, before inference

    def prepare_explanation(self, raw: bytes) -> ExplainJob:
        """/v1/explain's body parsed, checked and rendered as `prepare` does, and every check of the explanation
        (Clef.prepare_explanation): 422 before anything is queued."""
        parsed = parse_request_json(raw, self.explain_type)
        self.check_body_size(raw, parsed)
        return self.model.prepare_explanation(parsed, options_of(parsed))

    def check_body_size(self, raw: bytes, parsed: Any) -> None:
        """Only a request with images may pass the text body limit (up to max_image_body_bytes), and one with videos
        the image limit (up to max_video_body_bytes): 413 otherwise."""
        settings = self.settings
        if parsed.videos:
            limit, what = settings.max_video_body_bytes, "with videos"
        elif parsed.images:
            limit, what = settings.max_image_body_bytes, "with images and without videos"
        else:
            limit, what = settings.max_body_bytes, "without images"
        if len(raw) > limit:
            raise body_too_large(limit, f"{len(raw)} bytes {what} are")

    def prepare_set(self, name: str, raw: bytes) -> Prepared:
        """A set route's body, `{"state": ...}`, asked the saved set's questions; 404 without the set."""
        try:
            question_set = self.sets.get(name)
        except QuestionSetError as error:
            raise ApiError(404, str(error), cf_code=7000) from None
        if len(raw) > self.settings.max_body_bytes:  # a set's body is a state: the text limit
            raise body_too_large(self.settings.max_body_bytes, f"{len(raw)} bytes are")
        return self.model.prepare(parse_request(question_set.request_from_body(decode_body(raw)), self.request_type))

    async def wait_for(self, job: Job, request: Request) -> list[Any]:
        """The job's result; if the client goes first, or the deadline passes, the job leaves the queue."""
        disconnect = asyncio.ensure_future(_wait_for_disconnect(request))
        timeout = self.settings.request_timeout_s
        try:
            done, _ = await asyncio.wait((job.future, disconnect), timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        finally:
            disconnect.cancel()
            if not job.future.done():  # the client went away, the deadline passed, or this task was cancelled
                self.batcher.cancel(job)
        if job.future in done:
            return job.future.result()  # may raise InferenceError or WorkerUnavailable
        if disconnect in done:
            raise ClientGone
        raise unavailable(f"the model did not answer within {timeout:g} s", self.settings.retry_after_s)

    async def answer(self, request: Request, prepare: Callable[[bytes], Prepared]) -> tuple[dict[str, Any], dict[str, str]]:
        """`prepare`: the raw body to a prepared request (`self.prepare`, or a set's)."""
        prepared = await self.read(request, prepare)
        job = self.queue(lambda: self.batcher.submit(prepared.record, request.state.request_id))
        results = await self.result_of(job, request)
        return self.model.respond(prepared, results), self.timing(job)

    async def answer_explanation(self, request: Request) -> tuple[dict[str, Any], dict[str, str]]:
        """/v1/explain: the explanation runs on the model worker as one task, between batches."""
        explained = await self.read(request, self.prepare_explanation)

        def run() -> dict[str, Any]:
            return self.model.run_explanation(explained).to_dict()

        job = self.queue(lambda: self.batcher.submit_task(run, explained.tokens, request.state.request_id))
        return await self.result_of(job, request), self.timing(job)

    async def read(self, request: Request, prepare: Callable[[bytes], Any]) -> Any:
        """The API key, the server's state, the content type and the body (within the parse budget), then
        `prepare(raw)` in a thread: RequestInvalid and ApiError before anything is queued."""
        self.check_api_key(request)
        retry_after = self.settings.retry_after_s
        if self.status == "shutting_down":
            raise unavailable("the server is shutting down", retry_after)
        check_content_type(request.headers.get("content-type"))
        with self.parse_budget.reserve() as reservation:  # 429 past the bytes or requests being parsed
            raw = await read_body(request, self.settings.max_video_body_bytes, reservation)  # the largest limit
            prepared = await run_in_threadpool(prepare, raw)  # tokenizing a 1 MiB state takes a while
            del raw
        return prepared

    def queue(self, submit: Callable[[], Job]) -> Job:
        """`submit()` (a record or a task to the batcher), a full queue as 429 and a dead worker as 503."""
        retry_after = self.settings.retry_after_s
        try:
            return submit()
        except QueueFull:
            raise ApiError(
                429,
                f"the server is busy: {self.batcher.max_queue} records are queued; retry after {retry_after} s",
                cf_code=3040,
                headers={"Retry-After": str(retry_after)},
            ) from None
        except WorkerUnavailable as error:
            raise unavailable(str(error), retry_after) from None

    async def result_of(self, job: Job, request: Request) -> Any:
        try:
            return await self.wait_for(job, request)
        except WorkerUnavailable as error:
            raise unavailable(str(error), self.settings.retry_after_s) from None

    @staticmethod
    def timing(job: Job) -> dict[str, str]:
        return {"Server-Timing": f"queue;dur={job.queue_ms():.1f}, model;dur={job.model_ms():.1f}"}

    async def run_route(
        self,
        request: Request,
        prepare: Callable[[bytes], Prepared] | None = None,
        answer: Callable[[Request], Awaitable[tuple[dict[str, Any], dict[str, str]]]] | None = None,
    ) -> Outcome:
        """(body, headers), or the error to answer in the route's own shape (`answer`: another route's own way)."""
        try:
            if answer is not None:
                return await answer(request)
            return await self.answer(request, prepare or self.prepare)
        except (ApiError, RequestInvalid, InferenceError, ClientGone) as error:
            return error
        except Exception as error:
            log.exception("unexpected error answering request id %s", request.state.request_id)
            return error

    # -- routes ---------------------------------------------------------------------------------

    async def systemone(self, request: Request) -> Response:
        return systemone_response(await self.run_route(request), request.state.request_id)

    async def explain(self, request: Request) -> Response:
        return systemone_response(await self.run_route(request, answer=self.answer_explanation), request.state.request_id)

    async def question_set(self, request: Request, name: str) -> Response:
        outcome = await self.run_route(request, lambda raw: self.prepare_set(name, raw))
        return systemone_response(outcome, request.state.request_id)

    async def workers_ai(self, request: Request, account: Annotated[str, Path(pattern=schemas.PATH_SEGMENT)]) -> Response:
        return workers_ai_response(await self.run_route(request), request.state.request_id)

    async def other_model(self, account: str, model_path: str) -> Response:
        status, body = _cf_failure(400, 7000, f"No route for that URI: this server runs {WORKERS_AI_MODEL}")
        return JSONResponse(body, status)

    async def list_models(self, request: Request) -> Response:
        try:
            self.check_api_key(request)
        except ApiError as error:
            return systemone_response(error, request.state.request_id)  # /v1's error shape
        return JSONResponse(self.models_body)

    async def health(self) -> Response:
        status, error = self.current_status()
        body = {"status": status, **self.identity, "queue_depth": self.batcher.depth}
        if error:
            body["error"] = error
        return JSONResponse(body, 200 if status == "ready" else 503)

    async def prometheus(self, request: Request) -> Response:
        content, content_type = self.metrics.render(request.headers.get("accept"))
        return Response(content, media_type=content_type)

    async def demo(self) -> Response:
        return HTMLResponse(self.demo_page)


def create_app(model: Clef, *, make_batcher: Callable[..., Batcher] = build_batcher, **settings: Any) -> FastAPI:
    """The server app around a loaded model. `settings`: the fields of `ServerSettings`; `make_batcher`:
    what queues records and runs the model, `(model, metrics, settings) -> Batcher`."""
    return SystemOneServer(model, ServerSettings(**settings), make_batcher).app


def serve(model: Clef, *, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info", **settings: Any) -> None:
    """Run the app under uvicorn, with the read and shutdown deadlines, until SIGTERM or ^C
    (what `clef-flash serve` does)."""
    from .transport import uvicorn_server

    uvicorn_server(create_app(model, **settings), host=host, port=port, log_level=log_level).run()
