"""The API routes' request and response schemas, as /openapi.json publishes them.

The routes read a raw `Request` (the body's size, encoding and parse budget come before JSON), so
FastAPI cannot infer their schemas: they are declared here, from the protocol's own pydantic models
(`SystemOneRequest`, `SystemOneResponse`) and the error bodies below, for schema-driven clients and
fuzzers. Each route's entry is keyword arguments of `add_api_route` (see `Route.openapi` in app.py).
"""

from __future__ import annotations

import sys
from typing import Any, Literal

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel, Field
from starlette.convertors import CONVERTOR_TYPES

from ..explain import DEFAULT_MAX_PARTS, MOST_PARTS, MOST_PASSES
from ..request.protocol import SystemOneRequest, SystemOneResponse, Usage

COMPONENTS = "#/components/schemas/{model}"
PATH_SEGMENT = f"^{CONVERTOR_TYPES['str'].regex}$"
"""What a path parameter (`{account}`) matches, decoded: the router's own rule, published as its pattern."""


class ValidationErrorItem(BaseModel):
    type: str = Field(description="e.g. json_invalid, missing, record_too_long, model_not_served")
    loc: list[str | int] = Field(description='Where in the body, from "body": ["body", "questions", "team", "criteria"]')
    msg: str
    input: Any = None
    ctx: dict[str, Any] | None = None


class ValidationErrorBody(BaseModel):
    """422: FastAPI's shape, one item per problem."""

    detail: list[ValidationErrorItem]


class ErrorBody(BaseModel):
    """Any other error: one line saying what to do."""

    detail: str


class CloudflareError(BaseModel):
    code: int = Field(description="Cloudflare's code: 5006, 5012, 5021, 6003, 7000, 3040, 10000")
    message: str


class WorkersAIEnvelope(BaseModel):
    """Workers AI's envelope, for the answer and for every error."""

    result: SystemOneResponse | None
    success: bool
    errors: list[CloudflareError]
    messages: list[Any]


class SetBody(BaseModel):
    """The body of `POST /v1/sets/{name}` and the input of a set's MCP tool: only the state."""

    state: Any = Field(
        json_schema_extra={"type": ["string", "object", "array", "number", "boolean"]},
        description="The text (or JSON value) the saved questions are about",
    )
    model: str | None = Field(None, description="Any of the served model names, or left out")


class ExplainedPartBody(BaseModel):
    index: int
    kind: Literal["image", "video", "field", "item", "value", "line", "sentence"]
    label: str = Field(description='"customer.name", "tags[2]", "line 3, sentence 2", "images[0]"')
    path: list[str | int] = Field(description="JSON: the keys and indices to the member; text: [line, sentence]; media: [field, index]")
    excerpt: str = Field(description="The part as rendered, cut to 80 characters")
    chars: list[int] | None = Field(None, min_length=2, max_length=2, description="A text's part: [start, end) of its characters in the state")
    token_span: list[int] = Field(min_length=2, max_length=2, description="[start, end) of its tokens in the full record")


class ExplainedOptionBody(BaseModel):
    probability: float = Field(description="The option's probability for the full request (unrounded)")
    contributions: list[float] = Field(
        description="One per part, in `parts` order. leave-out: the probability minus the probability with the part "
        "left out (positive: the part supports the option); gradients: the attributions of the part's tokens, summed"
    )
    without: list[float] | None = Field(None, description="leave-out: the probability with each part left out")
    token_scores: list[float] | None = Field(None, description="gradients: one per token of `tokens`")
    convergence_delta: float | None = Field(
        None, description="integrated-gradients: the attributions' sum minus (p(input) - p(baseline)); near 0 when the steps suffice"
    )


class ExplainedQuestionBody(BaseModel):
    type: Literal["noul", "choice", "score"]
    decision: str = Field(description="The most probable option (ties: the first in criteria order)")
    options: dict[str, ExplainedOptionBody] = Field(description="Every option, in criteria order (noul: true, false)")


class ExplainedTokenBody(BaseModel):
    position: int
    text: str
    part: int | None = Field(description="The part that owns the token (null: between parts)")


class ExplainCost(BaseModel):
    records: int = Field(description="Records scored: the full request and one per part left out (gradients: one)")
    tokens_whole: int = Field(description="Their tokens, as whole records answered one by one would run")
    tokens_run: int = Field(description="Decoder tokens actually run (leave-out: the shared prefix once)")
    passes: int = Field(description="leave-out: decoder steps; gradients: forward + backward passes")
    milliseconds: float


class ExplanationBody(BaseModel):
    """Each part of the state's contribution to every option of every question (`Explanation.to_dict()`)."""

    model: str
    method: Literal["leave-out", "integrated-gradients", "input-x-gradient"]
    parts: list[ExplainedPartBody] = Field(description="The state's parts, in record order: images, videos, then the text's or JSON's")
    questions: dict[str, ExplainedQuestionBody] = Field(description="The explained questions, in request order")
    tokens: list[ExplainedTokenBody] | None = Field(None, description="gradients: the parts' tokens")
    cost: ExplainCost
    usage: Usage


class ModelEntry(BaseModel):
    name: str
    description: str
    release_date: str | None


class ModelsBody(BaseModel):
    models: list[ModelEntry]


class Fingerprint(BaseModel):
    config: str
    weights: str | None


class HealthBody(BaseModel):
    """The server's readiness and the served model's identity."""

    status: Literal["starting", "warming_up", "ready", "shutting_down", "failed", "stalled"]
    model: str
    source: str
    fingerprint: Fingerprint
    precision: str
    precision_reason: str
    device: str
    random_weights: bool
    max_length: int
    api_key_required: bool
    version: str
    queue_depth: int
    error: str | None = Field(default=None, description="Why the server is not ready, when it is not")


def _errors(model: type[BaseModel], statuses: dict[int, str]) -> dict[int | str, dict[str, Any]]:
    return {status: {"model": model, "description": description} for status, description in statuses.items()}


_ERROR_STATUSES = {
    400: "Content-Length malformed, or the body not valid gzip / zstd",
    401: "API key missing or wrong (only when the server has one)",
    413: "The body is over the limit, on the wire or decompressed",
    415: "Content-Type other than application/json, or an unknown Content-Encoding",
    429: "Too many records queued or bodies being parsed: retry after Retry-After seconds",
    500: "Inference or the server failed: the body names the request id to look for in the log",
    503: "The model worker is down, the server is shutting down, or the model did not answer in time",
}
_REQUEST_BODY = {
    "requestBody": {
        "required": True,
        "content": {"application/json": {"schema": {"$ref": COMPONENTS.format(model="SystemOneRequest")}}},
    }
}
_NOT_FOUND = {
    404: {"model": ErrorBody, "description": "No such route: the account is empty or holds a '/' (%2F) once decoded"}
}

SYSTEMONE: dict[str, Any] = {
    "responses": {
        200: {"model": SystemOneResponse, "description": "One answer per question, in request order"},
        422: {"model": ValidationErrorBody, "description": "The body is not a valid System One request"},
        **_errors(ErrorBody, _ERROR_STATUSES),
    },
    "openapi_extra": _REQUEST_BODY,
}
QUESTION_SET: dict[str, Any] = {
    "responses": {
        200: {"model": SystemOneResponse, "description": "One answer per question of the saved set, in its order"},
        404: {"model": ErrorBody, "description": "No saved set by that name (clef-flash sets list)"},
        422: {"model": ValidationErrorBody, "description": "The body is not {\"state\": ...}, or brings questions"},
        **_errors(ErrorBody, _ERROR_STATUSES),
    },
    "openapi_extra": {
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": {"$ref": COMPONENTS.format(model="SetBody")}}},
        }
    },
}
WORKERS_AI: dict[str, Any] = {
    "responses": {
        200: {"model": WorkersAIEnvelope, "description": "The answer in `result`"},
        **_errors(
            WorkersAIEnvelope,
            {
                **_ERROR_STATUSES,
                400: f"{_ERROR_STATUSES[400]} (6003); the body not JSON (6003); no questions, or an unknown "
                "question type (5006)",
                422: "Invalid request (5012)",
                529: "Inference failed (5012)",
            },
        ),
        **_NOT_FOUND,
    },
    "openapi_extra": _REQUEST_BODY,
}
EXPLAIN: dict[str, Any] = {
    "responses": {
        200: {"model": ExplanationBody, "description": "Each part's contribution to every option of the explained questions"},
        422: {
            "model": ValidationErrorBody,
            "description": "The body is not a valid System One request, or cannot be explained: an unknown question id "
            "(question_unknown), an empty state (state_empty), a state of one part (state_one_part), more parts than "
            "max_parts (too_many_parts), a gradient method on an 8-bit model (explain_method_unsupported) or of more than "
            f"{MOST_PASSES:,} forward and backward passes (explain_too_costly)",
        },
        **_errors(ErrorBody, _ERROR_STATUSES),
    },
    "openapi_extra": {
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": {"$ref": COMPONENTS.format(model="ExplainRequest")}}},
        }
    },
}
EXPLAIN_RULES = f"""\
A System One body, with how to explain it (`method`, `depth`, `max_parts`, `steps`, `question_ids`). The state splits
into parts: each image and video, each field of a JSON state (to `depth` levels), each sentence or line of a text.
`leave-out` answers the request once with each part left out (the full record's shared prefix computed once);
`integrated-gradients` and `input-x-gradient` attribute to the input embeddings (Captum; a server of an 8-bit model
refuses them). A state of more than `max_parts` parts (default {DEFAULT_MAX_PARTS}, at most {MOST_PARTS}), of one
part or none, or an unknown question id: 422, before inference. The explanation runs on the model worker between
batches, within the request deadline.

"""
MODELS: dict[str, Any] = {
    "responses": {
        200: {"model": ModelsBody, "description": "The served name and its aliases"},
        401: {"model": ErrorBody, "description": _ERROR_STATUSES[401]},
    }
}
HEALTH: dict[str, Any] = {
    "responses": {
        200: {"model": HealthBody, "description": "Ready"},
        503: {"model": HealthBody, "description": "Not ready: starting, warming up, shutting down, failed or stalled"},
    }
}
METRICS: dict[str, Any] = {
    "responses": {
        200: {
            "description": "The Prometheus text format, or OpenMetrics when the Accept header asks for it",
            "content": {"text/plain": {"schema": {"type": "string"}}, "application/openmetrics-text": {"schema": {"type": "string"}}},
        }
    }
}


def request_rules(max_body_bytes: int, max_length: int, max_image_body_bytes: int, max_video_body_bytes: int) -> str:
    """The rules a System One body must follow that its JSON schema cannot state, with their statuses
    (a route's description in the OpenAPI document)."""
    return f"""\
The body's JSON schema (`SystemOneRequest`) states its shape, counts, lengths and the served model names.
Beyond it:

- **Tokens**: the rendered record (prompt, state and every question) must fit {max_length:,} tokens;
  longer ones are refused before inference with 422 `record_too_long` (never truncated).
- **Size**: at most {max_body_bytes:,} bytes on the wire and again after `Content-Encoding` (zstd, gzip), a
  body with images {max_image_body_bytes:,}, one with videos {max_video_body_bytes:,}: 413.
- **Media**: an image's or a video's base64 must decode to one of its type (a list's frames of one size), the
  images and videos together within their bytes: 422 naming the item (`["body", "videos", 0]`).
- **Content-Type**: `application/json` (or `+json`) or none; anything else 415.
- **Text**: every string must be valid Unicode (a `\\ud800`-style lone surrogate escape: 422
  `string_unicode`); integers have at most {sys.get_int_max_str_digits():,} digits (422 `integer_too_long`);
  NaN and Infinity are not JSON (422 `json_invalid`).
- **Ids and labels** are taken as sent, without normalisation: ids that differ only in case or Unicode
  form are different questions. A key repeated within one JSON object keeps its last value, as JSON
  parsers do.
- **Load**: a full queue, or too many bodies being parsed at once, gets 429 with `Retry-After`.
"""


def publish_models(app: FastAPI, request_type: type[BaseModel] = SystemOneRequest, explain_type: type[BaseModel] | None = None) -> None:
    """Make `app.openapi()` carry the request body's schema (and its parts) in its components:
    `request_type`, the model the routes validate with (its `model` lists the served names), and `explain_type`,
    /v1/explain's."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(
                title=app.title, version=app.version, description=app.description, routes=app.routes
            )
            request_schema = request_type.model_json_schema(ref_template=COMPONENTS)
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            components.update(request_schema.pop("$defs", {}))
            components["SystemOneRequest"] = request_schema
            if explain_type is not None:
                explain_schema = explain_type.model_json_schema(ref_template=COMPONENTS)
                components.update(explain_schema.pop("$defs", {}))
                components["ExplainRequest"] = explain_schema
            components["SetBody"] = SetBody.model_json_schema(ref_template=COMPONENTS)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
