"""Labelled sets with known temperature distortions, for the calibration tests and benchmarks/calibration.py.

The labels of question q are drawn from the model's own logits at a true temperature: softmax(z / T_q). The model's
probabilities, softmax(z), are then miscalibrated by exactly that factor (T_q < 1: the model is underconfident), so a
fitted calibration should find T close to T_q and bring the held-out ECE down.
"""

from __future__ import annotations

import json
import random
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..calibration import tempered
from ..request.samples import random_state

if TYPE_CHECKING:
    from ..clef import Clef

QUESTIONS = {
    "urgent": {"type": "noul", "instructions": "Is this ticket urgent?"},
    "team": {
        "type": "choice",
        "instructions": "Which team should handle it?",
        "criteria": {"billing": "Charges and refunds", "engineering": "Bugs and outages", "account": None},
    },
    "level": {"type": "score", "instructions": "How upset is the customer?", "criteria": ["Calm", "Annoyed", "Angry"]},
}


def distorted_labelled_set(
    model: Clef,
    temperatures: Mapping[str, float],
    *,
    records: int,
    seed: int = 0,
    questions: Mapping[str, Any] = QUESTIONS,
    extra: Mapping[str, Any] | None = None,
) -> list[dict[str, Any]]:
    """`records` labelled lines: generated states (request/samples.py) asked `questions`, each question in
    `temperatures` labelled with an option drawn from softmax(logits / T) (the others left unlabelled). `extra`: fields
    every request carries (an `adapter`)."""
    rng = random.Random(seed)
    requests = [{**(extra or {}), "state": random_state(rng, rng.randint(5, 40)), "questions": dict(questions)} for _ in range(records)]
    results = model.score([model.prepare(request).record for request in requests])  # logits: the model's own
    lines = []
    for request, per_question in zip(requests, results, strict=True):
        expected = {}
        for result in per_question:
            if result.question_id in temperatures:
                weights = tempered(result.logits, temperatures[result.question_id])
                expected[result.question_id] = result.option_ids[rng.choices(range(len(weights)), weights=weights)[0]]
        lines.append({**request, "expected": expected})
    return lines


def write_jsonl(path: str | Path, lines: list[dict[str, Any]]) -> Path:
    out = Path(path)
    out.write_text("".join(json.dumps(line, ensure_ascii=False) + "\n" for line in lines), encoding="utf-8")
    return out
