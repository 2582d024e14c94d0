"""The plan: how a checkpoint runs on a machine, decided once and carried as one thing by everything after.

    resolve(checkpoint, device, requested, rates=..., available_memory=..., gpu=...)  what `load` runs (loader.py)
    coreml_plan(runner)       a Core ML export: as exported
    shapes_plan()             building a bundle's modules from names and shapes alone (checkpoint/bundle.py)
    export_plan(stored_int8)  filling the Core ML export twins (coreml/modules.py)
    defaults(rates)           what `resolve` picks on a CPU with those rates, for a release and a bundle (`info`)
    gpu_defaults(found)       the same on a CUDA device

A `Plan` is the precision (name, compute dtype, int8 mode: model/precision.py), the W8A8 kernel (from the
machine's probe), the device, the backend, and the reason. Nothing else constructs one (tests/test_architecture.py).
The probe's figures are handed in (`rates`, `available_memory`, `gpu`: machine.py, read by loader.py), so that this module
sits below everything that takes a plan (checkpoint/ builds modules with it) and imports only the precision policy.
`build_model`, conversion, Ray's engine spec, the Core ML export and the state cache's key take the plan; `Plan.key`
is the whole of it, what Ray's workers compare with the driver's. A new precision is a row of
`model.precision.PRECISIONS`; a new kernel is an entry of `checkpoint.w8a8.W8A8_KERNELS` (the probe times and
qualifies it); a new backend is a `backend` name here and a class in engine/.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from .errors import ClefError
from .model.precision import (
    BYTES_PER_PARAMETER,
    CUDA_W8A8_BITS,
    CUDA_W8A8_KERNEL,
    Gpu,
    TooBig,
    WeightCounts,
    COREML_PRECISION,
    MEMORY_SHARE,
    PRECISION_CHOICES,
    PRECISIONS,
    W8A8,
    Precision,
    Rates,
    choose_on_gpu,
    choose_precision,
    resolve_precision,
    w8a8_kernel,
    weight_only_rate,
)

TORCH, COREML = "torch", "coreml"
BACKENDS = (TORCH, COREML)


@dataclass(frozen=True)
class Plan:
    """How a model runs (made by this module's constructors only). `key` is the whole plan: what the state cache's
    identity includes and what a Ray worker compares with the driver's."""

    precision: Precision
    device: torch.device
    kernel: str | None = None  # the W8A8 kernel (checkpoint/w8a8.py): the probe's on a CPU, int_mm on CUDA; None unless W8A8
    backend: str = TORCH
    activation_bits: int | None = None  # W8A8's activations on its kernel: 8, or 7 (FBGEMM); None unless W8A8
    # Streamed (the default when no precision fits memory whole): at most this many decoder layers hold weights at once,
    # each filled from the memory-mapped files as it runs (`load(resident_layers=)`). None: all resident. Not in `key`:
    # streaming changes where the weights wait, not what is computed.
    resident_layers: int | None = None

    @property
    def name(self) -> str:
        return self.precision.name

    @property
    def reason(self) -> str:
        return self.precision.reason

    @property
    def compute_dtype(self) -> torch.dtype:
        return self.precision.compute_dtype

    @property
    def int8_mode(self) -> str | None:
        return self.precision.int8_mode

    @property
    def key(self) -> str:
        return "|".join(
            map(str, (self.backend, self.name, self.compute_dtype, self.int8_mode, self.kernel, self.device))
        )

    def describe(self) -> dict[str, Any]:
        """What `info`, `/health` and `Clef.plan` show."""
        return {
            "backend": self.backend,
            "precision": self.name,
            "compute_dtype": str(self.compute_dtype).removeprefix("torch."),
            "int8_mode": self.int8_mode,
            "kernel": self.kernel,
            "activation_bits": self.activation_bits,
            "device": str(self.device),
            "resident_layers": self.resident_layers,
            "reason": self.reason,
        }

    def with_reason(self, reason: str) -> Plan:
        return dataclasses.replace(self, precision=self.precision.with_reason(reason))


class Resolvable(Protocol):
    """What `resolve` reads of a checkpoint (checkpoint/sources.py `Checkpoint`)."""

    stored_int8: bool
    where: str

    def weight_counts(self) -> WeightCounts | None: ...

    def layer_parameters(self) -> list[int]: ...


def streamed(
    checkpoint: Resolvable, weights: WeightCounts, measured: Rates, memory_bytes: int, too_big: TooBig, name: str | None = None
) -> tuple[Precision, int]:
    """When `name` (None: no qualified precision) does not fit memory whole: `name`, else the faster qualified 8-bit
    path, with as many decoder layers resident as fit in MEMORY_SHARE of `memory_bytes` beside the rest of the model
    (`weights`, counted as `choose_precision` counts them: `WeightCounts.bytes_in`), the others read from the
    memory-mapped files as they run. Not even one layer fitting is `too_big`, raised as it was."""
    layers = checkpoint.layer_parameters()
    if not layers:
        raise too_big
    if name is None:
        names = [name for name in ("int8-w8a8", "int8-weight-only") if name != "int8-w8a8" or measured.int8_kernel is not None]
        name = max(names, key=lambda name: measured.int8 if name == "int8-w8a8" else weight_only_rate(measured))
    whole = weights.bytes_in(name)
    layer_bytes = max(layers) * BYTES_PER_PARAMETER[name]  # projections: all but a few thousand of a layer's weights
    room = MEMORY_SHARE * memory_bytes - (whole - sum(layers) * BYTES_PER_PARAMETER[name])
    resident = min(len(layers) - 1, int(room // layer_bytes))
    if resident < 1:
        raise too_big
    reason = (
        f"streamed: {str(too_big).split(':', 1)[0]} ({whole / 2**30:.1f} GiB in {name}); {name}, {resident} of "
        f"{len(layers)} decoder layers resident at once ({MEMORY_SHARE:.0%} of {memory_bytes / 2**30:.1f} GiB "
        "available), the others read from the memory-mapped files as they run (slower: every record reads them); a "
        "machine with more memory holds them all"
    )
    return PRECISIONS[name].with_reason(reason), resident


def resolve(
    checkpoint: Resolvable,
    device: torch.device,
    requested: str | None,
    *,
    rates: Callable[[], Rates],
    available_memory: Callable[[], int | None],
    fit_memory: bool = False,
    gpu: Callable[[torch.device], Gpu | None] | None = None,
) -> Plan:
    """The plan `checkpoint` runs in on `device`: `requested`, else $CLEF_FLASH_PRECISION, else the fastest qualified
    path on this machine (`rates`: the machine's probe; `available_memory`: its free bytes, weighed only then; `gpu`: a
    CUDA device's name and compute capability, machine.py `cuda_gpu`: int8 tensor cores or not); when
    none fits that memory whole, 8-bit with streamed layers (`Plan.resident_layers`). `fit_memory`: `requested` was
    chosen elsewhere (a Ray driver's default): weighed against this machine's memory too, streamed if it does not fit
    whole (streaming is not in `Plan.key`: the answers are the same)."""
    weighing = (requested is None or fit_memory) and device.type == "cpu"  # the default weighs sizes against memory
    memory = available_memory() if weighing else None
    weights = checkpoint.weight_counts() if memory else None
    resident = None
    try:
        try:
            precision = resolve_precision(
                requested, device, stored_int8=checkpoint.stored_int8, rates=rates, weights=weights, memory_bytes=memory, gpu=gpu
            )
            whole = weights.bytes_in(precision.name) if weights and requested is not None else 0
            if memory and whole > MEMORY_SHARE * memory:  # given (fit_memory): streamed in it, if one layer at a time fits
                too_big = TooBig(f"{precision.name} does not fit this machine's memory whole: {whole / 2**30:.1f} GiB")
                precision, resident = streamed(checkpoint, weights, rates(), memory, too_big, precision.name)
        except TooBig as exc:
            if weights is None:
                raise
            precision, resident = streamed(checkpoint, weights, rates(), memory, exc)
    except ValueError as exc:
        raise ClefError(f"{checkpoint.where} {exc}" if checkpoint.stored_int8 else str(exc)) from None
    if precision.int8_mode != W8A8:
        return Plan(precision, device, resident_layers=resident)
    if device.type == "cuda":  # int8 tensor cores through cuBLASLt: exact int32 sums, no probe
        return Plan(precision, device, kernel=CUDA_W8A8_KERNEL, activation_bits=CUDA_W8A8_BITS, resident_layers=resident)
    if device.type != "cpu":
        return Plan(precision, device, resident_layers=resident)
    measured = rates()
    try:
        kernel = w8a8_kernel(measured)  # exact kernels only: forced or not
    except ValueError as exc:
        raise ClefError(str(exc)) from None
    return Plan(precision, device, kernel=kernel, activation_bits=measured.int8_bits, resident_layers=resident)


def coreml_plan(runner: str) -> Plan:
    """A Core ML export runs as exported (`runner`: "coreml", or "torch" for the fp32 twins standing in)."""
    precision = COREML_PRECISION if runner == "coreml" else COREML_PRECISION.with_reason(
        "a Core ML export run by its traced fp32 torch twins (--coreml-runner torch), standing in for Core ML"
    )
    return Plan(precision, torch.device("cpu"), backend=COREML)


def shapes_plan() -> Plan:
    """A bundle's modules built on the meta device from names and shapes alone: the strict check of a conversion."""
    return Plan(PRECISIONS["int8-weight-only"].with_reason("checking a bundle's names and shapes"), torch.device("meta"))


def export_plan(stored_int8: bool) -> Plan:
    """The Core ML export twins, filled on the CPU: in fp32, an 8-bit bundle's projections as int8 weight-only
    first (then made dense by coreml/modules.py)."""
    name = "int8-weight-only" if stored_int8 else "fp32"
    return Plan(PRECISIONS[name].with_reason("filling the Core ML export twins"), torch.device("cpu"))


def defaults(rates: Rates) -> dict[str, Precision]:
    """What `resolve` picks on a CPU with `rates` when nothing is asked for, for a release and for an 8-bit bundle
    (memory aside: that depends on the model's size)."""
    cpu = torch.device("cpu")
    return {kind: choose_precision(cpu, stored_int8=stored, rates=lambda: rates) for kind, stored in (("release", False), ("bundle", True))}


def gpu_defaults(found: Gpu | None) -> dict[str, Precision]:
    """What `resolve` picks on CUDA for a release and for an 8-bit bundle on the GPU `found` (`info`)."""
    cuda = torch.device("cuda")
    return {kind: choose_on_gpu(cuda, found, stored_int8=stored) for kind, stored in (("release", False), ("bundle", True))}


__all__ = ["BACKENDS", "COREML", "PRECISION_CHOICES", "TORCH", "Plan", "coreml_plan", "defaults", "export_plan", "gpu_defaults", "resolve", "shapes_plan"]
