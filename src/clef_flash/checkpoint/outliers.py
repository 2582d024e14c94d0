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

`max|X_j|` comes from a calibration run (conversion.py's `calibrate_layer_major`): the release at 16 or 32 bits,
layer by layer, on a set of requests (a built-in one, or the user's), a forward hook on every quantized projection.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch



THRESHOLD = 6.0  # an outlier channel's absmax is above THRESHOLD x the median channel's
MAX_FRACTION = 1 / 64  # at most this share of a projection's input channels (the largest first)
FLOOR = 1e-5  # smallest max|X_j| or max|W_j| taken as non-zero


@dataclass(frozen=True)
class Calibration:
    """Per-input-channel absmax of every quantized projection's activations, over the calibration tokens."""

    activation_absmax: dict[str, torch.Tensor]  # full weight name -> [I] fp32
    records: int
    tokens: int


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
