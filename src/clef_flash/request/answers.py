"""Answers (SPEC §6): System One answer bodies from option probabilities.

The choice is the argmax in criteria order (ties to the first), score is the expected level, and
every value is rounded to `decimals` (4 on the wire) only here, at the very end.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from .protocol import DEFAULT_MODEL_NAME, SystemOneRequest

def option_order(question: Mapping[str, Any]) -> list[str]:
    """A question's option ids in the order the answer lists them (the request's, not sorted)."""
    question_type = question["type"]
    if question_type == "noul":
        return ["true", "false"]
    if question_type == "choice":
        return [str(label) for label in question["criteria"]]
    if question_type == "score":
        return [str(level) for level in range(len(question["criteria"]))]
    raise ValueError(f"unknown question type {question_type!r}")


def shape_answer(
    question: Mapping[str, Any],
    option_ids: Sequence[str],
    probabilities: Sequence[float],
    decimals: int | None = 4,
) -> dict[str, Any]:
    """One System One answer from a question (`type` + `criteria`) and its option probabilities.

    ``option_ids`` may come in any order (the encoder sorts choice labels); the answer lists options
    in the request's criteria order. The choice is the argmax of the unrounded probabilities, ties
    to the first in criteria order; score is sum k * p_k, summed in level order as the reference
    does so that rounding agrees to the last digit. ``decimals=None`` leaves values unrounded.
    """
    if len(option_ids) != len(probabilities):
        raise ValueError(f"{len(option_ids)} option ids but {len(probabilities)} probabilities")
    by_option = {str(option): float(p) for option, p in zip(option_ids, probabilities, strict=True)}
    order = option_order(question)
    if len(by_option) != len(option_ids) or set(by_option) != set(order):
        raise ValueError(f"option ids {sorted(by_option)} do not match the question's options {sorted(order)}")

    def rounded(x: float) -> float:
        return x if decimals is None else round(x, decimals)

    question_type = question["type"]
    if question_type == "noul":
        return {"type": "noul", "noul": rounded(by_option["true"])}
    if question_type == "choice":
        choice = order[0]
        for option in order[1:]:
            if by_option[option] > by_option[choice]:  # strict: a tie keeps the earlier option
                choice = option
        return {
            "type": "choice",
            "choice": choice,
            "confidence": rounded(by_option[choice]),
            "probabilities": {option: rounded(by_option[option]) for option in order},
        }
    expected = 0.0
    for level, option in enumerate(order):
        expected += level * by_option[option]
    return {
        "type": "score",
        "score": rounded(expected),
        "confidence": rounded(max(by_option.values())),
        "legend": dict(zip(order, question["criteria"], strict=True)),
        "probabilities": {option: rounded(by_option[option]) for option in order},
    }


def shape_response(
    request: SystemOneRequest,
    per_question: Sequence[tuple[Sequence[str], Sequence[float]]],
    input_tokens: int,
    decimals: int | None = 4,
    *,
    default_model: str = DEFAULT_MODEL_NAME,
) -> dict[str, Any]:
    """The response body: one answer per question in request order, plus usage.

    ``per_question[i]`` is ``(option_ids, probabilities)`` of the i-th question in request order.
    A request without a model name (absent, null or "") is answered as ``default_model``.
    """
    if len(per_question) != len(request.questions):
        raise ValueError(f"{len(per_question)} results for {len(request.questions)} questions")
    record = request.to_record()["questions"]
    answers = {
        question_id: shape_answer(question, option_ids, probabilities, decimals)
        for (question_id, question), (option_ids, probabilities) in zip(record.items(), per_question, strict=True)
    }
    return {
        "model": request.model or default_model,
        "answers": answers,
        "usage": {"input_tokens": int(input_tokens), "output_tokens": 0},
    }
