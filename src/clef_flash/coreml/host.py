"""The host side of the Core ML packages: what the port's Swift host does, in Python, for any runner.

Per record (batch 1, as the packages are shaped): pick the smallest bucket that holds it; gather its embedding
rows from the memory-mapped fp16 table and pad them to the bucket; build cos/sin for positions 0..L-1; run the
parts in order; then build the head's inputs (span-mean matrices, the one-hot owner of each option, the mean
output-embedding rows of each option, masks) from the same `HeadBatch` the torch engine uses, run the head,
and take a float32 softmax per question. A record longer than the largest bucket, or with more questions or
options than the head's shape, is refused with its counts: nothing is ever cut.

The runner is `MLModelRunner` on macOS, or any object with `predict(package, function, inputs)`; the tests
use `runners.TorchRunner`, the traced torch twins standing in for Core ML.
"""

from __future__ import annotations

import os
import time
from typing import Any, Protocol

import numpy as np
import torch
from torch import Tensor

from ..errors import RequestInvalid
from ..model.config import TextConfig
from ..model.export import rotary_tables
from ..model.head_batch import QUESTION_TYPE_COUNT, HeadBatch, build_head_batch, softmax_per_question, split_logits
from ..model.precision import COREML_HEAD_DTYPE, COREML_TABLE_DTYPE
from ..request.records import EncodedRecord
from ..request.tokenizer import Tokenizer
from ..checkpoint import coreml_layout as layout

class Runner(Protocol):
    """Runs one function of one package. `part_dtype`: the dtype the parts take and return."""

    part_dtype: torch.dtype

    def predict(self, package: str, function: str, inputs: dict[str, Tensor]) -> Tensor: ...


# (question id, option ids, logits, probabilities) for each question of a record
Scored = tuple[str, tuple[str, ...], tuple[float, ...], tuple[float, ...]]


class CoreMLHost:
    """An export (a directory, or its layout already read) opened for scoring: tables mapped, tokenizer and
    text config read."""

    def __init__(self, export: str | os.PathLike[str] | layout.ExportLayout, runner: Runner, *, verify: bool = False):
        self.layout = export if isinstance(export, layout.ExportLayout) else layout.read_export(export, verify=verify)
        config = self.layout.config
        self.root = self.layout.root
        self.runner = runner
        self.text_config = TextConfig.from_release_config(config["release_config"])
        self.tokenizer = Tokenizer.from_file(self.root / layout.TOKENIZER)
        self.embeddings = self._table(layout.EMBEDDINGS)
        self.output_embeddings = self._table(layout.OUTPUT_EMBEDDINGS)
        self.head_questions = int(self.layout.head["questions"])
        self.head_options = int(self.layout.head["options"])
        self.last_timings = {"decoder_ms": 0.0, "head_ms": 0.0}

    def _table(self, name: str) -> Tensor:
        """[V, D] fp16, memory-mapped copy-on-write: rows are read from disk when gathered, never all at once."""
        mapped = np.memmap(self.root / name, dtype=numpy_dtype(COREML_TABLE_DTYPE), mode="c")
        return torch.from_numpy(mapped).view(self.layout.vocab_size, self.layout.hidden_size)

    @property
    def max_tokens(self) -> int:
        return self.layout.buckets[-1]

    # -- checks ----------------------------------------------------------------------------------

    def bucket_for(self, token_count: int) -> int:
        """The smallest bucket that holds `token_count` tokens; refused (with the count) past the largest."""
        problems = self._too_long(token_count)
        if problems:
            raise RequestInvalid(problems)
        return next(bucket for bucket in self.layout.buckets if token_count <= bucket)

    def _too_long(self, token_count: int) -> list[dict[str, Any]]:
        if token_count <= self.max_tokens:
            return []
        return [
            {
                "type": "record_too_long",
                "loc": ["body", "state"],
                "msg": f"the record needs {token_count} tokens, over the largest Core ML bucket of this export "
                f"({self.max_tokens}; buckets {', '.join(map(str, self.layout.buckets))}): shorten the state, or "
                "export with a larger bucket (clef-flash export coreml --buckets ...)",
                "ctx": {"token_count": token_count, "bucket": self.max_tokens},
            }
        ]

    def check(self, record: EncodedRecord) -> int:
        """The record's bucket; refuses one that does not fit the buckets or the head's shape (every reason)."""
        problems = self._too_long(record.token_count)
        questions = len(record.questions)
        options = sum(len(question.option_spans) for question in record.questions)
        over = []
        if questions > self.head_questions:
            over.append(f"{questions} questions, the Core ML head holds {self.head_questions}")
        if options > self.head_options:
            over.append(f"{options} options in all, the Core ML head holds {self.head_options}")
        if over:
            problems.append(
                {
                    "type": "too_many_for_head",
                    "loc": ["body", "questions"],
                    "msg": "; ".join(over) + ": ask fewer, or export with a larger head "
                    "(clef-flash export coreml --head-questions Q --head-options O)",
                    "ctx": {"questions": questions, "options": options, "head_questions": self.head_questions,
                            "head_options": self.head_options},
                }
            )  # fmt: skip
        if problems:
            raise RequestInvalid(problems)
        return self.bucket_for(record.token_count)

    # -- the decoder -----------------------------------------------------------------------------

    def decoder_inputs(self, record: EncodedRecord, bucket: int) -> dict[str, Tensor]:
        """hidden [1, L, D] (the record's embedding rows, zeros after), cos, sin [L, rd], in the parts' dtype."""
        dtype = self.runner.part_dtype
        ids = torch.tensor(record.input_ids, dtype=torch.long)
        hidden = torch.zeros(1, bucket, self.layout.hidden_size, dtype=dtype)
        hidden[0, : len(ids)] = self.embeddings.index_select(0, ids).to(dtype)
        cos, sin = rotary_tables(self.text_config, bucket, dtype)
        return {"hidden": hidden, "cos": cos, "sin": sin}

    def run_decoder(self, record: EncodedRecord, bucket: int) -> Tensor:
        """The final hidden states [L, D] in the head's dtype, zero past the record."""
        inputs = self.decoder_inputs(record, bucket)
        function = layout.function_name(bucket)
        for part in self.layout.parts:
            inputs["hidden"] = self.runner.predict(part["package"], function, inputs)
        states = inputs["hidden"][0].to(COREML_HEAD_DTYPE)  # [L, D]
        states[record.token_count :] = 0.0
        return states

    # -- the head --------------------------------------------------------------------------------

    def head_inputs(self, record: EncodedRecord, bucket: int, states: Tensor, batch: HeadBatch | None = None) -> dict[str, Tensor]:
        """The head's inputs (model/export.py's ExportHead) at its fixed shape [Q questions, O options]."""
        batch = batch or build_head_batch([record])
        L, Q, O, n = bucket, self.head_questions, self.head_options, record.token_count
        nq, no = batch.num_questions, batch.num_options
        masked = self.layout.mask_value
        dtype = COREML_HEAD_DTYPE
        means = torch.zeros(nq + no, L, dtype=dtype)  # 1/|span| over each span's positions
        means[batch.span_token_span, batch.span_token_position] = 1.0 / batch.span_lengths[batch.span_token_span]
        q_mean, o_mean = torch.zeros(Q, L, dtype=dtype), torch.zeros(O, L, dtype=dtype)
        q_mean[:nq], o_mean[:no] = means[:nq], means[nq:]
        o2q = torch.zeros(O, Q, dtype=dtype)
        o2q[torch.arange(no), batch.option_question] = 1.0
        rows = self.output_embeddings.index_select(0, batch.vocab_ids).to(dtype)  # [U, D]: each token id once
        lexical = torch.zeros(O, self.layout.hidden_size, dtype=dtype)
        lexical[:no].index_add_(0, batch.option_token_option, rows[batch.option_token_row])
        lexical[:no] /= batch.span_lengths[nq:, None]
        type_oh = torch.zeros(Q, QUESTION_TYPE_COUNT, dtype=dtype)
        type_oh[torch.arange(nq), batch.question_type] = 1.0
        positions = torch.arange(L)
        return {
            "states": states,
            "mem_mask": torch.where(positions < n, 0.0, masked).to(dtype),
            "last": (positions == n - 1).to(dtype),
            "q_mean": q_mean,
            "o_mean": o_mean,
            "o2q": o2q,
            "lexical": lexical,
            "type_oh": type_oh,
            "q_mask": torch.where(torch.arange(Q) < nq, 0.0, masked).to(dtype),
            "o_mask": torch.where(torch.arange(O) < no, 0.0, masked).to(dtype),
        }

    def score(self, record: EncodedRecord) -> list[Scored]:
        """Logits and probabilities of every question of one record."""
        bucket = self.check(record)
        start = time.perf_counter()
        states = self.run_decoder(record, bucket)
        decoded = time.perf_counter()
        batch = build_head_batch([record])
        inputs = self.head_inputs(record, bucket, states, batch)
        logits = self.runner.predict(self.layout.head["package"], layout.function_name(bucket), inputs)
        logits = logits[: batch.num_options].to(COREML_HEAD_DTYPE)
        probabilities = softmax_per_question(logits, batch)
        self.last_timings = {"decoder_ms": (decoded - start) * 1000, "head_ms": (time.perf_counter() - decoded) * 1000}
        (per_logits,) = split_logits(logits.double(), batch)
        (per_probabilities,) = split_logits(probabilities.double(), batch)
        return [
            (question.question_id, question.option_ids, tuple(q_logits.tolist()), tuple(q_probabilities.tolist()))
            for question, q_logits, q_probabilities in zip(record.questions, per_logits, per_probabilities)
        ]

    def describe(self) -> dict[str, Any]:
        return {"root": str(self.root), "buckets": self.layout.buckets, "parts": len(self.layout.parts),
                "head": [self.head_questions, self.head_options]}  # fmt: skip


def numpy_dtype(dtype: torch.dtype) -> type:
    """The NumPy scalar type of a torch dtype (Core ML's inputs and the raw tables are NumPy)."""
    return torch.empty(0, dtype=dtype).numpy().dtype.type
