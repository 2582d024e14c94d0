"""The 8-bit bundle: a converted release that loads in seconds from memory-mapped files.

A bundle directory:

    manifest.json          format name and version, precision and scheme, the source's config and its hash,
                           every file with its size and sha256, every tensor with its file, dtype and shape
    decoder.safetensors    the decoder: int8 projections in the int8 scheme (checkpoint/quant.py: smoothed by their
                           norm's scale and rotated) + fp32 scales and smoothing, everything else as the release stores it
    embeddings.safetensors input embeddings, 16-bit, gathered by row from the memory map (never loaded whole)
    lm_head.safetensors    output embeddings, 16-bit; the head gathers only the option tokens' rows
    joint_head.safetensors the joint head, fp32
    vision.safetensors     the vision tower (model.visual.*) as the release stores it, when the release has one and
                           an image processor; then preprocessor_config.json (and video_preprocessor_config.json)
                           are copied too, and the bundle answers images and videos
    config.json, joint_head_config.json, tokenizer.json   copied from the release

The tensor files are standard safetensors (any safetensors reader opens them), written by a streaming
writer: the header first (every shape is known before any data is read), then each tensor as it is
converted, so conversion holds one tensor at a time. Tensors are ordered by element size (4, 2, then
1 byte) so every tensor starts aligned and the loader can view the mapped bytes without copying.

Conversion writes into a temporary directory beside the destination and renames it when every file
and, last, the manifest are complete: an interrupted conversion never leaves a bundle that looks valid.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from pathlib import Path

import torch

from ..console import ProgressBar
from ..errors import BundleError, WeightsError
from ..model.precision import INT8_SCHEME_VERSION, KEPT_HIGH_PRECISION, storage_dtype_of
from ..plan import shapes_plan
from .loading import build_model
from .names import DECODER_PREFIX, EMBEDDING, IGNORED_PREFIXES, LM_HEAD, VISION_PREFIX
from .quant import SCHEME, QuantizingSource
from .safetensors_io import (
    MappedSafetensors,
    MergedSources,
    PlannedTensor,
    ShapesOnly,
    StreamedSafetensors,
    sha256_of,
    staged_directory,
    write_json_durably,
    write_safetensors,
)
from .sources import (
    HEAD_CONFIG,
    HEAD_WEIGHTS,
    PROCESSOR_CONFIG,
    VIDEO_PROCESSOR_CONFIG,
    RANDOM_PREFIX,
    Checkpoint,
    config_fingerprint,
    open_random,
    open_release,
    processor_configs,
    read_json,
    resolve_source,
)

FORMAT = "clef-flash-bundle"
FORMAT_VERSION = 2  # 1: plain per-channel int8 (+ calibrated outlier channels); 2: the smoothed and rotated scheme
MANIFEST = "manifest.json"
COPIED_FILES = ("config.json", HEAD_CONFIG, "tokenizer.json")
COPIED_IF_PRESENT = (PROCESSOR_CONFIG, VIDEO_PROCESSOR_CONFIG)  # with the vision tower
REDO = ": convert the release again"


def is_bundle(root: Path) -> bool:
    return (root / MANIFEST).is_file()


# -- conversion --------------------------------------------------------------------------------------


def _part_of(name: str) -> str:
    """Which bundle file (and storage rule) a release tensor belongs to."""
    if name.startswith(VISION_PREFIX):
        return "vision"
    if name == LM_HEAD:
        return "lm_head"
    if name == DECODER_PREFIX + EMBEDDING:
        return "embeddings"
    return "decoder"


def _bundled(name: str, with_vision: bool) -> bool:
    return not name.startswith(IGNORED_PREFIXES) or (with_vision and name.startswith(VISION_PREFIX))


def convert(
    source: str | os.PathLike[str],
    destination: str | os.PathLike[str],
    *,
    precision: str = "int8",
    revision: str | None = None,
    overwrite: bool = False,
    progress: bool = True,
) -> Path:
    """Convert a release into an 8-bit bundle at `destination`, reading one tensor at a time (no calibration: the
    int8 scheme needs the weights alone)."""
    if precision != "int8":
        raise BundleError(f"unknown bundle precision {precision!r}: only int8 bundles exist")
    root = check_conversion(source, destination, revision=revision, overwrite=overwrite)
    destination = Path(destination)
    # Read once, in order (no memory map), or drawn one tensor at a time (random:NAME: no release written first);
    # its projections as the int8 bundle will store them.
    release = open_random(str(source)) if root is None else open_release(root, source=str(source), files=StreamedSafetensors)
    checkpoint = dataclasses.replace(release, tensors=QuantizingSource(release.tensors), stored_int8=True)
    # Check every name and shape against the model before writing anything (meta tensors: no data read).
    _check(checkpoint)

    # The vision tower comes along when the runtime would load it from the release (a tower and an image processor).
    with_vision = release.processor_config is not None and "vision_config" in release.config
    plans: dict[str, list[PlannedTensor]] = {}
    for name in sorted(name for name in checkpoint.tensors.keys() if _bundled(name, with_vision)):
        part, shape = _part_of(name), checkpoint.tensors.shape(name)
        dtype = storage_dtype_of(name, shape, checkpoint.tensors.dtype(name), part=part)
        plans.setdefault(f"{part}.safetensors", []).append(PlannedTensor(name, dtype, shape))
    plans[HEAD_WEIGHTS] = [
        PlannedTensor(name, storage_dtype_of(name, shape, checkpoint.head_tensors.dtype(name), part="head"), shape)
        for name in sorted(checkpoint.head_tensors.keys())
        for shape in [checkpoint.head_tensors.shape(name)]
    ]
    total_bytes = sum(planned.nbytes for plan in plans.values() for planned in plan)

    with staged_directory(destination, "converting") as staging:
        files: dict[str, dict[str, object]] = {}
        with ProgressBar(total_bytes, "converting", unit="B", enabled=progress) as meter:
            for file, plan in plans.items():
                source_of = checkpoint.head_tensors if file == HEAD_WEIGHTS else checkpoint.tensors
                digest = write_safetensors(
                    staging / file,
                    plan,
                    lambda planned, source_of=source_of: source_of.get(planned.name).to(planned.dtype),
                    metadata={"format": FORMAT},
                    on_bytes=meter.advance,
                )
                files[file] = {"bytes": (staging / file).stat().st_size, "sha256": digest}
        present = {PROCESSOR_CONFIG: release.processor_config, VIDEO_PROCESSOR_CONFIG: release.video_processor_config}
        copied = [*COPIED_FILES, *(name for name in COPIED_IF_PRESENT if with_vision and present[name] is not None)]
        for name in copied:
            _copy_release_file(release, name, staging / name)
            files[name] = {"bytes": (staging / name).stat().st_size, "sha256": sha256_of(staging / name)}
        manifest = {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "precision": precision,
            "scheme": {
                "weights": SCHEME,
                "quantized": "decoder projections (*_proj.weight, in_proj_*.weight; 2-D)",
                "kept_high_precision": list(KEPT_HIGH_PRECISION) + ["norms", "conv1d", "A_log", "dt_bias", "model.visual.* (as released)"],
                "dtypes": {part: str(dtype).removeprefix("torch.") for part, dtype in _part_dtypes(plans).items()},
                "int8_scheme_version": INT8_SCHEME_VERSION,
            },
            "source": {
                "path": str(source),
                "revision": revision,
                "config_sha256": config_fingerprint(checkpoint.config),
                "head_config_sha256": config_fingerprint(checkpoint.head_config),
            },
            "config": checkpoint.config,
            "files": files,
            "tensors": {
                planned.name: {
                    "file": file,
                    "dtype": str(planned.dtype).removeprefix("torch."),
                    "shape": list(planned.shape),
                }
                for file, plan in plans.items()
                for planned in plan
            },
        }
        write_json_durably(staging / MANIFEST, manifest)  # last: its presence marks a complete bundle
    return destination


def check_conversion(
    source: str | os.PathLike[str], destination: str | os.PathLike[str], *, revision: str | None = None, overwrite: bool = False
) -> Path | None:
    """The release directory `source` names (None: `random:NAME[:SEED]`, drawn as it is converted), once it is known
    not to be a bundle and `destination` to be free (or `overwrite`): checked before any work is done."""
    if Path(destination).exists() and not overwrite:
        raise BundleError(f"{destination} exists: remove it or pass --overwrite")
    if os.fspath(source).startswith(RANDOM_PREFIX):
        return None
    root = resolve_source(source, revision=revision)
    if is_bundle(root):
        raise BundleError(f"{root} is already a bundle: convert the release it came from")
    return root


def _copy_release_file(release: Checkpoint, name: str, target: Path) -> None:
    """A release's small file into the bundle: copied, or for `random:NAME` written as `write_random_release` writes
    it (the bundle of `random:NAME` is byte for byte the bundle of its written release)."""
    if release.root is not None:
        shutil.copyfile(release.root / name, target)
    elif name == "tokenizer.json":
        shutil.copyfile(release.tokenizer_file, target)
    else:
        from .random_release import write_release_json

        written = {
            "config.json": release.config,
            HEAD_CONFIG: release.head_config,
            PROCESSOR_CONFIG: release.processor_config,
            VIDEO_PROCESSOR_CONFIG: release.video_processor_config,
        }
        write_release_json(target, written[name])


def _part_dtypes(plans: dict[str, list[PlannedTensor]]) -> dict[str, torch.dtype]:
    """The dtype of each bundle file's largest tensor: what the manifest reports as the file's precision."""
    return {file.removesuffix(".safetensors"): max(plan, key=lambda t: t.nbytes).dtype for file, plan in plans.items()}


def _check(checkpoint: Checkpoint) -> None:
    """Build the model on the meta device from the checkpoint's names and shapes: strict, and no data read."""
    shapes = dataclasses.replace(
        checkpoint, tensors=ShapesOnly(checkpoint.tensors), head_tensors=ShapesOnly(checkpoint.head_tensors)
    )
    build_model(shapes, shapes_plan())


# -- loading -----------------------------------------------------------------------------------------


def read_manifest(root: Path) -> dict:
    """The manifest, checked: format, version, and every file present with its recorded size."""
    path = root / MANIFEST
    try:
        manifest = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise BundleError(f"{path} cannot be read ({exc}){REDO}") from exc
    if manifest.get("format") != FORMAT:
        raise BundleError(f"{root} is not a clef-flash bundle (format {manifest.get('format')!r})")
    version = manifest.get("format_version")
    if version != FORMAT_VERSION:
        raise BundleError(
            f"{root} is a bundle of format version {version}; this clef-flash reads version {FORMAT_VERSION} (its int8 "
            "weights are smoothed and rotated: checkpoint/quant.py): convert the release again with this version "
            "(clef-flash convert SRC DST)"
        )
    for name, entry in manifest.get("files", {}).items():
        file = root / name
        if not file.is_file():
            raise BundleError(f"{root}: {name} is missing from the bundle{REDO}")
        if file.stat().st_size != entry["bytes"]:
            raise BundleError(
                f"{file} is {file.stat().st_size} bytes, the manifest says {entry['bytes']}: "
                "the bundle is truncated or altered; convert the release again"
            )
    return manifest


def verify_checksums(root: Path) -> None:
    """Check every file's sha256 against the manifest (reads the whole bundle once)."""
    manifest = read_manifest(root)
    for name, entry in manifest["files"].items():
        if sha256_of(root / name) != entry["sha256"]:
            raise BundleError(f"{root / name} does not match its sha256 in the manifest{REDO}")


def open_bundle(root: Path, *, source: str | None = None, verify: bool = False) -> Checkpoint:
    """A bundle as a Checkpoint: every tensor a view of a memory map (on CPU), nothing read until used."""
    manifest = read_manifest(root)
    if verify:
        verify_checksums(root)
    try:
        tensor_files = [
            MappedSafetensors(root / name, REDO)
            for name in manifest["files"]
            if name.endswith(".safetensors") and name != HEAD_WEIGHTS
        ]
        head_tensors = MappedSafetensors(root / HEAD_WEIGHTS, REDO)
    except WeightsError as error:
        raise BundleError(str(error)) from error
    tensors = MergedSources(tensor_files)
    if set(manifest["tensors"]) != tensors.keys() | head_tensors.keys():
        raise BundleError(f"{root}: the files hold other tensors than the manifest lists{REDO}")
    return Checkpoint(
        source=source or str(root),
        kind="bundle",
        root=root,
        config=read_json(root / "config.json"),
        head_config=read_json(root / HEAD_CONFIG),
        tokenizer_file=root / "tokenizer.json",
        tensors=tensors,
        head_tensors=head_tensors,
        stored_int8=True,
        manifest=manifest,
        decoder_files="decoder.safetensors",
        **processor_configs(root),
    )
