"""Outlier channels for W8A8, found at conversion by calibration (LLM.int8()'s decomposition).

Trained LLMs carry a few hidden channels tens of times larger than the rest in every token (Dettmers
et al., 2022; Sun et al., 2024). Per-token int8 activations spend their 255 steps on those channels and
round all the others coarsely. So, per projection, the input channels whose calibration absmax exceeds
`THRESHOLD` times the median channel's are taken out of the int8 product: the weight's columns there
are kept in fp32 and multiplied densely (an [M, n] x [n, O] product, n of a few), the int8 weight holds
zeros there, and the activations are quantized without them.

Measured against SmoothQuant's migration (alpha 0.5, which moves half the range into the weights):
on the outlier-injected release it still flipped 6 of 75 decisions where the reference's bf16 flips
none; the decomposition is what the default W8A8 path uses (README "Numbers").

`max|X_j|` comes from a calibration run: the release at 16 or 32 bits on a set of requests (a built-in
one, or the user's), a forward hook on every quantized projection.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ..model.precision import is_quantized
from .loading import DECODER_PREFIX

if TYPE_CHECKING:
    from ..engine import Clef

THRESHOLD = 6.0  # an outlier channel's absmax is above THRESHOLD x the median channel's
MAX_FRACTION = 1 / 64  # at most this share of a projection's input channels (the largest first)
DEFAULT_CALIBRATION_REQUESTS = 16
FLOOR = 1e-5  # smallest max|X_j| or max|W_j| taken as non-zero


@dataclass(frozen=True)
class Calibration:
    """Per-input-channel absmax of every quantized projection's activations, over the calibration tokens."""

    activation_absmax: dict[str, torch.Tensor]  # full weight name -> [I] fp32
    records: int
    tokens: int


def default_calibration_requests(count: int = DEFAULT_CALIBRATION_REQUESTS) -> list[dict[str, Any]]:
    """Generated requests of every question type (request/samples.py), states of 5 to 400 words."""
    from ..request.samples import random_requests

    return random_requests(seed=20261203, count=count, state_words=(5, 400))


@torch.inference_mode()
def calibrate(model: Clef, requests: Sequence[Any]) -> Calibration:
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


def find_outliers(
    calibration: Calibration, threshold: float = THRESHOLD, max_fraction: float = MAX_FRACTION
) -> dict[str, torch.Tensor]:
    """Weight name -> sorted indices [n] of its input's outlier channels (projections with none are left out)."""
    found = {}
    for name, absmax in calibration.activation_absmax.items():
        limit = threshold * absmax.median().clamp_min(FLOOR)
        candidates = torch.nonzero(absmax > limit).flatten()
        if len(candidates) == 0:
            continue
        most = max(1, int(len(absmax) * max_fraction))
        if len(candidates) > most:
            candidates = candidates[absmax[candidates].topk(most).indices]
        found[name] = candidates.sort().values
    return found


def outlier_ratios(calibration: Calibration) -> dict[str, float]:
    """Per projection: the largest channel absmax over the median channel absmax (how spiky its input is)."""
    return {
        name: (absmax.max() / absmax.median().clamp_min(FLOOR)).item()
        for name, absmax in sorted(calibration.activation_absmax.items())
    }
