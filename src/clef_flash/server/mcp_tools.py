"""The model as tools for agents: a Model Context Protocol server on the official SDK (`mcp` 2.3).

    decide      a System One request -> the System One response
    classify    {"text", "labels": [label or {"label", "description"}], "instructions"?} -> the
                probabilities of one `choice` question built from them
    explain     a System One request (+ method, depth, max_parts, steps, question_ids) -> each part of the
                state's contribution to every option (explain/: leave a part out, or token attributions)
    <set name>  {"state": ...} -> the answers of a saved question set (sets.py), one tool per set

Every tool publishes its input and output JSON schemas (`tools/list`); the sets are read on every
listing and call, so a set saved while the server runs is a tool at the client's next listing. A
call is validated and encoded as the HTTP server does it (`Clef.prepare`, the served model names),
then queued on the same `Batcher` (one model worker thread, batches across concurrent calls). A bad
call is an MCP tool error (`isError`) whose text and structured content are the HTTP 422 body,
`{"detail": [{"type", "loc", "msg", ...}]}`, with the locations a request would get (classify's
are those of its own arguments); a missing set, a full queue, a dead worker or a failed inference
are tool errors with one line of `detail`.

Transports: stdio (what desktop agents launch) and streamable HTTP at `/mcp`, bound to loopback
by default (the SDK then turns on its DNS-rebinding protection), with the `Authorization: Bearer`
key of `clef-flash serve` when one is given.
"""

from __future__ import annotations

import contextlib
import json
import logging
import uuid
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

import anyio
import mcp_types as types
from mcp.server import Server, ServerRequestContext
from starlette.types import ASGIApp, Receive, Scope, Send

from .. import __version__
from ..errors import InferenceError, QuestionSetError, RequestInvalid
from ..explain import ExplainJob, explain_request, options_of
from ..request.protocol import SystemOneRequest, SystemOneResponse, parse_request, served_request
from ..sets import QuestionSet, SetStore
from .batcher import QueueFull, WorkerUnavailable, build_batcher
from .metrics import ServerMetrics
from .schemas import ExplanationBody, SetBody
from .settings import API_KEY_REQUIRED, ServerSettings, bearer_matches, served_names

if TYPE_CHECKING:
    from ..clef import Clef, Prepared

log = logging.getLogger("clef_flash.mcp")

CLASSIFY_QUESTION = "label"  # the id of the one choice question classify asks
CLASSIFY_INSTRUCTIONS = "Which label fits the text best?"
CLASSIFY_INPUT: dict[str, Any] = {
    "type": "object",
    "properties": {
        "text": {"type": "string", "description": "What to classify"},
        "labels": {
            "type": "array",
            "minItems": 2,
            "maxItems": 255,
            "description": "The labels to choose from: names, or {label, description} objects",
            "items": {
                "anyOf": [
                    {"type": "string", "minLength": 1},
                    {
                        "type": "object",
                        "properties": {"label": {"type": "string", "minLength": 1}, "description": {"type": "string"}},
                        "required": ["label"],
                    },
                ]
            },
        },
        "instructions": {"type": "string", "description": f"The question to decide (default: {CLASSIFY_INSTRUCTIONS!r})"},
    },
    "required": ["text", "labels"],
}
CLASSIFY_OUTPUT: dict[str, Any] = {
    "type": "object",
    "properties": {
        "choice": {"type": "string", "description": "The most probable label"},
        "confidence": {"type": "number", "description": "Its probability"},
        "probabilities": {"type": "object", "additionalProperties": {"type": "number"}, "description": "Every label's, in order"},
        "usage": {"type": "object", "properties": {"input_tokens": {"type": "integer"}}},
    },
    "required": ["choice", "confidence", "probabilities"],
}
INSTRUCTIONS = (
    "clef-flash answers typed questions about a text in one forward pass: `decide` takes a System One "
    "request (state + noul/choice/score questions), `classify` picks one of a list of labels, and each "
    "saved question set is a tool that takes only the state. Answers are probabilities, nothing is generated."
)


def label_and_description(entry: Any) -> tuple[Any, Any]:
    """A `labels` entry, `"billing"` or `{"label": "billing", "description": ...}`, as (label, description)."""
    if isinstance(entry, dict):
        return entry.get("label"), entry.get("description")
    return (entry, None) if isinstance(entry, str) else (None, None)


def classify_request(arguments: dict[str, Any]) -> tuple[dict[str, Any], dict[str, int]]:
    """classify's arguments -> (the request with its one choice question, each label's position)."""
    errors: list[dict[str, Any]] = []
    labels = arguments.get("labels")
    criteria: dict[str, Any] = {}
    positions: dict[str, int] = {}
    if not isinstance(labels, list):
        message = "add 'labels': a list of 2 to 255 labels" if labels is None else "'labels' must be a list"
        errors.append({"type": "list_type", "loc": ["body", "labels"], "msg": message, "input": labels})
        labels = []
    for index, entry in enumerate(labels):
        label, description = label_and_description(entry)
        if not isinstance(label, str):
            msg = 'a label is a string or an object {"label": ..., "description"?: ...}'
            errors.append({"type": "label_type", "loc": ["body", "labels", index], "msg": msg, "input": entry})
        elif label in positions:
            msg = f"the label {label[:60]!r} is given twice (positions {positions[label]} and {index})"
            errors.append({"type": "label_duplicate", "loc": ["body", "labels", index], "msg": msg, "input": entry})
        else:
            criteria[label], positions[label] = description, index
    if errors:
        raise RequestInvalid(errors)
    question = {"type": "choice", "instructions": arguments.get("instructions", CLASSIFY_INSTRUCTIONS), "criteria": criteria}
    request = {"questions": {CLASSIFY_QUESTION: question}}
    if "text" in arguments:
        request["state"] = arguments["text"]
    return request, positions


def classify_locations(error: RequestInvalid, positions: dict[str, int]) -> RequestInvalid:
    """The request's error locations as classify's arguments: state -> text, the question's criteria
    -> labels (a label's by its position), its instructions -> instructions."""
    question = ["body", "questions", CLASSIFY_QUESTION]
    items = []
    for item in error.errors:
        loc = list(item["loc"])
        if loc[:2] == ["body", "state"]:
            loc = ["body", "text", *loc[2:]]
        elif loc[:4] == [*question, "criteria"]:
            rest = loc[4:]
            loc = ["body", "labels", *([positions.get(rest[0], rest[0]), *rest[1:]] if rest else [])]
        elif loc[:4] == [*question, "instructions"]:
            loc = ["body", "instructions", *loc[4:]]
        msg = item["msg"].replace("'state'", "'text'")
        items.append({**item, "loc": loc, "msg": msg})
    return RequestInvalid(items)


def tool_result(body: dict[str, Any], *, error: bool = False) -> types.CallToolResult:
    """A tool's answer (or error), as JSON text for any client and as structured content."""
    text = json.dumps(body, ensure_ascii=False)
    return types.CallToolResult(content=[types.TextContent(text=text)], structured_content=body, is_error=error)


class ToolServer:
    """A loaded model behind MCP: the tools, the batcher that runs their calls, and the transports."""

    def __init__(self, model: Clef, settings: ServerSettings | None = None, sets: SetStore | None = None):
        self.model = model
        self.settings = settings or ServerSettings()
        self.sets = sets or SetStore(self.settings.sets_dir)
        self.served_names = served_names(model)
        self.request_type = served_request(self.served_names, model.adapters)  # `model`: one of the served names, as the server
        self.explain_type = explain_request(self.request_type)
        self.metrics = ServerMetrics(queue_depth=lambda: self.batcher.depth, cache_stats=lambda: model.state_cache.stats)
        self.batcher = build_batcher(model, self.metrics, self.settings)
        self.server: Server[dict[str, Any]] = Server(
            "clef-flash",
            version=__version__,
            instructions=INSTRUCTIONS,
            lifespan=self.lifespan,
            on_list_tools=self.list_tools,
            on_call_tool=self.call_tool,
        )

    @contextlib.asynccontextmanager
    async def lifespan(self, server: Server[Any]) -> AsyncIterator[dict[str, Any]]:
        """The model worker runs while the server does (entered once per process, on either transport)."""
        self.batcher.start()
        try:
            yield {}
        finally:
            await anyio.to_thread.run_sync(self.batcher.stop, 5.0)

    # -- tools ----------------------------------------------------------------------------------

    def tools(self) -> list[types.Tool]:
        response = SystemOneResponse.model_json_schema()
        random = " (random weights: the answers mean nothing)" if self.model.is_random else ""
        built_in = [
            types.Tool(
                name="decide",
                description="Answer typed questions about a state: a System One request (state; questions of type "
                "noul = yes/no, choice = one of labels, score = an ordered rubric) -> a probability for every "
                f"option{random}",
                input_schema=SystemOneRequest.model_json_schema(),  # `adapter` included: a name `clef-flash mcp --adapter` loaded
                output_schema=response,
            ),
            types.Tool(
                name="classify",
                description=f"Pick the label that fits a text: the probability of each label{random}",
                input_schema=CLASSIFY_INPUT,
                output_schema=CLASSIFY_OUTPUT,
            ),
            types.Tool(
                name="explain",
                description="Why the model decided that: each part of the state (JSON field, sentence or line, image) and "
                "its contribution to every option's probability (method leave-out: the change when the part is left out)"
                f"{random}",
                input_schema=self.explain_type.model_json_schema(),
                output_schema=ExplanationBody.model_json_schema(),
            ),
        ]
        return built_in + [self.set_tool(question_set, response, random) for question_set in self.sets.all()]

    @staticmethod
    def set_tool(question_set: QuestionSet, response: dict[str, Any], random: str) -> types.Tool:
        description = question_set.description or f"Ask the saved question set {question_set.name!r} about a state"
        return types.Tool(
            name=question_set.name,
            description=f"{description}. Questions: {question_set.describe()}{random}",
            input_schema=SetBody.model_json_schema(),
            output_schema=response,
        )

    async def list_tools(self, ctx: ServerRequestContext[Any], params: types.PaginatedRequestParams | None) -> types.ListToolsResult:
        return types.ListToolsResult(tools=await anyio.to_thread.run_sync(self.tools))

    async def call_tool(self, ctx: ServerRequestContext[Any], params: types.CallToolRequestParams) -> types.CallToolResult:
        arguments = params.arguments or {}
        try:
            if params.name == "decide":
                return tool_result(await self.answer(lambda: arguments))
            if params.name == "classify":
                return tool_result(await self.classify(arguments))
            if params.name == "explain":
                return tool_result(await self.explain(arguments))
            return tool_result(await self.answer(lambda: self.sets.get(params.name).request_from_body(arguments)))
        except RequestInvalid as error:
            return tool_result(error.detail(), error=True)
        except (QuestionSetError, InferenceError, WorkerUnavailable) as error:
            return tool_result({"detail": str(error)}, error=True)
        except QueueFull:
            return tool_result({"detail": f"busy: {self.batcher.max_queue} records are queued; call again shortly"}, error=True)
        except TimeoutError:
            return tool_result({"detail": f"the model did not answer within {self.settings.request_timeout_s:g} s"}, error=True)

    async def classify(self, arguments: dict[str, Any]) -> dict[str, Any]:
        request, positions = classify_request(arguments)
        try:
            body = await self.answer(lambda: request)
        except RequestInvalid as error:
            raise classify_locations(error, positions) from None
        answer = {key: value for key, value in body["answers"][CLASSIFY_QUESTION].items() if key != "type"}
        return {**answer, "usage": body["usage"]}

    # -- one call, through the batcher ----------------------------------------------------------

    def prepare(self, build_request: Callable[[], Any]) -> Prepared:
        """Build, validate and encode a call's request (in a worker thread: tokenizing takes a while)."""
        return self.model.prepare(parse_request(build_request(), self.request_type))

    async def answer(self, build_request: Callable[[], Any]) -> dict[str, Any]:
        """The System One body for the request `build_request()` makes, queued with every other call."""
        prepared = await anyio.to_thread.run_sync(self.prepare, build_request)
        job = self.batcher.submit(prepared.record, f"mcp-{uuid.uuid4().hex[:12]}")
        try:
            with anyio.fail_after(self.settings.request_timeout_s):
                results = await job.future
        finally:
            if not job.future.done() or job.future.cancelled():  # the call was cancelled, or timed out
                self.batcher.cancel(job)
        return self.model.respond(prepared, results)

    def prepare_explanation(self, arguments: dict[str, Any]) -> ExplainJob:
        parsed = parse_request(arguments, self.explain_type)
        return self.model.prepare_explanation(parsed, options_of(parsed))

    async def explain(self, arguments: dict[str, Any]) -> dict[str, Any]:
        """The explanation, run on the model worker as one task between batches (as /v1/explain)."""
        explained = await anyio.to_thread.run_sync(self.prepare_explanation, arguments)
        job = self.batcher.submit_task(lambda: self.model.run_explanation(explained).to_dict(), explained.tokens, f"mcp-{uuid.uuid4().hex[:12]}")
        try:
            with anyio.fail_after(self.settings.request_timeout_s):
                return await job.future
        finally:
            if not job.future.done() or job.future.cancelled():
                self.batcher.cancel(job)

    # -- transports -----------------------------------------------------------------------------

    async def serve_stdio(self) -> None:
        from mcp.server.stdio import stdio_server

        async with stdio_server() as (read_stream, write_stream):
            await self.server.run(read_stream, write_stream, self.server.create_initialization_options())

    def http_app(self, *, host: str = "127.0.0.1") -> ASGIApp:
        """The streamable HTTP app (`/mcp`); with `settings.api_key`, behind the bearer check."""
        app = self.server.streamable_http_app(host=host)
        return BearerKey(app, self.settings.api_key) if self.settings.api_key else app


class BearerKey:
    """Requires `Authorization: Bearer <key>` on every HTTP request (401 otherwise), as `serve` does."""

    def __init__(self, app: ASGIApp, api_key: str):
        self.app, self.api_key = app, api_key

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            headers = dict(scope["headers"])
            authorization = headers.get(b"authorization", b"").decode("latin-1")
            if not bearer_matches(authorization, self.api_key):
                body = json.dumps({"detail": API_KEY_REQUIRED}).encode()
                await send(
                    {
                        "type": "http.response.start",
                        "status": 401,
                        "headers": [(b"content-type", b"application/json"), (b"www-authenticate", b"Bearer")],
                    }
                )
                await send({"type": "http.response.body", "body": body})
                return
        await self.app(scope, receive, send)

