"""safetensors, our one reader and writer: a streaming writer, the dtype table, three readers, one hash.

- `write_safetensors` writes the header first (every shape is known before any data is produced), then
  each tensor, or each tensor's chunks, as its turn comes: a 19 GB release or a bundle is written holding
  one tensor (or one chunk) at a time. Byte for byte what `safetensors.torch.save_file` writes for the
  same tensors: ordered by dtype (8, 4, then 2 bytes; bf16 before f16; then 1 byte), then by name, so
  every tensor starts aligned and a reader can view mapped bytes without copying.
- Readers, all with `keys / shape / dtype / get` (a `TensorSource`): `SafetensorsFiles` (a release's
  shards through `safe_open`, memory-mapped), `MappedSafetensors` (one file as views of one private
  memory map: nothing read until touched), `StreamedSafetensors` (plain reads into fresh buffers:
  memory stays one tensor deep, for conversion).
- `staged_directory` and `write_json_durably`: what a written directory (a bundle, a Core ML export) is made
  with, so that an interrupted write never leaves one that looks complete.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import json
import mmap
import os
import shutil
import struct
import sys
import weakref
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from ..errors import WeightsError

# safetensors' dtype codes, in the order `save_file` lays tensors out (largest alignment first).
DTYPE_CODES: dict[str, torch.dtype] = {
    "I64": torch.int64,
    "F64": torch.float64,
    "F32": torch.float32,
    "I32": torch.int32,
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
CODE_OF = {dtype: code for code, dtype in DTYPE_CODES.items()}
_LAYOUT_RANK = {dtype: rank for rank, dtype in enumerate(DTYPE_CODES.values())}


class TensorSource(Protocol):
    """Named tensors: safetensors files, a bundle, tensors drawn on demand, or a quantizing view of one."""

    def keys(self) -> set[str]: ...

    def shape(self, name: str) -> tuple[int, ...]: ...

    def dtype(self, name: str) -> torch.dtype: ...

    def get(self, name: str) -> torch.Tensor: ...


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


Produced = torch.Tensor | Iterable[torch.Tensor]  # a tensor, or its flat chunks in order


def write_safetensors(
    path: Path,
    plan: Iterable[PlannedTensor],
    produce: Callable[[PlannedTensor], Produced],
    *,
    metadata: dict[str, str] | None = None,
    on_bytes: Callable[[int], None] = lambda count: None,
    durable: bool = True,
) -> str:
    """Write a safetensors file tensor by tensor (`produce` makes each when its turn comes); returns its sha256.

    `metadata` None writes no `__metadata__` entry (as `save_file(tensors)` without metadata).
    `durable` fsyncs the file before returning.
    """
    ordered = sorted(plan, key=lambda tensor: (_LAYOUT_RANK[tensor.dtype], tensor.name))
    header: dict[str, object] = {} if metadata is None else {"__metadata__": metadata}
    offset = 0
    for tensor in ordered:
        header[tensor.name] = {
            "dtype": CODE_OF[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + tensor.nbytes],
        }
        offset += tensor.nbytes
    encoded = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    encoded += b" " * (-len(encoded) % 8)  # data starts 8-byte aligned
    digest = hashlib.sha256()
    with open(path, "wb") as file:
        for block in (struct.pack("<Q", len(encoded)), encoded):
            file.write(block)
            digest.update(block)
        for planned in ordered:
            produced = produce(planned)
            chunks = [produced] if isinstance(produced, torch.Tensor) else produced
            written = 0
            for chunk in chunks:
                if chunk.dtype != planned.dtype:
                    raise WeightsError(f"{planned.name}: produced {chunk.dtype}, planned {planned.dtype}")
                data = memoryview(chunk.contiguous().reshape(-1).view(torch.uint8).numpy())
                file.write(data)
                digest.update(data)
                written += len(data)
                on_bytes(len(data))
            if written != planned.nbytes:
                raise WeightsError(f"{planned.name}: produced {written} bytes, planned {planned.nbytes} {list(planned.shape)}")
        if durable:
            file.flush()
            os.fsync(file.fileno())
    return digest.hexdigest()


def read_safetensors_header(path: Path, hint: str = "") -> tuple[int, dict]:
    """(offset of the data, header dict) of a safetensors file; a clear error for a damaged one."""
    size = path.stat().st_size
    with open(path, "rb") as file:
        prefix = file.read(8)
        if len(prefix) < 8:
            raise WeightsError(f"{path} is truncated ({size} bytes){hint}")
        (length,) = struct.unpack("<Q", prefix)
        if 8 + length > size:
            raise WeightsError(f"{path} is truncated (header of {length} bytes, file of {size}){hint}")
        try:
            header = json.loads(file.read(length))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise WeightsError(f"{path} has a damaged header ({exc}){hint}") from exc
    header.pop("__metadata__", None)
    return 8 + length, header


class SafetensorsFiles:
    """The tensors of a (possibly sharded) set of safetensors files, memory-mapped by `safe_open`, by name."""

    def __init__(self, files: Iterable[Path]):
        from safetensors import safe_open

        self._handles = {}
        self._location: dict[str, str] = {}
        for path in files:
            try:
                handle = safe_open(str(path), framework="pt", device="cpu")
            except Exception as exc:
                raise WeightsError(f"cannot open {path}: {exc}") from exc
            self._handles[str(path)] = handle
            for name in handle.keys():
                self._location[name] = str(path)

    def keys(self) -> set[str]:
        return set(self._location)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._handles[self._location[name]].get_slice(name).get_shape())

    def dtype(self, name: str) -> torch.dtype:
        return DTYPE_CODES[self._handles[self._location[name]].get_slice(name).get_dtype()]

    def get(self, name: str) -> torch.Tensor:
        return self._handles[self._location[name]].get_tensor(name)


_MAPPED: dict[int, tuple[int, weakref.ref]] = {}  # start -> (end, the map) of every live MappedSafetensors


def is_mapped(tensor: torch.Tensor) -> bool:
    """Whether `tensor` views a file map that is still open (its pages are the page cache's, not the process's own)."""
    start = tensor.data_ptr()
    end = start + tensor.numel() * tensor.element_size()
    return any(low <= start and end <= high and alive() is not None for low, (high, alive) in list(_MAPPED.items()))


def release_pages(tensor: torch.Tensor) -> bool:
    """Give back the resident pages of a tensor that views a file map (they are clean: read again if touched).

    For a weight copied elsewhere (oneDNN's packed layout): without this, every page the copy read would
    stay in the process's resident set beside the copy. Does nothing (False) for any other tensor.
    """
    if not is_mapped(tensor):
        return False
    start = tensor.data_ptr()
    end = start + tensor.numel() * tensor.element_size()
    page = mmap.PAGESIZE
    first, last = -(-start // page) * page, end // page * page  # whole pages inside the tensor only
    if last > first:
        _libc().madvise(ctypes.c_void_p(first), ctypes.c_size_t(last - first), MADV_DONTNEED)
    return True


def return_free_heap() -> None:
    """Hand the C heap's free pages back to the system (glibc's `malloc_trim`; elsewhere nothing).

    Packing a weight (FBGEMM, oneDNN, a private copy) allocates and frees temporaries of the weight's size; glibc
    serves those under 32 MB from its heap once it has freed a mapped chunk, and the holes they leave stay
    resident: on the 9B bundle (W8A8 on FBGEMM, emulated AVX2 on E) 0.9 GB of the resident set."""
    trim = getattr(_libc(), "malloc_trim", None)
    if trim is not None:
        trim(0)


@functools.lru_cache(maxsize=1)
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


MADV_DONTNEED = 4  # Linux


class MappedSafetensors:
    """Tensors of one safetensors file as views of a single private memory map (no copy, read lazily)."""

    def __init__(self, path: Path, hint: str = ""):
        self.path = path
        data_start, header = read_safetensors_header(path, hint)
        size = path.stat().st_size
        end = max((entry["data_offsets"][1] for entry in header.values()), default=0)
        if data_start + end != size:
            raise WeightsError(f"{path} is {size} bytes, its header describes {data_start + end}{hint}")
        self._entries = header
        self._data_start = data_start
        self._bytes = torch.from_file(str(path), shared=False, size=size, dtype=torch.uint8)
        if size and sys.platform == "linux":
            base = self._bytes.data_ptr()
            _MAPPED[base] = (base + size, weakref.ref(self._bytes, lambda _, base=base: _MAPPED.pop(base, None)))

    def keys(self) -> set[str]:
        return set(self._entries)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._entries[name]["shape"])

    def dtype(self, name: str) -> torch.dtype:
        return DTYPE_CODES[self._entries[name]["dtype"]]

    def get(self, name: str) -> torch.Tensor:
        entry = self._entries[name]
        begin, end = (self._data_start + offset for offset in entry["data_offsets"])
        return self._bytes[begin:end].view(self.dtype(name)).view(entry["shape"])


class StreamedSafetensors:
    """The tensors of safetensors files, each read with plain file reads when asked for.

    For conversion: a memory map would leave every page read in the process's resident set until the
    kernel reclaims it; a read into a fresh buffer is freed with the tensor, so memory stays one tensor deep.
    """

    def __init__(self, files: Iterable[Path]):
        self._entries: dict[str, tuple[Path, int, dict]] = {}
        for path in files:
            data_start, header = read_safetensors_header(path)
            for name, entry in header.items():
                self._entries[name] = (path, data_start, entry)

    def keys(self) -> set[str]:
        return set(self._entries)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._entries[name][2]["shape"])

    def dtype(self, name: str) -> torch.dtype:
        return DTYPE_CODES[self._entries[name][2]["dtype"]]

    def get(self, name: str) -> torch.Tensor:
        path, data_start, entry = self._entries[name]
        begin, end = entry["data_offsets"]
        buffer = bytearray(end - begin)
        with open(path, "rb") as file:
            file.seek(data_start + begin)
            if file.readinto(buffer) != len(buffer):
                raise WeightsError(f"{path} is truncated: {name} is cut short")
        flat = torch.frombuffer(buffer, dtype=torch.uint8) if buffer else torch.empty(0, dtype=torch.uint8)
        return flat.view(self.dtype(name)).view(entry["shape"])


class MergedSources:
    """Several tensor sources seen as one (e.g. a bundle's files), by name."""

    def __init__(self, sources: Iterable[TensorSource]):
        self._sources = {name: source for source in sources for name in source.keys()}

    def keys(self) -> set[str]:
        return set(self._sources)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._sources[name].shape(name)

    def dtype(self, name: str) -> torch.dtype:
        return self._sources[name].dtype(name)

    def get(self, name: str) -> torch.Tensor:
        return self._sources[name].get(name)


def mapped_files(files: Iterable[Path]) -> MergedSources:
    """Safetensors files as one source whose tensors are views of memory maps: a few rows of a large table
    read only their pages, and `release_pages` gives back what was read."""
    return MergedSources(MappedSafetensors(path) for path in files)


class ShapesOnly:
    """A source's names, shapes and dtypes as meta tensors: a model can be checked against it, no data read."""

    def __init__(self, source: TensorSource):
        self.source = source

    def keys(self) -> set[str]:
        return self.source.keys()

    def shape(self, name: str) -> tuple[int, ...]:
        return self.source.shape(name)

    def dtype(self, name: str) -> torch.dtype:
        return self.source.dtype(name)

    def get(self, name: str) -> torch.Tensor:
        return torch.empty(self.source.shape(name), dtype=self.source.dtype(name), device="meta")


def sha256_of(path: Path, chunk: int = 1 << 24) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        while block := file.read(chunk):
            digest.update(block)
    return digest.hexdigest()


@contextlib.contextmanager
def staged_directory(destination: Path, purpose: str) -> Iterator[Path]:
    """A hidden staging directory beside `destination`, renamed to it when the block completes (replacing
    what was there) and removed when the block fails."""
    staging = destination.parent / f".{destination.name}.{purpose}-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        yield staging
        if destination.exists():
            shutil.rmtree(destination)
        staging.rename(destination)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def write_json_durably(path: Path, value: object) -> None:
    with open(path, "w") as file:
        json.dump(value, file, indent=1, ensure_ascii=False)
        file.flush()
        os.fsync(file.fileno())
