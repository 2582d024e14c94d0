"""The torch backend: the decoder and the head as modules, records run in segments, states continued.

Records of a forward are right-padded to the longest and run through the decoder together; causality keeps
padding away from real tokens, so a record's logits do not depend on its neighbours beyond float rounding.
Long records run in segments (prefill.py), so memory grows with a record only by its K/V and the head's
memory rows. A kept state (state_cache.CachedState) is the decoder's state after the prefix + state and the
head's memory rows of those tokens.

Adapters (checkpoint/adapters.py, model/lora.py): each record names its fine-tune (`EncodedRecord.adapter`); one
decoder forward runs records of different adapters (routed per row inside the projections), and each adapter's
group of records reads its own head.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from ..checkpoint import Checkpoint, ModelParts, build_model
from ..checkpoint.adapters import AdapterCheckpoint, LoadedAdapters, install_adapters
from ..errors import ClefError, adapter_not_loaded, no_vision_tower
from ..model.head_batch import build_head_batch, softmax_per_question, split_logits
from ..model.joint_head import FeatureBuilder
from ..model.lora import BASE
from ..model.qwen3_5 import DecoderState
from ..plan import Plan
from ..prefill import DEFAULT_SEGMENT_TOKENS, RowMedia, row_media, run_segments
from ..request.records import EncodedRecord, RecordMedia
from ..state_cache import CachedState
from .. import device_io
from .backend import HeadClock, QuestionResult, Timings
from .graphs import CAPTURE_MODES, GraphPool


class TorchBackend:
    """`parts` (decoder, head, output embeddings) built from `checkpoint` as `plan` says."""

    state_reuse_unsupported = None

    def __init__(
        self,
        checkpoint: Checkpoint,
        plan: Plan,
        *,
        resident_layers: int | None = None,
        segment_tokens: int = DEFAULT_SEGMENT_TOKENS,
        adapters: Mapping[str, AdapterCheckpoint] | None = None,
        default_adapter: str | None = None,
        graphs: str | None = None,
    ):
        """`adapters`: clef-finetune checkpoints by name (checkpoint.adapters.read_adapters), run beside the base;
        `default_adapter`: the one a record that names none takes (None: the base). `graphs` (a GPU): how whole steps
        are captured (engine/graphs.py: "lazy", "load", "eager" or "off"; None: "lazy" on CUDA)."""
        if segment_tokens < 1:
            raise ClefError(f"segment_tokens must be at least 1, not {segment_tokens}")
        self.plan = plan
        self.device = plan.device
        self.parts: ModelParts = build_model(checkpoint, plan, resident_layers=resident_layers)
        self.pad_id = checkpoint.tokenizer.pad_id
        self.segment_tokens = segment_tokens
        self._empty_state: DecoderState | None = None
        self.adapters: LoadedAdapters | None = None
        if adapters:
            self.adapters = install_adapters(self.parts, plan, adapters, default=default_adapter, resident_layers=resident_layers)
        # A GPU runs every step in bucketed shapes (buckets.py), whole steps through captured graphs (not with
        # streamed layers: their weights arrive from the host as they run).
        self.bucketed = device_io.is_gpu(self.device)
        self.graphs: GraphPool | None = None
        if graphs not in (None, *CAPTURE_MODES):
            raise ClefError(f"unknown graphs mode {graphs!r}: use one of {', '.join(CAPTURE_MODES)}")
        if self.bucketed and graphs != "off" and not resident_layers:
            mode = graphs or ("lazy" if self.device.type == "cuda" else "eager")
            self.graphs = GraphPool(self.parts.decoder, self.pad_id, self.device, mode)

    def check(self, record: EncodedRecord) -> None:
        """Any record within the token limit runs here (the limit is checked when it is encoded); one with
        images or videos needs the source's vision tower; one with an adapter, that adapter loaded."""
        if record.media is not None and self.parts.vision is None:
            raise no_vision_tower(bool(record.media.image_count))
        if record.adapter is not None and (self.adapters is None or record.adapter not in self.adapters.adapters):
            raise adapter_not_loaded(record.adapter, [] if self.adapters is None else list(self.adapters.adapters))

    def describe(self) -> dict[str, Any]:
        described: dict[str, Any] = {"segment_tokens": self.segment_tokens, "bucketed": self.bucketed}
        if self.graphs is not None:
            described["graphs"] = self.graphs.describe()
        if self.adapters is not None:
            described["adapters"] = self.adapters.describe()
        return described

    def head_of(self, adapter: str | None):
        """The joint head a record of `adapter` (None: the base) is scored by."""
        return self.parts.head if self.adapters is None else self.adapters.heads[adapter]

    def _route(self, names: Sequence[str | None]):
        """run_segments' `route` for rows of these adapters (None: no adapter is kept apart)."""
        bank = None if self.adapters is None else self.adapters.bank
        if bank is None or (bank.default == BASE and all(name is None for name in names)):
            return None  # (the base's rows alone need no routing: whole steps of them can be graphed)
        slots = [bank.slot_of(name) for name in names]
        return lambda active, counts, width: bank.route([slots[index] for index in active], counts, width)

    def state_nbytes(self, tokens: int) -> int:
        return self.parts.decoder.state_nbytes(tokens) + tokens * self.parts.head.config.width * 4

    def run_states(
        self,
        rows: Sequence[Sequence[int]],
        timings: Timings,
        media: Sequence[RecordMedia | None] | None = None,
        adapters: Sequence[str | None] | None = None,
        entries: Sequence[CachedState | None] | None = None,
    ) -> list[CachedState]:
        """Run each row (a record's first tokens, with its images, through its adapter) and keep its decoder state
        and its head's memory rows. `entries[i]`, when given, is row i's state after its first `entries[i].tokens`
        tokens: the row runs on from there (the state is not changed)."""
        entries = [None] * len(rows) if entries is None else list(entries)
        starts = [0 if entry is None else entry.tokens for entry in entries]
        memory: list[list[torch.Tensor]] = [[] if entry is None else [entry.memory] for entry in entries]
        clock = HeadClock(timings, device_io.timing_sync(self.device))
        names = [None] * len(rows) if adapters is None else list(adapters)

        def keep_memory(hidden, active, done, counts):
            with clock:
                for name, picked in _by_adapter([names[index] for index in active]):
                    _, rows_memory = self.head_of(name).read(_rows_of(hidden, picked, len(active)))  # [B'', L, w]
                    for row, position in enumerate(picked):
                        memory[active[position]].append(rows_memory[row, : counts[position]])

        state = None
        if any(entry is not None for entry in entries):
            state = DecoderState.stack([self._empty() if entry is None else entry.decoder for entry in entries])
        started = time.perf_counter()
        states = run_segments(
            self.parts.decoder,
            [row[start:] for row, start in zip(rows, starts)],
            segment=self.segment_tokens,
            pad_id=self.pad_id,
            device=self.device,
            on_segment=keep_memory,
            state=state,
            keep_states=True,
            media=None if media is None else self._media(rows, media, starts),
            route=self._route(names),
            bucketed=self.bucketed,
        )
        kept = [CachedState(state, torch.cat(pieces), len(row)) for state, pieces, row in zip(states, memory, rows)]
        clock.close(time.perf_counter() - started)
        return kept

    def forward(
        self, records: Sequence[EncodedRecord], entries: Sequence[CachedState | None], timings: Timings
    ) -> list[list[QuestionResult]]:
        """Records from their kept states (or from the start) to the end, then the head: one decoder pass for
        all, each adapter's records then read by its own head. Records run ordered by adapter (each adapter's
        tokens one slice in the projections), answered in the order given."""
        order = sorted(range(len(records)), key=lambda index: (records[index].adapter is not None, records[index].adapter or ""))
        if order == list(range(len(records))):
            return self._forward(records, entries, timings)
        ran = self._forward([records[index] for index in order], [entries[index] for index in order], timings)
        results: list[list[QuestionResult]] = [[] for _ in records]
        for position, index in enumerate(order):
            results[index] = ran[position]
        return results

    def _forward(
        self, records: Sequence[EncodedRecord], entries: Sequence[CachedState | None], timings: Timings
    ) -> list[list[QuestionResult]]:
        start = time.perf_counter()
        clock = HeadClock(timings, device_io.timing_sync(self.device))
        names = [record.adapter for record in records]
        lengths = [record.token_count for record in records]
        starts = [0 if entry is None else entry.tokens for entry in entries]
        groups = []  # (adapter, its records' indices, their head batch, their feature builder)
        for name, members in _by_adapter(names):
            head_batch = build_head_batch([records[index] for index in members], self.device)
            # records from one kept state share its memory rows (the head attends to them once for all)
            prefixes = [None if entries[index] is None else entries[index].memory for index in members]
            builder = FeatureBuilder(self.head_of(name), head_batch, [lengths[index] for index in members], self.device, prefixes)
            groups.append((name, members, head_batch, builder))
        local = {index: (group, position) for group, (_, members, _, _) in enumerate(groups) for position, index in enumerate(members)}
        state = None
        if any(entry is not None for entry in entries):
            state = DecoderState.stack([self._empty() if entry is None else entry.decoder for entry in entries])

        def read(hidden, rows, done, counts):
            with clock:
                for group, (_, _, _, builder) in enumerate(groups):
                    picked = [position for position, row in enumerate(rows) if local[row][0] == group]
                    if picked:
                        builder.add(
                            _rows_of(hidden, picked, len(rows)),
                            [local[rows[position]][1] for position in picked],
                            [starts[rows[position]] + done[position] for position in picked],
                            [counts[position] for position in picked],
                        )

        run_segments(
            self.parts.decoder,
            [record.input_ids[first:] for record, first in zip(records, starts)],
            segment=self.segment_tokens,
            pad_id=self.pad_id,
            device=self.device,
            on_segment=read,
            state=state,
            media=self._media([record.input_ids for record in records], [record.media for record in records], starts),
            route=self._route(names),
            bucketed=self.bucketed,
            whole_step=self.graphs,
        )
        clock.sync()
        clock.close(time.perf_counter() - start)  # (on a GPU the host's time, unless timing_sync waits for the device)
        decoded = time.perf_counter()
        results: list[list[QuestionResult]] = [[] for _ in records]
        scored = []  # each adapter group's logits and probabilities [No] float64, on the device
        for name, members, head_batch, builder in groups:
            logits = self.head_of(name).score(builder.features(), head_batch, self.parts.lm_head)  # [No]
            scored += [logits.double(), softmax_per_question(logits, head_batch).double()]
        host = device_io.to_host(scored)  # the forward's one readback
        for (_, members, head_batch, _), host_logits, host_probabilities in zip(groups, host[0::2], host[1::2]):
            per_record_logits = split_logits(host_logits, head_batch)
            per_record_probabilities = split_logits(host_probabilities, head_batch)
            for index, record_logits, record_probabilities in zip(members, per_record_logits, per_record_probabilities):
                results[index] = [
                    QuestionResult(question.question_id, question.option_ids, tuple(q_logits.tolist()), tuple(q_probabilities.tolist()))
                    for question, q_logits, q_probabilities in zip(records[index].questions, record_logits, record_probabilities)
                ]
        timings.head_ms += (time.perf_counter() - decoded) * 1000
        return results

    def _media(self, rows: Sequence[Sequence[int]], media: Sequence[RecordMedia | None], starts: Sequence[int]) -> list[RowMedia | None] | None:
        """The rows' positions and the features of the media they run from `starts` on (prefill.row_media)."""
        return row_media(self.parts.vision, rows, media, starts, dtype=self.parts.decoder.dtype, device=self.device)

    def _empty(self) -> DecoderState:
        if self._empty_state is None:
            self._empty_state = self.parts.decoder.empty_state()
        return self._empty_state


def _by_adapter(names: Sequence[str | None]) -> list[tuple[str | None, list[int]]]:
    """Positions grouped by adapter, in order of first appearance."""
    groups: dict[str | None, list[int]] = {}
    for position, name in enumerate(names):
        groups.setdefault(name, []).append(position)
    return list(groups.items())


def _rows_of(hidden: torch.Tensor, picked: list[int], rows: int) -> torch.Tensor:
    """Rows `picked` of hidden [B, L, D] (all of them: hidden itself, no copy)."""
    if len(picked) == rows:
        return hidden
    return hidden.index_select(0, torch.tensor(picked, device=hidden.device))
