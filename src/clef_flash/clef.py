"""`Clef`, the facade: a loaded model as the protocol sees it. Build one with `clef_flash.load(source)`.

It owns requests: parse, encode (and truncate), score through the engine, temper the probabilities when a
calibration is loaded (calibration.py), and shape the System One answers. Everything above it (server, batch, eval,
bench, Ray, the CLI) is written against it once, for every backend. What runs the tensors is the engine's backend
(engine/); how, the plan (plan.py).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from . import explain
from .calibration import Calibration
from .checkpoint import Checkpoint
from .engine import Engine, QuestionResult, Timings
from .explain import ExplainJob, ExplainOptions, Explanation, explain_options
from .plan import Plan
from .request.answers import shape_response
from .request.protocol import DEFAULT_MODEL_NAME, SystemOneRequest, parse_request
from .request.records import DEFAULT_MAX_LENGTH, EncodedRecord, encode_record, marked_text
from .errors import RequestInvalid, adapter_not_loaded
from .state_cache import StateCache


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


class Encoder:
    """A checkpoint's tokenizer and processors: requests to token ids and spans, no weights loaded (what
    `clef-flash render` runs: `clef_flash.loader.open_encoder`). `Clef` is one, with an engine."""

    def __init__(self, checkpoint: Checkpoint, *, max_length: int | None = DEFAULT_MAX_LENGTH):
        self.checkpoint = checkpoint
        self.tokenizer = checkpoint.tokenizer
        self.max_length = DEFAULT_MAX_LENGTH if max_length is None else max_length  # tokens per record

    def parse(self, request: Any) -> SystemOneRequest:
        return request if isinstance(request, SystemOneRequest) else parse_request(request)

    def encode(self, request: Any, *, truncate_state: bool = False) -> EncodedRecord:
        """Validate a request and render it to token ids and spans (SPEC §3)."""
        return encode_record(
            self.tokenizer,
            self.parse(request),
            max_length=self.max_length,
            truncate_state=truncate_state,
            image_processor=self.checkpoint.image_processor,
            video_processor=self.checkpoint.video_processor,
        )

    def marked_text(self, record: EncodedRecord) -> str:
        """An encoded record's prompt with every question and option span marked (request/records.py)."""
        return marked_text(self.tokenizer, record)

    def render(self, request: Any, *, truncate_state: bool = False) -> str:
        """The rendered prompt with every question and option span marked."""
        return self.marked_text(self.encode(request, truncate_state=truncate_state))


class Clef(Encoder):
    """A loaded clef-flash model: requests in, System One answers out."""

    def __init__(
        self, checkpoint: Checkpoint, engine: Engine, *, max_length: int | None = DEFAULT_MAX_LENGTH, calibration: Calibration | None = None
    ):
        super().__init__(checkpoint, max_length=max_length)
        self.engine = engine
        self.calibration = calibration  # temperatures per adapter and question (None: the model's own probabilities)
        self.model_name = DEFAULT_MODEL_NAME
        self.last_timings = Timings()
        self.last_records: list[EncodedRecord] = []  # the last call's records (a truncated state's counts)

    # -- what it is ---------------------------------------------------------------------------

    @property
    def plan(self) -> Plan:
        """How it runs: backend, precision, kernel, dtypes, device and why (plan.py)."""
        return self.engine.backend.plan

    @property
    def precision(self) -> str:
        """The precision this model runs in: fp32, bf16, fp64, int8-weight-only, int8-w8a8 (or Core ML's)."""
        return self.plan.name

    @property
    def precision_policy(self):
        return self.plan.precision

    @property
    def device(self) -> torch.device:
        return self.plan.device

    @property
    def source(self) -> str:
        return self.checkpoint.source

    @property
    def is_random(self) -> bool:
        return self.checkpoint.is_random

    @property
    def state_cache(self) -> StateCache:
        return self.engine.state_cache

    @property
    def state_reuse(self) -> str:
        """"on", "off" (a bound of 0) or why the backend cannot continue a state."""
        unsupported = self.engine.backend.state_reuse_unsupported
        return f"unsupported: {unsupported}" if unsupported else ("on" if self.state_cache.enabled else "off")

    @property
    def parts(self):
        """The torch backend's modules (decoder, head, output embeddings); None on Core ML."""
        return getattr(self.engine.backend, "parts", None)

    @property
    def host(self):
        """The Core ML backend's host (coreml/host.py); None on torch."""
        return getattr(self.engine.backend, "host", None)

    @property
    def batch_tokens(self) -> int:
        return self.engine.batch_tokens

    @batch_tokens.setter
    def batch_tokens(self, value: int) -> None:
        self.engine.batch_tokens = value

    @property
    def keep_from_tokens(self) -> int:
        return self.engine.keep_from_tokens

    @keep_from_tokens.setter
    def keep_from_tokens(self, value: int) -> None:
        self.engine.keep_from_tokens = value

    @property
    def segment_tokens(self) -> int | None:
        return getattr(self.engine.backend, "segment_tokens", None)

    @segment_tokens.setter
    def segment_tokens(self, value: int) -> None:
        self.engine.backend.segment_tokens = value

    def describe(self) -> dict[str, Any]:
        """What /health and `info` say of the loaded model beyond its identity."""
        described = {"plan": self.plan.describe(), "state_reuse": self.state_reuse, **self.engine.backend.describe()}
        if self.calibration is not None:
            described["calibration"] = self.calibration.describe()
        return described

    @property
    def adapters(self) -> list[str]:
        """The names of the adapters loaded beside the base (clef-finetune checkpoints), in load order."""
        loaded = getattr(self.engine.backend, "adapters", None)
        return [] if loaded is None else list(loaded.adapters)

    @property
    def default_adapter(self) -> str | None:
        """The adapter a request that names none gets (None: the base model)."""
        loaded = getattr(self.engine.backend, "adapters", None)
        return None if loaded is None else loaded.default

    @property
    def adapter_fingerprints(self) -> dict[str, str]:
        """Each loaded adapter's fingerprint (sha256 over its files): what a calibration fitted for it records."""
        loaded = getattr(self.engine.backend, "adapters", None)
        return {} if loaded is None else {name: item.fingerprint for name, item in loaded.adapters.items()}

    def adapter_for(self, name: str | None) -> str | None:
        """The adapter a request's `adapter` field (None: left out) resolves to; RequestInvalid when not loaded."""
        if name is None:
            return self.default_adapter
        if name not in self.adapters:
            raise adapter_not_loaded(name, self.adapters)
        return name

    def __repr__(self) -> str:
        random = " (random weights)" if self.is_random else ""
        return f"Clef({self.source!r}, precision={self.precision}, device={self.device}){random}"

    # -- requests --------------------------------------------------------------------------

    def prepare(self, request: Any, *, truncate_state: bool = False) -> Prepared:
        """Parse and encode a request (raises RequestInvalid / RecordTooLong, before any inference), and
        check that the backend can run it."""
        parsed = self.parse(request)
        adapter = self.adapter_for(parsed.adapter)
        record = self.encode(parsed, truncate_state=truncate_state)
        prepared = Prepared(parsed, record if adapter is None else dataclasses.replace(record, adapter=adapter))
        self.engine.backend.check(prepared.record)
        return prepared

    def respond(self, prepared: Prepared, results: Sequence[QuestionResult], *, decimals: int | None = 4) -> dict[str, Any]:
        """The System One body of a prepared request from its scored questions; with a calibration loaded, its
        `calibration` field (clef-flash's own, additive) names the file and each question's temperature."""
        body = prepared.respond(results, default_model=self.model_name, decimals=decimals)
        if self.calibration is not None:
            body["calibration"] = self.calibration.note(results)
        return body

    # -- inference -------------------------------------------------------------------------

    def batches(self, records: Sequence[EncodedRecord]) -> list[list[int]]:
        """Indices of records grouped into forwards: sorted by length, each within the token budget."""
        return self.engine.batches(records)

    @torch.inference_mode()
    def score(self, records: Sequence[EncodedRecord], timings: Timings | None = None) -> list[list[QuestionResult]]:
        """Logits and probabilities for every question of every encoded record (engine/core.py); with a calibration
        loaded, the probabilities are softmax(logits / T) with each record's adapter's T per question (the logits
        stay the model's)."""
        results = self.engine.score(records, timings)
        if self.calibration is None:
            return results
        return [self.calibration.apply(record.adapter, per_question) for record, per_question in zip(records, results, strict=True)]

    # -- the public API of SPEC §7 ------------------------------------------------------------

    def logits(self, request: Any) -> dict[str, dict[str, float]]:
        """Unrounded logits per question and option (options in the model's order): the model's own, before a
        calibration's temperature."""
        (results,) = self._run([request])[1]
        return {result.question_id: dict(zip(result.option_ids, result.logits)) for result in results}

    def probabilities(self, request: Any) -> dict[str, dict[str, float]]:
        """Unrounded float32 softmax probabilities per question and option (float64 softmax(logits / T) for a question
        a loaded calibration tempers)."""
        (results,) = self._run([request])[1]
        return {result.question_id: dict(zip(result.option_ids, result.probabilities)) for result in results}

    def answer(self, request: Any, *, decimals: int | None = 4, truncate_state: bool = False) -> dict[str, Any]:
        """The System One response body for one request (`truncate_state`: cut the state's end to fit)."""
        return self.answer_many([request], decimals=decimals, truncate_state=truncate_state)[0]

    def answer_many(self, requests: Sequence[Any], *, decimals: int | None = 4, truncate_state: bool = False) -> list[dict[str, Any]]:
        """System One response bodies for many requests, batched into as few forwards as fit."""
        prepared, results = self._run(requests, truncate_state=truncate_state)
        return [self.respond(item, per_question, decimals=decimals) for item, per_question in zip(prepared, results)]

    # -- explanations (explain/) -------------------------------------------------------------

    def explain(
        self,
        request: Any,
        *,
        method: str = "leave-out",
        depth: int = 1,
        max_parts: int = 64,
        steps: int = 16,
        question_ids: Sequence[str] | None = None,
    ) -> Explanation:
        """Why it decided that: every part of the state's contribution to every option of every question.

        Parts: each image and video, each field of a JSON state (to `depth` levels), each sentence or line of a text
        (explain/parts.py). `method="leave-out"`: a contribution is p(option) minus p(option) with the part left out,
        the full record's shared prefix run once (the state cache's machinery); `"integrated-gradients"` (`steps`
        along the path) or `"input-x-gradient"`: Captum's token-level attributions, summed per part (fp32 / bf16
        models). `question_ids`: the questions to report. A state with more than `max_parts` parts, of one part or
        none, an unknown question id: RequestInvalid, before any inference."""
        return self.run_explanation(
            self.prepare_explanation(request, explain_options(method=method, depth=depth, max_parts=max_parts, steps=steps, question_ids=question_ids))
        )

    def prepare_explanation(self, request: Any, options: ExplainOptions) -> ExplainJob:
        """Everything `explain` checks and renders, no inference (the server does this before queueing)."""
        return explain.prepare(self, request, options)

    def run_explanation(self, job: ExplainJob) -> Explanation:
        """Score a prepared explanation (the server's model worker runs this)."""
        return explain.run(self, job)

    def _run(self, requests: Sequence[Any], *, truncate_state: bool = False) -> tuple[list[Prepared], list[list[QuestionResult]]]:
        """Validate and encode every request (errors name the request's position), then score them all."""
        timings = Timings()
        start = time.perf_counter()
        prepared = []
        for position, request in enumerate(requests):
            try:
                prepared.append(self.prepare(request, truncate_state=truncate_state))
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
        self.last_records = [item.record for item in prepared]
        return prepared, results
