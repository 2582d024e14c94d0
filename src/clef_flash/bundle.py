"""The 8-bit bundle: a converted release that loads in seconds from memory-mapped files.

A bundle directory:

    manifest.json          format name and version, precision and scheme, the source's config and its hash,
                           every file with its size and sha256, every tensor with its file, dtype and shape
    decoder.safetensors    the decoder: int8 projections + fp32 scales, everything else as the release stores it
    embeddings.safetensors input embeddings, 16-bit, gathered by row from the memory map (never loaded whole)
    lm_head.safetensors    output embeddings, 16-bit; the head gathers only the option tokens' rows
    joint_head.safetensors the joint head, fp32
    config.json, joint_head_config.json, tokenizer.json   copied from the release

The tensor files are standard safetensors (any safetensors reader opens them), written by a streaming
writer: the header first (every shape is known before any data is read), then each tensor as it is
converted, so conversion holds one tensor at a time. Tensors are ordered by element size (4, 2, then
1 byte) so every tensor starts aligned and the loader can view the mapped bytes without copying.

Conversion writes into a temporary directory beside the destination and renames it when every file
and, last, the manifest are complete: an interrupted conversion never leaves a bundle that looks valid.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

import torch

from .errors import BundleError, ModelSourceError
from . import quant
from .quant import DEFAULT_MODE, SCHEME, QuantizingSource
from .weights import SAFETENSORS_DTYPES

_CODES = {dtype: code for code, dtype in SAFETENSORS_DTYPES.items()}

FORMAT = "clef-flash-bundle"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
COPIED_FILES = ("config.json", "joint_head_config.json", "tokenizer.json")
EMBEDDING_DTYPE = torch.bfloat16  # input and output embeddings in the bundle

def is_bundle(root: Path) -> bool:
    return (root / MANIFEST).is_file()


# -- safetensors, written by stream and read by memory map -------------------------------------------


@dataclass(frozen=True)
class PlannedTensor:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        count = 1
        for size in self.shape:
            count *= size
        return count * self.dtype.itemsize


def write_safetensors(
    path: Path,
    plan: list[PlannedTensor],
    produce: Callable[[PlannedTensor], torch.Tensor],
    *,
    metadata: dict[str, str] | None = None,
    on_tensor: Callable[[PlannedTensor], None] = lambda tensor: None,
) -> str:
    """Write a safetensors file tensor by tensor (`produce` makes each one when its turn comes); returns its sha256."""
    plan = sorted(plan, key=lambda tensor: (-tensor.dtype.itemsize, tensor.name))  # aligned without padding
    header: dict[str, object] = {"__metadata__": metadata or {}}
    offset = 0
    for tensor in plan:
        header[tensor.name] = {
            "dtype": _CODES[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + tensor.nbytes],
        }
        offset += tensor.nbytes
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # data starts 8-byte aligned
    digest = hashlib.sha256()
    with open(path, "wb") as file:
        for chunk in (struct.pack("<Q", len(encoded)), encoded):
            file.write(chunk)
            digest.update(chunk)
        for planned in plan:
            tensor = produce(planned)
            if tensor.dtype != planned.dtype or tuple(tensor.shape) != planned.shape:
                raise BundleError(
                    f"{planned.name}: produced {tensor.dtype} {list(tensor.shape)}, "
                    f"planned {planned.dtype} {list(planned.shape)}"
                )
            data = memoryview(tensor.contiguous().reshape(-1).view(torch.uint8).numpy())
            file.write(data)
            digest.update(data)
            on_tensor(planned)
        file.flush()
        os.fsync(file.fileno())
    return digest.hexdigest()


def read_safetensors_header(path: Path) -> tuple[int, dict]:
    """(offset of the data, header dict) of a safetensors file; a clear error for a damaged one."""
    size = path.stat().st_size
    with open(path, "rb") as file:
        prefix = file.read(8)
        if len(prefix) < 8:
            raise BundleError(f"{path} is truncated ({size} bytes): convert the release again")
        (length,) = struct.unpack("<Q", prefix)
        if 8 + length > size:
            raise BundleError(f"{path} is truncated (header of {length} bytes, file of {size}): convert again")
        try:
            header = json.loads(file.read(length))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise BundleError(f"{path} has a damaged header ({exc}): convert the release again") from exc
    return 8 + length, header


class MappedSafetensors:
    """Tensors of one safetensors file as views of a single private memory map (no copy, read lazily)."""

    def __init__(self, path: Path):
        self.path = path
        data_start, header = read_safetensors_header(path)
        header.pop("__metadata__", None)
        size = path.stat().st_size
        end = max((entry["data_offsets"][1] for entry in header.values()), default=0)
        if data_start + end != size:
            raise BundleError(f"{path} is {size} bytes, its header describes {data_start + end}: convert again")
        self._entries = header
        self._data_start = data_start
        self._bytes = torch.from_file(str(path), shared=False, size=size, dtype=torch.uint8)

    def keys(self) -> set[str]:
        return set(self._entries)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._entries[name]["shape"])

    def dtype(self, name: str) -> torch.dtype:
        return SAFETENSORS_DTYPES[self._entries[name]["dtype"]]

    def get(self, name: str) -> torch.Tensor:
        entry = self._entries[name]
        begin, end = (self._data_start + offset for offset in entry["data_offsets"])
        dtype = SAFETENSORS_DTYPES[entry["dtype"]]
        return self._bytes[begin:end].view(dtype).view(entry["shape"])


class StreamedSafetensors:
    """The tensors of a release's safetensors files, each read with plain file reads when asked for.

    For conversion: a memory map would leave every page read in the process's resident set until the
    kernel reclaims it; a read into a fresh buffer is freed with the tensor, so memory stays one tensor deep.
    """

    def __init__(self, files: Iterable[Path]):
        self._entries: dict[str, tuple[Path, int, dict]] = {}
        for path in files:
            data_start, header = read_safetensors_header(path)
            header.pop("__metadata__", None)
            for name, entry in header.items():
                self._entries[name] = (path, data_start, entry)

    @classmethod
    def of_release(cls, root: Path) -> StreamedSafetensors:
        from .weights import SafetensorsFiles

        return cls(SafetensorsFiles.release_files(root))

    def keys(self) -> set[str]:
        return set(self._entries)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._entries[name][2]["shape"])

    def dtype(self, name: str) -> torch.dtype:
        return SAFETENSORS_DTYPES[self._entries[name][2]["dtype"]]

    def get(self, name: str) -> torch.Tensor:
        path, data_start, entry = self._entries[name]
        begin, end = entry["data_offsets"]
        buffer = bytearray(end - begin)
        with open(path, "rb") as file:
            file.seek(data_start + begin)
            if file.readinto(buffer) != len(buffer):
                raise BundleError(f"{path} is truncated: {name} is cut short")
        flat = torch.frombuffer(buffer, dtype=torch.uint8) if buffer else torch.empty(0, dtype=torch.uint8)
        return flat.view(self.dtype(name)).view(entry["shape"])


class BundleTensors:
    """The tensors of a bundle's files, by name (a `weights.TensorSource`)."""

    def __init__(self, files: Iterable[MappedSafetensors]):
        self._files = {name: file for file in files for name in file.keys()}

    def keys(self) -> set[str]:
        return set(self._files)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._files[name].shape(name)

    def dtype(self, name: str) -> torch.dtype:
        return self._files[name].dtype(name)

    def get(self, name: str) -> torch.Tensor:
        return self._files[name].get(name)


# -- conversion --------------------------------------------------------------------------------------


class Progress:
    """Tensors and bytes done, on stderr: a rewritten line on a terminal, a line every few seconds otherwise."""

    def __init__(self, tensors: int, total_bytes: int, enabled: bool = True):
        self.tensors, self.total_bytes, self.enabled = tensors, total_bytes, enabled
        self.done_tensors = self.done_bytes = 0
        self.start = self.last = time.perf_counter()
        self.terminal = sys.stderr.isatty()

    def advance(self, nbytes: int) -> None:
        self.done_tensors += 1
        self.done_bytes += nbytes
        now = time.perf_counter()
        if not self.enabled or (not self.terminal and now - self.last < 5 and self.done_tensors < self.tensors):
            return
        self.last = now
        rate = self.done_bytes / max(now - self.start, 1e-9)
        line = (
            f"converting: {self.done_tensors}/{self.tensors} tensors, "
            f"{self.done_bytes / 1e9:.2f}/{self.total_bytes / 1e9:.2f} GB, {rate / 1e6:.0f} MB/s"
        )
        print(("\r" + line) if self.terminal else line, end="" if self.terminal else "\n", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.enabled and self.terminal:
            print(file=sys.stderr)


def _file_of(name: str) -> str:
    from .weights import DECODER_PREFIX, LM_HEAD

    if name == LM_HEAD:
        return "lm_head.safetensors"
    if name == DECODER_PREFIX + "embed_tokens.weight":
        return "embeddings.safetensors"
    return "decoder.safetensors"


def convert(
    source: str | os.PathLike[str],
    destination: str | os.PathLike[str],
    *,
    precision: str = "int8",
    revision: str | None = None,
    overwrite: bool = False,
    progress: bool = True,
) -> Path:
    """Convert a release into an 8-bit bundle at `destination`, reading one tensor at a time."""
    from .weights import HEAD_WEIGHTS, IGNORED_PREFIXES, config_fingerprint, read_json, resolve_source

    if precision != "int8":
        raise BundleError(f"unknown bundle precision {precision!r}: only int8 bundles exist")
    root = resolve_source(source, revision=revision)
    if is_bundle(root):
        raise BundleError(f"{root} is already a bundle: convert the release it came from")
    destination = Path(destination)
    if destination.exists() and not overwrite:
        raise BundleError(f"{destination} exists: remove it or pass --overwrite")
    for name in COPIED_FILES + (HEAD_WEIGHTS,):
        if not (root / name).is_file():
            raise ModelSourceError(f"{root} is not a Clef release: {name} is missing")
    config = read_json(root / "config.json")
    head_config = read_json(root / "joint_head_config.json")

    quantized = QuantizingSource(StreamedSafetensors.of_release(root))
    head_tensors = StreamedSafetensors([root / HEAD_WEIGHTS])
    # Check every name and shape against the model before writing anything (meta tensors: no data read).
    _check_release(config, head_config, root, quantized, head_tensors)

    names = sorted(name for name in quantized.keys() if not name.startswith(IGNORED_PREFIXES))
    plans: dict[str, list[PlannedTensor]] = {}
    for name in names:
        dtype = quantized.dtype(name)
        file = _file_of(name)
        if file != "decoder.safetensors":
            dtype = EMBEDDING_DTYPE
        plans.setdefault(file, []).append(PlannedTensor(name, dtype, quantized.shape(name)))
    head_plan = [
        PlannedTensor(name, torch.float32, head_tensors.shape(name)) for name in sorted(head_tensors.keys())
    ]
    plans[HEAD_WEIGHTS] = head_plan
    meter = Progress(sum(map(len, plans.values())), sum(t.nbytes for plan in plans.values() for t in plan), progress)

    staging = destination.parent / f".{destination.name}.converting-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        files: dict[str, dict[str, object]] = {}
        for file, plan in plans.items():
            source_of = head_tensors if file == HEAD_WEIGHTS else quantized
            digest = write_safetensors(
                staging / file,
                plan,
                lambda planned, source_of=source_of: source_of.get(planned.name).to(planned.dtype),
                metadata={"format": FORMAT},
                on_tensor=lambda planned: meter.advance(planned.nbytes),
            )
            files[file] = {"bytes": (staging / file).stat().st_size, "sha256": digest}
        for name in COPIED_FILES:
            shutil.copyfile(root / name, staging / name)
            files[name] = {"bytes": (staging / name).stat().st_size, "sha256": sha256_of(staging / name)}
        manifest = {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "precision": precision,
            "scheme": {
                "weights": SCHEME,
                "quantized": "decoder projections (*_proj.weight, in_proj_*.weight; 2-D)",
                "kept_high_precision": list(quant.KEPT_HIGH_PRECISION) + ["norms", "conv1d", "A_log", "dt_bias"],
                "embeddings": str(EMBEDDING_DTYPE).removeprefix("torch."),
                "head": "float32",
                "default_mode": DEFAULT_MODE,
            },
            "source": {
                "path": str(source),
                "revision": revision,
                "config_sha256": config_fingerprint(config),
                "head_config_sha256": config_fingerprint(head_config),
            },
            "config": config,
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
        _write_json_durably(staging / MANIFEST, manifest)  # last: its presence marks a complete bundle
        meter.close()
        if destination.exists():
            shutil.rmtree(destination)
        staging.rename(destination)
    except BaseException:
        meter.close()
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return destination


class _ShapesOnly:
    """A tensor source's names, shapes and dtypes as meta tensors: build_release checks them without reading data."""

    def __init__(self, source):
        self.source = source

    def keys(self) -> set[str]:
        return self.source.keys()

    def shape(self, name: str) -> tuple[int, ...]:
        return self.source.shape(name)

    def get(self, name: str) -> torch.Tensor:
        return torch.empty(self.source.shape(name), dtype=self.source.dtype(name), device="meta")


def _check_release(config: dict, head_config: dict, root: Path, tensors, head_tensors) -> None:
    """Build the model on the meta device from the release's names and shapes: strict, and no data read."""
    from .tokenizer import Tokenizer
    from .weights import build_release

    build_release(
        config,
        head_config,
        Tokenizer.from_file(root / "tokenizer.json"),
        _ShapesOnly(tensors),
        _ShapesOnly(head_tensors),
        device=torch.device("meta"),
        dtype=torch.float32,
        root=root,
        quantization=DEFAULT_MODE,
    )


def sha256_of(path: Path, chunk: int = 1 << 24) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        while block := file.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def _write_json_durably(path: Path, value: object) -> None:
    with open(path, "w") as file:
        json.dump(value, file, indent=1, ensure_ascii=False)
        file.flush()
        os.fsync(file.fileno())


# -- loading -----------------------------------------------------------------------------------------


def read_manifest(root: Path) -> dict:
    """The manifest, checked: format, version, and every file present with its recorded size."""
    path = root / MANIFEST
    try:
        manifest = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise BundleError(f"{path} cannot be read ({exc}): convert the release again") from exc
    if manifest.get("format") != FORMAT:
        raise BundleError(f"{root} is not a clef-flash bundle (format {manifest.get('format')!r})")
    version = manifest.get("format_version")
    if version != FORMAT_VERSION:
        raise BundleError(
            f"{root} is a bundle of format version {version}; this clef-flash reads version {FORMAT_VERSION}: "
            "convert the release again with this version (clef-flash convert SRC DST)"
        )
    for name, entry in manifest.get("files", {}).items():
        file = root / name
        if not file.is_file():
            raise BundleError(f"{root}: {name} is missing from the bundle: convert the release again")
        if file.stat().st_size != entry["bytes"]:
            raise BundleError(
                f"{file} is {file.stat().st_size} bytes, the manifest says {entry['bytes']}: "
                "the bundle is truncated or altered; convert the release again"
            )
    return manifest


def verify(root: Path) -> None:
    """Check every file's sha256 against the manifest (reads the whole bundle once)."""
    manifest = read_manifest(root)
    for name, entry in manifest["files"].items():
        if sha256_of(root / name) != entry["sha256"]:
            raise BundleError(f"{root / name} does not match its sha256 in the manifest: convert the release again")


def load_bundle(
    root: Path,
    *,
    device: torch.device,
    dtype: torch.dtype,
    mode: str = DEFAULT_MODE,
    check: bool = False,
    resident_layers: int | None = None,
):
    """A Release from a bundle: every tensor a view of a memory map (on CPU), no copy of the weights."""
    from .tokenizer import Tokenizer
    from .weights import HEAD_WEIGHTS, build_release, read_json

    manifest = read_manifest(root)
    if check:
        verify(root)
    tensor_files = [root / name for name in manifest["files"] if name.endswith(".safetensors") and name != HEAD_WEIGHTS]
    tensors = BundleTensors(MappedSafetensors(path) for path in tensor_files)
    head_tensors = MappedSafetensors(root / HEAD_WEIGHTS)
    recorded = set(manifest["tensors"])
    held = tensors.keys() | head_tensors.keys()
    if recorded != held:
        raise BundleError(f"{root}: the files hold other tensors than the manifest lists: convert the release again")
    return build_release(
        read_json(root / "config.json"),
        read_json(root / "joint_head_config.json"),
        Tokenizer.from_file(root / "tokenizer.json"),
        tensors,
        head_tensors,
        device=device,
        dtype=dtype,
        root=root,
        quantization=mode,
        resident_layers=resident_layers,
    )
