"""The Core ML backend: an export's packages run a record at a time (coreml/host.py), by Core ML on macOS or
by the traced torch twins standing in for it (`runner="torch"`: tests, and checking an export before it
goes to a Mac). The packages take no decoder state, so states are not continued here: the engine runs
every record whole, and /health says why.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ..checkpoint import Checkpoint
from ..checkpoint import coreml_layout as layout
from ..coreml.host import CoreMLHost, Runner
from ..checkpoint.coreml_layout import RUNNERS
from ..coreml.runners import make_runner
from ..errors import ClefError, media_unsupported
from ..request.records import EncodedRecord
from ..state_cache import CachedState
from .backend import QuestionResult, Timings

if TYPE_CHECKING:
    from ..plan import Plan


class CoreMLBackend:
    state_reuse_unsupported = "the Core ML parts run a record whole from position 0: they take no decoder state"

    def __init__(self, checkpoint: Checkpoint, plan: Plan, *, runner: str | Runner = "coreml", verify: bool = False):
        """`plan`: plan.py's `coreml_plan` for `runner`: "coreml", "torch" (coreml/runners.py), or a runner object
        (benchmarks: the fp16 twins)."""
        if isinstance(runner, str) and runner not in RUNNERS:
            raise ClefError(f"unknown Core ML runner {runner!r}: use one of {', '.join(RUNNERS)}")
        export = layout.read_export(checkpoint.root, verify=verify)
        self.runner_name = runner if isinstance(runner, str) else type(runner).__name__
        self.host = CoreMLHost(export, make_runner(runner, export) if isinstance(runner, str) else runner)
        self.plan = plan

    def check(self, record: EncodedRecord) -> None:
        """Refuses a record longer than the largest bucket, or with more questions or options than the head holds,
        or with images (the Core ML export is text only: not done)."""
        if record.media is not None:
            field = "images" if record.media.image_count else "videos"
            raise media_unsupported(field, f"the Core ML export answers text only; {field} need the torch backend (a release)")
        self.host.check(record)

    def describe(self) -> dict[str, Any]:
        return {**self.host.describe(), "runner": self.runner_name}

    def state_nbytes(self, tokens: int) -> int:
        return 0

    def run_states(self, rows: Sequence[Sequence[int]], timings: Timings, media=None, entries=None) -> list[CachedState]:
        raise ClefError(f"Core ML: {self.state_reuse_unsupported}")

    def forward(
        self, records: Sequence[EncodedRecord], entries: Sequence[CachedState | None], timings: Timings
    ) -> list[list[QuestionResult]]:
        results = []
        for record, entry in zip(records, entries):
            if entry is not None:
                raise ClefError(f"Core ML: {self.state_reuse_unsupported}")
            results.append([QuestionResult(*scored) for scored in self.host.score(record)])
            timings.decoder_ms += self.host.last_timings["decoder_ms"]
            timings.head_ms += self.host.last_timings["head_ms"]
            timings.forwards += 1
        return results
