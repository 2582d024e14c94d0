"""`clef-flash export coreml SRC OUT`: the Core ML packages in the port's layout (checkpoint/coreml_layout.py).

Streaming, part by part: a part's layers are filled from the source (fp32), traced once per bucket
(`torch.jit.trace`), converted (`ct.convert`, macOS 15; fp16 compute except the op families of
`COREML_FP32_FAMILIES`, kept in fp32 by an op selector that reads each op's module scope, `Region`), and their
projections quantized per op:
exactly the tensors of our int8 predicate (`is_quantized`) become 8-bit, symmetric, one scale per output
channel, and everything else (norms, conv, A_log, dt_bias, the gate projections in_proj_a / in_proj_b) stays
fp16. The bucket functions are then merged into one multifunction package, which stores identical weights
once. From an 8-bit bundle the weights are its own int8 values times its scales, so the quantizer finds the
bundle's int8 values and scales again (tests/test_coreml.py reads them back). The manifest lists every op that
computes in fp32, per package and function, as read from the converted program.

Resumable: everything is written into a staging directory beside the destination (`.NAME.exporting`) that an
interrupted export leaves behind, with `progress.json` recording each finished package and table (its files'
sha256). The same export run again skips what is recorded and still matches its hashes, and redoes the rest;
other settings, or `resume=False`, start over. The staging directory is renamed when complete;
`manifest.json` comes last. Packages are byte-for-byte reproducible (`_pin_package_identifiers`).

coremltools (`pip install -e ".[coreml]"`) converts on Linux too; only running the packages needs macOS.
"""

from __future__ import annotations

import gc
import json
import os
import uuid
import shutil
import tempfile
import time
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from ..machine import peak_rss_mb
from ..checkpoint import open_checkpoint
from ..checkpoint.names import DECODER_PREFIX, EMBEDDING, LM_HEAD
from ..checkpoint.quant import SCHEME
from ..checkpoint.safetensors_io import sha256_of, write_json_durably
from ..checkpoint.sources import config_fingerprint
from ..errors import BundleError, ClefError
from ..model.config import TextConfig
from ..model.export import FAMILIES, MASKED, rotary_tables
from ..model.precision import (
    COREML_FP32_FAMILIES, COREML_HEAD_DTYPE, COREML_PART_DTYPE, COREML_TABLE_DTYPE, EXPORT_DTYPE, KEPT_HIGH_PRECISION,
    is_quantized,
)  # fmt: skip
from ..checkpoint import coreml_layout as layout
from .host import numpy_dtype
from .modules import build_head, build_part, part_layers

TABLE_ROWS_AT_ONCE = 8192  # rows converted to fp16 at a time while writing a table
PROGRESS = "progress.json"  # in the staging directory: the settings and each finished file's hashes
REGION = "Region"  # the module type whose scope names an op family (model/export.py)


def coremltools():
    try:
        import coremltools as ct
    except ImportError as exc:
        raise ClefError('exporting to Core ML needs coremltools: pip install -e ".[coreml]" (coremltools==9.0)') from exc
    return ct


def trace(module: torch.nn.Module, example: Sequence[torch.Tensor]) -> torch.jit.ScriptModule:
    """`torch.jit.trace` of an export twin at one fixed shape (its shape checks are Python: silence their warnings)."""
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        return torch.jit.trace(module, tuple(example), check_trace=False)


def part_example(config: TextConfig, bucket: int) -> tuple[torch.Tensor, ...]:
    cos, sin = rotary_tables(config, bucket, EXPORT_DTYPE)
    return (torch.zeros(1, bucket, config.hidden_size, dtype=EXPORT_DTYPE), cos, sin)


def head_example(hidden_size: int, bucket: int, questions: int, options: int) -> tuple[torch.Tensor, ...]:
    shapes = layout.head_shapes(bucket, hidden_size, questions, options)
    return tuple(torch.zeros(shapes[name], dtype=EXPORT_DTYPE) for name in layout.HEAD_INPUTS)


def op_family(op) -> str | None:
    """The op family (model/export.py, FAMILIES) a converted op was traced in: the name of the innermost `Region`
    module among its TorchScript scopes; None outside every family (conv taps, SiLU, residual adds)."""
    from coremltools.converters.mil.mil.scope import ScopeSource

    types = op.scopes.get(ScopeSource.TORCHSCRIPT_MODULE_TYPE, [])
    names = op.scopes.get(ScopeSource.TORCHSCRIPT_MODULE_NAME, [])
    found = [name for kind, name in zip(types, names) if kind == REGION]
    return found[-1] if found else None


def compute_precision(ct, dtype: torch.dtype, fp32_families: Sequence[str]):
    """fp32 for the head; for the parts fp16, except the ops of `fp32_families`, which the selector leaves in fp32
    (coremltools then casts their fp16 inputs up and their outputs down)."""
    if dtype != COREML_PART_DTYPE:
        return ct.precision.FLOAT32
    unknown = sorted(set(fp32_families) - set(FAMILIES))
    if unknown:
        raise ValueError(f"unknown op families {unknown}: the families are {', '.join(FAMILIES)}")
    kept = frozenset(fp32_families)
    return ct.transform.FP16ComputePrecision(op_selector=lambda op: op_family(op) not in kept)


def fp32_ops(function) -> list[str]:
    """The ops of a MIL function that compute in fp32: neither const nor cast, with a floating fp32 output."""
    from coremltools.converters.mil.mil import types

    return [
        op.name
        for op in function.operations
        if op.op_type not in ("const", "cast") and any(output.dtype == types.fp32 for output in op.outputs)
    ]


def _convert(ct, traced, shapes: dict[str, tuple[int, ...]], output: str, dtype: torch.dtype, fp32_families: Sequence[str] = ()):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return ct.convert(
            traced,
            inputs=[ct.TensorType(name=name, shape=shape, dtype=numpy_dtype(dtype)) for name, shape in shapes.items()],
            outputs=[ct.TensorType(name=output, dtype=numpy_dtype(dtype))],
            convert_to="mlprogram",
            compute_precision=compute_precision(ct, dtype, fp32_families),
            minimum_deployment_target=ct.target.macOS15,
            skip_model_load=True,
        )


def quantized_weight_names(module: torch.nn.Module) -> list[str]:
    """The module's tensors under our int8 predicate (names relative to the decoder)."""
    return sorted(name for name, tensor in module.state_dict().items() if is_quantized(name, tuple(tensor.shape)))


def const_name(name: str) -> str:
    """The const op coremltools makes of a traced parameter (`layers.0.mlp.up_proj.weight`), in fp16."""
    return name.replace(".", "_") + "_to_fp16"


def quantize(ct, mlmodel, names: list[str]):
    """8-bit, symmetric, per output channel, on exactly `names`' const ops; every other const stays fp16."""
    from coremltools.optimize.coreml import OpLinearQuantizerConfig, OptimizationConfig, linear_quantize_weights

    present = {op.name for op in mlmodel._mil_program.functions["main"].operations if op.op_type == "const"}
    missing = sorted(name for name in names if const_name(name) not in present)
    if missing:
        raise BundleError(f"the converted program lacks the weights {', '.join(missing[:5])}: cannot quantize them")
    config = OpLinearQuantizerConfig(mode="linear_symmetric", dtype="int8", granularity="per_channel", weight_threshold=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return linear_quantize_weights(mlmodel, OptimizationConfig(op_name_configs={const_name(n): config for n in names}))


def merge_functions(ct, packages: dict[int, Path], destination: Path) -> None:
    """One multifunction package, function `L{bucket}` per bucket (the smallest the default); weights once."""
    descriptor = ct.utils.MultiFunctionDescriptor()
    for bucket, package in sorted(packages.items()):
        descriptor.add_function(str(package), src_function_name="main", target_function_name=layout.function_name(bucket))
    descriptor.default_function_name = layout.function_name(min(packages))
    scratch = destination.parent / f".{destination.stem}.merging"  # the temporary package it converts into, then saves
    scratch.mkdir(exist_ok=True)
    before, tempfile.tempdir = tempfile.tempdir, str(scratch)  # (coremltools would leave it in /tmp until exit)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ct.utils.save_multifunction(descriptor, str(destination))
    finally:
        tempfile.tempdir = before
        shutil.rmtree(scratch, ignore_errors=True)


def _tree_bytes(path: Path) -> int:
    return sum(file.stat().st_size for file in path.rglob("*") if file.is_file()) if path.is_dir() else path.stat().st_size


def _files_of(root: Path, name: str) -> dict[str, dict[str, Any]]:
    """Every file of `root / name` (a package directory or one file), relative to root: bytes and sha256."""
    path = root / name
    files = sorted(path.rglob("*")) if path.is_dir() else [path]
    return {
        file.relative_to(root).as_posix(): {"bytes": file.stat().st_size, "sha256": sha256_of(file)}
        for file in files
        if file.is_file()
    }


def _pin_package_identifiers(package: Path) -> None:
    """coremltools names a package's items by random UUIDs in its Manifest.json: derived from each item's path
    instead, the same export writes the same bytes (a resumed export ends with one run's hashes)."""
    manifest_path = package / "Manifest.json"
    manifest = json.loads(manifest_path.read_text())
    renamed = {key: str(uuid.uuid5(uuid.NAMESPACE_URL, entry["path"])).upper() for key, entry in manifest["itemInfoEntries"].items()}
    manifest["itemInfoEntries"] = {renamed[key]: entry for key, entry in sorted(manifest["itemInfoEntries"].items(), key=lambda item: renamed[item[0]])}
    manifest["rootModelIdentifier"] = renamed[manifest["rootModelIdentifier"]]
    manifest_path.write_text(json.dumps(manifest, indent=4, sort_keys=True) + "\n")  # as Core ML itself rewrites it on opening


class _Progress:
    """The staging directory of an export and its `progress.json`: the settings, and each finished item (a package
    or a table) with its files' hashes, written durably after every item."""

    def __init__(self, staging: Path, settings: dict[str, Any], resume: bool, log: Callable[[str], None]):
        self.staging, self.settings, self.done = staging, settings, {}
        recorded = _read_progress(staging / PROGRESS) if resume else None
        if recorded is not None and recorded.get("settings") == settings:
            for name, item in recorded["done"].items():
                if _files_of(staging, name) == item["files"]:
                    self.done[name] = item
                    log(f"{name}: already written and matching its hashes, kept")
                else:
                    log(f"{name}: does not match its recorded hashes, written again")
            for path in staging.iterdir():  # anything else is the unfinished item of an interrupted run
                if path.name not in self.done and path.name != PROGRESS:
                    shutil.rmtree(path) if path.is_dir() else path.unlink()
        else:
            if recorded is not None:
                log(f"{staging}: an unfinished export with other settings, started over")
            shutil.rmtree(staging, ignore_errors=True)
            staging.mkdir(parents=True)
        self._save()

    def finished(self, name: str, **extra: Any) -> None:
        self.done[name] = {"files": _files_of(self.staging, name), **extra}
        self._save()

    def _save(self) -> None:
        scratch = self.staging / (PROGRESS + ".tmp")
        write_json_durably(scratch, {"settings": self.settings, "done": self.done})
        scratch.replace(self.staging / PROGRESS)


def _read_progress(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None


def export_coreml(
    source: str | os.PathLike[str],
    destination: str | os.PathLike[str],
    *,
    buckets: Sequence[int] = layout.DEFAULT_BUCKETS,
    layers_per_part: int = layout.LAYERS_PER_PART,
    head_questions: int = layout.HEAD_QUESTIONS,
    head_options: int = layout.HEAD_OPTIONS,
    only_parts: Sequence[int] | None = None,
    tables: bool | None = None,
    fp32_families: Sequence[str] = COREML_FP32_FAMILIES,
    overwrite: bool = False,
    resume: bool = True,
    log: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Export `source` (a release, an 8-bit bundle, "tiny" or "random:NAME") to `destination`; returns a report
    (seconds and bytes per file, what was resumed, peak RSS). `only_parts` (benchmarks): export those parts only
    (the export is then partial and says so in its manifest); `tables`: write the fp16 tables (default: unless
    `only_parts`); `fp32_families`: the op families the parts compute in fp32; `resume`: continue an interrupted
    export of the same settings (module doc)."""
    ct = coremltools()
    log = log or (lambda message: None)
    buckets = layout.check_buckets(list(buckets))
    destination = Path(destination)
    if destination.exists() and not overwrite:
        raise BundleError(f"{destination} exists: remove it or pass --overwrite")
    checkpoint = open_checkpoint(source)
    config = TextConfig.from_release_config(checkpoint.config)
    plan = part_layers(config, layers_per_part)
    chosen = list(range(len(plan))) if only_parts is None else sorted(set(only_parts))
    write_tables = tables if tables is not None else only_parts is None
    source_record = {
        "path": os.fspath(source),
        "kind": checkpoint.kind,
        "config_sha256": config_fingerprint(checkpoint.config),
        "head_config_sha256": config_fingerprint(checkpoint.head_config),
    }
    settings = {
        "format_version": layout.FORMAT_VERSION, "source": source_record, "buckets": list(buckets),
        "layers_per_part": layers_per_part, "head": [head_questions, head_options], "parts": chosen,
        "tables": write_tables, "fp32_families": list(fp32_families),
    }  # fmt: skip
    report: dict[str, Any] = {"files": {}, "seconds": {}, "resumed": []}
    start = time.perf_counter()
    staging = destination.parent / f".{destination.name}.exporting"
    progress = _Progress(staging, settings, resume, log)
    report["resumed"] = sorted(progress.done)
    work = staging / ".work"

    def package(name: str, module_of, **options) -> None:
        if name in progress.done:
            return
        work.mkdir(exist_ok=True)
        began = time.perf_counter()
        ops = _package(ct, module_of(), buckets, work, staging / name, log, **options)
        shutil.rmtree(work)
        progress.finished(name, seconds=round(time.perf_counter() - began, 2), peak_rss_mb=round(peak_rss_mb()), fp32_ops=ops)

    for index in chosen:
        package(
            layout.part_package(index),
            lambda: build_part(checkpoint, config, plan[index], final_norm=index == len(plan) - 1),
            example=lambda bucket: part_example(config, bucket),
            shapes=lambda bucket: layout.part_shapes(bucket, config.hidden_size, config.rotary_dim),
            output=layout.PART_OUTPUT, dtype=COREML_PART_DTYPE, fp32_families=fp32_families, quantized=True,
        )  # fmt: skip
    package(
        layout.HEAD_PACKAGE, lambda: build_head(checkpoint),
        example=lambda bucket: head_example(config.hidden_size, bucket, head_questions, head_options),
        shapes=lambda bucket: layout.head_shapes(bucket, config.hidden_size, head_questions, head_options),
        output=layout.HEAD_OUTPUT, dtype=COREML_HEAD_DTYPE, fp32_families=(), quantized=False,
    )  # fmt: skip
    if write_tables:
        for file, name in ((layout.EMBEDDINGS, DECODER_PREFIX + EMBEDDING), (layout.OUTPUT_EMBEDDINGS, LM_HEAD)):
            if file not in progress.done:
                began = time.perf_counter()
                _write_table(checkpoint.tensors.get(name), staging / file)
                progress.finished(file, seconds=round(time.perf_counter() - began, 2), peak_rss_mb=round(peak_rss_mb()))
                log(f"{file} written")

    shutil.copyfile(checkpoint.tokenizer_file, staging / layout.TOKENIZER)
    write_json_durably(staging / layout.CONFIG, _host_config(checkpoint, config, plan, buckets, head_questions, head_options))
    files = {**_files_of(staging, layout.TOKENIZER), **_files_of(staging, layout.CONFIG)}
    for item in progress.done.values():
        files.update(item["files"])
    manifest = {
        "format": layout.FORMAT,
        "format_version": layout.FORMAT_VERSION,
        "complete": only_parts is None,
        "parts_exported": chosen,
        "source": source_record,
        "weights": {
            "decoder": f"{SCHEME} (Core ML: int8 with fp16 scales)",
            "kept_fp16": list(KEPT_HIGH_PRECISION) + ["norms", "conv1d", "A_log", "dt_bias"],
            "head": "fp32",
            "carried_from": "the bundle's int8 values and scales" if checkpoint.stored_int8 else "quantized here",
        },
        "compute": {
            "parts": "fp16, except the op families fp32_families, in fp32",
            "fp32_families": list(fp32_families),
            "fp32_ops": {name: item["fp32_ops"] for name, item in sorted(progress.done.items()) if name.startswith("part")},
            "head": "fp32",
        },
        "files": dict(sorted(files.items())),
    }
    (staging / PROGRESS).unlink()
    write_json_durably(staging / layout.MANIFEST, manifest)  # last: its presence marks a complete export
    if destination.exists():
        shutil.rmtree(destination)
    staging.rename(destination)
    for name, item in progress.done.items():
        report["files"][name] = sum(entry["bytes"] for entry in item["files"].values())
        report["seconds"][name] = item["seconds"]
    report["seconds"]["total"] = round(time.perf_counter() - start, 2)
    report["peak_rss_mb"] = round(peak_rss_mb())  # this run's; each item records the peak of the run that wrote it
    report["item_peak_rss_mb"] = {name: item["peak_rss_mb"] for name, item in progress.done.items()}
    return report


def _package(ct, module, buckets, work: Path, destination: Path, log, *, example, shapes, output: str, dtype, fp32_families, quantized: bool) -> dict[str, list[str]]:
    """One multifunction package: `module` traced, converted (its fp32 families kept in fp32, and with `quantized`
    its predicate's weights made 8-bit) per bucket. Returns each function's fp32 ops."""
    weights = quantized_weight_names(module) if quantized else []
    packages, ops = {}, {}
    for bucket in buckets:
        converted = _convert(ct, trace(module, example(bucket)), shapes(bucket), output, dtype, fp32_families)
        mlmodel = quantize(ct, converted, weights) if weights else converted
        if dtype == COREML_PART_DTYPE:
            ops[layout.function_name(bucket)] = fp32_ops(mlmodel._mil_program.functions["main"])
        packages[bucket] = work / f"{destination.stem}-{bucket}.mlpackage"
        mlmodel.save(str(packages[bucket]))
        _discard(converted, mlmodel)
        del converted, mlmodel
        gc.collect()
        log(f"{destination.stem} L{bucket} converted")
    del module
    merge_functions(ct, packages, destination)
    _pin_package_identifiers(destination)
    log(f"{destination.name}: {_tree_bytes(destination) / 1e6:,.1f} MB")
    return ops


def _discard(*mlmodels) -> None:
    """Remove the temporary packages coremltools made for `mlmodels` now: it removes them only when the process
    exits, and a 9B export makes ~2.6 GB of them per bucket (the whole export's ~80 GB filled the disk)."""
    for mlmodel in mlmodels:
        if getattr(mlmodel, "is_temp_package", False) and mlmodel.package_path:
            shutil.rmtree(mlmodel.package_path, ignore_errors=True)


def _write_table(table: torch.Tensor, path: Path) -> None:
    """A [V, D] table as raw fp16, row-major, a block of rows at a time."""
    with open(path, "wb") as file:
        for first in range(0, table.shape[0], TABLE_ROWS_AT_ONCE):
            file.write(table[first : first + TABLE_ROWS_AT_ONCE].to(COREML_TABLE_DTYPE).contiguous().numpy().tobytes())
        file.flush()
        os.fsync(file.fileno())


def _host_config(checkpoint, config: TextConfig, plan, buckets, questions: int, options: int) -> dict[str, Any]:
    tokenizer = checkpoint.tokenizer
    return {
        "hidden_size": config.hidden_size,
        "vocab_size": config.vocab_size,
        "rotary_dim": config.rotary_dim,
        "rope_theta": config.rope_theta,
        "buckets": list(buckets),
        "functions": {str(bucket): layout.function_name(bucket) for bucket in buckets},
        "parts": [
            {"package": layout.part_package(index), "layers": layers, "final_norm": index == len(plan) - 1}
            for index, layers in enumerate(plan)
        ],
        "part_inputs": {"hidden": [1, "L", config.hidden_size], "cos": ["L", config.rotary_dim], "sin": ["L", config.rotary_dim]},
        "part_output": layout.PART_OUTPUT,
        "part_dtype": str(COREML_PART_DTYPE).removeprefix("torch."),
        "head": {
            "package": layout.HEAD_PACKAGE,
            "questions": questions,
            "options": options,
            "inputs": list(layout.HEAD_INPUTS),
            "output": layout.HEAD_OUTPUT,
            "dtype": str(COREML_HEAD_DTYPE).removeprefix("torch."),
        },
        "mask_value": MASKED,
        "tables": {
            name: {"shape": [config.vocab_size, config.hidden_size], "dtype": str(COREML_TABLE_DTYPE).removeprefix("torch.")}
            for name in (layout.EMBEDDINGS, layout.OUTPUT_EMBEDDINGS)
        },
        "token_ids": {"pad": tokenizer.pad_id},
        "release_config": checkpoint.config,
        "head_config": checkpoint.head_config,
    }
