"""Explanations: why did the model decide that? `Clef.explain(request)` answers with each part of the state's
contribution to every option of every question.

    parts.py       the state as parts (fields, sentences and lines, images, videos); the request without some
    request.py     the options (method, depth, max_parts, steps, question_ids) and the explain body's model
    job.py         a request ready to explain: every check, the variants rendered, the parts' tokens
    leave_out.py   leave one part out, through the engine's branches (the shared prefix runs once)
    gradients.py   token-level attributions through Captum (integrated gradients, gradient x input)
    result.py      Explanation and its parts: plain data, `to_dict()`
    core.py        prepare, run, and the deletion curve that measures faithfulness
"""

from .core import deletion_area, deletion_curve, faithfulness, prepare, ranking, run
from .gradients import MOST_PASSES
from .job import ExplainJob
from .parts import Part, state_parts, without
from .request import DEFAULT_MAX_PARTS, DEFAULT_STEPS, METHODS, MOST_PARTS, ExplainOptions, explain_options, explain_request, options_of
from .result import Cost, ExplainedOption, ExplainedPart, ExplainedQuestion, ExplainedToken, Explanation

__all__ = [
    "DEFAULT_MAX_PARTS",
    "DEFAULT_STEPS",
    "METHODS",
    "MOST_PARTS",
    "MOST_PASSES",
    "Cost",
    "ExplainJob",
    "ExplainOptions",
    "ExplainedOption",
    "ExplainedPart",
    "ExplainedQuestion",
    "ExplainedToken",
    "Explanation",
    "Part",
    "deletion_area",
    "deletion_curve",
    "explain_options",
    "faithfulness",
    "explain_request",
    "options_of",
    "prepare",
    "ranking",
    "run",
    "state_parts",
    "without",
]
