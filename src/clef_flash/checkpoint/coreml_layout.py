"""The Core ML export directory: its files, its config.json and its manifest (no torch, no coremltools here).

    part00.mlpackage ... partNN.mlpackage   decoder layers 4k..4k+3 (the last also applies the final norm);
                                            one function per bucket, `L256` ... `L8192`, sharing one copy of
                                            the weights. Inputs hidden [1, L, D], cos [L, rd], sin [L, rd]
                                            (fp16); output out [1, L, D] (fp16). Weights 8-bit; fp16 compute
                                            except the manifest's `compute.fp32_families` (fp32)
    Head.mlpackage                          the joint head at a fixed shape (questions Q, options O), fp32, the
                                            same functions; inputs as `model/export.py`'s ExportHead; output logits [O]
    embeddings.f16, output_embeddings.f16   raw fp16 tables [V, D], row-major, gathered by row (memory-mapped)
    tokenizer.json
    config.json                             what the host needs: shapes, buckets, parts, head shape, token ids,
                                            mask value, the release's config
    manifest.json                           format and version, the source, the ops computing in fp32 (per
                                            package and function), every file's size and sha256 (last
                                            written: its presence marks a complete export)
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import BundleError

FORMAT = "clef-flash-coreml"
FORMAT_VERSION = 2  # 2: mixed compute precision, the fp32 ops listed in the manifest
MANIFEST = "manifest.json"
CONFIG = "config.json"
TOKENIZER = "tokenizer.json"
EMBEDDINGS = "embeddings.f16"
OUTPUT_EMBEDDINGS = "output_embeddings.f16"
HEAD_PACKAGE = "Head.mlpackage"
DEFAULT_BUCKETS = (256, 512, 1024, 2048, 4096, 8192)  # 4096 and 8192 hold 64 questions / 255 options
LAYERS_PER_PART = 4  # the port: 8 parts of 4 layers
HEAD_QUESTIONS = 64  # the hosted limits: 64 questions, a choice of up to 255 options
HEAD_OPTIONS = 256
CHUNK = 64  # the Gated DeltaNet's chunk; every bucket is a multiple of it
PART_INPUTS = ("hidden", "cos", "sin")
PART_OUTPUT = "out"
HEAD_INPUTS = ("states", "mem_mask", "last", "q_mean", "o_mean", "o2q", "lexical", "type_oh", "q_mask", "o_mask")
HEAD_OUTPUT = "logits"
REDO = ": export it again (clef-flash export coreml SRC OUT)"
RUNNERS = ("coreml", "torch")  # what runs an export: Core ML (macOS), or its traced fp32 torch twins (coreml/runners.py)


def function_name(bucket: int) -> str:
    return f"L{bucket}"


def part_package(index: int) -> str:
    return f"part{index:02d}.mlpackage"


def part_shapes(bucket: int, hidden_size: int, rotary_dim: int) -> dict[str, tuple[int, ...]]:
    return {"hidden": (1, bucket, hidden_size), "cos": (bucket, rotary_dim), "sin": (bucket, rotary_dim)}


def head_shapes(bucket: int, hidden_size: int, questions: int, options: int) -> dict[str, tuple[int, ...]]:
    L, D, Q, O = bucket, hidden_size, questions, options
    return {
        "states": (L, D), "mem_mask": (L,), "last": (L,), "q_mean": (Q, L), "o_mean": (O, L), "o2q": (O, Q),
        "lexical": (O, D), "type_oh": (Q, 3), "q_mask": (Q,), "o_mask": (O,),
    }  # fmt: skip


def check_buckets(buckets: list[int] | tuple[int, ...]) -> tuple[int, ...]:
    """Sorted, unique, positive multiples of the chunk size."""
    bad = [bucket for bucket in buckets if bucket <= 0 or bucket % CHUNK]
    if not buckets or bad:
        raise ValueError(f"buckets must be positive multiples of {CHUNK}: {list(buckets)}")
    return tuple(sorted(set(buckets)))


@dataclass(frozen=True)
class ExportLayout:
    """An export directory, read: its config.json and manifest."""

    root: Path
    config: dict[str, Any]
    manifest: dict[str, Any]

    @property
    def buckets(self) -> tuple[int, ...]:
        return tuple(self.config["buckets"])

    @property
    def parts(self) -> list[dict[str, Any]]:
        return self.config["parts"]

    @property
    def head(self) -> dict[str, Any]:
        return self.config["head"]

    @property
    def hidden_size(self) -> int:
        return int(self.config["hidden_size"])

    @property
    def vocab_size(self) -> int:
        return int(self.config["vocab_size"])

    @property
    def fp32_families(self) -> tuple[str, ...]:
        """The op families the parts compute in fp32 (everything else fp16)."""
        return tuple(self.manifest["compute"]["fp32_families"])

    @property
    def mask_value(self) -> float:
        return float(self.config["mask_value"])


def read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise BundleError(f"{path} cannot be read ({exc}){REDO}") from exc


def is_export(source: str | os.PathLike[str]) -> bool:
    """Whether `source` is a Core ML export directory (its manifest names the format)."""
    path = Path(os.fspath(source)) / MANIFEST
    if not path.is_file():
        return False
    try:
        return json.loads(path.read_text()).get("format") == FORMAT
    except (OSError, json.JSONDecodeError):
        return False


def read_export(root: str | os.PathLike[str], *, verify: bool = False) -> ExportLayout:
    """The export at `root`, checked: format, version, every file present with its size (and sha256 with `verify`)."""
    from .safetensors_io import sha256_of

    root = Path(root)
    manifest = read_json(root / MANIFEST)
    if manifest.get("format") != FORMAT:
        raise BundleError(f"{root} is not a clef-flash Core ML export (format {manifest.get('format')!r})")
    if manifest.get("format_version") != FORMAT_VERSION:
        raise BundleError(
            f"{root} is a Core ML export of format version {manifest.get('format_version')}; this clef-flash "
            f"reads version {FORMAT_VERSION}{REDO}"
        )
    for name, entry in manifest["files"].items():
        file = root / name
        if not file.is_file() or file.stat().st_size != entry["bytes"]:
            raise BundleError(f"{file} is missing or not {entry['bytes']} bytes as the manifest says{REDO}")
        if verify and sha256_of(file) != entry["sha256"]:
            raise BundleError(f"{file} does not match its sha256 in the manifest{REDO}")
    return ExportLayout(root=root, config=read_json(root / CONFIG), manifest=manifest)
