"""The engine: `load` a model, then encode, batch, run the decoder and the head, and shape answers.

Records of a batch are right-padded to the longest and run through the decoder together; causality
keeps padding away from real tokens, so a record's logits do not depend on its neighbours beyond
float rounding. A record's prefix + state is run once and kept (state_cache.py): records that share it,
in one call or later ones, run only their schema and suffix from the kept state. Long records run in
segments (prefill.py), so memory grows with a record only by its K/V and the head's memory rows.
"""

from __future__ import annotations

import os
import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from .checkpoint import Checkpoint, ModelParts, build_model, open_checkpoint
from .errors import ClefError, RequestInvalid
from .model.head_batch import build_head_batch, softmax_per_question, split_logits
from .model.joint_head import FeatureBuilder
from .model.qwen3_5 import DecoderState
from .prefill import DEFAULT_SEGMENT_TOKENS, run_segments
from .state_cache import MEBIBYTE, CachedState, StateCache, default_state_cache_mb
from .machine import rates as machine_rates
from .checkpoint.w8a8 import INT_MM
from .coreml.layout import is_export
from .model.precision import W8A8, Precision, dense_dtype_for, resolve_precision, w8a8_kernel
from .request.answers import shape_response
from .request.protocol import DEFAULT_MODEL_NAME, SystemOneRequest, parse_request
from .request.records import DEFAULT_MAX_LENGTH, EncodedRecord, encode_record

DEFAULT_BATCH_TOKENS = 8192  # padded tokens per decoder forward
# A prefix + state this long or longer is kept on first sight (when the cache is on): running a record as
# prefix + state, then the rest, costs a second decoder step, which pays only when the state is long.
# Shorter ones are kept only when records of one call share them. Measured in README's table (issue 14).
KEEP_FROM_TOKENS = 512


@dataclass
class Timings:
    """Milliseconds spent in the last call, by stage."""

    tokenize_ms: float = 0.0
    decoder_ms: float = 0.0
    head_ms: float = 0.0
    total_ms: float = 0.0
    records: int = 0
    tokens: int = 0
    tokens_reused: int = 0  # prefix + state tokens read from a kept state instead of run again
    forwards: int = 0  # decoder steps (segments)

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


def _state_end(record: EncodedRecord) -> int:
    """Tokens of the prefix + state: what records with the same state share."""
    return record.prefix_tokens + record.state_tokens


class _HeadClock:
    """Splits a decoder loop's time: what runs inside `with clock:` (the head reading each segment) goes to
    head_ms, the rest of the loop's seconds (`close`) to decoder_ms; one decoder step per `with`."""

    def __init__(self, timings: Timings):
        self.timings, self.inside = timings, 0.0

    def __enter__(self) -> None:
        self.started = time.perf_counter()

    def __exit__(self, *exc) -> None:
        self.inside += time.perf_counter() - self.started
        self.timings.forwards += 1

    def close(self, loop_seconds: float) -> None:
        self.timings.head_ms += self.inside * 1000
        self.timings.decoder_ms += (loop_seconds - self.inside) * 1000


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
        segment_tokens: int = DEFAULT_SEGMENT_TOKENS,
        state_cache_mb: float | None = None,
    ):
        if segment_tokens < 1:
            raise ClefError(f"segment_tokens must be at least 1, not {segment_tokens}")
        self.checkpoint = checkpoint
        self.parts = parts
        self.tokenizer = checkpoint.tokenizer
        self.device = device
        self.precision_policy = precision
        self.max_length = max_length
        self.batch_tokens = batch_tokens
        self.model_name = DEFAULT_MODEL_NAME
        self.last_timings = Timings()
        self.segment_tokens = segment_tokens
        self.keep_from_tokens = KEEP_FROM_TOKENS
        cache_mb = default_state_cache_mb() if state_cache_mb is None else state_cache_mb
        if cache_mb < 0:
            raise ClefError(f"state_cache_mb must be 0 (off) or more, not {cache_mb}")
        identity = "|".join(
            map(str, (checkpoint.source, checkpoint.fingerprint, checkpoint.weights_fingerprint, precision.name, device))
        )
        self.state_cache = StateCache(int(cache_mb * MEBIBYTE), identity)
        self._empty_state: DecoderState | None = None

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
        return self._pack(order, [record.token_count for record in records])

    def _pack(self, order: list[int], tokens: Sequence[int]) -> list[list[int]]:
        """Consecutive runs of `order` whose padded tokens fit the budget."""
        groups: list[list[int]] = []
        while order:
            count = fitting((tokens[index] for index in order), self.batch_tokens)
            groups.append(order[:count])
            order = order[count:]
        return groups

    @torch.inference_mode()
    def score(self, records: Sequence[EncodedRecord], timings: Timings | None = None) -> list[list[QuestionResult]]:
        """Logits and probabilities for every question of every encoded record.

        A record whose prefix + state is kept (cached, or shared with another record of this call) runs
        from that state; otherwise its state is kept on the way when it may be asked again (the cache is
        on and the entry fits, or another record of this call shares it). Records sharing a state are
        grouped, so a call holds at most the states of the group at hand beyond the cache.
        """
        timings = timings if timings is not None else Timings()
        results: list[list[QuestionResult] | None] = [None] * len(records)
        cache = self.state_cache
        keys = [cache.key(record.input_ids[: _state_end(record)]) for record in records]
        shared = Counter(keys)
        keyed = [
            shared[key] > 1 or key in cache or self._worth_keeping(key, _state_end(record))
            for key, record in zip(keys, records)
        ]
        new_tokens = [
            record.token_count - (_state_end(record) if uses else 0) for record, uses in zip(records, keyed)
        ]
        order = sorted(  # records sharing a state side by side; the others by length
            range(len(records)),
            key=lambda index: (keyed[index], _state_end(records[index]) if keyed[index] else 0, keys[index] if keyed[index] else "", new_tokens[index]),
        )
        remaining = Counter(key for key, uses in zip(keys, keyed) if uses)
        held: dict[str, CachedState] = {}
        computed: set[str] = set()
        for group in self._pack(order, new_tokens):
            missing: dict[str, EncodedRecord] = {}  # key -> the first record of the group with it
            for index in group:
                key = keys[index]
                if keyed[index] and key not in held and key not in missing:
                    entry = cache.get(key)
                    if entry is None:
                        missing[key] = records[index]
                    else:
                        held[key] = entry
            if missing:
                held.update(self._states(missing, timings))
                computed.update(missing)
            entries = [held[keys[index]] if keyed[index] else None for index in group]
            for index, per_question in zip(group, self._forward([records[index] for index in group], entries, timings)):
                results[index] = per_question
            for index in group:
                if keyed[index]:
                    remaining[keys[index]] -= 1
                    if not remaining[keys[index]]:
                        del held[keys[index]]
        state_tokens = {key: _state_end(record) for key, record in zip(keys, records)}
        timings.tokens_reused += sum(state_tokens[key] for key, uses in zip(keys, keyed) if uses) - sum(
            state_tokens[key] for key in computed
        )
        cache.count(hits=sum(keyed) - len(computed), misses=len(computed))
        timings.records += len(records)
        timings.tokens += sum(record.token_count for record in records)
        return results  # type: ignore[return-value]

    def _worth_keeping(self, key: str, tokens: int) -> bool:
        """Whether to keep a state this call does not share, within the cache's bound: when it is long
        enough that reusing it pays for the second decoder step it costs now (KEEP_FROM_TOKENS), or when it
        was seen before (a short state asked again is kept the second time)."""
        seen = self.state_cache.seen(key)
        entry_bytes = self.parts.decoder.state_nbytes(tokens) + tokens * self.parts.head.config.width * 4
        return (tokens >= self.keep_from_tokens or seen) and self.state_cache.fits(entry_bytes)

    def _states(self, records: dict[str, EncodedRecord], timings: Timings) -> dict[str, CachedState]:
        """Run the prefix + state of each record (one per key) and keep what later tokens need."""
        keys = sorted(records, key=lambda key: _state_end(records[key]))
        rows = [records[key].input_ids[: _state_end(records[key])] for key in keys]
        memory: list[list[torch.Tensor]] = [[] for _ in keys]
        clock = _HeadClock(timings)

        def keep_memory(hidden, active, starts, counts):
            with clock:
                _, rows_memory = self.parts.head.read(hidden)  # [B', L, w]
                for row, index in enumerate(active):
                    memory[index].append(rows_memory[row, : counts[row]])

        kept: dict[str, CachedState] = {}
        started = time.perf_counter()
        for group in self._pack(list(range(len(keys))), [len(row) for row in rows]):
            states = run_segments(
                self.parts.decoder,
                [rows[index] for index in group],
                segment=self.segment_tokens,
                pad_id=self.tokenizer.pad_id,
                device=self.device,
                on_segment=lambda hidden, active, starts, counts: keep_memory(
                    hidden, [group[row] for row in active], starts, counts
                ),
                keep_states=True,
            )
            for index, state in zip(group, states):
                entry = CachedState(state, torch.cat(memory[index]), len(rows[index]))
                memory[index] = []
                kept[keys[index]] = entry
                self.state_cache.put(keys[index], entry)
        self._sync()
        clock.close(time.perf_counter() - started)
        return kept

    def _forward(
        self, records: Sequence[EncodedRecord], entries: Sequence[CachedState | None], timings: Timings
    ) -> list[list[QuestionResult]]:
        """Records from their kept states (or from the start) to the end, then the head."""
        start = time.perf_counter()
        clock = _HeadClock(timings)
        lengths = [record.token_count for record in records]
        head_batch = build_head_batch(records, self.device)
        builder = FeatureBuilder(self.parts.head, head_batch, lengths, self.device)
        starts = [0 if entry is None else entry.tokens for entry in entries]
        state = None
        if any(entry is not None for entry in entries):
            for row, entry in enumerate(entries):
                if entry is not None:
                    builder.add_memory(row, entry.memory)
            state = DecoderState.stack([self._empty() if entry is None else entry.decoder for entry in entries])

        def read(hidden, rows, done, counts):
            with clock:
                builder.add(hidden, rows, [starts[row] + offset for row, offset in zip(rows, done)], counts)

        run_segments(
            self.parts.decoder,
            [record.input_ids[first:] for record, first in zip(records, starts)],
            segment=self.segment_tokens,
            pad_id=self.tokenizer.pad_id,
            device=self.device,
            on_segment=read,
            state=state,
        )
        self._sync()
        clock.close(time.perf_counter() - start)
        decoded = time.perf_counter()
        logits = self.parts.head.score(builder.features(), head_batch, self.parts.lm_head)  # [No]
        probabilities = softmax_per_question(logits, head_batch)
        per_record_logits = split_logits(logits.double().cpu(), head_batch)
        per_record_probabilities = split_logits(probabilities.double().cpu(), head_batch)
        timings.head_ms += (time.perf_counter() - decoded) * 1000
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

    def _empty(self) -> DecoderState:
        if self._empty_state is None:
            self._empty_state = self.parts.decoder.empty_state()
        return self._empty_state

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
    segment_tokens: int = DEFAULT_SEGMENT_TOKENS,
    state_cache_mb: float | None = None,
) -> Clef:
    """Load a model: a release or bundle directory, a Hugging Face repo id, "tiny" (a generated random
    release) or "random:NAME[:SEED]" (random weights drawn in memory; names in RANDOM_CONFIGS).

    `precision` (model/precision.py): fp32, bf16, fp64, int8 (= int8-weight-only) or int8-w8a8; None:
    $CLEF_FLASH_PRECISION, else the fastest path qualified for this checkpoint on this machine (`Clef.precision`
    and `Clef.precision_policy.reason` say which and why; `clef-flash info`). A bundle (`clef-flash convert`) is int8 and memory-mapped; `verify` checks
    its files' sha256 first. A release loads in any precision (int8: quantized while loading).
    `resident_layers` (low-memory mode): at most that many decoder layers hold weights at once, each
    filled from the memory-mapped files just before it runs (slower: every forward reads every layer).
    `segment_tokens`: the most tokens of a record one decoder step runs (prefill.py). `state_cache_mb`:
    the bound of the state cache (state_cache.py); None: an eighth of this machine's memory, at most
    4 GiB; 0: off (records of one call still share their states).
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
        try:
            kernel = w8a8_kernel(measured)  # exact kernels only: forced or not
        except ValueError as exc:
            raise ClefError(str(exc)) from None
        dense_dtype = dense_dtype_for(measured)
    parts = build_model(
        checkpoint, policy, resolved_device, resident_layers=resident_layers, int8_kernel=kernel, dense_dtype=dense_dtype
    )
    return Clef(
        checkpoint,
        parts,
        device=resolved_device,
        precision=policy,
        max_length=max_length,
        batch_tokens=batch_tokens,
        segment_tokens=segment_tokens,
        state_cache_mb=state_cache_mb,
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
        self.state_cache = StateCache(0, f"coreml|{host.root}")  # off: a record runs whole, as exported
        self.segment_tokens = self.keep_from_tokens = 0

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
