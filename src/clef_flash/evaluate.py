"""Evaluation: agreement between two models (or precisions) and accuracy on labelled requests.

- `agreement(reference, candidate)`: the Core ML port's quality table: questions compared, answers
  (argmax decisions) that differ, the median and max |dp| over every option probability, and how
  many of the differing answers were near-ties (the reference's top-2 margin under `near_tie`).
- `labelled_report(predictions)`: accuracy, macro-F1, log-loss, Brier, ECE and the reliability bins,
  overall and per question, and the reliability bins that `plots.reliability_figure` draws.
- `fit_calibration(path, model)`: a temperature per question id and adapter fitted on a labelled file, less a
  seeded held-out share on which the report compares accuracy, log-loss, Brier and ECE before and after
  (calibration.py holds the math and the file).

Labelled files are JSONL: each line a System One request plus `"expected": {question_id: label}`,
with a choice's label, `true` / `false` (or "true" / "false") for noul, and a score's level index
(0 or "0") or its level text. Questions left out of `expected` are answered but not scored.
The metrics are pure functions of `Prediction`s; everything with a model is in `score_requests`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import random
import statistics
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from .batch import read_jsonl
from .calibration import Calibration, at_bound, calibrated, fit_temperature, logits_vary
from .errors import ClefError, RequestInvalid
from .request.protocol import parse_request
from .request.records import EncodedRecord, question_options

if TYPE_CHECKING:
    from .clef import Clef
    from .engine import QuestionResult

DEFAULT_NEAR_TIE = 0.05
DEFAULT_BINS = 10
LOG_LOSS_FLOOR = 1e-15  # p(truth) is clipped here so that a confident miss costs ~34.5, not infinity


# -- reading and scoring -------------------------------------------------------------------------


def prepare_requests(model: Clef, lines: Sequence[tuple[int, Any]], *, where: str) -> list[EncodedRecord]:
    """Every request encoded, with its adapter (the request's, else the model's default); an invalid one names its line."""
    records = []
    for number, request in lines:
        try:
            records.append(model.prepare(request).record)
        except RequestInvalid as error:
            raise ClefError(f"{where} line {number}: {error}") from error
    return records


def score_requests(model: Clef, lines: Sequence[tuple[int, Any]], *, where: str) -> list[list[QuestionResult]]:
    """Unrounded probabilities per question of every request, batched; an invalid one names its line."""
    return model.score(prepare_requests(model, lines, where=where))


def with_adapter(lines: Sequence[tuple[int, Any]], name: str | None) -> list[tuple[int, Any]]:
    """The lines with their `adapter` field set to `name` (None: left out, the model's default answers)."""
    return [
        (number, {**request, "adapter": name} if name else {key: value for key, value in request.items() if key != "adapter"})
        for number, request in lines
    ]


def describe_model(model: Clef) -> dict[str, Any]:
    described = {"source": model.source, "precision": model.precision, "random": model.is_random}
    if model.adapters:
        described["adapters"] = model.adapters
    if model.calibration is not None:
        described["calibration"] = model.calibration.digest[:16]
    return described


def evaluate_agreement(
    path: str | Path, load_candidate: Callable[[], Clef], load_reference: Callable[[], Clef], *, near_tie: float
) -> dict[str, Any]:
    """The agreement report on a JSONL file of requests; one model is in memory at a time."""
    lines = read_jsonl(path)
    sides = {}
    for side, load_model in (("candidate", load_candidate), ("reference", load_reference)):
        model = load_model()
        sides[side] = (describe_model(model), score_requests(model, lines, where=str(path)))
        del model
    return {
        "file": str(path),
        "candidate": sides["candidate"][0],
        "reference": sides["reference"][0],
        **agreement(
            sides["reference"][1], sides["candidate"][1], near_tie=near_tie, request_numbers=[n for n, _ in lines]
        ),
    }


def evaluate_labelled(path: str | Path, load_model: Callable[[], Clef]) -> dict[str, Any]:
    """The labelled report on a JSONL file of requests with `"expected"` labels (all checked
    before the model is loaded)."""
    lines, expected = read_labelled(path)
    model = load_model()
    results = score_requests(model, lines, where=str(path))
    predictions = predictions_of(lines, expected, results)
    return {"file": str(path), "model": describe_model(model), "records": len(lines), **labelled_report(predictions)}


def evaluate_base_vs_tuned(path: str | Path, model: Clef, adapter: str) -> dict[str, Any]:
    """The labelled report of the base and of `adapter` side by side (as clef-finetune's comparison), from one
    model that serves both (the adapter kept apart from one copy of the base)."""
    lines, expected = read_labelled(path)
    reports = {}
    for side, name in (("base", None), ("tuned", adapter)):
        sided = with_adapter(lines, name)
        results = score_requests(model, sided, where=str(path))
        reports[side] = labelled_report(predictions_of(sided, expected, results))
    return {"file": str(path), "model": describe_model(model), "adapter": adapter, "records": len(lines), **reports}


def base_vs_tuned_markdown(report: dict[str, Any]) -> str:
    """Base and tuned metrics per question, with the change (lower is better for log-loss, Brier and ECE)."""
    lines = [
        "# clef-flash eval: base vs tuned",
        "",
        f"model: {model_label(report['model'])}; adapter {report['adapter']!r}; {report['records']} records from {report['file']}",
        "",
        "| question | n | metric | base | tuned | change |",
        "|---|---:|---|---:|---:|---:|",
    ]
    base, tuned = report["base"], report["tuned"]
    rows = [("overall", base, tuned)] + [(q, base["by_question"][q], tuned["by_question"][q]) for q in tuned["by_question"]]
    for question, before, after in rows:
        for metric in ("accuracy", "macro_f1", "log_loss", "brier", "ece"):
            lines.append(
                f"| {question} | {after['questions']} | {metric} | {before[metric]:.4f} | {after[metric]:.4f} | {after[metric] - before[metric]:+.4f} |"
            )
    return "\n".join(lines + ["", "Lower is better for log-loss, Brier and ECE."]) + "\n"


def decision(probabilities: Sequence[float]) -> int:
    """The argmax; a tie goes to the first option (the model's order)."""
    return max(range(len(probabilities)), key=lambda index: (probabilities[index], -index))


def top2_margin(probabilities: Sequence[float]) -> float:
    top = sorted(probabilities, reverse=True)
    return top[0] - top[1]


# -- agreement -----------------------------------------------------------------------------------


def agreement(
    reference: Sequence[Sequence[QuestionResult]],
    candidate: Sequence[Sequence[QuestionResult]],
    *,
    near_tie: float = DEFAULT_NEAR_TIE,
    request_numbers: Sequence[int] | None = None,
) -> dict[str, Any]:
    """Compare the candidate's probabilities with the reference's, request by request."""
    numbers = request_numbers if request_numbers is not None else range(1, len(reference) + 1)
    deltas: list[float] = []
    differing = []
    questions = 0
    for number, reference_questions, candidate_questions in zip(numbers, reference, candidate, strict=True):
        for expected, actual in zip(reference_questions, candidate_questions, strict=True):
            if (expected.question_id, expected.option_ids) != (actual.question_id, actual.option_ids):
                raise ClefError(f"request {number}: the two models encode question {expected.question_id!r} differently")
            questions += 1
            deltas += [abs(p - q) for p, q in zip(expected.probabilities, actual.probabilities, strict=True)]
            want, got = decision(expected.probabilities), decision(actual.probabilities)
            if want != got:
                margin = top2_margin(expected.probabilities)
                differing.append(
                    {
                        "request": number,
                        "question": expected.question_id,
                        "reference": expected.option_ids[want],
                        "candidate": actual.option_ids[got],
                        "reference_margin": margin,
                        "near_tie": margin < near_tie,
                    }
                )
    return {
        "requests": len(reference),
        "questions": questions,
        "answers_differing": len(differing),
        "near_ties": sum(item["near_tie"] for item in differing),
        "near_tie_margin": near_tie,
        "median_abs_dp": statistics.median(deltas) if deltas else 0.0,
        "max_abs_dp": max(deltas, default=0.0),
        "abs_dp_histogram": abs_dp_histogram(deltas),
        "differing": differing,
    }


def abs_dp_histogram(deltas: Sequence[float], low: float = 1e-8, per_decade: int = 4) -> dict[str, list[float]]:
    """Counts of |dp| on log-spaced bins from `low` to 1 (smaller values, 0 included, in the first bin)."""
    edges = np.logspace(math.log10(low), 0, round(-math.log10(low)) * per_decade + 1)
    counts, _ = np.histogram(np.clip(np.asarray(deltas, dtype=np.float64), low, 1.0), bins=edges)
    return {"edges": edges.tolist(), "counts": counts.tolist()}


def agreement_markdown(report: dict[str, Any]) -> str:
    lines = [
        "# clef-flash eval: agreement",
        "",
        (
            f"candidate: {model_label(report['candidate'])}; reference: {model_label(report['reference'])}; "
            f"{report['requests']} requests from {report['file']}"
        ),
        "",
        f"| questions | answers differing | median \\|dp\\| | max \\|dp\\| | near-ties among them (margin < {report['near_tie_margin']}) |",
        "|---:|---:|---:|---:|---:|",
        (
            f"| {report['questions']} | {report['answers_differing']} | {report['median_abs_dp']:.2e} "
            f"| {report['max_abs_dp']:.2e} | {report['near_ties']} |"
        ),
    ]
    if report["differing"]:
        lines += ["", "| request | question | reference | candidate | reference top-2 margin |", "|---:|---|---|---|---:|"]
        lines += [
            f"| {item['request']} | {item['question']} | {item['reference']} | {item['candidate']} | {item['reference_margin']:.2e} |"
            for item in report["differing"]
        ]
    return "\n".join(lines) + "\n"


def model_label(model: dict[str, Any]) -> str:
    random = ", random weights" if model.get("random") else ""
    return f"{model['source']} ({model['precision']}{random})"


# -- labelled accuracy ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Prediction:
    """One scored question: the model's probabilities over its options and the true option."""

    question: str  # the question id: questions with the same id across records form one task
    question_type: str
    options: tuple[str, ...]  # option ids in the model's order
    probabilities: tuple[float, ...]
    truth: int  # index into options
    logits: tuple[float, ...] = ()  # the model's (what a calibration's temperature divides)

    @property
    def predicted(self) -> int:
        return decision(self.probabilities)

    @property
    def confidence(self) -> float:
        return max(self.probabilities)


def option_of_label(question: dict[str, Any], label: Any) -> str:
    """The option id an expected label names (see the module docstring for the accepted forms)."""
    kind = question["type"]
    options = [option_id for option_id, _ in question_options(question)]
    if kind == "noul" and isinstance(label, bool):
        label = "true" if label else "false"
    elif kind == "score" and isinstance(label, int) and not isinstance(label, bool):
        label = str(label)
    elif kind == "score" and isinstance(label, str) and label not in options and label in question["criteria"]:
        label = str(question["criteria"].index(label))
    if not isinstance(label, str) or label not in options:
        allowed = {"noul": "true or false", "choice": "one of its criteria keys", "score": "a level index or level text"}
        raise ValueError(f"label {label!r} is not an option of this {kind} question ({allowed[kind]})")
    return label


def read_labelled(path: str | Path) -> tuple[list[tuple[int, Any]], list[dict[str, str]]]:
    """(line number, request) pairs, and per line the expected option id of each labelled question;
    every label is checked here, before a model is loaded."""
    lines, expected = [], []
    for number, value in read_jsonl(path):
        if not isinstance(value, dict) or not isinstance(value.get("expected"), dict):
            raise ClefError(f"{path} line {number}: a labelled line is a request with \"expected\": {{question_id: label}}")
        request = {key: item for key, item in value.items() if key != "expected"}
        try:
            questions = parse_request(request).to_record()["questions"]
        except RequestInvalid as error:
            raise ClefError(f"{path} line {number}: {error}") from error
        unknown = sorted(set(value["expected"]) - set(questions))
        if unknown:
            raise ClefError(f"{path} line {number}: expected labels for questions the request does not ask: {unknown}")
        labels = {}
        for question_id, label in value["expected"].items():
            try:
                labels[question_id] = option_of_label(questions[question_id], label)
            except ValueError as error:
                raise ClefError(f"{path} line {number}, question {question_id!r}: {error}") from error
        lines.append((number, request))
        expected.append(labels)
    return lines, expected


def predictions_of(
    lines: Sequence[tuple[int, Any]], expected: Sequence[dict[str, str]], results: Sequence[Sequence[QuestionResult]]
) -> list[Prediction]:
    """A `Prediction` per labelled question (questions without a label are left out)."""
    predictions = []
    for (_, request), labels, per_question in zip(lines, expected, results, strict=True):
        questions = request["questions"]
        for result in per_question:
            if result.question_id in labels:
                predictions.append(
                    Prediction(
                        result.question_id,
                        questions[result.question_id]["type"],
                        result.option_ids,
                        result.probabilities,
                        result.option_ids.index(labels[result.question_id]),
                        result.logits,
                    )
                )
    return predictions


def accuracy(predictions: Sequence[Prediction]) -> float:
    return sum(p.predicted == p.truth for p in predictions) / len(predictions)


def log_loss(predictions: Sequence[Prediction]) -> float:
    """Mean of -ln p(truth)."""
    return sum(-math.log(max(p.probabilities[p.truth], LOG_LOSS_FLOOR)) for p in predictions) / len(predictions)


def brier(predictions: Sequence[Prediction]) -> float:
    """Multi-class Brier score: mean over questions of sum_k (p_k - [k = truth])^2 (0 to 2)."""
    return sum(
        sum((probability - (index == p.truth)) ** 2 for index, probability in enumerate(p.probabilities))
        for p in predictions
    ) / len(predictions)


def macro_f1(truths: Sequence[str], predicted: Sequence[str]) -> float:
    """Mean F1 over the labels that occur as a truth or a prediction (sklearn's average="macro")."""
    scores = []
    for label in sorted(set(truths) | set(predicted)):
        true_positives = sum(t == label and p == label for t, p in zip(truths, predicted))
        false_positives = sum(t != label and p == label for t, p in zip(truths, predicted))
        false_negatives = sum(t == label and p != label for t, p in zip(truths, predicted))
        scores.append(2 * true_positives / (2 * true_positives + false_positives + false_negatives))
    return sum(scores) / len(scores)


def reliability_bins(predictions: Sequence[Prediction], bins: int = DEFAULT_BINS) -> list[dict[str, float]]:
    """Equal-width bins of the top-class confidence, [k/bins, (k+1)/bins) (the last one includes 1)."""
    members: list[list[Prediction]] = [[] for _ in range(bins)]
    for p in predictions:
        members[min(int(p.confidence * bins), bins - 1)].append(p)
    return [
        {
            "lower": k / bins,
            "upper": (k + 1) / bins,
            "count": len(group),
            "confidence": sum(p.confidence for p in group) / len(group) if group else 0.0,
            "accuracy": sum(p.predicted == p.truth for p in group) / len(group) if group else 0.0,
        }
        for k, group in enumerate(members)
    ]


def expected_calibration_error(predictions: Sequence[Prediction], bins: int = DEFAULT_BINS) -> float:
    """Sum over bins of (share of questions) * |accuracy - mean confidence|."""
    return sum(
        b["count"] / len(predictions) * abs(b["accuracy"] - b["confidence"]) for b in reliability_bins(predictions, bins)
    )


def summary(predictions: Sequence[Prediction]) -> dict[str, float]:
    """Every figure of a group of predictions; macro-F1 is averaged over its question ids."""
    by_question = defaultdict(list)
    for p in predictions:
        by_question[p.question].append(p)
    per_question_f1 = [
        macro_f1([p.options[p.truth] for p in group], [p.options[p.predicted] for p in group])
        for group in by_question.values()
    ]
    return {
        "questions": len(predictions),
        "accuracy": accuracy(predictions),
        "macro_f1": sum(per_question_f1) / len(per_question_f1),
        "log_loss": log_loss(predictions),
        "brier": brier(predictions),
        "ece": expected_calibration_error(predictions),
    }


def labelled_report(predictions: Sequence[Prediction]) -> dict[str, Any]:
    if not predictions:
        raise ClefError("no question has an expected label: nothing to score")
    by_question = defaultdict(list)
    for p in predictions:
        by_question[p.question].append(p)
    return {
        **summary(predictions),
        "by_question": {
            question: {"type": group[0].question_type, **summary(group)} for question, group in by_question.items()
        },
        "reliability": reliability_bins(predictions),
    }


def labelled_markdown(report: dict[str, Any]) -> str:
    lines = [
        "# clef-flash eval: labelled",
        "",
        (
            f"model: {model_label(report['model'])}; {report['records']} records, {report['questions']} questions "
            f"scored, from {report['file']}"
        ),
        "",
        "| accuracy | macro-F1 | log-loss | Brier | ECE (10 bins) |",
        "|---:|---:|---:|---:|---:|",
        (
            f"| {report['accuracy']:.4f} | {report['macro_f1']:.4f} | {report['log_loss']:.4f} "
            f"| {report['brier']:.4f} | {report['ece']:.4f} |"
        ),
        "",
        "Brier is the multi-class score (sum over options, 0 to 2); macro-F1 is averaged over the labels of",
        "each question id, then over question ids; ECE bins the top option's probability.",
        "",
        "| question | type | n | accuracy | macro-F1 | log-loss | Brier | ECE |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    lines += [
        f"| {question} | {row['type']} | {row['questions']} | {row['accuracy']:.4f} | {row['macro_f1']:.4f} "
        f"| {row['log_loss']:.4f} | {row['brier']:.4f} | {row['ece']:.4f} |"
        for question, row in report["by_question"].items()
    ]
    lines += ["", "| confidence | n | mean confidence | accuracy |", "|---|---:|---:|---:|"]
    lines += [
        f"| {b['lower']:.1f}–{b['upper']:.1f} | {b['count']} | {b['confidence']:.4f} | {b['accuracy']:.4f} |"
        for b in report["reliability"]
        if b["count"]
    ]
    return "\n".join(lines) + "\n"


# -- fitted calibration --------------------------------------------------------------------------

DEFAULT_HOLDOUT = 0.3  # the share of a labelled file's records held out of the fit, to measure it on
DEFAULT_MIN_EXAMPLES = 20  # labelled answers a question needs in the fitting part for a temperature of its own


def held_out_lines(count: int, holdout: float, seed: int, *, where: str) -> set[int]:
    """The positions of the held-out records: the first round(holdout * count) of a seeded shuffle, at least one on
    each side. Records, not questions, are split: a record's questions share its state."""
    if not 0 < holdout < 1:
        raise ClefError(f"the held-out share is a fraction between 0 and 1 (e.g. 0.3), not {holdout}")
    held = round(holdout * count)
    if not 0 < held < count:
        raise ClefError(f"{where} has {count} records: too few to hold {holdout:g} of them out and fit on the rest; label more")
    order = list(range(count))
    random.Random(seed).shuffle(order)
    return set(order[:held])


def tempered_prediction(prediction: Prediction, temperature: float) -> Prediction:
    """The prediction as a calibration answers it (calibration.calibrated; T = 1: the model's own probabilities)."""
    if temperature == 1.0:
        return prediction
    return dataclasses.replace(prediction, probabilities=calibrated(prediction.logits, prediction.probabilities, temperature))


def fit_questions(samples: Sequence[tuple[bool, Prediction]], min_examples: int) -> tuple[dict[str, float], dict[str, dict[str, Any]]]:
    """One adapter's temperatures from its (held out?, prediction) samples: fitted on the fitting part per question id,
    and a row per question id (its type, T, examples on each side, why it kept T = 1 or sits at a bound)."""
    by_question: dict[str, list[tuple[bool, Prediction]]] = defaultdict(list)
    for held, prediction in samples:
        by_question[prediction.question].append((held, prediction))
    fitted, rows = {}, {}
    for question, group in by_question.items():
        fit = [prediction for held, prediction in group if not held]
        row: dict[str, Any] = {"type": group[0][1].question_type, "fit_examples": len(fit), "held_out_examples": len(group) - len(fit)}
        if len(fit) < min_examples:
            row.update(temperature=1.0, note=f"kept at 1: {len(fit)} fitting examples, fewer than {min_examples}")
        elif not logits_vary([prediction.logits for prediction in fit]):
            row.update(temperature=1.0, note="kept at 1: its options' logits never differ")
        else:
            fitted[question] = fit_temperature([prediction.logits for prediction in fit], [prediction.truth for prediction in fit])
            row.update(temperature=fitted[question], note="at the search's bound" if at_bound(fitted[question]) else None)
        rows[question] = row
    return fitted, rows


def fit_calibration(
    path: str | Path,
    model: Clef,
    *,
    adapters: Sequence[str | None] | None = None,
    holdout: float = DEFAULT_HOLDOUT,
    seed: int = 0,
    min_examples: int = DEFAULT_MIN_EXAMPLES,
) -> tuple[Calibration, dict[str, Any]]:
    """A temperature per question id and adapter, fitted on a labelled file's fitting part (minimum mean negative
    log-likelihood, calibration.fit_temperature), and the report: accuracy, log-loss, Brier and ECE before and after on
    its held-out part (a seeded `holdout` share of its records), with the reliability bins of each.

    `adapters`: None: each line as the model answers it (its `adapter` field, else the model's default); a list: every
    line by each of them (None: the base), the lines' own field replaced. Temperatures are keyed by the adapter that
    answered. A question with fewer than `min_examples` labelled answers in the fitting part keeps T = 1 (said in its
    row), as does one whose logits never differ."""
    if model.calibration is not None:
        raise ClefError("a calibration is fitted on the model's own probabilities: load the model without one")
    lines, expected = read_labelled(path)
    held = held_out_lines(len(lines), holdout, seed, where=str(path))
    samples: dict[str | None, list[tuple[bool, Prediction]]] = defaultdict(list)
    for sided in [lines] if adapters is None else [with_adapter(lines, name) for name in adapters]:
        records = prepare_requests(model, sided, where=str(path))
        for position, (line, labels, record, results) in enumerate(zip(sided, expected, records, model.score(records), strict=True)):
            samples[record.adapter] += [(position in held, prediction) for prediction in predictions_of([line], [labels], [results])]
    temperatures, sides = {}, []
    for adapter, side in samples.items():
        temperatures[adapter], rows = fit_questions(side, min_examples)
        before = [prediction for held_out, prediction in side if held_out]
        after = [tempered_prediction(prediction, temperatures[adapter].get(prediction.question, 1.0)) for prediction in before]
        compared = {"before": labelled_report(before), "after": labelled_report(after)} if before else {"before": None, "after": None}
        sides.append({"adapter": adapter, "temperatures": rows, **compared})
    fitted_model = {
        "source": model.source,
        "precision": model.precision,
        "fingerprint": model.checkpoint.fingerprint,
        "weights_fingerprint": model.checkpoint.weights_fingerprint,
        "adapters": {name: fingerprint for name, fingerprint in model.adapter_fingerprints.items() if temperatures.get(name)},
    }
    fitted_on = {
        "file": Path(path).name,
        "sha256": hashlib.sha256(Path(path).read_bytes()).hexdigest(),
        "records": len(lines),
        "held_out_records": len(held),
        "holdout": holdout,
        "seed": seed,
        "min_examples": min_examples,
        "model": fitted_model,
    }
    calibration = Calibration.fitted(temperatures, fitted_on)
    report = {
        "file": str(path),
        "model": describe_model(model),
        "records": len(lines),
        "fit_records": len(lines) - len(held),
        "held_out_records": len(held),
        "holdout": holdout,
        "seed": seed,
        "min_examples": min_examples,
        "calibration": calibration.digest[:16],
        "sides": sides,
    }
    return calibration, report


def calibration_markdown(report: dict[str, Any]) -> str:
    """Per adapter: the temperatures, then the held-out figures before -> after and the reliability bins of each."""
    split = f"{report['fit_records']} to fit, {report['held_out_records']} held out (share {report['holdout']:g}, seed {report['seed']})"
    about = f"model: {model_label(report['model'])}; {report['records']} records from {report['file']}: {split}"
    lines = ["# clef-flash eval: fitted calibration", "", f"{about}; calibration sha256 {report['calibration']}"]
    for side in report["sides"]:
        name = "the base model" if side["adapter"] is None else f"adapter {side['adapter']!r}"
        lines += ["", f"## {name}", "", "| question | type | temperature | fitting examples | held-out examples | note |", "|---|---|---:|---:|---:|---|"]
        lines += [
            f"| {question} | {row['type']} | {row['temperature']:.4g} | {row['fit_examples']} | {row['held_out_examples']} | {row['note'] or ''} |"
            for question, row in side["temperatures"].items()
        ]
        before, after = side["before"], side["after"]
        if before is None:
            lines += ["", "No held-out record has a label for it: nothing to compare."]
            continue
        lines += [
            "",
            "Held out, before -> after (a temperature never changes a decision: accuracy stays):",
            "",
            "| question | n | accuracy | log-loss | Brier | ECE (10 bins) |",
            "|---|---:|---|---|---|---|",
        ]
        rows = [("overall", before, after)] + [(question, before["by_question"][question], row) for question, row in after["by_question"].items()]
        for question, was, now in rows:
            figures = " | ".join(f"{was[metric]:.4f} -> {now[metric]:.4f}" for metric in ("accuracy", "log_loss", "brier", "ece"))
            lines.append(f"| {question} | {now['questions']} | {figures} |")
        lines += ["", "| confidence | n before | mean confidence | accuracy | n after | mean confidence | accuracy |", "|---|---:|---:|---:|---:|---:|---:|"]
        lines += [
            f"| {was['lower']:.1f}–{was['upper']:.1f} | {was['count']} | {was['confidence']:.4f} | {was['accuracy']:.4f} "
            f"| {now['count']} | {now['confidence']:.4f} | {now['accuracy']:.4f} |"
            for was, now in zip(before["reliability"], after["reliability"], strict=True)
            if was["count"] or now["count"]
        ]
    return "\n".join(lines) + "\n"


# -- reports -------------------------------------------------------------------------------------


def write_reports(
    out_dir: str | Path, report: dict[str, Any], markdown: str, figures: dict[str, bytes] | None = None
) -> list[Path]:
    """`report.json`, `report.md` and each of `figures` (file name -> PNG bytes) in `out_dir` (created)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = [out / "report.json", out / "report.md"]
    written[0].write_text(json.dumps(report, indent=2, ensure_ascii=False) + "\n")
    written[1].write_text(markdown)
    for name, data in (figures or {}).items():
        written.append(out / name)
        written[-1].write_bytes(data)
    return written
