"""The joint schema head (SPEC §5), batched: every option of every question of every record in one pass.

The parameter names and shapes are those of Cloudflare's reference ``JointSchemaHead``, so
``joint_head.safetensors`` loads strictly; the math is written here with masks and gathers
instead of the reference's Python loops over records, questions and options.

Flat layout of a batch (built once on the host by `head_batch.build_head_batch`):
    records     b in [0, B)
    questions   i in [0, Nq), record-major (the questions of a record are contiguous)
    options     j in [0, No), question-major (the options of a question are contiguous)
    spans       s in [0, Nq + No): the question spans first, then the option spans
The head returns one logit per option, flat ``[No]``; `head_batch.split_logits` cuts it per record
and question, `head_batch.softmax_per_question` turns it into probabilities.

Everything is computed in float32 (the head is small next to the decoder).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any, Union

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .head_batch import QUESTION_TYPE_COUNT, HeadBatch, segment_softmax
from .precision import HEAD_DTYPE

LOG_MAX_LOGIT_SCALE = math.log(100.0)  # the scales are exp(min(s, ln 100)), i.e. min(exp(s), 100)
# The head's attention over a record's memory: up to ONE_CALL_ROWS rows, one SDPA call; longer (or with a
# shared prefix), MEMORY_CHUNK rows at a time (its transient: ~3 x 4 x width bytes per row, 24 MB at 2,048).
ONE_CALL_ROWS = 8192
MEMORY_CHUNK = 2048

# `lm_head.weight` [V, D], or a function gathering its rows for a LongTensor of ids (e.g. from a
# memory-mapped 8-bit table): rows(ids [U]) -> [U, D].
OutputEmbedding = Union[Tensor, Callable[[Tensor], Tensor]]


@dataclass(frozen=True)
class HeadConfig:
    """``joint_head_config.json`` (clef-flash: 4096, 1024, 2, 4, 16, 4096)."""

    hidden_size: int
    width: int
    routing_layers: int
    layers: int
    heads: int
    feedforward: int

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> HeadConfig:
        """Keep the keys this head knows (the release may carry others, e.g. ``dropout``)."""
        names = [field.name for field in fields(cls)]
        missing = [name for name in names if name not in values]
        if missing:
            raise ValueError(f"joint head config lacks {', '.join(missing)} (has {sorted(values)})")
        config = cls(**{name: int(values[name]) for name in names})
        if config.width % config.heads:
            raise ValueError(f"joint head width {config.width} is not a multiple of heads {config.heads}")
        return config

# --------------------------------------------------------------------------------------------
# Parameter containers (names as in torch.nn.MultiheadAttention / TransformerDecoderLayer / the
# reference's Sequential indices); the math is in the forward methods below.


class _Attention(nn.Module):
    """Multi-head attention with torch.nn.MultiheadAttention's packed, biased projections."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.in_proj_weight = nn.Parameter(torch.empty(3 * width, width))
        self.in_proj_bias = nn.Parameter(torch.zeros(3 * width))
        self.out_proj = nn.Linear(width, width)
        nn.init.xavier_uniform_(self.in_proj_weight)

    def _heads(self, x: Tensor) -> Tensor:
        return x.unflatten(-1, (self.heads, -1)).transpose(1, 2)  # [B, L, w] -> [B, h, L, w/h]

    def keys_values(self, memory: Tensor) -> tuple[Tensor, Tensor]:
        """[B, T, w] -> keys, values [B, h, T, w/h]."""
        width = memory.shape[-1]
        keys, values = F.linear(memory, self.in_proj_weight[width:], self.in_proj_bias[width:]).chunk(2, dim=-1)
        return self._heads(keys), self._heads(values)

    def attend(self, queries: Tensor, keys: Tensor, values: Tensor, mask: Tensor) -> Tensor:
        """queries [B, L, w]; keys, values [B, h, T, w/h]; mask [B, 1, 1, T] bool (True: attend)."""
        width = queries.shape[-1]
        q = self._heads(F.linear(queries, self.in_proj_weight[:width], self.in_proj_bias[:width]))
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)  # [B, h, L, w/h]
        return self.out_proj(out.transpose(1, 2).flatten(2))  # [B, L, w]

    def attend_memory(
        self,
        queries: Tensor,
        memory: Tensor,
        mask: Tensor,
        memory_norm: nn.Module | None = None,
        prefixes: Sequence[SharedMemory] = (),
    ) -> Tensor:
        """queries [B, L, w] attend to memory [B, T, w] (after `memory_norm`, when given); mask [B, 1, 1, T].
        With `prefixes`, the records of each one attend to its rows first, then to their own `memory`.

        Up to ONE_CALL_ROWS rows and no prefixes, one SDPA call. Otherwise MEMORY_CHUNK rows at a time with a running
        log-sum-exp, so that the normed memory, keys and values of at most MEMORY_CHUNK rows exist at once
        (a 64K-token record's would be ~1 GB per layer), and a prefix's keys and values are computed once
        for all its records; the same softmax up to float rounding.
        """
        tokens = memory.shape[1]
        if tokens <= ONE_CALL_ROWS and not prefixes:
            keys, values = self.keys_values(memory if memory_norm is None else memory_norm(memory))
            return self.attend(queries, keys, values, mask)
        width = queries.shape[-1]
        q = self._heads(F.linear(queries, self.in_proj_weight[:width], self.in_proj_bias[:width]))  # [B, h, L, d]
        q = q * q.shape[-1] ** -0.5
        best = q.new_full((*q.shape[:-1], 1), float("-inf"))  # running max score [B, h, L, 1]
        total = q.new_zeros(best.shape)  # running sum of exp(score - best)
        out = torch.zeros_like(q)  # running sum of exp(score - best) * value [B, h, L, d]

        def step(rows, part: Tensor, part_mask: Tensor | None) -> None:
            """Records `rows` (a slice or indices) attend to memory `part` [b, c, w] (b: 1 or theirs)."""
            keys, values = self.keys_values(part if memory_norm is None else memory_norm(part))  # [b, h, c, d]
            scores = q[rows] @ keys.transpose(-1, -2)  # [n, h, L, c]
            if part_mask is not None:
                scores = scores.masked_fill(~part_mask, float("-inf"))
            new_best = torch.maximum(best[rows], scores.amax(-1, keepdim=True))  # finite: every record has a real row
            correction = (best[rows] - new_best).exp()
            weights = (scores - new_best).exp()  # [n, h, L, c]
            total[rows] = total[rows] * correction + weights.sum(-1, keepdim=True)
            out[rows] = out[rows] * correction + weights @ values
            best[rows] = new_best

        for prefix in prefixes:  # first: then every record's first chunk of its own rows meets a finite max
            for start in range(0, prefix.memory.shape[0], MEMORY_CHUNK):
                step(prefix.records, prefix.memory[None, start : start + MEMORY_CHUNK], None)
        for start in range(0, tokens, MEMORY_CHUNK):
            step(slice(None), memory[:, start : start + MEMORY_CHUNK], mask[..., start : start + MEMORY_CHUNK])
        return self.out_proj((out / total).transpose(1, 2).flatten(2))  # [B, L, w]

    def self_attend(self, x: Tensor, mask: Tensor) -> Tensor:
        """x [B, L, w]; mask [B, 1, 1, L] bool."""
        q, k, v = (self._heads(part) for part in F.linear(x, self.in_proj_weight, self.in_proj_bias).chunk(3, -1))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # [B, h, L, w/h]
        return self.out_proj(out.transpose(1, 2).flatten(2))  # [B, L, w]


class _GeluMlp(nn.Module):
    """Linear, exact GELU, Linear; the linears sit at the reference Sequential's indices 0 and 3."""

    def __init__(self, width: int, hidden: int, out: int) -> None:
        super().__init__()
        self.add_module("0", nn.Linear(width, hidden))
        self.add_module("3", nn.Linear(hidden, out))

    @property
    def first(self) -> nn.Linear:
        return self._modules["0"]  # type: ignore[return-value]

    @property
    def second(self) -> nn.Linear:
        return self._modules["3"]  # type: ignore[return-value]

    def forward(self, x: Tensor) -> Tensor:
        return self.second(F.gelu(self.first(x)))


class _EvidenceLayer(nn.Module):
    """SPEC §5 step 4: options attend to their record's memory (not to each other), then an MLP."""

    def __init__(self, width: int, heads: int, feedforward: int) -> None:
        super().__init__()
        self.query_norm = nn.LayerNorm(width)
        self.memory_norm = nn.LayerNorm(width)
        self.attention = _Attention(width, heads)
        self.feedforward_norm = nn.LayerNorm(width)
        self.feedforward = _GeluMlp(width, feedforward, width)

    def forward(self, options: Tensor, memory: Tensor, memory_mask: Tensor, prefixes: Sequence[SharedMemory] = ()) -> Tensor:
        """options [B, O, w]; memory [B, T, w]; memory_mask [B, 1, 1, T] -> [B, O, w]."""
        options = options + self.attention.attend_memory(self.query_norm(options), memory, memory_mask, self.memory_norm, prefixes)
        return options + self.feedforward(self.feedforward_norm(options))


class _FieldLayer(nn.Module):
    """A norm_first TransformerDecoderLayer (GELU, no dropout) over the questions of each record."""

    def __init__(self, width: int, heads: int, feedforward: int) -> None:
        super().__init__()
        self.self_attn = _Attention(width, heads)
        self.multihead_attn = _Attention(width, heads)
        self.linear1 = nn.Linear(width, feedforward)
        self.linear2 = nn.Linear(feedforward, width)
        self.norm1 = nn.LayerNorm(width)
        self.norm2 = nn.LayerNorm(width)
        self.norm3 = nn.LayerNorm(width)

    def forward(
        self, fields: Tensor, question_mask: Tensor, memory: Tensor, memory_mask: Tensor, prefixes: Sequence[SharedMemory] = ()
    ) -> Tensor:
        """fields [B, Q, w]; question_mask [B, 1, 1, Q]; memory [B, T, w]; memory_mask [B, 1, 1, T]."""
        fields = fields + self.self_attn.self_attend(self.norm1(fields), question_mask)
        fields = fields + self.multihead_attn.attend_memory(self.norm2(fields), memory, memory_mask, None, prefixes)  # raw memory
        return fields + self.linear2(F.gelu(self.linear1(self.norm3(fields))))


# --------------------------------------------------------------------------------------------
# The head


@dataclass(frozen=True)
class SharedMemory:
    """The first memory rows [S, w] of several records (a kept state's), held and attended once for all."""

    records: Tensor  # [n] long, the records that start with these rows
    memory: Tensor  # [S, w]


@dataclass(frozen=True)
class HeadFeatures:
    """What the head reads from the decoder's hidden states. A record's memory is its shared prefix's rows
    (if any) followed by its own rows in `memory`."""

    memory: Tensor  # [B, T, w] each record's own rows, zero past them
    memory_mask: Tensor  # [B, T] bool, real rows
    span_sums: Tensor  # [Nq + No, D], sums of Hn over each span
    last: Tensor  # [B, D], g = Hn at each record's last token
    prefixes: tuple[SharedMemory, ...] = ()


class FeatureBuilder:
    """Gathers `HeadFeatures` from a batch's hidden states piece by piece (SPEC §5 step 1, the span sums of
    step 2), so a record can run through the decoder in segments, or start from a kept state whose memory
    rows (`prefixes[b]`, [S_b, w]) are not copied: records given the same tensor share it (SharedMemory),
    and the head attends to it once for them all. Pieces come in token order; the records' own rows
    [B, T, w] are allocated once.
    """

    def __init__(
        self,
        head: JointHead,
        batch: HeadBatch,
        lengths: Sequence[int],
        device: torch.device,
        prefixes: Sequence[Tensor | None] | None = None,
    ):
        self.head, self.batch, self.lengths, self.device = head, batch, tuple(lengths), device
        prefixes = [None] * len(self.lengths) if prefixes is None else list(prefixes)
        self.offsets = [0 if prefix is None else prefix.shape[0] for prefix in prefixes]  # rows before the own rows
        groups: dict[int, tuple[Tensor, list[int]]] = {}
        for record, prefix in enumerate(prefixes):
            if prefix is not None and prefix.shape[0]:
                groups.setdefault(id(prefix), (prefix, []))[1].append(record)
        self.prefixes = tuple(
            SharedMemory(torch.tensor(records, dtype=torch.long, device=device), prefix.to(device=device, dtype=HEAD_DTYPE))
            for prefix, records in groups.values()
        )
        own = max(length - offset for length, offset in zip(self.lengths, self.offsets))
        self.memory = torch.zeros(len(self.lengths), own, head.config.width, dtype=HEAD_DTYPE, device=device)
        self.filled = list(self.offsets)  # memory rows per record so far, in token order
        self.span_sums = torch.zeros(len(batch.span_lengths), head.config.hidden_size, dtype=HEAD_DTYPE, device=device)
        self.last = torch.zeros(len(self.lengths), head.config.hidden_size, dtype=HEAD_DTYPE, device=device)

    def add_memory(self, record: int, rows: Tensor) -> None:
        """Memory rows [n, w] of the record's next n tokens."""
        start = self.filled[record] - self.offsets[record]
        self.memory[record, start : start + rows.shape[0]] = rows
        self.filled[record] += rows.shape[0]

    def add(self, hidden: Tensor, records: Sequence[int], starts: Sequence[int], counts: Sequence[int]) -> None:
        """A segment: row i of hidden [B', L, D] holds tokens starts[i] .. starts[i] + counts[i] - 1 of record
        records[i] (right-padded)."""
        normed, memory = self.head.read(hidden)
        for row, (record, count) in enumerate(zip(records, counts)):
            if starts[row] != self.filled[record]:
                raise ValueError(f"record {record}: a segment from token {starts[row]} after {self.filled[record]} tokens")
            self.add_memory(record, memory[row, :count])
            if starts[row] + count == self.lengths[record]:
                self.last[record] = normed[row, count - 1]
        batch = self.batch
        row_of = torch.full((len(self.lengths),), -1, dtype=torch.long)
        row_of[list(records)] = torch.arange(len(records))
        start_of = torch.zeros(len(self.lengths), dtype=torch.long)
        start_of[list(records)] = torch.tensor(list(starts), dtype=torch.long)
        end_of = start_of.clone()
        end_of[list(records)] += torch.tensor(list(counts), dtype=torch.long)
        token_record, position = batch.span_token_record, batch.span_token_position  # [P] each, on the host
        inside = (row_of[token_record] >= 0) & (position >= start_of[token_record]) & (position < end_of[token_record])
        if inside.any():  # (host tensors: picked here, only the picked indices go to the device)
            rows = row_of[token_record[inside]].to(self.device)
            offsets = (position[inside] - start_of[token_record[inside]]).to(self.device)
            self.span_sums.index_add_(0, batch.span_token_span[inside].to(self.device), normed[rows, offsets])

    def features(self) -> HeadFeatures:
        if list(self.filled) != list(self.lengths):
            raise ValueError(f"memory rows {self.filled} for records of {list(self.lengths)} tokens")
        own = torch.tensor([length - offset for length, offset in zip(self.lengths, self.offsets)], device=self.device)
        memory_mask = torch.arange(self.memory.shape[1], device=self.device)[None, :] < own[:, None]  # [B, T]
        return HeadFeatures(self.memory, memory_mask, self.span_sums, self.last, self.prefixes)


class JointHead(nn.Module):
    """Cloudflare's joint schema head, batched. State dict: exactly the reference's."""

    def __init__(self, config: HeadConfig) -> None:
        super().__init__()
        self.config = config
        hidden, width = config.hidden_size, config.width
        self.hidden_norm = nn.LayerNorm(hidden)
        self.memory_projection = nn.Linear(hidden, width, bias=False)
        self.question_projection = nn.Linear(hidden, width, bias=False)
        self.option_question_projection = nn.Linear(hidden, width, bias=False)
        self.global_projection = nn.Linear(hidden, width, bias=False)
        self.option_context_projection = nn.Linear(hidden, width, bias=False)
        self.option_lexical_projection = nn.Linear(hidden, width, bias=False)
        self.type_embedding = nn.Embedding(QUESTION_TYPE_COUNT, width)
        self.evidence_layers = nn.ModuleList(
            _EvidenceLayer(width, config.heads, config.feedforward) for _ in range(config.routing_layers)
        )
        self.option_summary_norm = nn.LayerNorm(width)
        self.layers = nn.ModuleList(
            _FieldLayer(width, config.heads, config.feedforward) for _ in range(config.layers)
        )
        self.field_norm = nn.LayerNorm(width)
        self.option_norm = nn.LayerNorm(width)
        self.residual_scorer = _GeluMlp(4 * width, width, 1)
        self.prior_logit_scale = nn.Parameter(torch.zeros(()))
        self.joint_logit_scale = nn.Parameter(torch.zeros(()))
        self.residual_gate = nn.Parameter(torch.zeros(()))

    def forward(
        self,
        hidden: Tensor,
        lengths: Tensor,
        batch: HeadBatch,
        output_embedding: OutputEmbedding,
    ) -> Tensor:
        """hidden [B, T, D] right-padded final hidden states; lengths [B] -> logits [No] float32."""
        return self.score(self.features(hidden, lengths, batch), batch, output_embedding)

    def read(self, hidden: Tensor) -> tuple[Tensor, Tensor]:
        """SPEC §5 step 1 for hidden states [B, L, D]: Hn [B, L, D] and memory rows [B, L, w] (float32)."""
        normed = self.hidden_norm(hidden.to(HEAD_DTYPE))
        return normed, self.memory_projection(normed)

    def features(self, hidden: Tensor, lengths: Tensor, batch: HeadBatch) -> HeadFeatures:
        """SPEC §5 step 1 and the span sums of step 2, from whole records' hidden states in one piece."""
        counts = [int(length) for length in torch.as_tensor(lengths).tolist()]
        builder = FeatureBuilder(self, batch, counts, hidden.device)
        builder.add(hidden, range(len(counts)), [0] * len(counts), counts)
        return builder.features()

    def score(self, features: HeadFeatures, batch: HeadBatch, output_embedding: OutputEmbedding) -> Tensor:
        """SPEC §5 steps 2-8 for every option of the batch -> logits [No] float32."""
        width = self.config.width
        batch_size = batch.num_records
        memory, memory_mask = features.memory, features.memory_mask[:, None, None, :]  # [B, 1, 1, T]
        num_questions = batch.num_questions
        span_means = features.span_sums / batch.span_lengths[:, None]  # [Nq + No, D]
        question_means = span_means[:num_questions]  # q_i [Nq, D]
        context_means = span_means[num_questions:]  # c_j [No, D]
        lexical_means = self._lexical_means(output_embedding, batch, span_means.device)  # x_j [No, D]
        owner = batch.option_question  # [No]

        # 3. option queries
        routed = (
            self.option_context_projection(context_means)
            + self.option_lexical_projection(lexical_means)
            + self.option_question_projection(question_means)[owner]
        )  # r [No, w]

        # 4. evidence routing: each record's options, padded, attend to that record's memory
        option_grid = routed.new_zeros(batch_size, batch.max_record_options, width)
        option_grid[batch.option_record, batch.option_record_slot] = routed  # [B, O, w]
        for layer in self.evidence_layers:
            option_grid = layer(option_grid, memory, memory_mask, features.prefixes)
        routed = option_grid[batch.option_record, batch.option_record_slot]  # [No, w]

        # 5. per-question routing summary
        base_fields = self.question_projection(question_means)  # b [Nq, w]
        weights = segment_softmax((routed * base_fields[owner]).sum(-1) / math.sqrt(width), batch)  # a [No]
        summaries = routed.new_zeros(num_questions, width).index_add_(0, owner, weights[:, None] * routed)  # s

        # 6. fields
        fields = (
            base_fields
            + self.option_summary_norm(summaries)
            + self.global_projection(features.last)[batch.question_record]
            + self.type_embedding(batch.question_type)
        )  # f [Nq, w]

        # 7. field decoder over each record's questions, padded
        field_grid = fields.new_zeros(batch_size, batch.max_questions, width)
        field_grid[batch.question_record, batch.question_slot] = fields  # [B, Q, w]
        question_mask = batch.question_mask[:, None, None, :]  # [B, 1, 1, Q]
        for layer in self.layers:
            field_grid = layer(field_grid, question_mask, memory, memory_mask, features.prefixes)
        fields = self.field_norm(field_grid[batch.question_record, batch.question_slot])  # F [Nq, w]

        # 8. scores
        anchor = F.normalize(question_means + features.last[batch.question_record], dim=-1)  # [Nq, D]
        prior = (F.normalize(lexical_means, dim=-1) * anchor[owner]).sum(-1)  # [No]
        options = self.option_norm(routed)  # o [No, w]
        option_fields = fields[owner]  # [No, w]
        cosine = F.cosine_similarity(option_fields, options, dim=-1)  # [No]
        residual = self._residual(fields, option_fields, options, owner)  # [No]
        prior_scale = self.prior_logit_scale.clamp(max=LOG_MAX_LOGIT_SCALE).exp()
        joint_scale = self.joint_logit_scale.clamp(max=LOG_MAX_LOGIT_SCALE).exp()
        return prior_scale * prior + torch.sigmoid(self.residual_gate) * (joint_scale * cosine + residual)

    def _residual(self, fields: Tensor, option_fields: Tensor, options: Tensor, owner: Tensor) -> Tensor:
        """residual_scorer([F, o, F*o, |F-o|]) without building the [No, 4w] features: the first
        linear is split by blocks, and the F block runs once per question instead of per option."""
        first, second = self.residual_scorer.first, self.residual_scorer.second
        field_block, option_block, product_block, distance_block = first.weight.chunk(4, dim=1)  # 4 × [w, w]
        hidden = (
            F.linear(fields, field_block)[owner]
            + F.linear(options, option_block)
            + F.linear(option_fields * options, product_block)
            + F.linear((option_fields - options).abs(), distance_block)
            + first.bias
        )  # [No, w]
        return second(F.gelu(hidden)).squeeze(-1)  # [No]

    @staticmethod
    def _lexical_means(output_embedding: OutputEmbedding, batch: HeadBatch, device: torch.device) -> Tensor:
        """x_j: mean of the raw output-embedding rows of option j's tokens; gathers each id once."""
        ids = batch.vocab_ids  # [U]
        if isinstance(output_embedding, Tensor):
            rows = output_embedding.index_select(0, ids.to(output_embedding.device))
        else:
            rows = output_embedding(ids)
        rows = rows.to(device=device, dtype=HEAD_DTYPE)  # [U, D]
        sums = rows.new_zeros(batch.num_options, rows.shape[-1])
        sums.index_add_(0, batch.option_token_option, rows[batch.option_token_row])  # [No, D]
        return sums / batch.span_lengths[batch.num_questions :, None]
