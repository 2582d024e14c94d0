"""The head's host side: index tensors that place every question and option of a batch of records.

Built once per batch from encoded records (spans, option ids, question types), on the host, with
no loop on the device; `split_logits` and `softmax_per_question` read the head's flat output back.
See `joint_head.py` for the flat layout (records, questions, options, spans).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from .precision import HEAD_DTYPE

QUESTION_TYPE_COUNT = 3  # noul 0, choice 1, score 2


# --------------------------------------------------------------------------------------------
# The index tensors of a batch


@dataclass(frozen=True)
class HeadBatch:
    """Index tensors that place every question and option of a batch of records (see module doc).

    Host-side sizes are plain ints so that padding and splitting never read the device.
    """

    num_records: int  # B
    questions_per_record: tuple[int, ...]  # [B]
    options_per_question: tuple[int, ...]  # [Nq]
    max_questions: int  # max questions in one record
    max_record_options: int  # max options in one record
    max_question_options: int  # max options in one question

    # One row per token of every span (P = total span length): where to read Hn, which span it sums into. Kept on
    # the host: a segment's rows of them are picked there and only those indices go up (no device read in a forward).
    span_token_record: Tensor  # [P] long
    span_token_position: Tensor  # [P] long, position inside its record
    span_token_span: Tensor  # [P] long, span index s
    span_lengths: Tensor  # [Nq + No] float32, tokens per span

    question_record: Tensor  # [Nq] long
    question_slot: Tensor  # [Nq] long, index of the question inside its record
    question_type: Tensor  # [Nq] long
    question_mask: Tensor  # [B, max_questions] bool, real questions

    option_question: Tensor  # [No] long, owning question i
    option_record: Tensor  # [No] long
    option_record_slot: Tensor  # [No] long, index of the option inside its record
    option_question_slot: Tensor  # [No] long, index of the option inside its question

    # Lexical means x_j: the unique token ids of all option spans, and for each option token
    # (Po = total option span length) its row among them and its option.
    vocab_ids: Tensor  # [U] long, sorted; kept on the CPU, since the table may live in host memory
    option_token_row: Tensor  # [Po] long, index into vocab_ids
    option_token_option: Tensor  # [Po] long, option j

    @property
    def num_questions(self) -> int:
        return len(self.options_per_question)

    @property
    def num_options(self) -> int:
        return int(sum(self.options_per_question))


def build_head_batch(records: Sequence[Any], device: torch.device | str | None = None) -> HeadBatch:
    """Index a batch of encoded records for :class:`JointHead` (host work, once per batch).

    A record has ``.input_ids`` (sequence of int) and ``.questions``, each with
    ``.question_type`` (0 noul, 1 choice, 2 score), ``.question_span`` and ``.option_spans``
    (half-open ``(start, end)`` token positions in the record).
    """
    if not records:
        raise ValueError("build_head_batch needs at least one record")
    question_record: list[int] = []
    question_slot: list[int] = []
    question_type: list[int] = []
    question_starts: list[int] = []
    question_ends: list[int] = []
    option_question: list[int] = []
    option_record: list[int] = []
    option_record_slot: list[int] = []
    option_question_slot: list[int] = []
    option_starts: list[int] = []
    option_ends: list[int] = []
    option_token_ids: list[int] = []
    questions_per_record: list[int] = []
    options_per_question: list[int] = []
    max_record_options = 0

    for record_index, record in enumerate(records):
        input_ids = record.input_ids
        length = len(input_ids)
        questions = tuple(record.questions)
        if not questions:
            raise ValueError(f"record {record_index} has no questions")
        questions_per_record.append(len(questions))
        record_options = 0
        for slot, question in enumerate(questions):
            where = f"record {record_index} question {slot}"
            kind = int(question.question_type)
            if not 0 <= kind < QUESTION_TYPE_COUNT:
                raise ValueError(f"{where}: question_type {kind} is not 0, 1 or 2")
            start, end = _checked_span(question.question_span, length, f"{where} question_span")
            question_index = len(question_record)
            question_record.append(record_index)
            question_slot.append(slot)
            question_type.append(kind)
            question_starts.append(start)
            question_ends.append(end)
            spans = tuple(question.option_spans)
            if not spans:
                raise ValueError(f"{where} has no options")
            options_per_question.append(len(spans))
            for option_slot, span in enumerate(spans):
                start, end = _checked_span(span, length, f"{where} option {option_slot}")
                option_question.append(question_index)
                option_record.append(record_index)
                option_record_slot.append(record_options)
                option_question_slot.append(option_slot)
                option_starts.append(start)
                option_ends.append(end)
                option_token_ids.extend(input_ids[start:end])
                record_options += 1
        max_record_options = max(max_record_options, record_options)

    long = dict(dtype=torch.long)
    span_record = torch.tensor(question_record + option_record, **long)  # [S]
    starts = torch.tensor(question_starts + option_starts, **long)  # [S]
    lengths = torch.tensor(question_ends + option_ends, **long) - starts  # [S]
    span_count = len(starts)
    token_span = torch.repeat_interleave(torch.arange(span_count), lengths)  # [P]
    first_token = torch.cumsum(lengths, 0) - lengths  # [S], where each span's tokens begin in P
    token_position = torch.arange(len(token_span)) - first_token[token_span] + starts[token_span]  # [P]
    question_token_count = int(lengths[: len(question_record)].sum())
    option_token_option = token_span[question_token_count:] - len(question_record)  # [Po]
    vocab_ids, option_token_row = torch.unique(
        torch.tensor(option_token_ids, **long), sorted=True, return_inverse=True
    )  # [U], [Po]

    counts = torch.tensor(questions_per_record, **long)  # [B]
    max_questions = max(questions_per_record)
    question_mask = torch.arange(max_questions)[None, :] < counts[:, None]  # [B, max_questions]

    def put(tensor: Tensor) -> Tensor:
        return tensor.to(device) if device is not None else tensor

    return HeadBatch(
        num_records=len(records),
        questions_per_record=tuple(questions_per_record),
        options_per_question=tuple(options_per_question),
        max_questions=max_questions,
        max_record_options=max_record_options,
        max_question_options=max(options_per_question),
        span_token_record=span_record[token_span],
        span_token_position=token_position,
        span_token_span=token_span,
        span_lengths=put(lengths.to(HEAD_DTYPE)),
        question_record=put(torch.tensor(question_record, **long)),
        question_slot=put(torch.tensor(question_slot, **long)),
        question_type=put(torch.tensor(question_type, **long)),
        question_mask=put(question_mask),
        option_question=put(torch.tensor(option_question, **long)),
        option_record=put(torch.tensor(option_record, **long)),
        option_record_slot=put(torch.tensor(option_record_slot, **long)),
        option_question_slot=put(torch.tensor(option_question_slot, **long)),
        vocab_ids=vocab_ids,
        option_token_row=put(option_token_row),
        option_token_option=put(option_token_option),
    )


def _checked_span(span: Sequence[int], length: int, where: str) -> tuple[int, int]:
    start, end = (int(value) for value in span)
    if not 0 <= start < end <= length:
        raise ValueError(f"{where} {(start, end)} is not a non-empty span inside the record's {length} tokens")
    return start, end


# --------------------------------------------------------------------------------------------
# Segment helpers


def segment_softmax(values: Tensor, batch: HeadBatch) -> Tensor:
    """Softmax over the options of each question: [No] -> [No], via a -inf padded [Nq, K] grid."""
    grid = values.new_full((batch.num_questions, batch.max_question_options), float("-inf"))
    grid[batch.option_question, batch.option_question_slot] = values  # [Nq, K]
    return grid.softmax(dim=-1)[batch.option_question, batch.option_question_slot]  # [No]


def split_logits(logits: Tensor, batch: HeadBatch) -> list[list[Tensor]]:
    """Flat per-option values [No] -> per record, per question (views, no copies)."""
    per_question = torch.split(logits, batch.options_per_question)
    result: list[list[Tensor]] = []
    first = 0
    for count in batch.questions_per_record:
        result.append(list(per_question[first : first + count]))
        first += count
    return result


def softmax_per_question(logits: Tensor, batch: HeadBatch) -> Tensor:
    """Probabilities: a float32 softmax over each question's options, flat [No]."""
    return segment_softmax(logits.to(HEAD_DTYPE), batch)


