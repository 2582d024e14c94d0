"""Leave one part out: every option's probability with each part of the state left out, through the engine's
branches (engine/core.py `score_branches`).

The request with part i left out renders as the full record up to where part i's tokens begin (their common token
prefix; for an image or video, at most up to that item's first token), so the decoder's state there is the full
record's. The full record's tokens run once, as a chain of kept states that stops at each part, and each variant
runs only from its part on. With N parts of a state of S tokens after a prompt prefix of P and before a schema of Q,
that is about P + S + N·Q + Σᵢ (the state after part i) tokens, against N·(P + S + Q) for N whole records; `Cost`
gives both, counted from the records.
"""

from __future__ import annotations

import time

import torch

from ..engine import Timings
from .job import ExplainJob, explained_questions
from .result import Cost, ExplainedOption, Explanation


def run_leave_out(model, job: ExplainJob) -> Explanation:
    """The full request's probabilities and each option's change when each part is left out (`model`: a Clef)."""
    timings = Timings()
    started = time.perf_counter()
    with torch.inference_mode():
        results = model.engine.score_branches(job.prepared.record, [variant.record for variant in job.variants], job.shared, timings)
    if model.calibration is not None:  # the probabilities the answers give: each record's adapter's temperatures
        records = [job.prepared.record, *(variant.record for variant in job.variants)]
        results = [model.calibration.apply(record.adapter, per_question) for record, per_question in zip(records, results, strict=True)]
    milliseconds = (time.perf_counter() - started) * 1000
    full, per_part = results[0], results[1:]

    def explain_option(question: int, option: int) -> ExplainedOption:
        probability = full[question].probabilities[option]
        without = tuple(variant[question].probabilities[option] for variant in per_part)
        return ExplainedOption(full[question].option_ids[option], probability, tuple(probability - p for p in without), without=without)

    return Explanation(
        method=job.options.method,
        model=job.model_name,
        parts=job.explained_parts(),
        questions=explained_questions(job, full, explain_option),
        input_tokens=job.prepared.record.token_count,
        cost=Cost(len(results), timings.tokens, timings.tokens - timings.tokens_reused, timings.forwards, milliseconds),
    )
