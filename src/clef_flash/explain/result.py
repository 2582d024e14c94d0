"""What an explanation returns: plain data (dataclasses), with `to_dict()` for JSON.

    Explanation
      parts       each part of the state: kind, label, path, excerpt, token span in the full record
      questions   per question (request order): its decision and, per option (criteria order), the full
                  request's probability and one contribution per part
      tokens      gradients only: the attributed tokens (position, text, part), aligned with each option's
                  token scores
      cost        records, tokens run against whole records, decoder steps, milliseconds
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .parts import Part


@dataclass(frozen=True)
class ExplainedPart:
    index: int
    part: Part
    token_span: tuple[int, int]  # [start, end) of the tokens it owns in the full record's input_ids

    def to_dict(self) -> dict[str, Any]:
        return {"index": self.index, **self.part.describe(), "token_span": list(self.token_span)}


@dataclass(frozen=True)
class ExplainedOption:
    option_id: str
    probability: float  # the full request's (unrounded)
    # leave-out: p(full) - p(with part i left out); gradients: the attributions of part i's tokens, summed
    contributions: tuple[float, ...]
    without: tuple[float, ...] | None = None  # leave-out: p with part i left out
    token_scores: tuple[float, ...] | None = None  # gradients: per token of `Explanation.tokens`
    convergence_delta: float | None = None  # integrated gradients: sum of attributions - (p(input) - p(baseline))

    def to_dict(self) -> dict[str, Any]:
        body: dict[str, Any] = {"probability": self.probability, "contributions": list(self.contributions)}
        if self.without is not None:
            body["without"] = list(self.without)
        if self.token_scores is not None:
            body["token_scores"] = list(self.token_scores)
        if self.convergence_delta is not None:
            body["convergence_delta"] = self.convergence_delta
        return body


@dataclass(frozen=True)
class ExplainedQuestion:
    question_id: str
    question_type: str  # noul, choice, score
    decision: str  # the option with the highest probability (ties: the first in criteria order)
    options: tuple[ExplainedOption, ...]  # criteria order (noul: true, false)

    def option(self, option_id: str) -> ExplainedOption:
        return next(option for option in self.options if option.option_id == option_id)

    def to_dict(self) -> dict[str, Any]:
        return {
            "type": self.question_type,
            "decision": self.decision,
            "options": {option.option_id: option.to_dict() for option in self.options},
        }


@dataclass(frozen=True)
class ExplainedToken:
    position: int  # in the full record's input_ids
    text: str
    part: int | None  # the part that owns it (None: between parts, e.g. a JSON brace)

    def to_dict(self) -> dict[str, Any]:
        return {"position": self.position, "text": self.text, "part": self.part}


@dataclass(frozen=True)
class Cost:
    """What the explanation ran, against running every record it scored whole."""

    records: int  # records scored: the full request and one per part (leave-out), or the one record (gradients)
    tokens_whole: int  # decoder tokens of those records run whole, one by one
    tokens_run: int  # decoder tokens actually run (leave-out: the shared prefixes once; gradients: every pass)
    passes: int  # leave-out: decoder steps; gradients: forward + backward passes
    milliseconds: float

    def to_dict(self) -> dict[str, Any]:
        return {
            "records": self.records,
            "tokens_whole": self.tokens_whole,
            "tokens_run": self.tokens_run,
            "passes": self.passes,
            "milliseconds": round(self.milliseconds, 3),
        }


@dataclass(frozen=True)
class Explanation:
    method: str
    model: str
    parts: tuple[ExplainedPart, ...]
    questions: tuple[ExplainedQuestion, ...]
    input_tokens: int
    cost: Cost
    tokens: tuple[ExplainedToken, ...] | None = None

    def question(self, question_id: str) -> ExplainedQuestion:
        return next(question for question in self.questions if question.question_id == question_id)

    def to_dict(self) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": self.model,
            "method": self.method,
            "parts": [part.to_dict() for part in self.parts],
            "questions": {question.question_id: question.to_dict() for question in self.questions},
        }
        if self.tokens is not None:
            body["tokens"] = [token.to_dict() for token in self.tokens]
        body["cost"] = self.cost.to_dict()
        body["usage"] = {"input_tokens": self.input_tokens, "output_tokens": 0}
        return body
