"""Converting a release into an 8-bit bundle, calibrated: the Python API behind `clef-flash convert`.

    convert(source, destination)                          built-in calibration requests
    convert(source, destination, calibrate="req.jsonl")   the user's requests (JSONL, one per line)
    convert(source, destination, calibrate=None)          no calibration (plain per-token W8A8)

Calibration records each quantized projection's per-input-channel activation absmax
(checkpoint/outliers.py) layer by layer (`calibrate_layer_major`): the requests' hidden states are carried
from one decoder layer to the next, and each layer's weights are read once, in the fastest 16/32-bit
precision of this CPU (`plan.fastest_dense`: bf16 or fp32), then freed. Nothing else of the model is
loaded: not the output embeddings nor the head, only the embedding rows of the requests' tokens, the
vision tower only for requests with images. Then the conversion streams (checkpoint/bundle.py).
`calibrate(model, requests)` is its whole-model twin (a loaded model, a request at a time); tests hold
them equal.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

import torch
from torch import nn

from .checkpoint import bundle
from .checkpoint.names import DECODER_PREFIX, EMBEDDING
from .checkpoint.outliers import Calibration
from .errors import ClefError, no_vision_tower
from .model.precision import is_quantized
from .prefill import DEFAULT_SEGMENT_TOKENS

if TYPE_CHECKING:
    from .checkpoint import Checkpoint
    from .model.precision import Plan, Precision
    from .model.qwen3_5 import LayerInputs, Qwen35Decoder
    from .request.records import EncodedRecord

BUILT_IN = "built-in"
DEFAULT_CALIBRATION_REQUESTS = 16


def convert(
    source: str | os.PathLike[str],
    destination: str | os.PathLike[str],
    *,
    calibrate: str | os.PathLike[str] | Sequence[Any] | None = BUILT_IN,
    revision: str | None = None,
    overwrite: bool = False,
    progress: bool = True,
) -> Path:
    """Convert `source` to a bundle at `destination`; `calibrate`: "built-in", a JSONL path, requests, or None."""
    bundle.check_conversion(source, destination, revision=revision, overwrite=overwrite)
    calibration, described = None, None
    if calibrate is not None:
        requests, described = _calibration_requests(calibrate)
        calibration = _calibrate(source, revision, requests, progress=progress)
    return bundle.convert(
        source,
        destination,
        revision=revision,
        overwrite=overwrite,
        progress=progress,
        calibration=calibration,
        calibration_source=described,
    )


def _calibration_requests(calibrate: str | os.PathLike[str] | Sequence[Any]) -> tuple[list[Any], str]:
    if isinstance(calibrate, (str, os.PathLike)):
        if os.fspath(calibrate) == BUILT_IN:
            requests = default_calibration_requests()
            return requests, f"{BUILT_IN} ({len(requests)} generated requests)"
        from .batch import read_jsonl
        from .checkpoint.safetensors_io import sha256_of

        path = Path(calibrate)
        requests = [request for _, request in read_jsonl(path)]
        return requests, f"{path.name} (sha256 {sha256_of(path)})"
    return list(calibrate), f"{len(calibrate)} requests given"


def _calibrate(source, revision, requests: Sequence[Any], *, progress: bool = False) -> Calibration:
    from .checkpoint import open_checkpoint
    from .checkpoint.safetensors_io import mapped_files
    from .checkpoint.sources import open_release
    from .plan import fastest_dense
    from .request.protocol import parse_request
    from .request.records import encode_record

    if not requests:
        raise ClefError("calibration needs at least one request")
    checkpoint = open_checkpoint(source, revision=revision)
    if checkpoint.kind not in ("release", "random"):
        raise ClefError(f"{checkpoint.where} is a {checkpoint.kind}, not a release: calibrate and convert the release it came from")
    if checkpoint.kind == "release":  # memory-mapped: what calibration reads it gives back (embedding rows, layers)
        checkpoint = open_release(checkpoint.root, source=checkpoint.source, files=mapped_files)
    records = [
        encode_record(checkpoint.tokenizer, parse_request(request), image_processor=checkpoint.image_processor)
        for request in requests
    ]
    return calibrate_layer_major(checkpoint, records, plan=fastest_dense(torch.device("cpu")), progress=progress)


def default_calibration_requests(count: int = DEFAULT_CALIBRATION_REQUESTS) -> list[dict[str, Any]]:
    """Generated requests of every question type (request/samples.py), states of 5 to 400 words."""
    from .request.samples import random_requests

    return random_requests(seed=20261203, count=count, state_words=(5, 400))


# The hidden states one pass over the weights carries: a larger calibration set takes more passes.
ACTIVATION_BUDGET = 1 << 30


@torch.inference_mode()
def calibrate_layer_major(
    checkpoint: Checkpoint,
    records: Sequence[EncodedRecord],
    *,
    plan: Plan,
    budget_bytes: int = ACTIVATION_BUDGET,
    segment_tokens: int = DEFAULT_SEGMENT_TOKENS,
    progress: bool = False,
) -> Calibration:
    """Record max|x| per input channel at each quantized projection over `records` (encoded), layer by layer.

    The records go in groups whose hidden states (`activation_groups`) fit `budget_bytes` (1 GiB: ~65K tokens
    of the 9B in fp32); each group is one pass over the decoder layers: a layer's weights are read from
    `checkpoint` in `plan`'s precision, every record of the group runs through it as the model would run it
    alone (in steps of `segment_tokens`, continuing the layer's state), and the layer is freed. A bigger
    set than one group holds takes one more pass over the weights per group. Memory: one layer's weights,
    the group's hidden states, one step's intermediates (a group with images builds the vision tower first
    and frees it before the layers run). Equal to `calibrate` on the model loaded whole in
    the same precision (same arithmetic: the same layer calls on the same inputs).
    """
    from .checkpoint.loading import LayerWindow, checked_decoder_names, meta_modules, text_config_of
    from .console import ProgressBar
    from .model.qwen3_5 import Qwen35Decoder

    if plan.precision.quantized:
        raise ValueError(f"calibration runs at 16 or 32 bits, not {plan.name}")
    config = text_config_of(checkpoint)
    with meta_modules():
        decoder = Qwen35Decoder(config)
    checked_decoder_names(checkpoint, checkpoint.tensors, decoder)
    precision, device = plan.precision, plan.device
    absmax: dict[str, torch.Tensor] = {}
    hooks = [hook for index, layer in enumerate(decoder.layers) for hook in absmax_hooks(layer, f"layers.{index}.", absmax)]
    window = LayerWindow(1, checkpoint.tensors, dtype_of=precision.dtype_of, device=device)
    bytes_per_token = (config.hidden_size + config.rotary_dim) * precision.compute_dtype.itemsize  # hidden, cos/sin
    groups = activation_groups([record.token_count for record in records], bytes_per_token, budget_bytes)
    try:
        with ProgressBar(len(groups) * len(decoder.layers), "calibrating", unit="layers", enabled=progress) as meter:
            for group in groups:
                steps = list(_record_steps(checkpoint, decoder, [records[index] for index in group], precision, device, segment_tokens))
                for index, layer in enumerate(decoder.layers):
                    window.enter(f"{DECODER_PREFIX}layers.{index}.", layer)
                    for record_steps in steps:
                        state = None
                        for number, step in enumerate(record_steps):
                            state = step.run(layer, state, return_state=number + 1 < len(record_steps))
                    meter.advance(1)
                window.clear()
                del steps
    finally:
        window.clear()
        for hook in hooks:
            hook.remove()
    return Calibration(activation_absmax=absmax, records=len(records), tokens=sum(record.token_count for record in records))


def activation_groups(token_counts: Sequence[int], bytes_per_token: int, budget_bytes: int) -> list[list[int]]:
    """Consecutive records whose tokens x `bytes_per_token` together stay within `budget_bytes` (a record
    larger than the budget makes a group alone)."""
    groups: list[list[int]] = []
    used = 0
    for index, tokens in enumerate(token_counts):
        size = tokens * bytes_per_token
        if not groups or used + size > budget_bytes:
            groups.append([])
            used = 0
        groups[-1].append(index)
        used += size
    return groups


def _record_steps(
    checkpoint: Checkpoint,
    decoder: Qwen35Decoder,
    records: Sequence[EncodedRecord],
    precision: Precision,
    device: torch.device,
    segment: int,
) -> Iterator[list[LayerInputs]]:
    """Each record's steps as the model runs it alone (prefill.run_segments for one row): the layers' inputs
    of every `segment` tokens. The embedding table gives only the rows of these records' tokens (the
    decoder's `embed_tokens` becomes that compact table, ids renumbered); the vision tower is built only
    when a record has images."""
    from .checkpoint.loading import build_vision, empty_module
    from .checkpoint.safetensors_io import release_pages
    from .prefill import media_inputs, row_media

    tokens = torch.tensor(sorted({token for record in records for token in record.input_ids}), dtype=torch.long)
    table = checkpoint.tensors.get(DECODER_PREFIX + EMBEDDING)  # [V, D], a view of the file where memory-mapped
    rows = table.index_select(0, tokens).to(device=device, dtype=precision.dtype_of(EMBEDDING, table.dtype))  # [n, D]
    release_pages(table)
    decoder.embed_tokens = nn.Embedding.from_pretrained(rows)
    vision = None
    with_media = [record.media for record in records if record.media is not None]
    if with_media:
        vision = build_vision(checkpoint, checkpoint.tensors, precision=precision, device=device)
        if vision is None:
            raise no_vision_tower(any(media.image_count for media in with_media))
    try:
        for record in records:
            ids = torch.searchsorted(tokens, torch.tensor(record.input_ids, dtype=torch.long))  # [T] rows of `rows`
            media = None
            if record.media is not None:
                media = row_media(vision, [record.input_ids], [record.media], [False], dtype=decoder.dtype, device=device)
            total = len(ids)
            steps = []
            for start in range(0, total, segment):
                count = min(segment, total - start)
                input_ids = ids[start : start + count][None].to(device)  # [1, L]
                extra = {} if media is None else media_inputs(decoder, input_ids, media, [start], [count])
                steps.append(decoder.inputs(input_ids, [count], past=(start,), reserve=total, **extra))
            yield steps
    finally:
        decoder.embed_tokens = None
        if vision is not None:
            empty_module(vision)


def absmax_hooks(module: nn.Module, prefix: str, absmax: dict[str, torch.Tensor]) -> list[Any]:
    """Forward pre-hooks on every quantized projection of `module` (names relative to the decoder start with
    `prefix`) that keep max|x| per input channel in `absmax`, by full weight name."""
    hooks = []
    for name, linear in module.named_modules():
        if isinstance(linear, nn.Linear) and is_quantized(f"{prefix}{name}.weight", tuple(linear.weight.shape)):
            weight_name = f"{DECODER_PREFIX}{prefix}{name}.weight"

            def record(linear, inputs, weight_name=weight_name):
                seen = inputs[0].detach().abs().float().reshape(-1, inputs[0].shape[-1]).amax(dim=0)  # [I]
                previous = absmax.get(weight_name)
                absmax[weight_name] = seen if previous is None else torch.maximum(previous, seen)

            hooks.append(linear.register_forward_pre_hook(record))
    return hooks


@torch.inference_mode()
def calibrate(model: Any, requests: Sequence[Any]) -> Calibration:
    """The whole-model twin of `calibrate_layer_major`: `model` (loaded whole at 16 or 32 bits) runs each
    request alone, from its start, and a hook on every quantized projection records max|x| per input channel."""
    from .checkpoint.loading import StreamedLayer
    from .engine import Timings

    decoder = model.parts.decoder
    if any(isinstance(layer, StreamedLayer) for layer in decoder.layers):
        raise ValueError("calibration's twin needs the model loaded whole (no resident_layers): use calibrate_layer_major")
    absmax: dict[str, torch.Tensor] = {}
    hooks = absmax_hooks(decoder, "", absmax)
    if not hooks:
        raise ValueError("calibration needs the model at 16 or 32 bits (its projections as nn.Linear)")
    tokens = 0
    try:
        for request in requests:
            record = model.prepare(request).record
            model.engine.backend.forward([record], [None], Timings())  # whole: no kept state splits it
            tokens += record.token_count
    finally:
        for hook in hooks:
            hook.remove()
    return Calibration(activation_absmax=absmax, records=len(requests), tokens=tokens)
