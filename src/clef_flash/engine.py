"""The engine: `load` a model, then encode, batch, run the decoder and the head, and shape answers.

Records of a batch are right-padded to the longest and run through one decoder forward; causality
keeps padding away from real tokens, so a record's logits do not depend on its neighbours beyond
float rounding. Batches are formed by sorting records by length and filling a token budget.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import torch

from .bundle import is_bundle, load_bundle
from .errors import ClefError, RequestInvalid
from .model.joint_head import build_head_batch, softmax_per_question, split_logits
from .quant import DEFAULT_MODE
from .protocol import DEFAULT_MODEL_NAME, SystemOneRequest, parse_request, shape_response
from .records import DEFAULT_MAX_LENGTH, EncodedRecord, encode_record
from .weights import Release, load_release, resolve_source

PRECISIONS = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp64": torch.float64}
# 8-bit weights (quant.py), by compute mode; "int8" is the default mode.
INT8_PRECISIONS = {"int8": DEFAULT_MODE, "int8-weight-only": "weight-only", "int8-w8a8": "w8a8"}
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


def pick_dtype(precision: str | None, device: torch.device) -> tuple[torch.dtype, str | None]:
    """(compute dtype, int8 mode or None). None: bf16 (the release's own dtype).

    8-bit weights compute in fp32 on CPU (bf16 arithmetic has no gain there without native bf16 units,
    and fp32 activations keep the agreement) and in bf16 on CUDA.
    """
    if precision is None:
        return torch.bfloat16, None
    if precision in INT8_PRECISIONS:
        return (torch.bfloat16 if device.type == "cuda" else torch.float32), INT8_PRECISIONS[precision]
    if precision not in PRECISIONS:
        raise ClefError(f"unknown precision {precision!r}: use one of {', '.join([*PRECISIONS, *INT8_PRECISIONS])}")
    return PRECISIONS[precision], None


def precision_name(dtype: torch.dtype, mode: str | None) -> str:
    """The name `load` was asked for, as `Clef.precision` reports it: fp32, bf16, int8-weight-only, ..."""
    return {value: key for key, value in PRECISIONS.items()}[dtype] if mode is None else f"int8-{mode}"


class Clef:
    """A loaded clef-flash model. Build it with `clef_flash.load(source)`."""

    def __init__(
        self,
        release: Release,
        *,
        device: torch.device,
        precision: str,
        source: str,
        max_length: int = DEFAULT_MAX_LENGTH,
        batch_tokens: int = DEFAULT_BATCH_TOKENS,
    ):
        self.release = release
        self.tokenizer = release.tokenizer
        self.device = device
        self.precision = precision
        self.source = source
        self.max_length = max_length
        self.batch_tokens = batch_tokens
        self.model_name = DEFAULT_MODEL_NAME
        self.last_timings = Timings()
        random_info = release.config.get("clef_flash_random")
        self.is_random = random_info is not None

    def __repr__(self) -> str:
        random = " (random weights)" if self.is_random else ""
        return f"Clef({self.source!r}, precision={self.precision}, device={self.device}){random}"

    # -- encoding --------------------------------------------------------------------------

    def parse(self, request: Any) -> SystemOneRequest:
        return request if isinstance(request, SystemOneRequest) else parse_request(request)

    def encode(self, request: Any, *, truncate_state: bool = False) -> EncodedRecord:
        """Validate a request and render it to token ids and spans (SPEC §3)."""
        return encode_record(
            self.tokenizer, self.parse(request), max_length=self.max_length, truncate_state=truncate_state
        )

    # -- inference -------------------------------------------------------------------------

    def batches(self, records: Sequence[EncodedRecord]) -> list[list[int]]:
        """Indices of records grouped into forwards: sorted by length, each within the token budget."""
        order = sorted(range(len(records)), key=lambda index: records[index].token_count)
        groups: list[list[int]] = []
        current: list[int] = []
        for index in order:
            longest = records[index].token_count  # sorted: the newest is the longest
            if current and longest * (len(current) + 1) > self.batch_tokens:
                groups.append(current)
                current = []
            current.append(index)
        if current:
            groups.append(current)
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
        hidden = self.release.decoder(input_ids, length_tensor)  # [B, L, D]
        self._sync()
        decoded = time.perf_counter()
        head_batch = build_head_batch(records, self.device)
        logits = self.release.head(hidden, length_tensor, head_batch, self.release.lm_head)  # [No]
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
        (results,) = self._run([request])[2]
        return {result.question_id: dict(zip(result.option_ids, result.logits)) for result in results}

    def probabilities(self, request: Any) -> dict[str, dict[str, float]]:
        """Unrounded float32 softmax probabilities per question and option."""
        (results,) = self._run([request])[2]
        return {result.question_id: dict(zip(result.option_ids, result.probabilities)) for result in results}

    def answer(self, request: Any, *, decimals: int | None = 4) -> dict[str, Any]:
        """The System One response body for one request."""
        return self.answer_many([request], decimals=decimals)[0]

    def answer_many(self, requests: Sequence[Any], *, decimals: int | None = 4) -> list[dict[str, Any]]:
        """System One response bodies for many requests, batched into as few forwards as fit."""
        parsed, records, results = self._run(requests)
        return [
            shape_response(
                request,
                [(result.option_ids, result.probabilities) for result in per_question],
                input_tokens=record.token_count,
                decimals=decimals,
                default_model=self.model_name,
            )
            for request, per_question, record in zip(parsed, results, records)
        ]

    def _run(
        self, requests: Sequence[Any]
    ) -> tuple[list[SystemOneRequest], list[EncodedRecord], list[list[QuestionResult]]]:
        """Validate and encode every request (errors name the request's position), then score them all."""
        timings = Timings()
        start = time.perf_counter()
        parsed, records = [], []
        for position, request in enumerate(requests):
            try:
                request = self.parse(request)
                records.append(encode_record(self.tokenizer, request, max_length=self.max_length))
            except RequestInvalid as error:
                if len(requests) == 1:
                    raise
                raise RequestInvalid(
                    [{**item, "loc": [item["loc"][0], position, *item["loc"][1:]]} for item in error.errors]
                ) from error
            parsed.append(request)
        timings.tokenize_ms = (time.perf_counter() - start) * 1000
        results = self.score(records, timings) if records else []
        timings.total_ms = (time.perf_counter() - start) * 1000
        self.last_timings = timings
        return parsed, records, results


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
    """Load a model: a release or bundle directory, a Hugging Face repo id, or "tiny" (random weights).

    A bundle (`clef-flash convert`) is int8 and memory-mapped; `verify` checks its files' sha256 first.
    A release loads in fp32 or bf16, or as int8 (quantized while loading).
    `resident_layers` (low-memory mode): at most that many decoder layers hold weights at once, each
    filled from the memory-mapped files just before it runs (slower: every forward reads every layer).
    """
    root = Path(resolve_source(source, revision=revision))
    resolved_device = pick_device(device)
    if is_bundle(root):
        if precision is not None and precision not in INT8_PRECISIONS:
            raise ClefError(
                f"{root} is an 8-bit bundle: use precision int8 (or {', '.join(list(INT8_PRECISIONS)[1:])}); "
                f"for {precision}, load the release it was converted from"
            )
        dtype, mode = pick_dtype(precision or "int8", resolved_device)
        release = load_bundle(
            root, device=resolved_device, dtype=dtype, mode=mode, check=verify, resident_layers=resident_layers
        )
    else:
        dtype, mode = pick_dtype(precision, resolved_device)
        release = load_release(
            root, device=resolved_device, dtype=dtype, quantization=mode, resident_layers=resident_layers
        )
    return Clef(
        release,
        device=resolved_device,
        precision=precision_name(dtype, mode),
        source=os.fspath(source),
        max_length=max_length,
        batch_tokens=batch_tokens,
    )
