"""What a backend is: the part of the engine that runs tensors. Two implement it: torch and Core ML.

    check(record)                       refuse a record this backend cannot run (RequestInvalid), before inference
    forward(records, entries, timings)  records (each from its kept state, or from the start) -> question results
    run_states(rows, timings)           records' first tokens -> one CachedState each (when supported); from a kept
                                        state when `entries` gives one
    state_nbytes(tokens)                what keeping a state of `tokens` tokens costs
    state_reuse_unsupported             None, or why this backend cannot continue a state (said in /health)
    plan, describe()                    how it runs (plan.py) and what /health shows of it
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from ..plan import Plan
    from ..request.records import EncodedRecord, RecordMedia
    from ..state_cache import CachedState


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
    logits: tuple[float, ...]  # the model's own, never tempered
    probabilities: tuple[float, ...]
    temperature: float = 1.0  # a calibration's (calibration.py): probabilities = softmax(logits / temperature)


class Backend(Protocol):
    plan: Plan
    state_reuse_unsupported: str | None

    def check(self, record: EncodedRecord) -> None: ...

    def forward(
        self, records: Sequence[EncodedRecord], entries: Sequence[CachedState | None], timings: Timings
    ) -> list[list[QuestionResult]]: ...

    def run_states(
        self,
        rows: Sequence[Sequence[int]],
        timings: Timings,
        media: Sequence[RecordMedia | None] | None = None,
        entries: Sequence[CachedState | None] | None = None,
    ) -> list[CachedState]: ...

    def state_nbytes(self, tokens: int) -> int: ...

    def describe(self) -> dict[str, Any]: ...


class HeadClock:
    """Splits a decoder loop's time: what runs inside `with clock:` (the head reading each segment) goes to
    head_ms, the rest of the loop's seconds (`close`) to decoder_ms; one decoder step per `with`."""

    def __init__(self, timings: Timings, sync: Callable[[], None] = lambda: None):
        """`sync`: called at each boundary (device_io.timing_sync: a no-op unless a benchmark asks)."""
        self.timings, self.inside, self.sync = timings, 0.0, sync

    def __enter__(self) -> None:
        self.sync()
        self.started = time.perf_counter()

    def __exit__(self, *exc) -> None:
        self.sync()
        self.inside += time.perf_counter() - self.started
        self.timings.forwards += 1

    def close(self, loop_seconds: float) -> None:
        self.timings.head_ms += self.inside * 1000
        self.timings.decoder_ms += (loop_seconds - self.inside) * 1000
