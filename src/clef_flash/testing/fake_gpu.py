"""The GPU path run on a CPU-only machine: the device's tensors hold no data, and every host sync is an error.

    with FakeGpu() as gpu:
        model = clef_flash.load(release, device=gpu.device, precision="bf16")   # the real load path
        model.answer(request)                                                  # the real forward
    gpu.uploads, gpu.readbacks                                                 # what crossed the bus

The stand-in for CUDA is torch's `meta` device: tensors with shapes, dtypes and a device but no data, computed by
torch's own shape functions. Inside, `device_io.is_gpu` takes it for a GPU (so every CUDA-only branch of the runtime
runs, `_int_mm` and the buckets included) and torch.cuda's queries answer as an H100 would. Host tensors stay real:
tokenization, index building and anything else on the CPU run as they do. What fails:
- a device tensor read on the host (`.item()`, `.tolist()`, `bool(t)`, a data-dependent shape: `nonzero`, a boolean
  mask index), which a CUDA forward pays for with a synchronization: `HostSync`;
- a device-to-host copy (`.cpu()`, `.to("cpu")`) anywhere but `device_io.to_host`, the one readback a forward
  makes at its end (here it returns zeros of the right shapes: the answers are then uniform, but every shape, dtype
  and device on the way was checked): `HostSync`;
- a host tensor (not a 0-dim scalar) meeting a device tensor in an op, as CUDA refuses it: `DeviceMix`;
- with `FakeGpu(no_uploads=True)`, inside `device_io.capturing()` (a CUDA graph's capture), any host-to-device copy.

Why not fake CUDA tensors (torch's FakeTensorMode with device "cuda"): on a CPU-only torch (2.13.0) indexing,
slicing assignment, `.to`, `copy_` and scaled_dot_product_attention of one fail in the Python bindings, which take
a CUDA device guard the build does not have (measured; `torch._C._ensureCUDADeviceGuardSet()` did not help). The
meta device has a guard, and raises on reads and copies out by itself; this mode adds the device-mix check and
clear messages. `tests/test_gpu_path.py` and `benchmarks/gpu.py --dry-run` run it. Nothing outside testing/ imports it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from unittest import mock

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from .. import device_io
from ..model import qwen3_5

aten = torch.ops.aten
STAND_IN = torch.device("meta")
_SCALAR = ".item(), .tolist(), bool() or a comparison of a device tensor"
_SHAPE = "a data-dependent shape (nonzero, a boolean mask index, unique)"
_HOST_READS = {  # overload packets
    aten._local_scalar_dense: _SCALAR,
    aten.item: _SCALAR,
    aten.is_nonzero: _SCALAR,
    aten.equal: _SCALAR,
    aten.nonzero: _SHAPE,
    aten.masked_select: _SHAPE,
    aten._unique2: _SHAPE,
    aten.unique_consecutive: _SHAPE,
}
_MASK_INDEXED = (aten.index, aten.index_put, aten.index_put_, aten._index_put_impl_)  # with a boolean index: nonzero
_COPIES = (aten.to, aten._to_copy, aten.copy_, aten._copy_from, aten._copy_from_and_resize)  # overload packets


class HostSync(RuntimeError):
    """A forward read a device tensor on the host, or copied one there: on CUDA, a synchronization."""


class DeviceMix(RuntimeError):
    """A host tensor met a device tensor in an op: CUDA refuses it."""


class _Guard(TorchDispatchMode):
    """Every op sees `FakeGpu.check` first when it touches the stand-in device (an input on it, or a result made there)."""

    def __init__(self, owner: FakeGpu):
        super().__init__()
        self.owner = owner

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        leaves, _ = tree_flatten((args, kwargs))
        tensors = [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]
        on_device = [tensor for tensor in tensors if tensor.device == STAND_IN]
        target = kwargs.get("device", next((arg for arg in args if isinstance(arg, torch.device)), None))
        if on_device or (target is not None and torch.device(target) == STAND_IN):
            self.owner.check(func, args, kwargs, tensors, target)
        return func(*args, **kwargs)


class FakeGpu:
    """The context described in the module's docstring. `device`: the stand-in to load on; `uploads`: host-to-device
    copies seen; `readbacks`: `device_io.to_host` calls; `no_uploads`: refuse uploads inside `device_io.capturing()`."""

    device = STAND_IN

    def __init__(self, *, no_uploads: bool = True, capability: tuple[int, int] = (9, 0), name: str = "NVIDIA H100 80GB HBM3 (stand-in: meta tensors)"):
        self.no_uploads = no_uploads
        self.capability, self.name = capability, name
        self.uploads = 0
        self.readbacks = 0
        self.captures = 0
        self._capturing = False
        self._stack = contextlib.ExitStack()

    def check(self, func, args, kwargs, tensors: list[torch.Tensor], target) -> None:
        """An op that touches the device: refuse what a CUDA forward could not do without waiting."""
        if func.overloadpacket in _MASK_INDEXED and any(
            isinstance(index, torch.Tensor) and index.dtype == torch.bool for index in (args[1] if len(args) > 1 else ())
        ):
            raise HostSync(f"{func}: {_SHAPE} inside a forward (the host would wait for the device)")
        if func.overloadpacket in _HOST_READS:
            raise HostSync(f"{func}: {_HOST_READS[func.overloadpacket]} inside a forward (the host would wait for the device)")
        if func.overloadpacket in _COPIES:
            packet = func.overloadpacket
            if packet is aten.copy_:  # copy_(destination, source)
                source, destination = args[1], args[0].device
            elif packet in (aten._copy_from, aten._copy_from_and_resize):  # _copy_from(source, destination)
                source, destination = args[0], args[1].device
            else:  # to / _to_copy(source, device=...)
                source, destination = args[0], torch.device(target or args[0].device)
            if source.device == STAND_IN and destination.type == "cpu":
                raise HostSync(f"{func}: a device-to-host copy inside a forward (only device_io.to_host reads back)")
            if source.device.type == "cpu" and destination == STAND_IN:
                self.uploads += 1
                if self._capturing and self.no_uploads:
                    raise HostSync(f"{func}: a host-to-device copy while capturing a CUDA graph (its inputs must be on the device)")
            return
        host = [tensor for tensor in tensors if tensor.device.type == "cpu" and tensor.dim() > 0]
        if host:
            shapes = ", ".join(str(tuple(tensor.shape)) for tensor in host)
            raise DeviceMix(f"{func}: host tensors {shapes} meet device tensors (CUDA: 'Expected all tensors to be on the same device')")

    @contextlib.contextmanager
    def _capturing_region(self) -> Iterator[None]:
        self._capturing, before = True, self._capturing
        self.captures += 1
        try:
            yield
        finally:
            self._capturing = before

    def _to_host(self, tensors):
        """`device_io.to_host` here: zeros of each tensor's shape and dtype, real, on the CPU."""
        self.readbacks += 1
        return [torch.zeros(tuple(tensor.shape), dtype=tensor.dtype) for tensor in tensors]

    def __enter__(self) -> FakeGpu:
        stack = self._stack
        patches = {
            "torch.cuda.is_available": lambda: True,
            "torch.cuda.device_count": lambda: 1,
            "torch.cuda.get_device_name": lambda device=None: self.name,
            "torch.cuda.get_device_capability": lambda device=None: self.capability,
            "torch.cuda.synchronize": lambda device=None: None,
            "torch.cuda.max_memory_allocated": lambda device=None: 0,
            "torch.cuda.reset_peak_memory_stats": lambda device=None: None,
        }
        for target, replacement in patches.items():
            stack.enter_context(mock.patch(target, replacement))
        stack.enter_context(mock.patch.object(device_io, "GPU_TYPES", (*device_io.GPU_TYPES, STAND_IN.type)))
        stack.enter_context(mock.patch.object(device_io, "to_host", self._to_host))
        stack.enter_context(mock.patch.object(device_io, "capturing", self._capturing_region))
        # torch's CausalBias is a tensor subclass that cannot be made while a Python dispatch mode is active: the same
        # lower-right causal mask as booleans, made on the device (tests/test_gpu_path.py holds the two equal on a CPU)
        stack.enter_context(mock.patch.object(qwen3_5, "causal_lower_right", qwen3_5.lower_right_mask))
        stack.enter_context(torch.no_grad())
        stack.enter_context(_Guard(self))
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()
