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

from .checkpoint.names import DECODER_PREFIX, LM_HEAD
from .errors import ClefError
from .checkpoint.w8a8 import W8A8_KERNELS
from .machine import available_memory_bytes
from .machine import rates as machine_rates
from .model.precision import (
    BYTES_PER_PARAMETER,
    COREML,
    COREML_PRECISION,
    MEMORY_SHARE,
    PRECISIONS,
    W8A8,
    Plan,
    Precision,
    choose_precision,
    is_scale,
    resolve_precision,
    w8a8_kernel,
    weight_only_rate,
)

LAYERS_PREFIX = DECODER_PREFIX + "layers."
TOO_BIG = "no qualified precision fits this machine's memory"  # choose_precision's words when nothing fits whole

__all__ = ["Plan", "coreml_plan", "resolve"]


def decoder_parameters(checkpoint: Any) -> int | None:
    """The decoder's parameters (the output embeddings aside: their rows are gathered, never held whole)."""
    tensors = checkpoint.tensors
    if tensors is None:
        return None
    return sum(math.prod(tensors.shape(name)) for name in tensors.keys() if name != LM_HEAD and not is_scale(name))


def layer_parameters(checkpoint: Any) -> list[int]:
    """Each decoder layer's parameters, in layer order (what streaming holds one at a time)."""
    tensors = checkpoint.tensors
    counts: dict[int, int] = {}
    for name in tensors.keys() if tensors is not None else ():
        if name.startswith(LAYERS_PREFIX) and not is_scale(name):
            index = int(name[len(LAYERS_PREFIX) :].split(".", 1)[0])
            counts[index] = counts.get(index, 0) + math.prod(tensors.shape(name))
    return [counts[index] for index in sorted(counts)]


def streamed(checkpoint: Any, memory_bytes: int, too_big: str) -> tuple[Precision, int]:
    """When no precision fits memory whole: the faster qualified 8-bit path, with as many decoder layers resident as
    fit in MEMORY_SHARE of `memory_bytes` beside the rest of the model (counted as `choose_precision` counts it), the
    others read from the memory-mapped files as they run. Not even one layer fitting is `too_big`, raised as it was."""
    layers = layer_parameters(checkpoint)
    if not layers:
        raise ValueError(too_big)
    measured = machine_rates()
    names = [name for name in ("int8-w8a8", "int8-weight-only") if name != "int8-w8a8" or measured.int8_kernel is not None]
    name = max(names, key=lambda name: measured.int8 if name == "int8-w8a8" else weight_only_rate(measured))
    rest = (decoder_parameters(checkpoint) or 0) - sum(layers)
    room = MEMORY_SHARE * memory_bytes - rest * BYTES_PER_PARAMETER[name]
    resident = min(len(layers) - 1, int(room // (max(layers) * BYTES_PER_PARAMETER[name])))
    if resident < 1:
        raise ValueError(too_big)
    whole = (sum(layers) + rest) * BYTES_PER_PARAMETER[name]
    reason = (
        f"streamed: {too_big.split(':', 1)[0]} ({whole / 2**30:.1f} GiB in {name}); {name}, {resident} of {len(layers)} "
        f"decoder layers resident at once ({MEMORY_SHARE:.0%} of {memory_bytes / 2**30:.1f} GiB available), the others "
        "read from the memory-mapped files as they run (slower: every record reads them); a machine with more memory "
        "holds them all"
    )
    return PRECISIONS[name].with_reason(reason), resident


def resolve(checkpoint: Any, device: torch.device, requested: str | None, *, memory_bytes: int | None = None) -> Plan:
    """The plan `checkpoint` (anything with `stored_int8`, `where` and `tensors`) runs in on `device`:
    `requested`, else $CLEF_FLASH_PRECISION, else the fastest qualified path on this machine; when none fits its
    memory whole (`memory_bytes`, default: what is available now), 8-bit with streamed layers."""
    choosing = requested is None and device.type == "cpu"  # only the default weighs sizes against memory
    memory = (memory_bytes or available_memory_bytes()) if choosing else None
    resident = None
    try:
        precision = resolve_precision(
            requested,
            device,
            stored_int8=checkpoint.stored_int8,
            rates=machine_rates,
            parameters=decoder_parameters(checkpoint) if choosing else None,
            memory_bytes=memory,
        )
    except ValueError as exc:
        try:
            if not (choosing and str(exc).startswith(TOO_BIG)):
                raise
            precision, resident = streamed(checkpoint, memory, str(exc))
        except ValueError as exc:
            raise ClefError(f"{checkpoint.where} {exc}" if checkpoint.stored_int8 else str(exc)) from None
    if precision.int8_mode != W8A8 or device.type != "cpu":
        return Plan(precision, device, resident_layers=resident)
    measured = machine_rates()
    try:
        kernel = w8a8_kernel(measured)  # exact kernels only: forced or not
    except ValueError as exc:
        raise ClefError(str(exc)) from None
    return Plan(precision, device, kernel=kernel, activation_bits=W8A8_KERNELS[kernel].activation_bits, resident_layers=resident)


def coreml_plan(runner: str) -> Plan:
    """A Core ML export runs as exported (`runner`: "coreml", or "torch" for the fp32 twins standing in)."""
    precision = COREML_PRECISION if runner == "coreml" else COREML_PRECISION.with_reason(
        "a Core ML export run by its traced fp32 torch twins (--coreml-runner torch), standing in for Core ML"
    )
    return Plan(precision, torch.device("cpu"), backend=COREML)
