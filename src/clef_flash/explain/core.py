"""Explain a request: prepare (every check, no inference), then run one method; and the deletion curve that
measures how faithful an explanation's ranking of the parts is.

Deletion curve: the chosen option's probability as the parts are left out one more at a time, in a given order.
An explanation that ranks the parts well (most supporting first) makes it fall faster than a random order does: a
smaller area under the curve (`deletion_area`, the curve's mean over the fraction of parts left out).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

from .gradients import check_gradients, check_passes, run_gradients
from .job import ExplainJob, prepare_job
from .leave_out import run_leave_out
from .parts import state_parts, without
from .request import GRADIENT_METHODS, ExplainOptions
from .result import Explanation


def prepare(model, request: Any, options: ExplainOptions) -> ExplainJob:
    """Validate and render (`model`: a Clef); RequestInvalid for any bad input, before inference."""
    if options.method not in GRADIENT_METHODS:
        return prepare_job(model, request, options)
    job = prepare_job(model, request, options, check_method=check_gradients)
    check_passes(job)
    return job


def run(model, job: ExplainJob) -> Explanation:
    """Score a prepared explanation by its method."""
    return run_gradients(model, job) if job.options.method in GRADIENT_METHODS else run_leave_out(model, job)


def ranking(explanation: Explanation, question_id: str, option_id: str | None = None) -> list[int]:
    """The parts, most supporting first, by their contribution to `option_id` (default: the question's decision)."""
    question = explanation.question(question_id)
    contributions = question.option(option_id or question.decision).contributions
    return sorted(range(len(contributions)), key=lambda index: (-contributions[index], index))


def deletion_curve(model, request: Any, order: Sequence[int], *, question_id: str, option_id: str, depth: int = 1) -> list[float]:
    """p(option_id) of `question_id` with no part left out, then with the first 1, 2, ... parts of `order` (indices
    into `state_parts(request, depth)`) left out, each request answered as any other (`model`: a Clef)."""
    parsed = model.parse(request)
    parts = state_parts(parsed, depth)
    records = [model.prepare(without(parsed, parts, order[:count])).record for count in range(len(order) + 1)]
    curve = []
    for results in model.score(records):
        result = next(result for result in results if result.question_id == question_id)
        curve.append(result.probabilities[result.option_ids.index(option_id)])
    return curve


def deletion_area(curve: Sequence[float]) -> float:
    """The area under a deletion curve over [0, 1] (fraction of the parts left out), trapezoids."""
    if len(curve) < 2:
        return float(curve[0]) if curve else 0.0
    return sum((a + b) / 2 for a, b in zip(curve, curve[1:])) / (len(curve) - 1)


def faithfulness(model, request: Any, *, shuffles: int = 3, seed: int = 7, **options: Any) -> tuple[float, float]:
    """(the deletion-curve area of the request's first question's decision with the parts left out in the order of
    their contribution, the mean area over `shuffles` random orders): an explanation that ranks well makes the first
    smaller. `options`: `Clef.explain`'s (method, depth, steps, ...); only the first question is explained."""
    question_id = next(iter(model.parse(request).questions))
    explanation = model.explain(request, question_ids=[question_id], **options)
    decision = explanation.question(question_id).decision
    order = ranking(explanation, question_id)
    depth = options.get("depth", 1)

    def area(parts: Sequence[int]) -> float:
        return deletion_area(deletion_curve(model, request, parts, question_id=question_id, option_id=decision, depth=depth))

    rng = random.Random(seed)
    return area(order), sum(area(rng.sample(order, len(order))) for _ in range(shuffles)) / shuffles
