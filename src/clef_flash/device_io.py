"""What crosses between the host and the device in a forward: its inputs go up at its start, its answers come
back once at its end, and nothing in between (no `.item()`, no `.cpu()`, no data-dependent shape: each would
make the host wait for the device). testing/fake_cuda.py holds a forward to that on a CPU-only machine.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator, Sequence

import torch

GPU_TYPES = ("cuda",)  # the device types that take the GPU path (testing/fake_gpu.py adds its stand-in)
CAPTURE_MODES = ("lazy", "load", "eager", "off")  # load(graphs=...): how engine/graphs.py captures a GPU's whole steps


def is_gpu(device: torch.device) -> bool:
    """Whether `device` takes the GPU path: buckets, graphs, int8 on `_int_mm`, every projection on the padded grid."""
    return device.type in GPU_TYPES


def to_host(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The forward's one readback: the tensors (one dtype) on the CPU, in one copy (one synchronization on CUDA; on a
    CPU the same path, a copy of a few thousand numbers), each in its shape."""
    flat = torch.cat([tensor.reshape(-1) for tensor in tensors]).cpu()
    return [part.view(tensor.shape) for part, tensor in zip(flat.split([tensor.numel() for tensor in tensors]), tensors)]


@contextlib.contextmanager
def capturing() -> Iterator[None]:
    """The region a CUDA graph captures (engine/graphs.py): its inputs must already be on the device. A no-op
    here; the fake CUDA harness refuses uploads inside it."""
    yield


SYNC_TIMINGS = "CLEF_FLASH_SYNC_TIMINGS"  # 1: wait for the device at each timed boundary (benchmarks/gpu.py)


def timing_sync(device: torch.device) -> Callable[[], None]:
    """What a stage's clock calls at its boundaries: nothing (a forward never waits), unless $CLEF_FLASH_SYNC_TIMINGS=1
    on CUDA, where the decoder's and the head's milliseconds are then the device's (a benchmark's split, not serving)."""
    if device.type == "cuda" and os.environ.get(SYNC_TIMINGS) == "1":
        return lambda: torch.cuda.synchronize(device)
    return lambda: None
