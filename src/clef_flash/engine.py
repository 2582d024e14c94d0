"""The engine: `load` a model, then encode, batch, run the decoder and the head, and shape answers.

Records of a batch are right-padded to the longest and run through one decoder forward; causality
keeps padding away from real tokens, so a record's logits do not depend on its neighbours beyond
float rounding. Batches are formed by sorting records by length and filling a token budget.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from .checkpoint import Checkpoint, ModelParts, build_model, open_checkpoint
from .errors import ClefError, RequestInvalid
from .model.head_batch import build_head_batch, softmax_per_question, split_logits
from .machine import rates as machine_rates
from .checkpoint.quant import INT_MM
from .coreml.layout import is_export
from .model.precision import W8A8, Precision, dense_dtype_for, resolve_precision
from .request.answers import shape_response
from .request.protocol import DEFAULT_MODEL_NAME, SystemOneRequest, parse_request
from .request.records import DEFAULT_MAX_LENGTH, EncodedRecord, encode_record

DEFAULT_BATCH_TOKENS = 8192  # padded tokens per decoder forward


@dataclass
class Timings:
    """Milliseconds spent in the last call, by stage."""

    tokenize_ms: float = 0.0
    decoder_ms: float = 0.0
    head_ms: float = 0.0
    total_ms: float = 0.0
    records: int = 0
    tokens: int = 0
    forwards: int = 0

    def as_dict(self) -> dict[str, float]:
        return {name: round(value, 3) if isinstance(value, float) else value for name, value in self.__dict__.items()}


@dataclass(frozen=True)
class QuestionResult:
    question_id: str
    option_ids: tuple[str, ...]  # the model's order (choice labels sorted)
    logits: tuple[float, ...]
    probabilities: tuple[float, ...]


def pick_device(device: str | torch.device) -> torch.device:
    if str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ClefError(f"unknown device {device!r}: use 'auto', 'cpu' or 'cuda'") from exc
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ClefError("device 'cuda' was asked for, but no CUDA device is available")
    return resolved


def fitting(lengths: Iterable[int], budget: int, max_records: int | None = None) -> int:
    """How many records, taken in this order, one forward holds: at least one, then while the padded
    tokens (records x longest) stay within `budget` and the count within `max_records`."""
    count, longest = 0, 0
    for length in lengths:
        longest = max(longest, length)
        if count and ((max_records is not None and count >= max_records) or longest * (count + 1) > budget):
            break
        count += 1
    return count


@dataclass(frozen=True)
class Prepared:
    """A request validated and encoded: what the engine scores and what its answer is shaped from."""

    request: SystemOneRequest
    record: EncodedRecord

    def respond(self, results: Sequence[QuestionResult], *, default_model: str, decimals: int | None = 4) -> dict[str, Any]:
        """The System One response body from this record's scored questions."""
        return shape_response(
            self.request,
            [(result.option_ids, result.probabilities) for result in results],
            input_tokens=self.record.token_count,
            decimals=decimals,
            default_model=default_model,
        )


class Clef:
    """A loaded clef-flash model. Build it with `clef_flash.load(source)`."""

    def __init__(
        self,
        checkpoint: Checkpoint,
        parts: ModelParts,
        *,
        device: torch.device,
        precision: Precision,
        max_length: int = DEFAULT_MAX_LENGTH,
        batch_tokens: int = DEFAULT_BATCH_TOKENS,
    ):
        self.checkpoint = checkpoint
        self.parts = parts
        self.tokenizer = checkpoint.tokenizer
        self.device = device
        self.precision_policy = precision
        self.max_length = max_length
        self.batch_tokens = batch_tokens
        self.model_name = DEFAULT_MODEL_NAME
        self.last_timings = Timings()

    @property
    def precision(self) -> str:
        """The precision this model runs in: fp32, bf16, fp64, int8-weight-only or int8-w8a8."""
        return self.precision_policy.name

    @property
    def source(self) -> str:
        return self.checkpoint.source

    @property
    def is_random(self) -> bool:
        return self.checkpoint.is_random

    def __repr__(self) -> str:
        random = " (random weights)" if self.is_random else ""
        return f"Clef({self.source!r}, precision={self.precision}, device={self.device}){random}"

    # -- requests --------------------------------------------------------------------------

    def parse(self, request: Any) -> SystemOneRequest:
        return request if isinstance(request, SystemOneRequest) else parse_request(request)

    def encode(self, request: Any, *, truncate_state: bool = False) -> EncodedRecord:
        """Validate a request and render it to token ids and spans (SPEC §3)."""
        return encode_record(
            self.tokenizer, self.parse(request), max_length=self.max_length, truncate_state=truncate_state
        )

    def prepare(self, request: Any) -> Prepared:
        """Parse and encode a request (raises RequestInvalid / RecordTooLong, before any inference)."""
        parsed = self.parse(request)
        return Prepared(parsed, self.encode(parsed))

    def respond(self, prepared: Prepared, results: Sequence[QuestionResult], *, decimals: int | None = 4) -> dict[str, Any]:
        """The System One body of a prepared request from its scored questions."""
        return prepared.respond(results, default_model=self.model_name, decimals=decimals)

    # -- inference -------------------------------------------------------------------------

    def batches(self, records: Sequence[EncodedRecord]) -> list[list[int]]:
        """Indices of records grouped into forwards: sorted by length, each within the token budget."""
        order = sorted(range(len(records)), key=lambda index: records[index].token_count)
        groups: list[list[int]] = []
        while order:
            count = fitting((records[index].token_count for index in order), self.batch_tokens)
            groups.append(order[:count])
            order = order[count:]
        return groups

    @torch.inference_mode()
    def score(self, records: Sequence[EncodedRecord], timings: Timings | None = None) -> list[list[QuestionResult]]:
        """Logits and probabilities for every question of every encoded record."""
        timings = timings if timings is not None else Timings()
        results: list[list[QuestionResult] | None] = [None] * len(records)
        for group in self.batches(records):
            batch_records = [records[index] for index in group]
            for index, per_question in zip(group, self._forward(batch_records, timings)):
                results[index] = per_question
        timings.records += len(records)
        timings.tokens += sum(record.token_count for record in records)
        return results  # type: ignore[return-value]

    def _forward(self, records: Sequence[EncodedRecord], timings: Timings) -> list[list[QuestionResult]]:
        start = time.perf_counter()
        lengths = [record.token_count for record in records]
        longest = max(lengths)
        input_ids = torch.full((len(records), longest), self.tokenizer.pad_id, dtype=torch.long)
        for row, record in enumerate(records):
            input_ids[row, : lengths[row]] = torch.tensor(record.input_ids, dtype=torch.long)
        input_ids = input_ids.to(self.device)
        length_tensor = torch.tensor(lengths, dtype=torch.long, device=self.device)
        hidden = self.parts.decoder(input_ids, length_tensor)  # [B, L, D]
        self._sync()
        decoded = time.perf_counter()
        head_batch = build_head_batch(records, self.device)
        logits = self.parts.head(hidden, length_tensor, head_batch, self.parts.lm_head)  # [No]
        probabilities = softmax_per_question(logits, head_batch)
        per_record_logits = split_logits(logits.double().cpu(), head_batch)
        per_record_probabilities = split_logits(probabilities.double().cpu(), head_batch)
        timings.decoder_ms += (decoded - start) * 1000
        timings.head_ms += (time.perf_counter() - decoded) * 1000
        timings.forwards += 1
        return [
            [
                QuestionResult(
                    question_id=question.question_id,
                    option_ids=question.option_ids,
                    logits=tuple(question_logits.tolist()),
                    probabilities=tuple(question_probabilities.tolist()),
                )
                for question, question_logits, question_probabilities in zip(
                    record.questions, record_logits, record_probabilities
                )
            ]
            for record, record_logits, record_probabilities in zip(
                records, per_record_logits, per_record_probabilities
            )
        ]

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    # -- the public API of SPEC §7 ------------------------------------------------------------

    def logits(self, request: Any) -> dict[str, dict[str, float]]:
        """Unrounded logits per question and option (options in the model's order)."""
        (results,) = self._run([request])[1]
        return {result.question_id: dict(zip(result.option_ids, result.logits)) for result in results}

    def probabilities(self, request: Any) -> dict[str, dict[str, float]]:
        """Unrounded float32 softmax probabilities per question and option."""
        (results,) = self._run([request])[1]
        return {result.question_id: dict(zip(result.option_ids, result.probabilities)) for result in results}

    def answer(self, request: Any, *, decimals: int | None = 4) -> dict[str, Any]:
        """The System One response body for one request."""
        return self.answer_many([request], decimals=decimals)[0]

    def answer_many(self, requests: Sequence[Any], *, decimals: int | None = 4) -> list[dict[str, Any]]:
        """System One response bodies for many requests, batched into as few forwards as fit."""
        prepared, results = self._run(requests)
        return [self.respond(item, per_question, decimals=decimals) for item, per_question in zip(prepared, results)]

    def _run(self, requests: Sequence[Any]) -> tuple[list[Prepared], list[list[QuestionResult]]]:
        """Validate and encode every request (errors name the request's position), then score them all."""
        timings = Timings()
        start = time.perf_counter()
        prepared = []
        for position, request in enumerate(requests):
            try:
                prepared.append(self.prepare(request))
            except RequestInvalid as error:
                if len(requests) == 1:
                    raise
                raise RequestInvalid(
                    [{**item, "loc": [item["loc"][0], position, *item["loc"][1:]]} for item in error.errors]
                ) from error
        timings.tokenize_ms = (time.perf_counter() - start) * 1000
        results = self.score([item.record for item in prepared], timings) if prepared else []
        timings.total_ms = (time.perf_counter() - start) * 1000
        self.last_timings = timings
        return prepared, results


def precision_for(checkpoint: Checkpoint, device: torch.device, requested: str | None) -> Precision:
    """The precision `load` runs `checkpoint` in on `device`: `requested`, or the machine's default."""
    try:
        return resolve_precision(
            requested, device, stored_int8=checkpoint.stored_int8, calibrated=checkpoint.calibrated, rates=machine_rates
        )
    except ValueError as exc:
        raise ClefError(f"{checkpoint.where} {exc}" if checkpoint.stored_int8 else str(exc)) from None


def load(
    source: str | os.PathLike[str] = "tiny",
    *,
    device: str | torch.device = "auto",
    precision: str | None = None,
    revision: str | None = None,
    max_length: int = DEFAULT_MAX_LENGTH,
    batch_tokens: int = DEFAULT_BATCH_TOKENS,
    verify: bool = False,
    resident_layers: int | None = None,
) -> Clef:
    """Load a model: a release or bundle directory, a Hugging Face repo id, "tiny" (a generated random
    release) or "random:NAME[:SEED]" (random weights drawn in memory; names in RANDOM_CONFIGS).

    `precision` (model/precision.py): fp32, bf16, fp64, int8 (= int8-weight-only) or int8-w8a8; None:
    $CLEF_FLASH_PRECISION, else the fastest path qualified for this checkpoint on this machine (`Clef.precision`
    and `Clef.precision_policy.reason` say which and why; `clef-flash info`). A bundle (`clef-flash convert`) is int8 and memory-mapped; `verify` checks
    its files' sha256 first. A release loads in any precision (int8: quantized while loading).
    `resident_layers` (low-memory mode): at most that many decoder layers hold weights at once, each
    filled from the memory-mapped files just before it runs (slower: every forward reads every layer).
    A Core ML export directory (`clef-flash export coreml`) loads as a `CoreMLClef` (macOS only).
    """
    if is_export(source):  # a Core ML export (clef-flash export coreml): macOS only
        return CoreMLClef.open(source, precision=precision, max_length=max_length, verify=verify)
    checkpoint = open_checkpoint(source, revision=revision, verify=verify)
    resolved_device = pick_device(device)
    policy = precision_for(checkpoint, resolved_device, precision)
    kernel, dense_dtype = INT_MM, None
    if policy.int8_mode == W8A8 and resolved_device.type == "cpu":
        measured = machine_rates()
        kernel, dense_dtype = measured.int8_kernel, dense_dtype_for(measured)
    parts = build_model(
        checkpoint, policy, resolved_device, resident_layers=resident_layers, int8_kernel=kernel, dense_dtype=dense_dtype
    )
    return Clef(
        checkpoint, parts, device=resolved_device, precision=policy, max_length=max_length, batch_tokens=batch_tokens
    )


class CoreMLClef(Clef):
    """A Clef over the Core ML packages (clef_flash/coreml/): the same requests and answers, one record per
    prediction through the parts and the head. Records that do not fit the export's buckets or head shape
    are refused in `prepare`, before any inference."""

    def __init__(self, host: Any, *, max_length: int = DEFAULT_MAX_LENGTH):
        self.host = host
        self.checkpoint = None
        self.parts = None
        self.tokenizer = host.tokenizer
        self.device = torch.device("cpu")
        self.precision_policy = host.precision
        self.max_length = max_length
        self.batch_tokens = host.max_tokens
        self.model_name = DEFAULT_MODEL_NAME
        self.last_timings = Timings()

    @classmethod
    def open(cls, root: Any, *, precision: str | None = None, max_length: int = DEFAULT_MAX_LENGTH, verify: bool = False, runner: Any = None) -> CoreMLClef:
        """`root` with Core ML (`MLModelRunner`, macOS) or another runner (`coreml.runners.TorchRunner`)."""
        from .coreml.host import CoreMLHost
        from .coreml.runners import MLModelRunner

        if precision is not None:
            raise ClefError(f"{root} is a Core ML export: it runs as exported (8-bit weights, fp16); leave precision unset")
        return cls(CoreMLHost(root, runner or MLModelRunner(root), verify=verify), max_length=max_length)

    @property
    def source(self) -> str:
        return str(self.host.root)

    @property
    def is_random(self) -> bool:
        return "clef_flash_random" in self.host.layout.config["release_config"]

    def prepare(self, request: Any) -> Prepared:
        prepared = super().prepare(request)
        self.host.check(prepared.record)
        return prepared

    def score(self, records: Sequence[EncodedRecord], timings: Timings | None = None) -> list[list[QuestionResult]]:
        timings = timings if timings is not None else Timings()
        results = []
        for record in records:
            results.append([QuestionResult(*scored) for scored in self.host.score(record)])
            timings.decoder_ms += self.host.last_timings["decoder_ms"]
            timings.head_ms += self.host.last_timings["head_ms"]
            timings.forwards += 1
        timings.records += len(records)
        timings.tokens += sum(record.token_count for record in records)
        return results
