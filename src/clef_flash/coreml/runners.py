"""What runs the packages: Core ML on macOS (`MLModelRunner`), or the traced torch twins (`TorchRunner`).

Both answer `predict(package, function, inputs) -> output` for the host (coreml/host.py). `TorchRunner` is the
stand-in the tests and `benchmarks/coreml_mac.py` use off macOS: the same export twins the exporter traces,
filled from the export's source, traced once per (package, bucket), so the whole host path runs up to the
Core ML call.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import Tensor

from ..checkpoint import open_checkpoint
from ..errors import ModelSourceError
from ..model.config import TextConfig
from ..model.precision import COREML_PART_DTYPE, EXPORT_DTYPE, FP32
from ..checkpoint import coreml_layout as layout
from .modules import build_head, build_part

COMPUTE_UNITS = "CPU_AND_GPU"  # the port's; ALL adds the Neural Engine


class MLModelRunner:
    """Core ML through coremltools' `MLModel`, one loaded model per (package, function), made on first use."""

    part_dtype = COREML_PART_DTYPE

    def __init__(self, root: str | os.PathLike[str], *, compute_units: str = COMPUTE_UNITS):
        if sys.platform != "darwin":
            raise ModelSourceError(
                f"{root} is a Core ML export: Core ML runs only on macOS (this is {sys.platform}). Exporting runs "
                "anywhere; to answer here, load the release or bundle it was exported from"
            )
        try:
            import coremltools as ct
        except ImportError as exc:
            raise ModelSourceError('running a Core ML export needs coremltools: pip install -e ".[coreml]"') from exc
        self.ct, self.root = ct, Path(root)
        self.compute_units = getattr(ct.ComputeUnit, compute_units)
        self.models: dict[tuple[str, str], object] = {}

    def model(self, package: str, function: str):
        key = (package, function)
        if key not in self.models:
            self.models[key] = self.ct.models.MLModel(
                str(self.root / package), compute_units=self.compute_units, function_name=function
            )
        return self.models[key]

    def predict(self, package: str, function: str, inputs: dict[str, Tensor]) -> Tensor:
        outputs = self.model(package, function).predict({name: value.numpy() for name, value in inputs.items()})
        (output,) = outputs.values()
        return torch.from_numpy(output.copy())


class TorchRunner:
    """The export twins in torch, filled from the export's source (a release, bundle, "tiny" or "random:NAME"),
    traced per (package, bucket) like the exporter traces them. `part_dtype`: fp32 for exactness checks, or
    Core ML's fp16 to see its rounding (slow on CPUs: use small configs): fp16 weights and activations, with the
    op families the export keeps in fp32 (`fp32_families`, its manifest's) computed in fp32, as the package."""

    def __init__(
        self,
        source: str | os.PathLike[str],
        export: layout.ExportLayout,
        *,
        part_dtype: torch.dtype = EXPORT_DTYPE,
        fp32_families: Sequence[str] | None = None,
    ):
        """`fp32_families` (fp16 only): the op families computed in fp32; None, the export's."""
        from .export import trace  # the exporter's trace (no coremltools needed for it)

        self.trace = trace
        self.part_dtype = part_dtype
        checkpoint = open_checkpoint(source)
        config = TextConfig.from_release_config(checkpoint.config)
        families = export.fp32_families if fp32_families is None else tuple(fp32_families)
        kept = {family: FP32 for family in families} if part_dtype == COREML_PART_DTYPE else {}
        self.modules = {
            part["package"]: build_part(checkpoint, config, part["layers"], final_norm=part["final_norm"])
            .to(part_dtype)
            .compute_families(kept)
            for part in export.parts
        }
        self.head_package = export.head["package"]
        self.modules[self.head_package] = build_head(checkpoint)
        self.traced: dict[tuple[str, str], torch.jit.ScriptModule] = {}

    def predict(self, package: str, function: str, inputs: dict[str, Tensor]) -> Tensor:
        key = (package, function)
        names = layout.HEAD_INPUTS if package == self.head_package else layout.PART_INPUTS
        arguments = tuple(inputs[name] for name in names)
        if key not in self.traced:
            self.traced[key] = self.trace(self.modules[package], arguments)
        with torch.no_grad(), torch.jit.optimized_execution(False):  # no profiling runs: one plain pass
            return self.traced[key](*arguments)


def make_runner(name: str, export: layout.ExportLayout) -> MLModelRunner | TorchRunner:
    """"coreml": Core ML (macOS); "torch": the traced fp32 twins, rebuilt from the source the export was made from."""
    if name == "coreml":
        return MLModelRunner(export.root)
    source = export.manifest["source"]["path"]
    try:
        return TorchRunner(source, export)
    except ModelSourceError as exc:
        raise ModelSourceError(
            f"{export.root}: the torch runner rebuilds the export's twins from its source {source!r}, which cannot "
            f"be opened here ({exc}); use the Core ML runner on a Mac"
        ) from None
