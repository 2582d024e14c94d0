"""The plan: how a checkpoint runs on this machine, decided once and read by everything after.

    resolve(checkpoint, device, requested) -> Plan   (the Plan itself: model/precision.py)

A `Plan` is the precision (name, compute dtype, int8 mode: model/precision.py), the W8A8 kernel (from the
machine's probe: machine.py), the device, the backend, and the reason. `resolve` is the only caller of the probe; `build_model`, the CLI,
conversion, Ray's engine spec, the Core ML export and the state cache's key take the plan. A new precision is a row of
`model.precision.PRECISIONS`; a new kernel is an entry of `checkpoint.w8a8.W8A8_KERNELS` (the probe times
and qualifies it); a new backend is a `backend` name here and a class in engine/.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from .checkpoint.names import LM_HEAD
from .errors import ClefError
from .checkpoint.w8a8 import W8A8_KERNELS
from .machine import available_memory_bytes
from .machine import rates as machine_rates
from .model.precision import (
    COREML,
    COREML_PRECISION,
    W8A8,
    Plan,
    choose_precision,
    is_scale,
    resolve_precision,
    w8a8_kernel,
)

__all__ = ["Plan", "coreml_plan", "resolve"]


def decoder_parameters(checkpoint: Any) -> int | None:
    """The decoder's parameters (the output embeddings aside: their rows are gathered, never held whole)."""
    tensors = checkpoint.tensors
    if tensors is None:
        return None
    return sum(math.prod(tensors.shape(name)) for name in tensors.keys() if name != LM_HEAD and not is_scale(name))


def resolve(checkpoint: Any, device: torch.device, requested: str | None) -> Plan:
    """The plan `checkpoint` (anything with `stored_int8` and `where`) runs in on `device`:
    `requested`, else $CLEF_FLASH_PRECISION, else the fastest qualified path on this machine."""
    choosing = requested is None and device.type == "cpu"  # only the default weighs sizes against memory
    try:
        precision = resolve_precision(
            requested,
            device,
            stored_int8=checkpoint.stored_int8,
            rates=machine_rates,
            parameters=decoder_parameters(checkpoint) if choosing else None,
            memory_bytes=available_memory_bytes() if choosing else None,
        )
    except ValueError as exc:
        raise ClefError(f"{checkpoint.where} {exc}" if checkpoint.stored_int8 else str(exc)) from None
    if precision.int8_mode != W8A8 or device.type != "cpu":
        return Plan(precision, device)
    measured = machine_rates()
    try:
        kernel = w8a8_kernel(measured)  # exact kernels only: forced or not
    except ValueError as exc:
        raise ClefError(str(exc)) from None
    return Plan(precision, device, kernel=kernel, activation_bits=W8A8_KERNELS[kernel].activation_bits)


def coreml_plan(runner: str) -> Plan:
    """A Core ML export runs as exported (`runner`: "coreml", or "torch" for the fp32 twins standing in)."""
    precision = COREML_PRECISION if runner == "coreml" else COREML_PRECISION.with_reason(
        "a Core ML export run by its traced fp32 torch twins (--coreml-runner torch), standing in for Core ML"
    )
    return Plan(precision, torch.device("cpu"), backend=COREML)
