"""A request ready to explain: validated, split into parts, each part's variant rendered, every check done.

Nothing here runs the model: a request `prepare_job` accepts is explained whole, and a refused one (an unknown
question id, an empty state, a state of one part, more parts than `max_parts`, a method this model cannot run)
costs no inference and returns nothing half-computed.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ..engine import QuestionResult
from ..errors import RequestInvalid
from ..request.answers import option_order
from ..request.protocol import SystemOneRequest
from ..request.records import EncodedRecord, media_spans
from ..request.tokenizer import Tokenizer
from .parts import Part, state_parts, without
from .request import MOST_PARTS, ExplainOptions
from .result import ExplainedOption, ExplainedPart, ExplainedQuestion

MEDIA_KINDS = ("image", "video")


@dataclass(frozen=True)
class ExplainJob:
    options: ExplainOptions
    model_name: str  # the response's "model": the request's, else the served name
    prepared: Any  # the full request, validated and encoded (clef.Prepared)
    parts: tuple[Part, ...]
    variants: tuple[Any, ...]  # per part: the request with it left out, prepared (clef.Prepared)
    shared: tuple[int, ...]  # per part: the tokens its variant shares with the full record, media included
    spans: tuple[tuple[int, int], ...]  # per part: the tokens it owns in the full record, [start, end)
    question_ids: tuple[str, ...]  # the questions to report, in request order

    @property
    def tokens(self) -> int:
        """The tokens of every record it scores, whole (what a server counts it as against a batch's budget)."""
        return self.prepared.record.token_count + sum(variant.record.token_count for variant in self.variants)

    def explained_parts(self) -> tuple[ExplainedPart, ...]:
        return tuple(ExplainedPart(index, part, span) for index, (part, span) in enumerate(zip(self.parts, self.spans)))

    def owner(self, position: int) -> int | None:
        """The part that owns the token at `position` of the full record (None: none does)."""
        return next((index for index, (start, end) in enumerate(self.spans) if start <= position < end), None)


def prepare_job(model, request: Any, options: ExplainOptions, *, check_method: Callable[[Any], None] | None = None) -> ExplainJob:
    """Validate and render everything an explanation of `request` needs (`model`: a Clef; `check_method`: refuses a
    method the model cannot run, before any work). Raises RequestInvalid for every bad input."""
    parsed: SystemOneRequest = model.parse(request)
    if check_method is not None:
        check_method(model)
    prepared = model.prepare(parsed)  # RequestInvalid / RecordTooLong for the request itself, as /v1/systemone
    question_ids = _reported_questions(parsed, options.question_ids)
    parts = state_parts(parsed, options.depth)
    _check_parts(parsed, parts, options)
    variants = tuple(model.prepare(without(parsed, parts, [index])) for index in range(len(parts)))
    shared, spans = token_layout(model.tokenizer, prepared.record, [variant.record for variant in variants], parts)
    return ExplainJob(
        options=options,
        model_name=parsed.model or model.model_name,
        prepared=prepared,
        parts=tuple(parts),
        variants=variants,
        shared=tuple(shared),
        spans=tuple(spans),
        question_ids=question_ids,
    )


def token_layout(
    tokenizer: Tokenizer, full: EncodedRecord, variants: Sequence[EncodedRecord], parts: Sequence[Part]
) -> tuple[list[int], list[tuple[int, int]]]:
    """Per part: the tokens its variant shares with the full record (what the engine may reuse), and the tokens it
    owns there. A text or JSON part owns the tokens from where its variant first differs up to where the next part's
    does (a boundary token such as `,"` before a field goes to the part it begins), at most to where its variant
    agrees again; an image or video owns its own tokens, and its variant shares at most the tokens before them
    (same-size images have the same pad tokens: only their pixels differ)."""
    ids = full.input_ids
    items = media_spans(tokenizer, full)
    video_offset = full.media.image_count if full.media is not None else 0
    shared, starts, ends = [], [], []
    for part, variant in zip(parts, variants):
        prefix = _common_prefix(ids, variant.input_ids)
        if part.kind in MEDIA_KINDS:
            start, end = items[part.path[1] + (video_offset if part.kind == "video" else 0)]
            shared.append(min(prefix, start))
        else:
            suffix = min(_common_prefix(ids[::-1], variant.input_ids[::-1]), len(variant.input_ids) - prefix)
            start, end = prefix, max(prefix, len(ids) - suffix)
            shared.append(prefix)
        starts.append(start)
        ends.append(end)
    in_state = [index for index, part in enumerate(parts) if part.kind not in MEDIA_KINDS]
    for this, following in zip(in_state, in_state[1:]):
        ends[this] = max(starts[this], min(ends[this], starts[following]))
    return shared, list(zip(starts, ends))


def explained_questions(
    job: ExplainJob, full: Sequence[QuestionResult], explain_option: Callable[[int, int], ExplainedOption]
) -> tuple[ExplainedQuestion, ...]:
    """The reported questions, request order, each option in criteria order: `explain_option(question index in the
    record, option index in the model's order)` says what each option gets."""
    asked = job.prepared.request.to_record()["questions"]
    explained = []
    for question_index, result in enumerate(full):
        if result.question_id not in job.question_ids:
            continue
        question = asked[result.question_id]
        options = tuple(explain_option(question_index, result.option_ids.index(option_id)) for option_id in option_order(question))
        decision = options[0]
        for option in options[1:]:
            if option.probability > decision.probability:  # ties keep the earlier option, as the answers do
                decision = option
        explained.append(ExplainedQuestion(result.question_id, question["type"], decision.option_id, options))
    return tuple(explained)


# -- the checks ----------------------------------------------------------------------------------------


def _reported_questions(request: SystemOneRequest, asked: Sequence[str] | None) -> tuple[str, ...]:
    if asked is None:
        return tuple(request.questions)
    known = ", ".join(repr(question_id) for question_id in request.questions)
    errors = [
        {
            "type": "question_unknown",
            "loc": ["body", "question_ids", index],
            "msg": f"no question {question_id!r} in this request; its questions: {known}",
            "input": question_id,
        }
        for index, question_id in enumerate(asked)
        if question_id not in request.questions
    ]
    if errors:
        raise RequestInvalid(errors)
    return tuple(question_id for question_id in request.questions if question_id in asked)


def _check_parts(request: SystemOneRequest, parts: Sequence[Part], options: ExplainOptions) -> None:
    def refuse(kind: str, message: str, **ctx: Any) -> RequestInvalid:
        return RequestInvalid([{"type": kind, "loc": ["body", "state"], "msg": message, **({"ctx": ctx} if ctx else {})}])

    if not parts:
        raise refuse(
            "state_empty",
            "the state is empty: an explanation leaves parts of it out, and there is none; send text, a JSON object or "
            "array with members, or images",
        )
    if len(parts) == 1:
        (part,) = parts
        deeper = _splits_deeper(request.state, part)
        hint = f"pass depth={options.depth + 1} to split it" if deeper else "send a state of several sentences, lines or fields"
        raise refuse(
            "state_one_part",
            f"the state is one part ({part.label}: {part.excerpt!r}): leaving out the only part leaves nothing to "
            f"compare it with; {hint}",
        )
    if len(parts) > options.max_parts:
        count = len(parts)
        if count <= MOST_PARTS:
            fix = f"pass max_parts={count} (--max-parts {count}; each part costs one more partial record)"
        else:
            fix = f"at most {MOST_PARTS} parts are explained at once: explain a part of the state"
        if options.depth > 1 and not isinstance(request.state, str):
            fix += f", or a smaller depth than {options.depth}"
        raise refuse(
            "too_many_parts", f"the state has {count} parts, over max_parts={options.max_parts}: {fix}", parts=count, max_parts=options.max_parts
        )


def _splits_deeper(state: Any, part: Part) -> bool:
    """Whether a larger depth would split this JSON part (a non-empty object or array)."""
    if part.kind not in ("field", "item"):
        return False
    value = state
    for key in part.path:
        value = value[key]
    return isinstance(value, (dict, list)) and bool(value)


def _common_prefix(first: Sequence[int], second: Sequence[int]) -> int:
    count = 0
    for a, b in zip(first, second):
        if a != b:
            break
        count += 1
    return count
