"""The System One request/response protocol: pydantic models, limits, errors (answers: request/answers.py).

A request is validated once, here, into a `SystemOneRequest`; everything after this module
(rendering, the engine, the server) may assume its shape and limits. Errors come out as a
`RequestInvalid` whose items are exactly FastAPI's 422 items (`type`, `loc` from `"body"`, `msg`,
`input`, `ctx`), with locations that name the caller's keys (never pydantic's union tags) and
messages written for the person who sent the body.

Choices where the public sources disagree (`/work/shared/systemone.md` §7), and why:

- **Top-level unknown fields are ignored.** `typesafe-sdk` (0.7.5) merges any `extra_body` into
  the body's top level, and gateways add or strip fields (ngrok); the fields we know are enough.
  The SDK always sends `model` (default `"jev-latest"`), so any model name is accepted and echoed.
- **Images as the hosted API takes them** (request/images.py): up to 4 data URIs, 4 MiB each, 8 MiB
  together, 16 MP each; remote URLs are refused. Every refusal names the image's index
  (`["body", "images", i]`) and what is wrong. **Videos** (request/videos.py; the hosted API takes none):
  up to 4, each a video data URI (MP4, WebM) or an array of frames (image data URIs), 16 MiB together;
  refusals name the video's index (`["body", "videos", i]`), and a frame's in the message. The SDK's
  image `assets` are refused (`images_unsupported`) when present and non-empty: answering as if they
  were not there would be silently wrong. Absent, `null`, `[]` or `{}` are fine.
- **`state` is required and may be any JSON value except `null`** (string, object, array, number,
  boolean; non-strings are rendered as compact JSON). The TypeSafe OpenAPI schema the SDK is
  generated from allows no `null` and the SDK refuses `None` itself: a null state is a caller bug
  that would otherwise get confident answers about nothing (`state_null`).
- **`null` descriptions mean "undescribed".** A choice option or a noul `true` / `false` given as
  `null` is kept as `None`; the reference then renders that option without a description (the
  SDK's own example sends `{"calm": None, "angry": None}`). A noul key that is *left out* instead
  gets the default description (SPEC §3), so `to_record` keeps only the noul keys that were sent.
- **`instructions` may be missing, `null` or `""`**: the question id is rendered instead (SPEC §3,
  the SDK and xr-ai allow it). Numbers and booleans are refused there, and in descriptions.
- **Score levels may not be `null`**: the wire schema's `legend` has no null values.
- **Ids and labels**: question ids have 1 to 100 characters of any kind (no character set is
  imposed); option labels are non-empty strings.
- **Text must be encodable**: lone surrogates (legal as JSON escapes) give `string_unicode`, and
  NaN / Infinity are refused: either would fail later, in the tokenizer or the JSON response.
- **Counts have their own messages** ("a choice question needs 2 to 255 options; got 1") under
  pydantic's types (`too_short`, `too_long`), except over 64 questions: `too_many_questions`, so a
  client can tell that it should split the request.

For FastAPI: the models give the OpenAPI schema (`SystemOneRequest`, `SystemOneResponse`), and every
limit JSON Schema can state is published by the same annotation that enforces it, so a body the schema
allows is refused only for what it cannot state (tokens, lone surrogates). A server that serves
named models validates with `served_request(names)`, whose `model` is an enum of them. A route that
lets FastAPI validate the body itself reports pydantic's raw locations; read the body and call
`parse_request_json` (or `parse_request`) to answer with these errors instead.
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Mapping, Sequence
from typing import Annotated, Any, Literal, get_origin

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PlainValidator,
    ValidationError,
    WithJsonSchema,
    create_model,
)
from pydantic_core import PydanticCustomError

from ..errors import RequestInvalid
from .images import MAX_IMAGE_BYTES, MAX_IMAGES, MAX_TOTAL_IMAGE_BYTES, MediaProblem, decode_image
from .videos import MAX_TOTAL_VIDEO_BYTES, MAX_VIDEO_BYTES, MAX_VIDEO_FRAMES, MAX_VIDEOS, decode_video

__all__ = [
    "DEFAULT_MODEL_NAME",
    "MAX_CHOICE_OPTIONS",
    "MAX_ID_LENGTH",
    "MAX_QUESTIONS",
    "MAX_SCORE_LEVELS",
    "MIN_CHOICE_OPTIONS",
    "MIN_ID_LENGTH",
    "MIN_LABEL_LENGTH",
    "MIN_QUESTIONS",
    "MIN_SCORE_LEVELS",
    "QUESTION_TYPES",
    "ChoiceAnswer",
    "ChoiceQuestion",
    "NoulAnswer",
    "NoulCriteria",
    "NoulQuestion",
    "ScoreAnswer",
    "ScoreQuestion",
    "SystemOneRequest",
    "SystemOneResponse",
    "Usage",
    "decode_body",
    "parse_request",
    "parse_request_json",
    "served_request",
]

# Limits of the hosted clef-flash (SPEC §6).
MIN_QUESTIONS = 1
MAX_QUESTIONS = 64
MIN_ID_LENGTH = 1
MAX_ID_LENGTH = 100
MIN_LABEL_LENGTH = 1
MIN_CHOICE_OPTIONS = 2
MAX_CHOICE_OPTIONS = 255
MIN_SCORE_LEVELS = 2
MAX_SCORE_LEVELS = 10

# Question type ids as the joint head's type embedding numbers them (SPEC §3).
QUESTION_TYPES: dict[str, int] = {"noul": 0, "choice": 1, "score": 2}
_ALLOWED_TYPES = "'noul', 'choice' or 'score'"
DEFAULT_MODEL_NAME = "clef-flash"
"""The `model` of a response to a request that named none."""


# --------------------------------------------------------------------------------------------
# JSON values. Our own validators (no pydantic unions) so that an error is one item at the
# caller's location, not one per union member under locations like `str` or `dict[str,any]`.


def _kind(value: Any) -> str:
    """A value's JSON type name, for messages ("got number")."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, (list, tuple)):
        return "array"
    if isinstance(value, Mapping):
        return "object"
    return type(value).__name__


def _is_unicode(text: str) -> bool:
    """False for text with lone surrogates (from JSON escapes): not encodable, so not tokenizable."""
    if text.isascii():
        return True
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _json_problem(value: Any) -> tuple[str, str] | None:
    """(error type, message) for the first part of ``value`` that is not JSON data, or None.

    Iterative, so deep values cannot raise RecursionError. Decoded JSON passes except for lone
    surrogates; the rest guards Python callers (a set, bytes, int keys, NaN would break
    rendering or the JSON response later).
    """
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            if not _is_unicode(item):
                return "string_unicode", "text must be valid Unicode; found a lone surrogate"
        elif item is None or isinstance(item, (bool, int)):
            continue
        elif isinstance(item, float):
            if not math.isfinite(item):
                return "json_type", "numbers must be finite; JSON has no NaN or Infinity"
        elif isinstance(item, list):
            stack.extend(item)
        elif isinstance(item, dict):
            for key, child in item.items():
                if not isinstance(key, str):
                    return "json_type", f"object keys must be strings; found a Python {type(key).__name__}"
                stack.append(key)
                stack.append(child)
        else:
            return "json_type", f"expected JSON data; found a Python {type(item).__name__}"
    return None


def _require_json(value: Any) -> None:
    problem = _json_problem(value)
    if problem is not None:
        raise PydanticCustomError(*problem)


def _check_text(text: str) -> str:
    if not _is_unicode(text):
        raise PydanticCustomError("string_unicode", "text must be valid Unicode; found a lone surrogate")
    return text


def _content_validator(what: str, *, nullable: bool) -> PlainValidator:
    """A validator for content: a string, an object or an array (rendered as JSON), maybe null."""
    allowed = "a string, object, array or null" if nullable else "a string, object or array"

    def validate(value: Any) -> Any:
        if value is None and nullable:
            return None
        _require_json(value)
        if not isinstance(value, (str, list, dict)):
            raise PydanticCustomError("content_type", f"{what} must be {allowed}; got {_kind(value)}")
        return value

    return PlainValidator(validate)


def _validate_state(value: Any) -> Any:
    if value is None:
        raise PydanticCustomError(
            "state_null",
            "'state' must not be null: send the content the questions are about (a string, object or array)",
        )
    _require_json(value)
    return value


_CONTENT_SCHEMA = {"anyOf": [{"type": "string"}, {"type": "object"}, {"type": "array"}]}
_NULLABLE_CONTENT_SCHEMA = {"anyOf": [*_CONTENT_SCHEMA["anyOf"], {"type": "null"}]}

State = Annotated[
    Any,
    PlainValidator(_validate_state),
    WithJsonSchema({"anyOf": [*_CONTENT_SCHEMA["anyOf"], {"type": "number"}, {"type": "boolean"}]}),
]
Instructions = Annotated[
    Any, _content_validator("instructions", nullable=True), WithJsonSchema(_NULLABLE_CONTENT_SCHEMA)
]
Description = Annotated[
    Any, _content_validator("an option description", nullable=True), WithJsonSchema(_NULLABLE_CONTENT_SCHEMA)
]
Level = Annotated[Any, _content_validator("a score level", nullable=False), WithJsonSchema(_CONTENT_SCHEMA)]


def _media_item(decode: Any) -> Any:
    """A validator of one image or video: `decode` it (request/images.py, request/videos.py), or its 422 item."""

    def validate(value: Any) -> Any:
        try:
            return decode(value)
        except MediaProblem as problem:
            raise PydanticCustomError(problem.kind, str(problem)) from None

    return PlainValidator(validate)


def _media_total(field: str, limit: int, words: str) -> Any:
    """A validator of a media list's encoded bytes together: at most `limit` (`words`), else `{field}_too_large`."""

    def validate(value: Any) -> Any:
        if not value:
            return None
        total = sum(item.nbytes for item in value)
        if total > limit:
            raise PydanticCustomError(f"{field}_too_large", f"{field} may have at most {limit} bytes ({words}) together; got {total}")
        return tuple(value)

    return AfterValidator(validate)


def _media_validator(field: str, error_type: str, noun: str) -> Any:
    """A media field that must be absent or empty: silently ignoring media would answer wrongly."""

    def validate(value: Any) -> None:
        if value is None or (isinstance(value, (list, dict)) and not value):
            return None
        raise PydanticCustomError(error_type, f"{noun} are not supported by this runtime (images are: send them in 'images')")

    schema = {
        "anyOf": [{"type": "null"}, {"type": "array", "maxItems": 0}, {"type": "object", "maxProperties": 0}],
        "description": f"Not supported by this runtime: leave out, null or empty ({field}).",
    }
    return Annotated[Any, PlainValidator(validate), WithJsonSchema(schema)]


# --------------------------------------------------------------------------------------------
# Ids, labels and counts. Each limit is written once, in the call that both enforces it and
# publishes it in the JSON schema (`minLength`, `propertyNames`, `minProperties`, ...), so the
# OpenAPI document cannot drift from the validation. Counts are checked *before* the items are
# validated, so that a body with 10,000 options costs one error, not 10,000 item validations, and
# the count error comes first.


def _check_question_id(question_id: str) -> str:
    _check_text(question_id)
    if not MIN_ID_LENGTH <= len(question_id) <= MAX_ID_LENGTH:
        error_type = "string_too_short" if len(question_id) < MIN_ID_LENGTH else "string_too_long"
        raise PydanticCustomError(
            error_type,
            "a question id must have {min_length} to {max_length} characters; got {actual_length}",
            {"min_length": MIN_ID_LENGTH, "max_length": MAX_ID_LENGTH, "actual_length": len(question_id)},
        )
    return question_id


def _check_label(label: str) -> str:
    _check_text(label)
    if len(label) < MIN_LABEL_LENGTH:
        raise PydanticCustomError("string_too_short", "an option label must not be empty", {"min_length": MIN_LABEL_LENGTH})
    return label


def _counted(
    container: Any, what: str, needs: str, unit: str, low: int, high: int, *, too_many: str = "too_long"
) -> Any:
    """``container`` (a dict or list type) whose JSON type and size are checked before its items,
    and whose JSON schema states the same bounds (`minProperties` / `minItems` and the maxima).

    Messages read "{what}; got array" and "{needs} 2 to 255 {unit}; got 1".
    """
    is_object = get_origin(container) is dict
    bounds = {"minProperties": low, "maxProperties": high} if is_object else {"minItems": low, "maxItems": high}
    validate = _count_check(is_object, what, needs, unit, low, high, too_many=too_many)
    return Annotated[container, BeforeValidator(validate), Field(json_schema_extra=bounds)]


def _count_check(is_object: bool, what: str, needs: str, unit: str, low: int, high: int, *, too_many: str = "too_long"):
    """The check `_counted` runs: the JSON type (object or array), then the size."""
    kinds: tuple[type, ...] = (Mapping,) if is_object else (list, tuple)
    wrong_type = "dict_type" if is_object else "list_type"

    def validate(value: Any) -> Any:
        if not isinstance(value, kinds):
            raise PydanticCustomError(wrong_type, f"{what}; got {_kind(value)}")
        count = len(value)
        if not low <= count <= high:
            raise PydanticCustomError(
                "too_short" if count < low else too_many,
                f"{needs} {low} to {high} {unit}; got {count}",
                {"min_length": low, "max_length": high, "actual_length": count},
            )
        return value

    return validate


QuestionId = Annotated[
    str,
    AfterValidator(_check_question_id),
    WithJsonSchema({"type": "string", "minLength": MIN_ID_LENGTH, "maxLength": MAX_ID_LENGTH}),
]
OptionLabel = Annotated[str, AfterValidator(_check_label), WithJsonSchema({"type": "string", "minLength": MIN_LABEL_LENGTH})]


def _media_list_schema(max_items: int, items: dict[str, Any], description: str) -> dict[str, Any]:
    """The published schema of `images` / `videos`: null, or an array of at most `max_items` `items`."""
    return {"anyOf": [{"type": "null"}, {"type": "array", "maxItems": max_items, "items": items}], "description": description}


IMAGE_DATA_URI_PATTERN = r"^data:image/(png|jpeg|webp);base64,[A-Za-z0-9+/]*={0,2}$"
_IMAGE_SCHEMA = {
    "type": "string",
    "pattern": IMAGE_DATA_URI_PATTERN,
    "maxLength": 4 * -(-MAX_IMAGE_BYTES // 3) + len("data:image/jpeg;base64,"),
    "description": "data:image/png|jpeg|webp;base64,... (4 MiB, 16 MP at most)",
}
_IMAGES_SCHEMA = _media_list_schema(
    MAX_IMAGES,
    _IMAGE_SCHEMA,
    "Up to 4 images as data URIs (8 MiB together); remote URLs are refused. Each must decode to "
    "an image of its type (a rule JSON Schema cannot state: 422 image_undecodable otherwise).",
)
_images_count = _count_check(
    False, "'images' must be an array of data URIs", "a request takes", "images", 0, MAX_IMAGES, too_many="too_many_images"
)


def _media_list(decode: Any, count: Any, field: str, limit: int, words: str, schema: dict[str, Any]) -> Any:
    """`images` / `videos`: null or a list, counted first (`count`), each item decoded, the bytes together checked."""
    return Annotated[
        list[Annotated[Any, _media_item(decode)]],
        BeforeValidator(lambda value: [] if value is None else count(value)),
        _media_total(field, limit, words),
        WithJsonSchema(schema),
    ]


Images = _media_list(decode_image, _images_count, "images", MAX_TOTAL_IMAGE_BYTES, "8 MiB", _IMAGES_SCHEMA)

VIDEO_DATA_URI_PATTERN = r"^data:video/(mp4|webm);base64,[A-Za-z0-9+/]*={0,2}$"
_VIDEOS_SCHEMA = _media_list_schema(
    MAX_VIDEOS,
    {
        "anyOf": [
            {
                "type": "string",
                "pattern": VIDEO_DATA_URI_PATTERN,
                "maxLength": 4 * -(-MAX_VIDEO_BYTES // 3) + len("data:video/webm;base64,"),
                "description": "data:video/mp4|webm;base64,... (16 MiB, 1,200 frames of 1920x1088 at most)",
            },
            {
                "type": "array",
                "minItems": 2,
                "maxItems": MAX_VIDEO_FRAMES,
                "items": _IMAGE_SCHEMA,
                "description": "the frames, as image data URIs of one size (16 MiB and 32 MP together)",
            },
        ]
    },
    "Up to 4 videos (16 MiB together), each a video data URI or an array of frames; sampled at the release's rate "
    "(2 frames per second; an array is a clip at 24 fps). Each must decode (422 video_undecodable otherwise).",
)
_videos_count = _count_check(
    False,
    "'videos' must be an array of videos (data URIs, or arrays of frames)",
    "a request takes",
    "videos",
    0,
    MAX_VIDEOS,
    too_many="too_many_videos",
)
Videos = _media_list(decode_video, _videos_count, "videos", MAX_TOTAL_VIDEO_BYTES, "16 MiB", _VIDEOS_SCHEMA)


# --------------------------------------------------------------------------------------------
# Models.


class _Question(BaseModel):
    """Fields shared by every question. Unknown fields are refused: a typo must not vanish."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    instructions: Instructions | None = Field(
        default=None, description='What to decide. Missing, null or "": the question id is used instead.'
    )


class NoulCriteria(BaseModel):
    """Descriptions of the yes and no outcomes; a key left out keeps the default description."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    true: Description | None = Field(default=None, description="What counts as yes; null: undescribed.")
    false: Description | None = Field(default=None, description="What counts as no; null: undescribed.")


def _noul_criteria(value: Any) -> Any:
    if value is not None and not isinstance(value, Mapping):
        raise PydanticCustomError(
            "dict_type", f"noul criteria must be an object with the keys 'true' and/or 'false'; got {_kind(value)}"
        )
    return value


class NoulQuestion(_Question):
    """A yes/no question: the answer is P(true)."""

    type: Literal["noul"]
    criteria: Annotated[NoulCriteria | None, BeforeValidator(_noul_criteria)] = Field(
        default=None, description="Optional descriptions of the outcomes; null or {}: the defaults."
    )


class ChoiceQuestion(_Question):
    """One label out of 2 to 255; the labels keep the request's order in the answer."""

    type: Literal["choice"]
    criteria: _counted(
        dict[OptionLabel, Description | None],
        "choice criteria must be an object mapping each option label to its description",
        "a choice question needs",
        "options",
        MIN_CHOICE_OPTIONS,
        MAX_CHOICE_OPTIONS,
    )


class ScoreQuestion(_Question):
    """An ordered rubric of 2 to 10 levels, lowest first; level k is option "k"."""

    type: Literal["score"]
    criteria: _counted(
        list[Level],
        "score criteria must be an array of level descriptions, lowest first",
        "a score question needs",
        "levels",
        MIN_SCORE_LEVELS,
        MAX_SCORE_LEVELS,
    )


Question = Annotated[NoulQuestion | ChoiceQuestion | ScoreQuestion, Field(discriminator="type")]


class SystemOneRequest(BaseModel):
    """The body of `POST /v1/systemone`. Build it with `parse_request` for clean errors."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    model: Annotated[str, AfterValidator(_check_text)] | None = Field(
        default=None, description="Any model name; echoed in the response."
    )
    state: State = Field(description="The content every question is about.")
    questions: _counted(
        dict[QuestionId, Question],
        "'questions' must be an object mapping question ids to questions",
        "a request needs",
        "questions",
        MIN_QUESTIONS,
        MAX_QUESTIONS,
        too_many="too_many_questions",  # its own type: clients split into requests of 64
    ) = Field(description="Questions keyed by caller-chosen ids; answers come back in this order.")
    images: Images = None
    videos: Videos = None
    assets: _media_validator("assets", "images_unsupported", "image assets") = None
    adapter: Annotated[str, AfterValidator(_check_text)] | None = Field(
        default=None,
        description=(
            "clef-flash's own field (not System One's): the fine-tune that answers, by the name of a clef-finetune "
            "adapter loaded beside the base (`clef-flash serve --adapter NAME=DIR`; GET /health lists them). Left out: "
            "the default model (the base, unless an adapter was loaded as the default)."
        ),
    )

    def to_record(self) -> dict[str, Any]:
        """The normalized record the encoder renders, as the reference `encode_record` reads it.

        `{"state", "questions": {id: {"type", "instructions", "criteria"}}}` in request order,
        plain dicts and lists. Missing `instructions` are None. Noul `criteria` is None when not
        sent, else a dict of only the keys sent (a key's None means "undescribed"). Values are
        shared with the request, not copied: treat the record as read-only.
        """
        questions: dict[str, dict[str, Any]] = {}
        for question_id, question in self.questions.items():
            criteria: Any = question.criteria
            if isinstance(criteria, NoulCriteria):
                criteria = {
                    key: getattr(criteria, key) for key in ("true", "false") if key in criteria.model_fields_set
                }
            questions[question_id] = {
                "type": question.type,
                "instructions": question.instructions,
                "criteria": criteria,
            }
        record: dict[str, Any] = {"state": self.state, "questions": questions}
        if self.images:
            record["images"] = self.images
        if self.videos:
            record["videos"] = self.videos
        return record


def served_request(names: Sequence[str], adapters: Sequence[str] = ()) -> type[SystemOneRequest]:
    """`SystemOneRequest` for a server that serves the model under `names` (the first is its own):
    `model` must be one of them, `""` or left out, else `model_not_served`; its schema's `enum` says so.
    `adapters`: the adapters loaded; `adapter` must be one of them or left out, else `adapter_not_loaded`."""
    accepted = (*names, "")
    message = f"this server serves {names[0]!r}; 'model' must be one of {', '.join(map(repr, names))} or left out"

    def check(name: str) -> str:
        if name not in accepted:
            raise PydanticCustomError("model_not_served", message, {"served": list(names)})
        return name

    served_name = Annotated[str, AfterValidator(check), WithJsonSchema({"type": "string", "enum": list(accepted)})]
    return create_model(
        "SystemOneRequest",
        __base__=SystemOneRequest,
        __doc__=SystemOneRequest.__doc__,
        model=(served_name | None, Field(default=None, description="The served model, or none; echoed in the response.")),
        adapter=_served_adapter(adapters),
    )


def _served_adapter(adapters: Sequence[str]) -> tuple[Any, Any]:
    """The `adapter` field of a server that loaded `adapters`: an enum of their names (none: the field must be left out)."""
    loaded = list(adapters)
    listed = ", ".join(map(repr, loaded)) if loaded else "none"

    def check(name: str) -> str:
        if name not in loaded:
            raise PydanticCustomError(
                "adapter_not_loaded",
                f"adapter {name!r} is not loaded here; loaded: {listed} (leave 'adapter' out for the default model)",
                {"loaded": loaded},
            )
        return name

    schema = {"type": "string", "enum": loaded} if loaded else {"type": "string", "enum": [], "description": "no adapter is loaded"}
    loaded_name = Annotated[str, AfterValidator(check), WithJsonSchema(schema)]
    field = SystemOneRequest.model_fields["adapter"]
    return (loaded_name | None, Field(default=None, description=field.description))


class NoulAnswer(BaseModel):
    type: Literal["noul"]
    noul: float = Field(description="P(true), from 0 to 1.")


class ChoiceAnswer(BaseModel):
    type: Literal["choice"]
    choice: str = Field(description="The most probable label; ties go to the first in criteria order.")
    confidence: float = Field(description="The probability of `choice`.")
    probabilities: dict[str, float] = Field(description="Every label's probability, in criteria order.")


class ScoreAnswer(BaseModel):
    type: Literal["score"]
    score: float = Field(description="The expected level, sum of k * p_k.")
    confidence: float = Field(description="The largest level probability.")
    legend: dict[str, Any] = Field(description='The criteria keyed by level, "0".."n-1".')
    probabilities: dict[str, float] = Field(description='Level probabilities keyed "0".."n-1".')


Answer = Annotated[NoulAnswer | ChoiceAnswer | ScoreAnswer, Field(discriminator="type")]


class Usage(BaseModel):
    input_tokens: int
    output_tokens: int = 0


class CalibrationNote(BaseModel):
    """clef-flash's own field: the answers went through fitted temperatures (calibration.py)."""

    sha256: str = Field(description="The first 16 hex digits of the calibration file's sha256.")
    temperatures: dict[str, float] = Field(
        description="Each question's temperature T: its probabilities are softmax(logits / T); 1: the model's own. "
        "A temperature never changes a decision, only its probabilities."
    )


class SystemOneResponse(BaseModel):
    """The response body (SPEC §6); `shape_response` builds it as a plain dict."""

    model: str
    answers: dict[str, Answer]
    usage: Usage
    calibration: CalibrationNote | None = Field(
        default=None, description="Present only when the server loaded a calibration (--calibration): the answers are calibrated."
    )


# --------------------------------------------------------------------------------------------
# Parsing and error translation.


def parse_request(body: Any, request_type: type[SystemOneRequest] = SystemOneRequest) -> SystemOneRequest:
    """Validate a decoded JSON body (any Python value) into a `SystemOneRequest` (or the
    `request_type` a server validates with: `served_request`).

    Raises `RequestInvalid` with one FastAPI-style item per problem; never anything else.
    """
    if isinstance(body, request_type):
        return body
    try:
        return request_type.model_validate(body)
    except ValidationError as error:
        raise RequestInvalid([_translate(item) for item in error.errors(include_url=False)]) from None


def parse_request_json(raw: bytes | str, request_type: type[SystemOneRequest] = SystemOneRequest) -> SystemOneRequest:
    """Decode (`decode_body`) and validate a raw body (as `request_type`: a server's names its served models)."""
    return parse_request(decode_body(raw), request_type)


def decode_body(raw: bytes | str) -> Any:
    """A raw body's JSON value. An undecodable one gives FastAPI's `json_invalid` item
    (`loc` `["body", position]`); an empty one `missing` at `["body"]`, as FastAPI reports it.

    Stricter than `json.loads` in one way: NaN and Infinity are refused (they are not JSON, and
    the response could not carry them back in an error).
    """
    if not (raw.strip() if isinstance(raw, str) else bytes(raw).strip()):
        raise RequestInvalid(
            [
                {
                    "type": "missing",
                    "loc": ["body"],
                    "msg": "the request body is empty; send a JSON object with 'state' and 'questions'",
                    "input": None,
                }
            ]
        )
    try:
        body = json.loads(raw, parse_constant=_refuse_constant)
    except json.JSONDecodeError as error:
        message = f"the body is not valid JSON: {error.msg} (line {error.lineno}, column {error.colno})"
        raise RequestInvalid([_json_invalid(error.pos, message, error.msg)]) from None
    except UnicodeDecodeError as error:
        raise RequestInvalid([_json_invalid(error.start, "the body is not valid UTF-8 text", error.reason)]) from None
    except RecursionError:
        raise RequestInvalid(
            [_json_invalid(0, "the body is nested too deeply to decode", "nested too deeply")]
        ) from None
    except _ConstantRefused as error:
        message = f"the body is not valid JSON: {error.args[0]} is not a JSON number"
        raise RequestInvalid([_json_invalid(0, message, f"{error.args[0]} is not JSON")]) from None
    except ValueError:  # an integer past Python's digit limit (sys.get_int_max_str_digits)
        raise RequestInvalid([_integer_too_long(raw)]) from None
    return body


class _LongInteger(str):
    """An integer literal whose digits `int()` refuses: kept as text while looking for where it is."""


def _int_or_long(text: str) -> int | _LongInteger:
    try:
        return int(text)
    except ValueError:
        return _LongInteger(text)


def _integer_too_long(raw: bytes | str) -> dict[str, Any]:
    """The 422 item for the first over-long integer, located in the body (not an offset).

    Only on the error path: the body is decoded again, keeping such integers as text, and walked
    without recursion (a body may be nested as deep as the decoder allows).
    """
    try:
        body = json.loads(raw, parse_int=_int_or_long, parse_constant=_refuse_constant)
    except json.JSONDecodeError as error:  # malformed further on: report that instead
        return _json_invalid(error.pos, f"the body is not valid JSON: {error.msg}", error.msg)
    limit = sys.get_int_max_str_digits()  # Python 3.10.7+; the ValueError comes from it
    stack: list[tuple[list[str | int], Any]] = [(["body"], body)]
    while stack:
        loc, value = stack.pop()
        if isinstance(value, _LongInteger):
            digits = len(value.lstrip("-"))
            return {
                "type": "integer_too_long",
                "loc": loc,
                "msg": f"this integer has {digits} digits; at most {limit} are accepted (send it as a string)",
                "input": value[:20] + "...",
                "ctx": {"digits": digits, "limit": limit},
            }
        children = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
        stack.extend((loc + [key], child) for key, child in reversed(list(children)))
    return _json_invalid(0, "the body is not valid JSON", "invalid")  # not reached: json.loads found one


class _ConstantRefused(Exception):
    pass


def _refuse_constant(name: str) -> Any:
    raise _ConstantRefused(name)


def _json_invalid(position: int, message: str, error: str) -> dict[str, Any]:
    return {"type": "json_invalid", "loc": ["body", position], "msg": message, "input": {}, "ctx": {"error": error}}


def _clean_loc(raw: Sequence[str | int]) -> list[str | int]:
    """Pydantic's location without its schema artifacts, as a path into the caller's body.

    Known shapes: `("questions", id, "[key]")` for an id, `("questions", id, TAG, field, ...)`
    inside a question (TAG: the discriminator's value), and `(..., "criteria", label, "[key]")`
    for a choice label. Positional, because a question id or label may itself be "choice".
    """
    loc = list(raw)
    if len(loc) >= 3 and loc[0] == "questions":
        del loc[2]  # "[key]" of an id error, or the union tag
        if len(loc) == 5 and loc[2] == "criteria" and loc[4] == "[key]":
            del loc[4]
    return loc


def _translate(error: Mapping[str, Any]) -> dict[str, Any]:
    """One pydantic error as a FastAPI item with our location, type and message."""
    raw_loc = error["loc"]
    loc = _clean_loc(raw_loc)
    error_type: str = error["type"]
    message: str = error["msg"]
    ctx: dict[str, Any] | None = error.get("ctx")
    value = error.get("input")
    in_question = len(loc) >= 2 and loc[0] == "questions"
    question_type = raw_loc[2] if in_question and len(raw_loc) >= 3 and raw_loc[2] in QUESTION_TYPES else None

    if error_type in ("model_type", "model_attributes_type"):
        error_type, ctx = "dict_type", None  # "expected an object", whatever pydantic calls it
        if not loc:
            message = f"the request body must be a JSON object with 'state' and 'questions'; got {_kind(value)}"
        elif in_question and len(loc) == 2:
            message = f"a question must be an object with a 'type' ({_ALLOWED_TYPES}); got {_kind(value)}"
    elif error_type == "missing":
        message = _missing_message(loc, question_type)
    elif error_type == "union_tag_not_found":
        error_type, loc, ctx = "missing", [*loc, "type"], None
        message = f"a question needs a 'type': {_ALLOWED_TYPES}"
    elif error_type == "union_tag_invalid":
        tag = value.get("type") if isinstance(value, Mapping) else None
        error_type, loc, value = "literal_error", [*loc, "type"], tag
        ctx = {"expected": _ALLOWED_TYPES}
        got = f"'{_short(tag)}'" if isinstance(tag, str) else _kind(tag)
        message = f"unknown question type {got}; the allowed types are {_ALLOWED_TYPES}"
        if tag == "box":
            message += " (box questions need an image, and this runtime is text-only)"
    elif error_type == "extra_forbidden":
        if in_question and len(loc) == 4 and loc[2] == "criteria":
            message = f"noul criteria may only have the keys 'true' and 'false'; got '{_short(loc[3])}'"
        elif in_question and len(loc) == 3:
            message = (
                f"unknown field '{_short(loc[2])}' in a {question_type} question; "
                "a question has only 'type', 'instructions' and 'criteria'"
            )
    elif error_type == "model_not_served":
        message = f"{message}; got {value[:100]!r}"
    elif error_type == "string_unicode":
        message = "text must be valid Unicode; found a lone surrogate"
    elif error_type == "string_type":
        if loc == ["model"]:
            message = f"'model' must be a string (or left out); got {_kind(value)}"
        elif raw_loc[-1:] == ("[key]",):
            message = f"ids and labels must be strings; got {_kind(value)}"

    if loc[:1] in (["images"], ["videos"]):  # never echo an image or a video
        if len(loc) == 1 and isinstance(value, (list, tuple)):
            value = f"<{len(value)} {loc[0]}>"
        elif isinstance(value, (list, tuple)):
            value = f"<{len(value)} frames>"
        elif value is not None:
            value = _short(value) if isinstance(value, str) else f"<{type(value).__name__}>"
    safe_loc = [_short(part, limit=10**6) if isinstance(part, str) else part for part in loc]
    item: dict[str, Any] = {"type": error_type, "loc": ["body", *safe_loc], "msg": message, "input": _jsonable(value)}
    if ctx:
        item["ctx"] = {key: _jsonable(entry) for key, entry in ctx.items()}
    return item


def _missing_message(loc: list[str | int], question_type: str | None) -> str:
    if loc == ["state"]:
        return "the request needs a 'state': the content the questions are about"
    if loc == ["questions"]:
        return "the request needs 'questions': an object mapping question ids to questions"
    if loc[-1:] == ["criteria"] and question_type == "choice":
        return (
            f"a choice question needs 'criteria': an object mapping each option label to its description "
            f"({MIN_CHOICE_OPTIONS} to {MAX_CHOICE_OPTIONS} options)"
        )
    if loc[-1:] == ["criteria"] and question_type == "score":
        return (
            f"a score question needs 'criteria': an array of {MIN_SCORE_LEVELS} to {MAX_SCORE_LEVELS} "
            "level descriptions, lowest first"
        )
    return f"'{loc[-1]}' is required" if loc else "a value is required"


def _jsonable(value: Any) -> Any:
    """``value`` when it is JSON data, else its repr: error bodies must always serialise
    (Starlette's JSONResponse refuses NaN and cannot encode lone surrogates)."""
    return value if _json_problem(value) is None else repr(value)


def _short(text: Any, limit: int = 60) -> str:
    """Caller text quoted in a message: encodable, and cut so that a message stays a line."""
    text = str(text).encode("utf-8", "backslashreplace").decode("utf-8")
    return text if len(text) <= limit else text[: limit - 3] + "..."
