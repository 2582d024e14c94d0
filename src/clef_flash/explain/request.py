"""How a request is explained: the options `Clef.explain` takes as keywords and `POST /v1/explain` (and the MCP
tool `explain`) as fields beside a System One body, validated once, here, with the protocol's errors.

    method        "leave-out" (default): each part's contribution is the change in every option's probability
                  when the part is left out; "integrated-gradients" or "input-x-gradient": token-level
                  attributions over the input embeddings (Captum), summed per part
    depth         how deep a JSON state splits into parts (1: its top-level fields)
    max_parts     the most parts explained (each one costs a partial record); past it, a clear refusal
    steps         integrated gradients' steps along the path from the baseline
    question_ids  the questions to report (all are still asked: the model decides them jointly)
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, create_model

from ..request.protocol import MAX_QUESTIONS, QuestionId, SystemOneRequest, parse_request

LEAVE_OUT = "leave-out"
INTEGRATED_GRADIENTS = "integrated-gradients"
INPUT_X_GRADIENT = "input-x-gradient"
METHODS = (LEAVE_OUT, INTEGRATED_GRADIENTS, INPUT_X_GRADIENT)
GRADIENT_METHODS = (INTEGRATED_GRADIENTS, INPUT_X_GRADIENT)
DEFAULT_MAX_PARTS = 64
MOST_PARTS = 256  # what max_parts may be raised to: past it, explain a part of the state (or a smaller depth)
MOST_DEPTH = 16
DEFAULT_STEPS = 16
MOST_STEPS = 256


class ExplainOptions(BaseModel):
    """The fields an explanation adds to a System One request (each optional)."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    method: Literal["leave-out", "integrated-gradients", "input-x-gradient"] = Field(
        LEAVE_OUT,
        description="leave-out: each part's contribution is p(option) minus p(option) with the part left out; "
        "integrated-gradients / input-x-gradient: token-level attributions over the input embeddings (Captum), "
        "summed per part (models loaded in fp32 or bf16 only)",
    )
    depth: Annotated[StrictInt, Field(ge=1, le=MOST_DEPTH)] = Field(
        1, description="How deep a JSON state splits into parts: 1 its top-level fields, 2 their fields, ..."
    )
    max_parts: Annotated[StrictInt, Field(ge=2, le=MOST_PARTS)] = Field(
        DEFAULT_MAX_PARTS, description="The most parts to explain; a state with more is refused (422 too_many_parts)"
    )
    steps: Annotated[StrictInt, Field(ge=1, le=MOST_STEPS)] = Field(
        DEFAULT_STEPS, description="integrated-gradients: steps along the path from the baseline (the state's embeddings at 0)"
    )
    question_ids: Annotated[list[QuestionId], Field(min_length=1, max_length=MAX_QUESTIONS)] | None = Field(
        None, description="The questions to explain (default: all); every question is still asked, the model decides them jointly"
    )


def explain_options(**options: Any) -> ExplainOptions:
    """`Clef.explain`'s keywords, validated as the server validates the fields (RequestInvalid, at ["body", name])."""
    given = {name: value for name, value in options.items() if value is not None}
    return parse_request(given, ExplainOptions)  # type: ignore[arg-type,return-value]


def options_of(request: SystemOneRequest) -> ExplainOptions:
    """The explain fields of a body parsed with `explain_request(...)`."""
    return ExplainOptions(**{name: getattr(request, name) for name in ExplainOptions.model_fields})


def explain_request(request_type: type[SystemOneRequest] = SystemOneRequest) -> type[SystemOneRequest]:
    """The body of `POST /v1/explain`: `request_type` (a server's: its served model names and adapters) and the
    explain fields."""
    fields = {name: (field.annotation, field) for name, field in ExplainOptions.model_fields.items()}
    return create_model("ExplainRequest", __base__=request_type, __doc__="A System One request and how to explain it.", **fields)
