"""Fitted calibration: a temperature per question id (and per adapter) that corrects how sure the answers are.

A question's probabilities are a softmax over its options' logits (SPEC §5.9). A temperature T > 0 divides those
logits first: p = softmax(z / T). T < 1 sharpens the probabilities (the model was underconfident), T > 1 flattens
them (overconfident). Dividing by a positive number keeps the logits' order, so a decision (the argmax, ties to the
first option) never changes: only how sure the answer says it is. A question the file does not name keeps T = 1,
and its probabilities are the model's own, untouched.

    fit_temperature(logits, truths)       the T of least mean negative log-likelihood (golden-section on log T)
    tempered(logits, T)                   softmax(logits / T) in float64
    calibrated(logits, probabilities, T)  what an answer shows: tempered, the model's own top ties kept (the decision holds)
    Calibration                           temperatures by adapter (None: the base) and question id, what they were
                                          fitted on; .apply(adapter, results) at answer time, .note(results) for a response
    read_calibration(path)                a calibration file, validated strictly (CalibrationError, saying the fix)

The file, JSON (`Calibration.save`; `clef-flash eval labelled FILE --fit-calibration OUT` writes it, evaluate.py's
`fit_calibration` fits it; `load(..., calibration=OUT)` and every model command's `--calibration OUT` apply it):

    {"format": "clef-flash-calibration", "version": 1,
     "temperatures": {"base": {QUESTION_ID: T, ...}, "adapters": {ADAPTER: {QUESTION_ID: T, ...}, ...}},
     "fitted_on": {"file", "sha256", "records", "held_out_records", "holdout", "seed", "min_examples",
                   "model": {"source", "precision", "fingerprint" (config), "weights_fingerprint", "adapters"}},
     "created": ISO 8601 time}
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import json
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from .errors import CalibrationError

if TYPE_CHECKING:
    from .engine import QuestionResult

FORMAT = "clef-flash-calibration"
VERSION = 1
BASE = "base"  # the file's key for the base model's temperatures (adapters sit under "adapters": any name works)
MIN_TEMPERATURE, MAX_TEMPERATURE = 1e-3, 1e3  # the fit's bounds, and what a file may hold
FILE_KEYS = ("format", "version", "temperatures", "fitted_on", "created")
REFIT = "fit one with `clef-flash eval labelled FILE --model SOURCE --fit-calibration OUT`"


# -- the math --------------------------------------------------------------------------------------


def tempered(logits: Sequence[float], temperature: float) -> tuple[float, ...]:
    """softmax(logits / T), in float64: equal logits stay equal, a larger one stays larger (the decision holds)."""
    scaled = [value / temperature for value in logits]
    top = max(scaled)
    weights = [math.exp(value - top) for value in scaled]
    total = math.fsum(weights)
    return tuple(weight / total for weight in weights)


def keep_top_ties(probabilities: Sequence[float], model_probabilities: Sequence[float]) -> tuple[float, ...]:
    """Tempered probabilities in which the options the model's own (float32) probabilities tie at the top stay tied
    (each at their mean): logits closer than float32 resolves near 1 can tie there, and the answer's decision, the
    first of them in criteria order, must not move when float64 would tell them apart."""
    top = max(model_probabilities)
    tied = [index for index, value in enumerate(model_probabilities) if value == top]
    if len(tied) == 1:
        return tuple(probabilities)
    mean = math.fsum(probabilities[index] for index in tied) / len(tied)
    return tuple(mean if index in tied else value for index, value in enumerate(probabilities))


def calibrated(logits: Sequence[float], model_probabilities: Sequence[float], temperature: float) -> tuple[float, ...]:
    """What a question answers at `temperature`: the model's own probabilities at T = 1, else softmax(logits / T) with
    the model's top ties kept."""
    if temperature == 1.0:
        return tuple(model_probabilities)
    return keep_top_ties(tempered(logits, temperature), model_probabilities)


def _padded(logits: Sequence[Sequence[float]]) -> np.ndarray:
    """Rows of logits as one [n, K] float64 grid, -inf beyond a row's options (a question id may have other
    options in other records)."""
    grid = np.full((len(logits), max(len(row) for row in logits)), -np.inf)
    for index, row in enumerate(logits):
        grid[index, : len(row)] = row
    return grid


def mean_negative_log_likelihood(grid: np.ndarray, truths: np.ndarray, temperature: float) -> float:
    """Mean of -ln softmax(z / T)[truth] over rows of `grid` [n, K] (-inf padded)."""
    scaled = grid / temperature
    top = scaled.max(axis=1)
    log_normalizer = top + np.log(np.exp(scaled - top[:, None]).sum(axis=1))  # [n]
    return float(np.mean(log_normalizer - scaled[np.arange(len(truths)), truths]))


def logits_vary(logits: Sequence[Sequence[float]]) -> bool:
    """Whether any row's options differ: a temperature changes nothing where every row's logits are equal."""
    return any(max(row) > min(row) for row in logits)


def fit_temperature(
    logits: Sequence[Sequence[float]], truths: Sequence[int], *, low: float = MIN_TEMPERATURE, high: float = MAX_TEMPERATURE
) -> float:
    """The temperature in [low, high] that minimizes the mean negative log-likelihood of `truths` (an option index
    per row of `logits`). The NLL is convex in 1/T, so it has one minimum along log T: a golden-section search to
    1e-7 in log T (about 40 evaluations). Rows whose logits are all equal carry no information; when every row is
    such, T = 1."""
    if len(logits) != len(truths) or not logits:
        raise ValueError(f"{len(logits)} rows of logits for {len(truths)} truths")
    if not logits_vary(logits):
        return 1.0
    grid, answers = _padded(logits), np.asarray(truths, dtype=np.int64)

    def loss(log_temperature: float) -> float:
        return mean_negative_log_likelihood(grid, answers, math.exp(log_temperature))

    ratio = (math.sqrt(5) - 1) / 2
    left, right = math.log(low), math.log(high)
    inner_left, inner_right = right - ratio * (right - left), left + ratio * (right - left)
    loss_left, loss_right = loss(inner_left), loss(inner_right)
    while right - left > 1e-7:
        if loss_left <= loss_right:
            right, inner_right, loss_right = inner_right, inner_left, loss_left
            inner_left = right - ratio * (right - left)
            loss_left = loss(inner_left)
        else:
            left, inner_left, loss_left = inner_left, inner_right, loss_right
            inner_right = left + ratio * (right - left)
            loss_right = loss(inner_right)
    return math.exp((left + right) / 2)


def at_bound(temperature: float) -> bool:
    """A fitted temperature pressed against the search's bounds (the data asked for more)."""
    return not MIN_TEMPERATURE * 1.001 < temperature < MAX_TEMPERATURE / 1.001


# -- the calibration and its file ------------------------------------------------------------------


@dataclass(frozen=True)
class Calibration:
    """Temperatures by adapter (None: the base model) and question id, and what they were fitted on.
    `digest` is the sha256 of the file's bytes (of `to_json()` for one built in memory): what responses name."""

    temperatures: Mapping[str | None, Mapping[str, float]]
    fitted_on: Mapping[str, Any] = field(default_factory=dict)
    created: str | None = None
    digest: str = ""
    path: str | None = None  # where it was read from

    def __post_init__(self) -> None:
        if not self.digest:
            object.__setattr__(self, "digest", hashlib.sha256(self.to_json().encode()).hexdigest())

    @classmethod
    def fitted(cls, temperatures: Mapping[str | None, Mapping[str, float]], fitted_on: Mapping[str, Any]) -> Calibration:
        """A new calibration, stamped with the time (sides without a temperature are left out)."""
        created = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        kept = {side: dict(values) for side, values in temperatures.items() if values}
        return cls(kept, dict(fitted_on), created)

    def temperature(self, adapter: str | None, question_id: str) -> float:
        return self.temperatures.get(adapter, {}).get(question_id, 1.0)

    def apply(self, adapter: str | None, results: Sequence[QuestionResult]) -> list[QuestionResult]:
        """A record's results (scored by `adapter`, None: the base) with softmax(logits / T) probabilities and their T;
        a question at T = 1 keeps the model's own probabilities, bit for bit. The decision never moves (keep_top_ties)."""
        applied = []
        for result in results:
            temperature = self.temperature(adapter, result.question_id)
            if temperature != 1.0:
                probabilities = calibrated(result.logits, result.probabilities, temperature)
                result = dataclasses.replace(result, probabilities=probabilities, temperature=temperature)
            applied.append(result)
        return applied

    def note(self, results: Sequence[QuestionResult]) -> dict[str, Any]:
        """The response's `calibration` field: this file's digest and each question's temperature (1: untouched)."""
        return {"sha256": self.digest[:16], "temperatures": {result.question_id: result.temperature for result in results}}

    def describe(self) -> dict[str, Any]:
        """What /health, `info` and `Clef.describe()` say of it."""
        fitted_on, model = self.fitted_on, self.fitted_on.get("model", {})
        described: dict[str, Any] = {"sha256": self.digest[:16], "base_questions": sorted(self.temperatures.get(None, {}))}
        adapters = {name: sorted(values) for name, values in self.temperatures.items() if name is not None}
        if adapters:
            described["adapter_questions"] = adapters
        if self.path:
            described["path"] = self.path
        described["fitted_on"] = {
            key: value
            for key, value in (
                ("file", fitted_on.get("file")),
                ("records", fitted_on.get("records")),
                ("source", model.get("source")),
                ("precision", model.get("precision")),
                ("created", self.created),
            )
            if value is not None
        }
        return described

    def check_model(self, fingerprint: str | None, adapters: Mapping[str, str] | None = None) -> None:
        """Refuse a calibration fitted on a model of another config, or for an adapter of the same name that is another
        checkpoint (its fingerprint differs): their temperatures do not carry over. The weights may differ (a bundle,
        another precision): the same model, answering within rounding."""
        model = self.fitted_on.get("model", {})
        where = self.path or "the calibration"
        fitted = model.get("fingerprint")
        if fitted and fingerprint and fitted != fingerprint:
            raise CalibrationError(
                f"{where} was fitted on another model ({model.get('source')}, config {fitted[:12]}; this one's is "
                f"{fingerprint[:12]}): its temperatures do not carry over; {REFIT}"
            )
        for name, loaded in (adapters or {}).items():
            expected = model.get("adapters", {}).get(name)
            if name in self.temperatures and expected and expected != loaded:
                raise CalibrationError(
                    f"{where} was fitted for another adapter named {name!r} (fingerprint {expected[:12]}; the one loaded "
                    f"is {loaded[:12]}): {REFIT} --adapter {name}=DIR"
                )

    def to_file(self) -> dict[str, Any]:
        temperatures: dict[str, Any] = {BASE: dict(self.temperatures.get(None, {}))}
        temperatures["adapters"] = {name: dict(values) for name, values in self.temperatures.items() if name is not None}
        return {"format": FORMAT, "version": VERSION, "temperatures": temperatures, "fitted_on": dict(self.fitted_on), "created": self.created}

    def to_json(self) -> str:
        return json.dumps(self.to_file(), indent=2, ensure_ascii=False) + "\n"

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write the file whose sha256 is `digest` (its parent directories made)."""
        out = Path(path)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(self.to_json(), encoding="utf-8")
        return out


def read_calibration(path: str | os.PathLike[str]) -> Calibration:
    """A calibration file, checked strictly: its format and version, its keys, and every temperature (a number from
    MIN_TEMPERATURE to MAX_TEMPERATURE); anything else is a one-line CalibrationError saying how to mend it."""
    where = str(path)
    file = Path(path)
    if not file.is_file():
        raise CalibrationError(f"no calibration file at {where}: {REFIT}")
    raw = file.read_bytes()
    try:
        value = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as error:
        raise CalibrationError(f"{where} is not JSON ({error}): a calibration file is what --fit-calibration writes") from None
    return from_file(value, where=where, digest=hashlib.sha256(raw).hexdigest())


def from_file(value: Any, *, where: str, digest: str = "") -> Calibration:
    """A calibration from a file's decoded JSON (see read_calibration)."""
    if not isinstance(value, dict) or value.get("format") != FORMAT:
        found = value.get("format") if isinstance(value, dict) else type(value).__name__
        raise CalibrationError(f"{where} is not a clef-flash calibration file (format {found!r}, not {FORMAT!r}): {REFIT}")
    if value.get("version") != VERSION:
        raise CalibrationError(
            f"{where} is calibration format version {value.get('version')!r}; this clef-flash reads version {VERSION}: "
            f"{REFIT} (or use the clef-flash that wrote it)"
        )
    unknown = sorted(set(value) - set(FILE_KEYS))
    if unknown or "temperatures" not in value:
        what = f"unexpected keys {unknown}" if unknown else "no 'temperatures'"
        raise CalibrationError(f"{where} has {what}: a version {VERSION} file holds {list(FILE_KEYS)}")
    temperatures = value["temperatures"]
    if not isinstance(temperatures, dict) or set(temperatures) - {BASE, "adapters"}:
        raise CalibrationError(f"{where}: 'temperatures' is an object with {BASE!r} and 'adapters' (adapter -> question id -> T)")
    adapters = temperatures.get("adapters", {})
    if not isinstance(adapters, dict):
        raise CalibrationError(f"{where}: temperatures.adapters is an object, adapter name -> question id -> T")
    sides: dict[str | None, dict[str, float]] = {None: _temperatures(temperatures.get(BASE, {}), f"{where}: temperatures.{BASE}")}
    for name, values in adapters.items():
        sides[name] = _temperatures(values, f"{where}: temperatures.adapters.{name}")
    fitted_on = value.get("fitted_on", {})
    if not isinstance(fitted_on, dict):
        raise CalibrationError(f"{where}: 'fitted_on' is an object")
    created = value.get("created")
    return Calibration({side: values for side, values in sides.items() if values}, fitted_on, created if isinstance(created, str) else None, digest, where)


def _temperatures(values: Any, where: str) -> dict[str, float]:
    if not isinstance(values, dict):
        raise CalibrationError(f"{where} is an object, question id -> temperature")
    for question_id, temperature in values.items():
        number = isinstance(temperature, (int, float)) and not isinstance(temperature, bool)
        if not number or not MIN_TEMPERATURE <= temperature <= MAX_TEMPERATURE:
            raise CalibrationError(
                f"{where}.{question_id} is {temperature!r}: a temperature is a number from {MIN_TEMPERATURE:g} to "
                f"{MAX_TEMPERATURE:g} (probabilities are softmax(logits / T)); {REFIT}, or correct it"
            )
    return {question_id: float(temperature) for question_id, temperature in values.items()}


def as_calibration(value: str | os.PathLike[str] | Calibration | None) -> Calibration | None:
    """`load`'s `calibration=`: a file's path (read here) or a Calibration (as it is), or None."""
    if value is None or isinstance(value, Calibration):
        return value
    return read_calibration(value)
