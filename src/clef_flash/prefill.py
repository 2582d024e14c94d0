"""Segmented prefill: rows of token ids through the decoder, a bounded number of tokens at a time.

Each step takes up to `segment` tokens of every row that has tokens left (right-padded to the longest),
continues each row from its `DecoderState`, and hands the hidden states to a callback (the head's feature
builder) before they are dropped. What a step holds is bounded by the segment: the 9B's MLP intermediates
are 2 x 12,288 floats per token. What grows with a row is its attention K/V (in the decoder state) and
the head's memory rows (kept by the callback); state_cache.py gives both per token.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from .buckets import batch_bucket, sequence_bucket
from .model.qwen3_5 import DecoderState, Qwen35Decoder
from .model.vision import rope_positions
from .request.records import RecordMedia

# Tokens per decoder step of one row. Matmuls are as fast per token from ~1K tokens on (measured on the
# 9b-part, README); 2,048 keeps a step's activations near 0.2 GB per row at the 9B's width.
DEFAULT_SEGMENT_TOKENS = 2048

# on_segment(hidden [B', L, D], rows: indices into the rows given, starts: tokens of each row before this
# step, counts: real tokens of each row in this step)
OnSegment = Callable[[torch.Tensor, list[int], list[int], list[int]], None]
# whole_step(input_ids [B, L] long, on the host) -> last_hidden_state [B, L, D] on the device: a whole step's runner
WholeStep = Callable[[torch.Tensor], torch.Tensor]
# route(rows: indices into the rows given, counts, width) -> the context a step's decoder call runs in (which
# adapter each row takes: model/lora.py)
Route = Callable[[list[int], list[int], int], contextlib.AbstractContextManager]


@dataclass(frozen=True)
class RowMedia:
    """A row's image features and where they go: the pad tokens at `pad_positions` (token indices of the row)
    take the rows of `features` in order; every token has its 3-D M-RoPE position in `positions` [3, T]."""

    features: torch.Tensor  # [pads, D], the model dtype
    pad_positions: torch.Tensor  # [pads] long
    positions: torch.Tensor  # [3, T] long


def run_segments(
    decoder: Qwen35Decoder,
    rows: Sequence[Sequence[int]],
    *,
    segment: int,
    pad_id: int,
    device: torch.device,
    on_segment: OnSegment,
    state: DecoderState | None = None,
    keep_states: bool = False,
    media: Sequence[RowMedia | None] | None = None,
    route: Route | None = None,
    bucketed: bool = False,
    whole_step: WholeStep | None = None,
) -> list[DecoderState] | None:
    """Run every row's tokens (row i continuing from row i of `state`, if given) in steps of `segment`.

    `media[i]` (rows with images, run from their start): image features replace the pad tokens' embeddings
    and the rows of the step take 3-D positions (text rows their plain ones, equal on the three axes).

    With `keep_states`, returns each row's final state on its own (compact; what a cache keeps). `route`: the
    context each step runs in (the rows' adapters).

    `bucketed` (the GPU path, buckets.py): each step's width is a sequence bucket, and a *whole* step (rows from their
    start, no state in or out, no media, no adapters) also runs a batch bucket of rows, through `whole_step` when
    given (engine/graphs.py: a captured CUDA graph per shape) instead of the decoder.
    """
    if segment < 1:
        raise ValueError(f"segment must be at least 1 token, not {segment}")
    done = [0] * len(rows)
    active = [index for index, tokens in enumerate(rows) if tokens]
    if state is not None and len(active) < len(rows):
        state = state.select(active)
    kept: list[DecoderState | None] = [None] * len(rows)
    past = [0] * len(rows) if state is None else list(state.lengths)
    reserve = max((past[row] + len(rows[index]) for row, index in enumerate(active)), default=0)
    past_of = {index: past[row] for row, index in enumerate(active)}
    while active:
        counts = [min(segment, len(rows[index]) - done[index]) for index in active]
        finishing = [done[index] + count == len(rows[index]) for index, count in zip(active, counts)]
        return_state = keep_states or not all(finishing)
        with_media = media is not None and any(media[index] is not None for index in active)
        whole = bucketed and state is None and not return_state and not with_media and route is None
        width = sequence_bucket(max(counts)) if bucketed else max(counts)
        input_ids = torch.full((batch_bucket(len(active)) if whole else len(active), width), pad_id, dtype=torch.long)
        for row, (index, count) in enumerate(zip(active, counts)):
            input_ids[row, :count] = torch.tensor(rows[index][done[index] : done[index] + count], dtype=torch.long)
        if whole:  # rows from their start, nothing kept: lengths change nothing (causality), padding rows dropped
            output = (whole_step or (lambda ids: decoder(ids.to(device))))(input_ids)[: len(active)]
        else:
            on_device = input_ids.to(device)  # the step's one upload of its ids
            inputs = {}
            if with_media:
                inputs = media_inputs(decoder, on_device, [media[index] for index in active], [past_of[index] + done[index] for index in active], counts)
            with contextlib.nullcontext() if route is None else route(active, counts, input_ids.shape[1]):
                output = decoder(on_device, counts, state=state, return_state=return_state, reserve=reserve, **inputs)
        hidden, state = output if return_state else (output, None)
        on_segment(hidden, active, [done[index] for index in active], counts)
        del hidden, output
        for index, count in zip(active, counts):
            done[index] += count
        if keep_states:
            for row, (index, finished) in enumerate(zip(active, finishing)):
                if finished:
                    kept[index] = state.row(row)
        going = [row for row, finished in enumerate(finishing) if not finished]
        if len(going) < len(active) and going:
            state = state.select(going)
        active = [active[row] for row in going]
    return kept if keep_states else None  # type: ignore[return-value]


def row_media(
    vision: torch.nn.Module,
    rows: Sequence[Sequence[int]],
    media: Sequence[RecordMedia | None],
    starts: Sequence[int],
    *,
    dtype: torch.dtype,
    device: torch.device,
) -> list[RowMedia | None] | None:
    """Per row: its 3-D positions (over the tokens given) and the features, in `dtype`, of the images and videos it
    runs: those with a pad token at or after `starts[i]` (the tokens before it are behind, in a kept state; a row
    may end inside its media, a state kept part-way). The vision tower runs once over all of them (attention stays
    within each image and frame pair)."""
    if all(item is None for item in media):
        return None
    pads: list[torch.Tensor | None] = []  # per row: the positions of the pads its features go to
    ahead: list[list[int]] = []  # per row: the media items it runs
    for ids, item, start in zip(rows, media, starts):
        if item is None:
            pads.append(None)
            ahead.append([])
            continue
        positions = torch.isin(torch.tensor(ids), torch.tensor(sorted(item.pad_ids))).nonzero().flatten()  # [pads]
        runs = [positions[first : first + count] for first, count in _item_pads(item)]  # each item's (a cut row: fewer)
        items = [index for index, run in enumerate(runs) if run.numel() and int(run[-1]) >= start]
        pads.append(torch.cat([runs[index] for index in items]) if items else None)
        ahead.append(items)
    per_record = iter(())
    if any(ahead):
        pixels, grids = [], []
        for item, items in zip(media, ahead):
            patches = [t * h * w for t, h, w in item.grids] if items else []
            offsets = np.cumsum([0, *patches])
            pixels += [item.pixel_values[offsets[index] : offsets[index + 1]] for index in items]
            grids += [item.grids[index] for index in items]
        features = vision(torch.from_numpy(np.concatenate(pixels)).to(device), grids).to(dtype)  # [pads, D]
        per_record = iter(features.split([sum(_item_pads(item)[index][1] for index in items) for item, items in zip(media, ahead) if items]))
    out: list[RowMedia | None] = []
    for ids, item, row_pads, items in zip(rows, media, pads, ahead):
        if item is None:
            out.append(None)
            continue
        positions = rope_positions(ids, item.position_grids, item.pad_ids, item.merge)
        if items:
            out.append(RowMedia(next(per_record), row_pads, positions))
        else:
            out.append(RowMedia(torch.empty(0), torch.empty(0, dtype=torch.long), positions))
    return out


def _item_pads(item: RecordMedia) -> list[tuple[int, int]]:
    """(first, count) of each image's and video's pad tokens among the record's pads, in order."""
    counts = [t * h * w // item.merge**2 for t, h, w in item.grids]
    return [(first, count) for first, count in zip(np.cumsum([0, *counts[:-1]]).tolist(), counts)]


def media_inputs(
    decoder: Qwen35Decoder, input_ids: torch.Tensor, media: Sequence[RowMedia | None], starts: Sequence[int], counts: Sequence[int]
) -> dict[str, torch.Tensor]:
    """The step's embeddings with image features scattered in, and its 3-D positions [3, B, L]."""
    B, L = input_ids.shape
    embeds = decoder.embed_tokens(input_ids).to(decoder.dtype)  # [B, L, D]
    positions = torch.empty(3, B, L, dtype=torch.long)
    for row, (item, start, count) in enumerate(zip(media, starts, counts)):
        if item is None:
            positions[:, row] = torch.arange(start, start + L)
            continue
        positions[:, row, :count] = item.positions[:, start : start + count]
        after = int(item.positions[:, start + count - 1].max()) + 1  # padding: any position past the real ones
        positions[:, row, count:] = torch.arange(after, after + L - count)
        inside = ((item.pad_positions >= start) & (item.pad_positions < start + count)).nonzero().squeeze(1)  # [n] (host)
        if inside.numel():  # which features and where: picked on the host, the indices sent up (no mask on the device)
            where = (item.pad_positions[inside] - start).to(embeds.device)
            embeds[row, where] = item.features.index_select(0, inside.to(item.features.device)).to(embeds.dtype)
    return {"embeds": embeds, "positions": positions.to(input_ids.device)}
