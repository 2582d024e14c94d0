"""`clef-flash export coreml SRC OUT`: the Core ML packages in the port's layout (checkpoint/coreml_layout.py).

Streaming, part by part: a part's layers are filled from the source (fp32), traced once per bucket
(`torch.jit.trace`), converted (`ct.convert`, fp16 compute, macOS 15), and their projections quantized per op:
exactly the tensors of our int8 predicate (`is_quantized`) become 8-bit, symmetric, one scale per output
channel, and everything else (norms, conv, A_log, dt_bias, the gate projections in_proj_a / in_proj_b) stays
fp16. The bucket functions are then merged into one multifunction package, which stores identical weights
once. From an 8-bit bundle the weights are its own int8 values times its scales, so the quantizer finds the
bundle's int8 values and scales again (tests/test_coreml.py reads them back). Everything is written into a
hidden staging directory, renamed when complete; `manifest.json` comes last.

coremltools (`pip install -e ".[coreml]"`) converts on Linux too; only running the packages needs macOS.
"""

from __future__ import annotations

import gc
import os
import shutil
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
from ..checkpoint.safetensors_io import sha256_of, staged_directory, write_json_durably
from ..checkpoint.sources import config_fingerprint
from ..errors import BundleError, ClefError
from ..model.config import TextConfig
from ..model.export import MASKED, rotary_tables
from ..model.precision import COREML_HEAD_DTYPE, COREML_PART_DTYPE, COREML_TABLE_DTYPE, EXPORT_DTYPE, KEPT_HIGH_PRECISION, is_quantized
from ..checkpoint import coreml_layout as layout
from .host import numpy_dtype
from .modules import build_head, build_part, part_layers

TABLE_ROWS_AT_ONCE = 8192  # rows converted to fp16 at a time while writing a table


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


def _convert(ct, traced, shapes: dict[str, tuple[int, ...]], output: str, dtype: torch.dtype):
    precision = ct.precision.FLOAT16 if dtype == COREML_PART_DTYPE else ct.precision.FLOAT32
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return ct.convert(
            traced,
            inputs=[ct.TensorType(name=name, shape=shape, dtype=numpy_dtype(dtype)) for name, shape in shapes.items()],
            outputs=[ct.TensorType(name=output, dtype=numpy_dtype(dtype))],
            convert_to="mlprogram",
            compute_precision=precision,
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
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ct.utils.save_multifunction(descriptor, str(destination))


def _tree_bytes(path: Path) -> int:
    return sum(file.stat().st_size for file in path.rglob("*") if file.is_file()) if path.is_dir() else path.stat().st_size


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
    overwrite: bool = False,
    log: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Export `source` (a release, an 8-bit bundle, "tiny" or "random:NAME") to `destination`; returns a report
    (seconds and bytes per file, peak RSS). `only_parts` (benchmarks): export those parts only (the export is then
    partial and says so in its manifest); `tables`: write the fp16 tables (default: unless `only_parts`)."""
    ct = coremltools()
    log = log or (lambda message: None)
    buckets = layout.check_buckets(list(buckets))
    destination = Path(destination)
    if destination.exists() and not overwrite:
        raise BundleError(f"{destination} exists: remove it or pass --overwrite")
    checkpoint = open_checkpoint(source)
    config = TextConfig.from_release_config(checkpoint.config)
    plan = part_layers(config, layers_per_part)
    chosen = range(len(plan)) if only_parts is None else sorted(set(only_parts))
    report: dict[str, Any] = {"files": {}, "seconds": {}}
    start = time.perf_counter()

    with staged_directory(destination, "exporting") as staging:
        (staging / ".work").mkdir()
        work = staging / ".work"
        for index in chosen:
            part = build_part(checkpoint, config, plan[index], final_norm=index == len(plan) - 1)
            _package(
                ct, part, buckets, work, staging / layout.part_package(index), report, log,
                example=lambda bucket: part_example(config, bucket),
                shapes=lambda bucket: layout.part_shapes(bucket, config.hidden_size, config.rotary_dim),
                output=layout.PART_OUTPUT, dtype=COREML_PART_DTYPE, quantized=quantized_weight_names(part),
            )  # fmt: skip
            del part
        _package(
            ct, build_head(checkpoint), buckets, work, staging / layout.HEAD_PACKAGE, report, log,
            example=lambda bucket: head_example(config.hidden_size, bucket, head_questions, head_options),
            shapes=lambda bucket: layout.head_shapes(bucket, config.hidden_size, head_questions, head_options),
            output=layout.HEAD_OUTPUT, dtype=COREML_HEAD_DTYPE, quantized=[],
        )  # fmt: skip

        if tables if tables is not None else only_parts is None:
            for file, name in ((layout.EMBEDDINGS, DECODER_PREFIX + EMBEDDING), (layout.OUTPUT_EMBEDDINGS, LM_HEAD)):
                began = time.perf_counter()
                _write_table(checkpoint.tensors.get(name), staging / file)
                report["seconds"][file] = round(time.perf_counter() - began, 2)
                log(f"{file} written")
        shutil.copyfile(checkpoint.tokenizer_file, staging / layout.TOKENIZER)
        shutil.rmtree(staging / ".work")
        write_json_durably(staging / layout.CONFIG, _host_config(checkpoint, config, plan, buckets, head_questions, head_options))
        files = {
            file.relative_to(staging).as_posix(): {"bytes": file.stat().st_size, "sha256": sha256_of(file)}
            for file in sorted(staging.rglob("*"))
            if file.is_file()
        }
        manifest = {
            "format": layout.FORMAT,
            "format_version": layout.FORMAT_VERSION,
            "complete": only_parts is None,
            "parts_exported": list(chosen),
            "source": {
                "path": os.fspath(source),
                "kind": checkpoint.kind,
                "config_sha256": config_fingerprint(checkpoint.config),
                "head_config_sha256": config_fingerprint(checkpoint.head_config),
            },
            "weights": {
                "decoder": f"{SCHEME} (Core ML: int8 with fp16 scales), fp16 compute",
                "kept_fp16": list(KEPT_HIGH_PRECISION) + ["norms", "conv1d", "A_log", "dt_bias"],
                "head": "fp32",
                "carried_from": "the bundle's int8 values and scales" if checkpoint.stored_int8 else "quantized here",
            },
            "files": files,
        }
        write_json_durably(staging / layout.MANIFEST, manifest)  # last: its presence marks a complete export
    report["files"].update({name: _tree_bytes(destination / name) for name in (layout.EMBEDDINGS, layout.OUTPUT_EMBEDDINGS) if (destination / name).exists()})
    report["seconds"]["total"] = round(time.perf_counter() - start, 2)
    report["peak_rss_mb"] = round(peak_rss_mb())
    return report


def _package(ct, module, buckets, work: Path, destination: Path, report: dict, log, *, example, shapes, output: str, dtype, quantized: list[str]) -> None:
    """One multifunction package: `module` traced, converted (and its `quantized` weights made 8-bit) per bucket."""
    began = time.perf_counter()
    packages = {}
    for bucket in buckets:
        mlmodel = _convert(ct, trace(module, example(bucket)), shapes(bucket), output, dtype)
        if quantized:
            mlmodel = quantize(ct, mlmodel, quantized)
        packages[bucket] = work / f"{destination.stem}-{bucket}.mlpackage"
        mlmodel.save(str(packages[bucket]))
        del mlmodel
        gc.collect()
        log(f"{destination.stem} L{bucket} converted")
    merge_functions(ct, packages, destination)
    for package in packages.values():
        shutil.rmtree(package)
    report["files"][destination.name] = _tree_bytes(destination)
    report["seconds"][destination.name] = round(time.perf_counter() - began, 2)
    log(f"{destination.name}: {report['files'][destination.name] / 1e6:,.1f} MB, {report['seconds'][destination.name]:.1f} s")


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
