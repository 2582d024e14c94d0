"""8-bit decoder weights: one storage scheme, two ways to compute with it.

Scheme: symmetric int8, one fp32 scale per output channel, `w ~ q * scale[:, None]`, `|q| <= 127`.
What is quantized is one explicit predicate, `model.precision.is_quantized`: the decoder's 2-D projection
weights (`*_proj.weight`, `in_proj_*.weight`), except `KEPT_HIGH_PRECISION`. Everything else stays as stored: norms, the
depthwise conv, `A_log`, `dt_bias`; the input embeddings are 16-bit and gathered by row; the head and
the output-embedding rows it reads are never quantized.

Compute modes (`Int8Linear.mode`):
- `weight-only`: the int8 weight is dequantized tile by tile (a block of output rows at a time) to the
  activations' dtype and multiplied there; only the weight's rounding is added.
- `w8a8`: activations are quantized per token (one scale per row) and multiplied in int8 with int32
  accumulation by one of the kernels of checkpoint/w8a8.py (oneDNN, FBGEMM, `torch._int_mm`): the one the
  machine's probe found exact and fastest.
- `w8a8-two-digit` (W8A8's gated products, where the probe found it fastest): as `w8a8`, each activation in
  two int8 digits (~15 bits; checkpoint/w8a8.py), the weight still its 1-byte int8.
- `weight-only-bf16-scratch` (W8A8's gated products where bf16 is fast and their bf16 copies do not fit): the
  int8 weight widened to bf16 on every forward into a scratch buffer shared by the linears of its shape (exact:
  |q| <= 127), multiplied in bf16, the scale applied to the output; the weight stays 1 byte.
- Outlier channels (LLM.int8()'s decomposition): a linear may carry a few input channels, found by
  calibration (checkpoint/outliers.py), that are multiplied densely in fp32 and left out of the int8 parts.

`QuantizingSource` wraps any tensor source (a release's safetensors) and presents the quantized
names, so loading a release as int8 and converting it to a bundle are the same code path.
"""

from __future__ import annotations

import threading
from typing import Any, Iterator

import torch
from torch import nn

from .safetensors_io import is_mapped, release_pages, return_free_heap
from .w8a8 import INT_MM, W8A8_KERNELS, fp16_pack, fp16_packed_linear

from ..model.precision import (
    BF16,
    BF16_SCRATCH,
    FP32,
    INT8,
    LINEAR_MODES,
    OUTLIER_CHANNELS,
    OUTLIER_DTYPE,
    OUTLIER_WEIGHT,
    PACKED_FP16,
    SCALE_DTYPE,
    SCALE_SUFFIX,
    TWO_DIGITS,
    W8A8,
    WEIGHT_ONLY,
    int8_mode_of,
    is_quantized,
)

SCHEME = "int8 symmetric, one fp32 scale per output channel"
TILE_ELEMENTS = 1 << 22  # weight elements dequantized at once in weight-only mode (16 MB of fp32)


def quantize_per_channel(weight: torch.Tensor, rows_at_once: int = 4096) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [O, I] (any float dtype) -> (q int8 [O, I], scale fp32 [O]); computed in fp32 a block of rows at a time."""
    out_features = weight.shape[0]
    q = torch.empty(weight.shape, dtype=INT8)
    scale = torch.empty(out_features, dtype=SCALE_DTYPE)
    for start in range(0, out_features, rows_at_once):
        block = weight[start : start + rows_at_once].float()  # [r, I]
        block_scale = block.abs().amax(dim=1).clamp_min(torch.finfo(FP32).tiny) / 127.0  # [r]
        q[start : start + rows_at_once] = torch.round(block / block_scale[:, None]).clamp_(-127, 127).to(INT8)
        scale[start : start + rows_at_once] = block_scale
    return q, scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = FP32) -> torch.Tensor:
    """q int8 [O, I], scale [O] -> [O, I] in `dtype` (the product taken in fp32, then cast)."""
    return (q.float() * scale.float()[:, None]).to(dtype)


_scratch = threading.local()  # .buffers: (shape, device) -> bf16 tensor; one set per thread that runs a model


def bf16_scratch(shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """A bf16 buffer of `shape` shared by every linear of that shape on this thread (overwritten by each use)."""
    buffers = _scratch.__dict__.setdefault("buffers", {})
    key = (shape, device)
    if key not in buffers:
        buffers[key] = torch.empty(shape, dtype=BF16, device=device)
    return buffers[key]


def bf16_scratch_linear(x2d: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x2d [M, I] @ dequantize(q, scale).T -> [M, O] fp32: q widened into a shared bf16 buffer (exact), the
    product in bf16 with fp32 sums, the per-channel scale applied to the rounded output. Copying into a buffer
    that exists costs ~4x less than `q.to(bf16)` (fresh pages); the weight is rounded once less than a bf16 copy."""
    widened = bf16_scratch(tuple(q.shape), q.device).copy_(q)  # [O, I]
    return (x2d.to(BF16) @ widened.t()).float().mul_(scale)


def weight_only_linear(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [..., I] @ dequantize(q, scale).T -> [..., O] in x.dtype, dequantizing a tile of output rows at a time."""
    x2d = x.reshape(-1, x.shape[-1])  # [M, I]
    out = torch.empty(x2d.shape[0], q.shape[0], dtype=x.dtype, device=x.device)  # [M, O]
    rows = max(1, TILE_ELEMENTS // q.shape[1])
    for start in range(0, q.shape[0], rows):
        tile = dequantize(q[start : start + rows], scale[start : start + rows], x.dtype)  # [r, I]
        out[:, start : start + rows] = x2d @ tile.t()
    return out.view(*x.shape[:-1], q.shape[0])


class Int8Linear(nn.Module):
    """A bias-free linear with int8 weights [O, I] and fp32 scales [O]: a drop-in for `nn.Linear`.

    `outliers` > 0 (LLM.int8()'s decomposition): that many input channels, found by calibration, are
    multiplied densely in high precision (`outlier_weight` [O, n] at `outlier_channels` [n]); the int8
    weight holds zeros there and W8A8 quantizes the activations without them, so a few channels tens of
    times larger than the rest do not coarsen every other channel's rounding. In W8A8 on a CPU with
    W8A8, the weight is packed for its kernel on the first forward (again if it is refilled).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        mode: str,
        outliers: int = 0,
        kernel: str = INT_MM,
        dense_dtype: torch.dtype | None = None,
    ):
        super().__init__()
        if mode not in LINEAR_MODES:
            raise ValueError(f"unknown int8 mode {mode!r}: use one of {', '.join(LINEAR_MODES)}")
        if kernel not in W8A8_KERNELS:
            raise ValueError(f"unknown W8A8 kernel {kernel!r}: use one of {', '.join(W8A8_KERNELS)}")
        self.in_features, self.out_features, self.mode, self.kernel = in_features, out_features, mode, kernel
        # Weight-only with a `dense_dtype` (W8A8's gated-product projections): the weight is dequantized once into
        # that 2-byte form and kept (dequantizing per forward cost more than the product): bf16 where the CPU is
        # fast at it, else FBGEMM's fp16-packed weights with fp32 arithmetic (precision.PACKED_FP16);
        # None: dequantized tile by tile on every forward, in x's dtype (int8-weight-only: memory stays 1 byte/weight).
        self.dense_dtype = dense_dtype
        self._prepared: Any = None  # the weight packed for the W8A8 kernel, or dequantized to dense_dtype
        self._prepared_from: torch.Tensor | None = None  # the weight it was made from
        self.register_buffer("weight", torch.empty(out_features, in_features, dtype=INT8))
        self.register_buffer("weight" + SCALE_SUFFIX, torch.empty(out_features, dtype=SCALE_DTYPE))
        # Buffers either way (None: not in the state dict), so that a plain projection loads as before.
        self.register_buffer(OUTLIER_CHANNELS, torch.empty(outliers, dtype=torch.long) if outliers else None)
        self.register_buffer(OUTLIER_WEIGHT, torch.empty(out_features, outliers, dtype=OUTLIER_DTYPE) if outliers else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2d = x.reshape(-1, self.in_features)  # [M, I]
        if self.mode == BF16_SCRATCH:  # a mapped weight is read once into the process's own memory, as the W8A8 packs are
            weight = self._prepare(lambda weight: weight.clone() if is_mapped(weight) else weight)
            out = bf16_scratch_linear(x2d, weight, self.weight_scale)
        elif self.mode == WEIGHT_ONLY:
            if self.dense_dtype is None:
                out = weight_only_linear(x2d, self.weight, self.weight_scale).float()  # outlier columns of q are 0
            elif self.dense_dtype == PACKED_FP16 and x.device.type == "cpu":  # FBGEMM: fp16 storage, fp32 math
                packed = self._prepare(lambda weight: fp16_pack(dequantize(weight, self.weight_scale, FP32)))
                out = fp16_packed_linear(x2d.float(), packed)
            else:
                dense = self._prepare(lambda weight: dequantize(weight, self.weight_scale, self.dense_dtype))  # [O, I]
                out = (x2d.to(self.dense_dtype) @ dense.t()).float()
        else:
            kernel = W8A8_KERNELS[self.kernel if x.device.type == "cpu" else INT_MM]  # cuBLAS on CUDA
            packed = self._prepare(lambda weight: kernel.pack(weight, self.weight_scale))
            multiply = kernel.two_digit_linear if self.mode == TWO_DIGITS else kernel.linear
            out = multiply(x2d, packed, self.weight_scale, self.outlier_channels)
        if self.outlier_channels is not None:
            out.addmm_(x2d.index_select(1, self.outlier_channels).to(out.dtype), self.outlier_weight.t().to(out.dtype))
        return out.to(x.dtype).view(*x.shape[:-1], self.out_features)

    def _prepare(self, make) -> torch.Tensor:
        """The weight in the form this linear runs (`make(weight)`), made on first use and again when the
        weight is refilled (the low-memory window); a bundle's mapped int8 pages are given back after."""
        if self._prepared_from is not self.weight:
            self._prepared, self._prepared_from = make(self.weight), self.weight
            if self._prepared is not self.weight:  # (torch._int_mm reads the int8 weight as it is)
                release_pages(self.weight)
                return_free_heap()  # the packing's temporaries
        return self._prepared

    def extra_repr(self) -> str:
        kernel = f", kernel={self.kernel}" if self.mode in (W8A8, TWO_DIGITS) else ""
        outliers = f", outliers={len(self.outlier_channels)}" if self.outlier_channels is not None else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, mode={self.mode}{kernel}{outliers}"


def replace_linears(
    module: nn.Module,
    mode: str,
    keep: tuple[str, ...] | None = None,
    outliers: dict[str, int] | None = None,
    kernel: str = INT_MM,
    dense_dtype: torch.dtype | None = None,
    gated_mode: str = WEIGHT_ONLY,
) -> list[str]:
    """Swap every `nn.Linear` whose weight `is_quantized` for an `Int8Linear` (on the same device); returns their names.

    `outliers`: linear name -> number of outlier channels its source holds (from a calibrated bundle).
    Each linear runs in `int8_mode_of(name, mode, gated_mode, kernel)`; `kernel` and `dense_dtype` as in `Int8Linear`.
    """
    outliers = outliers or {}
    replaced = []
    for name, child in list(module.named_modules()):
        for child_name, linear in list(child.named_children()):
            full = f"{name}.{child_name}" if name else child_name
            if isinstance(linear, nn.Linear) and is_quantized(f"{full}.weight", tuple(linear.weight.shape), keep):
                if linear.bias is not None:
                    raise ValueError(f"{full} has a bias: the int8 scheme covers bias-free projections only")
                with torch.device(linear.weight.device):
                    replacement = Int8Linear(
                        linear.in_features,
                        linear.out_features,
                        int8_mode_of(full, mode, gated_mode, kernel),
                        outliers=outliers.get(full, 0),
                        kernel=kernel,
                        dense_dtype=dense_dtype,
                    )
                setattr(child, child_name, replacement)
                replaced.append(full)
    return replaced


class QuantizingSource:
    """A tensor source seen through the scheme: `x.weight` becomes int8 and `x.weight_scale` appears.

    `outliers` (weight name -> channel indices [n], from checkpoint/outliers.py): those columns of the
    weight are zeroed before quantization and appear as `x.outlier_weight` [O, n] (fp32) beside
    `x.outlier_channels` [n]. The last quantized tensor is kept so that reading a weight and then its
    scale quantizes once.
    """

    def __init__(self, source, keep: tuple[str, ...] | None = None, outliers: dict[str, torch.Tensor] | None = None):
        self.source, self.keep, self.outliers = source, keep, outliers or {}
        self._quantized = {name for name in source.keys() if is_quantized(name, source.shape(name), keep)}
        unknown = sorted(set(self.outliers) - self._quantized)
        if unknown:
            raise ValueError(f"outlier channels given for tensors that are not quantized: {', '.join(unknown[:5])}")
        # derived name -> (its weight, what it is)
        self._derived = {name + SCALE_SUFFIX: (name, SCALE_SUFFIX) for name in self._quantized}
        for name in self.outliers:
            module = name.removesuffix("weight")
            self._derived[module + OUTLIER_CHANNELS] = (name, OUTLIER_CHANNELS)
            self._derived[module + OUTLIER_WEIGHT] = (name, OUTLIER_WEIGHT)
        self._last: tuple[str, tuple[torch.Tensor, torch.Tensor]] | None = None

    def keys(self) -> set[str]:
        return set(self.source.keys()) | set(self._derived)

    def shape(self, name: str) -> tuple[int, ...]:
        if name not in self._derived:
            return self.source.shape(name)
        weight, kind = self._derived[name]
        out_features, count = self.source.shape(weight)[0], len(self.outliers.get(weight, ()))
        return {SCALE_SUFFIX: (out_features,), OUTLIER_CHANNELS: (count,), OUTLIER_WEIGHT: (out_features, count)}[kind]

    def dtype(self, name: str) -> torch.dtype:
        if name in self._quantized:
            return INT8
        if name not in self._derived:
            return self.source.dtype(name)
        return {SCALE_SUFFIX: SCALE_DTYPE, OUTLIER_CHANNELS: torch.long, OUTLIER_WEIGHT: OUTLIER_DTYPE}[self._derived[name][1]]

    def _pair(self, weight_name: str) -> tuple[torch.Tensor, torch.Tensor]:
        if self._last is None or self._last[0] != weight_name:
            weight = self.source.get(weight_name)
            if weight_name in self.outliers:
                weight = weight.float().index_fill(1, self.outliers[weight_name], 0.0)
            self._last = (weight_name, quantize_per_channel(weight))
        return self._last[1]

    def get(self, name: str) -> torch.Tensor:
        if name in self._quantized:
            return self._pair(name)[0]
        if name not in self._derived:
            return self.source.get(name)
        weight, kind = self._derived[name]
        if kind == SCALE_SUFFIX:
            return self._pair(weight)[1]
        channels = self.outliers[weight]
        if kind == OUTLIER_CHANNELS:
            return channels.to(torch.long)
        return self.source.get(weight).index_select(1, channels).to(OUTLIER_DTYPE)

    def quantized_names(self) -> Iterator[str]:
        return iter(sorted(self._quantized))
