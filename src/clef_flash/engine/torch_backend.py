"""The torch backend: the decoder and the head as modules, records run in segments, states continued.

Records of a forward are right-padded to the longest and run through the decoder together; causality keeps
padding away from real tokens, so a record's logits do not depend on its neighbours beyond float rounding.
Long records run in segments (prefill.py), so memory grows with a record only by its K/V and the head's
memory rows. A kept state (state_cache.CachedState) is the decoder's state after the prefix + state and the
head's memory rows of those tokens.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch

from ..checkpoint import Checkpoint, ModelParts, build_model
from ..errors import ClefError, no_vision_tower
from ..model.head_batch import build_head_batch, softmax_per_question, split_logits
from ..model.joint_head import FeatureBuilder
from ..model.qwen3_5 import DecoderState
from ..plan import Plan
from ..prefill import DEFAULT_SEGMENT_TOKENS, RowMedia, row_media, run_segments
from ..request.records import EncodedRecord, RecordMedia
from ..state_cache import CachedState
from .backend import HeadClock, QuestionResult, Timings


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
    ):
        if segment_tokens < 1:
            raise ClefError(f"segment_tokens must be at least 1, not {segment_tokens}")
        self.plan = plan
        self.device = plan.device
        self.parts: ModelParts = build_model(checkpoint, plan, resident_layers=resident_layers)
        self.pad_id = checkpoint.tokenizer.pad_id
        self.segment_tokens = segment_tokens
        self._empty_state: DecoderState | None = None

    def check(self, record: EncodedRecord) -> None:
        """Any record within the token limit runs here (the limit is checked when it is encoded); one with
        images or videos needs the source's vision tower."""
        if record.media is not None and self.parts.vision is None:
            raise no_vision_tower(bool(record.media.image_count))

    def describe(self) -> dict[str, Any]:
        return {"segment_tokens": self.segment_tokens}

    def state_nbytes(self, tokens: int) -> int:
        return self.parts.decoder.state_nbytes(tokens) + tokens * self.parts.head.config.width * 4

    def run_states(
        self, rows: Sequence[Sequence[int]], timings: Timings, media: Sequence[RecordMedia | None] | None = None
    ) -> list[CachedState]:
        """Run each row (a prefix + state, with its record's images) and keep its decoder state and the head's
        memory rows."""
        memory: list[list[torch.Tensor]] = [[] for _ in rows]
        clock = HeadClock(timings)

        def keep_memory(hidden, active, starts, counts):
            with clock:
                _, rows_memory = self.parts.head.read(hidden)  # [B', L, w]
                for row, index in enumerate(active):
                    memory[index].append(rows_memory[row, : counts[row]])

        started = time.perf_counter()
        states = run_segments(
            self.parts.decoder,
            rows,
            segment=self.segment_tokens,
            pad_id=self.pad_id,
            device=self.device,
            on_segment=keep_memory,
            keep_states=True,
            media=None if media is None else self._media(rows, media, [False] * len(rows)),
        )
        kept = [CachedState(state, torch.cat(pieces), len(row)) for state, pieces, row in zip(states, memory, rows)]
        self._sync()
        clock.close(time.perf_counter() - started)
        return kept

    def forward(
        self, records: Sequence[EncodedRecord], entries: Sequence[CachedState | None], timings: Timings
    ) -> list[list[QuestionResult]]:
        """Records from their kept states (or from the start) to the end, then the head."""
        start = time.perf_counter()
        clock = HeadClock(timings)
        lengths = [record.token_count for record in records]
        head_batch = build_head_batch(records, self.device)
        # records from one kept state share its memory rows (the head attends to them once for all)
        builder = FeatureBuilder(self.parts.head, head_batch, lengths, self.device, [None if entry is None else entry.memory for entry in entries])
        starts = [0 if entry is None else entry.tokens for entry in entries]
        state = None
        if any(entry is not None for entry in entries):
            state = DecoderState.stack([self._empty() if entry is None else entry.decoder for entry in entries])

        def read(hidden, rows, done, counts):
            with clock:
                builder.add(hidden, rows, [starts[row] + offset for row, offset in zip(rows, done)], counts)

        run_segments(
            self.parts.decoder,
            [record.input_ids[first:] for record, first in zip(records, starts)],
            segment=self.segment_tokens,
            pad_id=self.pad_id,
            device=self.device,
            on_segment=read,
            state=state,
            media=self._media([record.input_ids for record in records], [record.media for record in records], [entry is not None for entry in entries]),
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
                QuestionResult(question.question_id, question.option_ids, tuple(q_logits.tolist()), tuple(q_probabilities.tolist()))
                for question, q_logits, q_probabilities in zip(record.questions, record_logits, record_probabilities)
            ]
            for record, record_logits, record_probabilities in zip(records, per_record_logits, per_record_probabilities)
        ]

    def _media(
        self, rows: Sequence[Sequence[int]], media: Sequence[RecordMedia | None], continuing: Sequence[bool]
    ) -> list[RowMedia | None] | None:
        return row_media(self.parts.vision, rows, media, continuing, dtype=self.parts.decoder.dtype, device=self.device)

    def _empty(self) -> DecoderState:
        if self._empty_state is None:
            self._empty_state = self.parts.decoder.empty_state()
        return self._empty_state

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
