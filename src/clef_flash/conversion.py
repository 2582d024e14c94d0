"""Converting a release into an 8-bit bundle, calibrated: the Python API behind `clef-flash convert`.

    convert(source, destination)                          built-in calibration requests
    convert(source, destination, calibrate="req.jsonl")   the user's requests (JSONL, one per line)
    convert(source, destination, calibrate=None)          no calibration (plain per-token W8A8)

Calibration loads the release in this machine's default precision for a release (bf16 or fp32, see
`clef-flash info`; at most 4 decoder layers resident when it would not fit in half the memory), runs the
requests through it one at a time recording each projection's per-channel activation absmax (checkpoint/outliers.py), frees it, then streams the conversion (checkpoint/bundle.py).
"""

from __future__ import annotations

import gc
import math
import os
from pathlib import Path
from typing import Any, Sequence

from .checkpoint import bundle
import torch
from torch import nn

from .checkpoint.names import DECODER_PREFIX
from .checkpoint.outliers import Calibration
from .errors import ClefError
from .model.precision import is_quantized

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
    calibration, described = None, None
    if calibrate is not None:
        requests, described = _calibration_requests(calibrate)
        calibration = _calibrate(source, revision, requests)
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


def _calibrate(source, revision, requests: Sequence[Any]):
    from .checkpoint import open_checkpoint
    from .loader import load, pick_device
    from .plan import resolve

    if not requests:
        raise ClefError("calibration needs at least one request")
    checkpoint = open_checkpoint(source, revision=revision)
    precision = resolve(checkpoint, pick_device("cpu"), None).precision  # the release's default here: bf16 or fp32
    parameters = sum(math.prod(checkpoint.tensors.shape(name)) for name in checkpoint.tensors.keys())
    resident = 4 if parameters * precision.compute_dtype.itemsize > _memory_bytes() // 2 else None
    model = load(source, device="cpu", precision=precision.name, revision=revision, resident_layers=resident)
    try:
        return calibrate(model, requests)
    finally:
        del model
        gc.collect()


def default_calibration_requests(count: int = DEFAULT_CALIBRATION_REQUESTS) -> list[dict[str, Any]]:
    """Generated requests of every question type (request/samples.py), states of 5 to 400 words."""
    from .request.samples import random_requests

    return random_requests(seed=20261203, count=count, state_words=(5, 400))


@torch.inference_mode()
def calibrate(model: Any, requests: Sequence[Any]) -> Calibration:
    """Run `requests` one at a time (no padding) and record max|x| per input channel at each projection."""
    absmax: dict[str, torch.Tensor] = {}
    hooks = []
    for name, module in model.parts.decoder.named_modules():
        if isinstance(module, nn.Linear) and is_quantized(f"{name}.weight", tuple(module.weight.shape)):
            weight_name = f"{DECODER_PREFIX}{name}.weight"

            def record(module, inputs, weight_name=weight_name):
                seen = inputs[0].detach().abs().float().reshape(-1, inputs[0].shape[-1]).amax(dim=0)  # [I]
                previous = absmax.get(weight_name)
                absmax[weight_name] = seen if previous is None else torch.maximum(previous, seen)

            hooks.append(module.register_forward_pre_hook(record))
    if not hooks:
        raise ValueError("calibration needs the model at 16 or 32 bits (its projections as nn.Linear)")
    tokens = 0
    try:
        for request in requests:
            record = model.prepare(request).record
            model.score([record])
            tokens += record.token_count
    finally:
        for hook in hooks:
            hook.remove()
    return Calibration(activation_absmax=absmax, records=len(requests), tokens=tokens)


def _memory_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
