"""8-bit decoder weights: one scheme (smoothed, rotated, per-channel int8), a class per way to compute with it;
and fp8 (plain row-wise e4m3), the opt-in precision GPU servers ship.

Scheme (`INT8_SCHEME_VERSION` 2). For a projection `y = x W^T` with input width I:
- `s` [I]: the square root of the per-channel scale of the norm its input comes from (`precision.smoothing_of`;
  ones for the projections that read no norm), and `R = D H` [I, I]: a fixed randomized Hadamard rotation (checkpoint/rotation.py). Both are
  orthogonal-or-diagonal, so `y = ((x / s) R) ((W diag(s)) R)^T` exactly.
- The weight `(W diag(s)) R` is held in symmetric int8, one fp32 scale per output channel, `|q| <= 127`;
  `s` is kept beside it (`x.input_smoothing`).
- At run time the input is divided by `s` and rotated: half of a norm's large channels (where activation outliers are
  made) moves into the weight (SmoothQuant's balance, alpha 0.5), and what is left of any few large channels is
  spread over the whole block, so one token's int8 scale is set by all its channels, not by a few
  (benchmarks/agreement.py measures each step).

What is quantized is one explicit predicate, `model.precision.is_quantized`: the decoder's 2-D projection
weights, except `KEPT_HIGH_PRECISION`. Everything else stays as stored.

A class per way to compute, one line of forward each, built by `replace_linears` from the plan:
- `WeightOnlyLinear`: the int8 weight dequantized tile by tile to fp32 and multiplied there.
- `W8A8Linear`: the rotated input quantized per token and multiplied in int8 with int32 sums by the plan's kernel
  (checkpoint/w8a8.py); the weight packed for that kernel once, when it is filled (`pack_int8`), never in a forward.
- `TwoDigitLinear`: as W8A8Linear, each activation in two int8 digits: on a kernel with 7-bit activations, every
  projection that reads no norm: down_proj, o_proj, out_proj (`precision.w8a8_digits`).
- `Fp8Linear` (precision `fp8`, not the int8 scheme): `W` in e4m3 per output channel, the input in e4m3 per token, no
  smoothing or rotation, multiplied by `torch._scaled_mm` with the row-wise scales.

`QuantizingSource` wraps any tensor source (a release's safetensors) and presents the quantized names, so loading
a release as int8 and converting it to a bundle are the same code path; `Fp8QuantizingSource` likewise for fp8 (no
bundle stores fp8: a release quantizes while loading).
"""

from __future__ import annotations

import threading
from typing import Any, Iterator

import torch
from torch import nn

from .. import device_io
from ..model.precision import (
    FP8,
    FP8_MODE,
    FP32,
    INT8,
    SCALE_DTYPE,
    SCALE_SUFFIX,
    SMOOTHING_EXPONENT,
    SMOOTHED_BY,
    SMOOTHING_SUFFIX,
    TWO_DIGITS,
    W8A8,
    WEIGHT_ONLY,
    is_quantized,
    smoothing_of,
    w8a8_digits,
)
from .rotation import rotate
from .safetensors_io import release_pages, return_free_heap
from .w8a8 import W8A8_KERNELS, W8A8Kernel

SCHEME = "int8 per output channel of (W diag(s)) R; activations (x / s) R per token (s: the square root of the input's norm scale, R: randomized Hadamard)"
TILE_ELEMENTS = 1 << 22  # weight elements dequantized at once in weight-only mode (16 MB of fp32)
ROWS_AT_ONCE = 4096  # weight rows rotated and quantized at once (64 MB of fp32 at 4096 columns)


def _quantize_rows(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """rows fp32 [r, I], overwritten (its own copy) -> (q int8 [r, I], scale fp32 [r]): `|q| <= 127`, one pass each."""
    scale = torch.linalg.vector_norm(rows, ord=float("inf"), dim=1).clamp_min_(torch.finfo(FP32).tiny).div_(127.0)  # [r]
    return rows.div_(scale[:, None]).round_().clamp_(-127, 127).to(INT8), scale


def quantize_per_channel(weight: torch.Tensor, rows_at_once: int = ROWS_AT_ONCE) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [O, I] (any float dtype) -> (q int8 [O, I], scale fp32 [O]); computed in fp32 a block of rows at a time."""
    q = torch.empty(weight.shape, dtype=INT8)
    scale = torch.empty(weight.shape[0], dtype=SCALE_DTYPE)
    for start in range(0, weight.shape[0], rows_at_once):
        rows = slice(start, start + rows_at_once)
        q[rows], scale[rows] = _quantize_rows(weight[rows].to(FP32, copy=True))
    return q, scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = FP32) -> torch.Tensor:
    """q int8 [O, I], scale [O] -> [O, I] in `dtype` (the product taken in fp32, then cast)."""
    return (q.float() * scale.float()[:, None]).to(dtype)


def smoothing(norm_weight: torch.Tensor | None, width: int, offset: bool) -> torch.Tensor:
    """The input scale `s` [width] fp32 of a projection: |g| ** SMOOTHING_EXPONENT of its norm's per-channel scale g
    (`1 + w` where `offset`, else `w`), repeated over heads where the norm is per head; ones without a norm. Entries
    near 0 are held at 1e-6 of the largest: the input there is ~0 anyway, and 1 / s stays finite."""
    if norm_weight is None:
        return torch.ones(width, dtype=SCALE_DTYPE)
    scale = (norm_weight.float() + 1.0 if offset else norm_weight.float()).abs().pow(SMOOTHING_EXPONENT)
    scale = scale.repeat(width // scale.numel())  # [width]: per-head norms repeat over the heads
    return scale.clamp_min(1e-6 * float(scale.max().clamp_min(torch.finfo(FP32).tiny)))


def quantize_weight(weight: torch.Tensor, input_smoothing: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [O, I] -> the scheme's (q int8 [O, I], scale fp32 [O]) of `(W diag(s)) R`, a block of rows at a time
    (rotated and quantized in one buffer: the 9B's release quantizes at load in about a third less time)."""
    q = torch.empty(weight.shape, dtype=INT8)
    scale = torch.empty(weight.shape[0], dtype=SCALE_DTYPE)
    for start in range(0, weight.shape[0], ROWS_AT_ONCE):
        rows = slice(start, start + ROWS_AT_ONCE)
        q[rows], scale[rows] = _quantize_rows(rotate(weight[rows], column_scale=input_smoothing))  # [r, I] fp32
    return q, scale


def weight_only_linear(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [..., I] @ dequantize(q, scale).T -> [..., O] in x.dtype, dequantizing a tile of output rows at a time."""
    x2d = x.reshape(-1, x.shape[-1])  # [M, I]
    out = torch.empty(x2d.shape[0], q.shape[0], dtype=x.dtype, device=x.device)  # [M, O]
    rows = max(1, TILE_ELEMENTS // q.shape[1])
    for start in range(0, q.shape[0], rows):
        tile = dequantize(q[start : start + rows], scale[start : start + rows], x.dtype)  # [r, I]
        out[:, start : start + rows] = x2d @ tile.t()
    return out.view(*x.shape[:-1], q.shape[0])


# What a projection's input is rotated in, on every device: fp32. On a GPU its two products in bf16 (tensor cores, ~8x
# the fp32 rate) were measured with the GPU's numerics (benchmarks/agreement.py --gpu-rows, README): 6 decisions
# differing in 304 questions against the fp32 rotation's 5 (the reference bf16's 5), worst median |dp| 1.66x the
# reference bf16's against 1.52x: they stay fp32.
ROTATION_DTYPE = FP32


_last_rotation = threading.local()  # .entry: (input, its version, smoothing, (input / smoothing) R)


class Int8Linear(nn.Module):
    """A bias-free linear in the int8 scheme, a drop-in for `nn.Linear`: `weight` int8 [O, I] (of `(W diag(s)) R`),
    `weight_scale` fp32 [O], `input_smoothing` fp32 [I] (`s`). Subclasses say how the product is computed."""

    mode = ""

    def __init__(self, in_features: int, out_features: int):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("weight", torch.empty(out_features, in_features, dtype=INT8))
        self.register_buffer("weight" + SCALE_SUFFIX, torch.empty(out_features, dtype=SCALE_DTYPE))
        self.register_buffer(SMOOTHING_SUFFIX, torch.empty(in_features, dtype=SCALE_DTYPE))

    def inputs(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., I] -> (x / s) R as fp32 [M, I]: what the int8 weight multiplies. The projections that read one
        input with one smoothing (q, k, v; in_proj_qkv, in_proj_z; gate, up) rotate it once: the last rotation is
        kept (per thread) with the very tensor it came from and that tensor's version (an inference tensor has none:
        the decoder never changes a projection's input in place, tests/test_quant.py); the smoothing by identity too:
        `share_smoothing` made those projections' one tensor."""
        version = None if x.is_inference() else x._version
        last = getattr(_last_rotation, "entry", None)
        if last is not None and last[0] is x and last[1] == version and last[2] is self.input_smoothing:
            return last[3]
        rotated = rotate(x.reshape(-1, self.in_features), column_scale=1.0 / self.input_smoothing, dtype=ROTATION_DTYPE)  # [M, I] fp32
        _last_rotation.entry = (x, version, self.input_smoothing, rotated)
        return rotated

    def shaped(self, out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """out [M, O] -> [..., O] in x's dtype."""
        return out.to(x.dtype).view(*x.shape[:-1], self.out_features)

    def pack(self) -> None:
        """Make the weight's run-time form from the filled buffers (W8A8: its kernel's layout); nothing here."""

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, mode={self.mode}"


class WeightOnlyLinear(Int8Linear):
    """The int8 weight dequantized tile by tile; the rotated input in fp32."""

    mode = WEIGHT_ONLY

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.shaped(weight_only_linear(self.inputs(x), self.weight, self.weight_scale), x)


class W8A8Linear(Int8Linear):
    """The rotated input in int8 per token (the kernel's levels), int8 x int8 products with int32 sums."""

    mode = W8A8

    def __init__(self, in_features: int, out_features: int, kernel: W8A8Kernel):
        super().__init__(in_features, out_features)
        self.kernel = kernel
        self.packed: Any = None  # the weight in the kernel's layout: `pack`, after every fill

    def pack(self) -> None:
        self.packed = self.kernel.pack(self.weight, self.weight_scale)
        if self.packed is not self.weight:  # (torch._int_mm reads the int8 weight as it is)
            release_pages(self.weight)  # a bundle's mapped pages: the packed copy is what runs
            return_free_heap()  # the packing's temporaries

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.shaped(self.kernel.linear(self.inputs(x), self.packed, self.weight_scale), x)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, kernel={self.kernel.name}"


class TwoDigitLinear(W8A8Linear):
    """W8A8 with each activation in two int8 digits (checkpoint/w8a8.py): where the kernel's 7 bits are not enough."""

    mode = TWO_DIGITS

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.shaped(self.kernel.two_digit_linear(self.inputs(x), self.packed, self.weight_scale), x)


def pack_int8(module: nn.Module, *, device: torch.device | None = None) -> None:
    """Pack every filled int8 linear of `module` for its kernel (`load` and the low-memory window call this; a layer
    still on the meta device waits for its window, unless the model's `device` is meta: testing/fake_gpu.py's GPU),
    and let the projections that read one norm share one `input_smoothing` (`share_smoothing`)."""
    share_smoothing(module)
    for child in module.modules():
        if isinstance(child, Int8Linear) and (not child.weight.is_meta or (device is not None and device.type == "meta")):
            child.pack()


def share_smoothing(module: nn.Module) -> None:
    """The projections that read one norm's output (q, k, v; in_proj_qkv, in_proj_z; gate, up) hold one `input_smoothing`
    tensor: the same values (from that norm), and `Int8Linear.inputs` then knows their common input by identity alone,
    rotating it once without comparing values on the device (a host sync on a GPU). Compared here, at load."""
    shared: dict[tuple[str, str], torch.Tensor] = {}
    for name, child in module.named_modules():
        if not isinstance(child, Int8Linear):
            continue
        for projection, (norm, _) in SMOOTHED_BY.items():
            if name == projection or name.endswith("." + projection):
                key = (name[: len(name) - len(projection)], norm)
                first = shared.setdefault(key, child.input_smoothing)
                if first is not child.input_smoothing and (first.is_meta or torch.equal(first, child.input_smoothing)):
                    child.input_smoothing = first
                break


def unpack_int8(module: nn.Module) -> None:
    """Drop the packed weights of `module`'s int8 linears (the low-memory window empties a layer)."""
    for child in module.modules():
        if isinstance(child, W8A8Linear):
            child.packed = None


FP8_MAX = float(torch.finfo(FP8).max)  # 448: e4m3's largest finite value
FP8_ROWS = 16  # torch._scaled_mm on CUDA wants every dimension a multiple of 16 (the CPU takes any)


def quantize_fp8(x2d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [R, I] (any float dtype) -> (e4m3 [R, I], fp32 scale [R, 1]): absmax per row / 448, rounded to nearest
    (the cast), clamped first so that no rounding of the division reaches past 448 (where e4m3fn has no infinity)."""
    x32 = x2d.float()
    scale = x32.abs().amax(dim=1, keepdim=True).clamp_min(torch.finfo(FP32).tiny) / FP8_MAX  # [R, 1]
    return (x32 / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8), scale


def quantize_fp8_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [O, I] -> (e4m3 [O, I], fp32 scale [O]), a block of rows at a time."""
    q = torch.empty(weight.shape, dtype=FP8)
    scale = torch.empty(weight.shape[0], dtype=SCALE_DTYPE)
    for start in range(0, weight.shape[0], ROWS_AT_ONCE):
        rows = slice(start, start + ROWS_AT_ONCE)
        q[rows], block_scale = quantize_fp8(weight[rows])
        scale[rows] = block_scale[:, 0]
    return q, scale


def fp8_linear(x2d: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, out_dtype: torch.dtype, row_multiple: int | None = None) -> torch.Tensor:
    """x [M, I] -> [M, O] in `out_dtype`: x in e4m3 per token times the e4m3 weight q [O, I] (scale [O]), products
    summed by `torch._scaled_mm` with both row-wise scales. On CUDA its dimensions must be multiples of 16: I and O of
    the 9B are; M is padded with zero rows to `row_multiple` (default: 16 on a GPU, device_io.is_gpu, 1 elsewhere; rows are independent,
    so the answers are the same) where the decoder's buckets do not already make it one. The CPU takes any shape
    (slow: for measurement)."""
    rows = x2d.shape[0]
    row_multiple = row_multiple or (FP8_ROWS if device_io.is_gpu(x2d.device) else 1)
    xq, x_scale = quantize_fp8(x2d)  # [M, I] e4m3, [M, 1]
    if rows % row_multiple:
        padding = -rows % row_multiple
        xq = torch.cat([xq, xq.new_zeros(padding, xq.shape[1])])  # [M', I]
        x_scale = torch.cat([x_scale, x_scale.new_ones(padding, 1)])  # [M', 1]
    out = torch._scaled_mm(xq, q.t(), scale_a=x_scale, scale_b=scale[None, :], out_dtype=out_dtype)  # [M', O]
    return out[:rows]


class Fp8Linear(nn.Module):
    """A bias-free linear in fp8 (precision `fp8`), a drop-in for `nn.Linear`: `weight` e4m3 [O, I] of the plain `W`,
    `weight_scale` fp32 [O]. Plain row-wise, no smoothing or rotation: what GPU servers ship. Measured with the GPU's
    numerics (benchmarks/agreement.py --gpu-rows, 4 runs): 22 decisions differing (worst median |dp| 6.8x the reference
    bf16's); in the int8 scheme's smoothing and rotation 18 (5.4x): better, far from qualifying either way (the int8
    scheme: 5, the reference bf16's 5), so fp8 stays the plain form it is shipped in."""

    mode = FP8_MODE

    def __init__(self, in_features: int, out_features: int):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("weight", torch.empty(out_features, in_features, dtype=FP8))
        self.register_buffer("weight" + SCALE_SUFFIX, torch.empty(out_features, dtype=SCALE_DTYPE))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = fp8_linear(x.reshape(-1, self.in_features), self.weight, self.weight_scale, x.dtype)  # [M, O]
        return out.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, mode={self.mode}"


def replace_linears(module: nn.Module, mode: str, kernel: str | None = None, keep: tuple[str, ...] | None = None) -> list[str]:
    """Swap every `nn.Linear` whose weight `is_quantized` for an `Int8Linear` of `mode` (W8A8 on `kernel`, a name of
    checkpoint/w8a8.py's W8A8_KERNELS) or an `Fp8Linear`, on the same device; returns their names."""
    if mode not in (WEIGHT_ONLY, W8A8, FP8_MODE):
        raise ValueError(f"unknown 8-bit mode {mode!r}: use one of {WEIGHT_ONLY}, {W8A8}, {FP8_MODE}")
    if mode == W8A8 and kernel not in W8A8_KERNELS:
        raise ValueError(f"unknown W8A8 kernel {kernel!r}: use one of {', '.join(W8A8_KERNELS)}")
    replaced = []
    for name, child in list(module.named_modules()):
        for child_name, linear in list(child.named_children()):
            full = f"{name}.{child_name}" if name else child_name
            if isinstance(linear, nn.Linear) and is_quantized(f"{full}.weight", tuple(linear.weight.shape), keep):
                if linear.bias is not None:
                    raise ValueError(f"{full} has a bias: the int8 scheme covers bias-free projections only")
                with torch.device(linear.weight.device):
                    if mode == W8A8:
                        chosen = W8A8_KERNELS[kernel]
                        two = w8a8_digits(full, chosen.activation_bits) == 2
                        replacement: nn.Module = (TwoDigitLinear if two else W8A8Linear)(linear.in_features, linear.out_features, chosen)
                    elif mode == FP8_MODE:
                        replacement = Fp8Linear(linear.in_features, linear.out_features)
                    else:
                        replacement = WeightOnlyLinear(linear.in_features, linear.out_features)
                setattr(child, child_name, replacement)
                replaced.append(full)
    return replaced


class QuantizingSource:
    """A tensor source seen through the scheme: `x.weight` becomes int8 (of `(W diag(s)) R`), and `x.weight_scale`
    and `x.input_smoothing` appear. The last quantized tensor is kept so that reading a weight and then its scale
    quantizes once."""

    weight_dtype = INT8
    smoothed = True  # `x.input_smoothing` is presented

    def __init__(self, source, keep: tuple[str, ...] | None = None):
        self.source, self.keep = source, keep
        self._quantized = {name for name in source.keys() if is_quantized(name, source.shape(name), keep)}
        # derived name -> (its weight, what it is)
        self._derived = {name + SCALE_SUFFIX: (name, SCALE_SUFFIX) for name in self._quantized}
        if self.smoothed:
            self._derived |= {name.removesuffix("weight") + SMOOTHING_SUFFIX: (name, SMOOTHING_SUFFIX) for name in self._quantized}
        self._last: tuple[str, tuple[torch.Tensor, torch.Tensor]] | None = None

    def keys(self) -> set[str]:
        return set(self.source.keys()) | set(self._derived)

    def shape(self, name: str) -> tuple[int, ...]:
        if name not in self._derived:
            return self.source.shape(name)
        weight, kind = self._derived[name]
        out_features, in_features = self.source.shape(weight)
        return (out_features,) if kind == SCALE_SUFFIX else (in_features,)

    def dtype(self, name: str) -> torch.dtype:
        if name in self._quantized:
            return self.weight_dtype
        return SCALE_DTYPE if name in self._derived else self.source.dtype(name)

    def input_smoothing(self, weight_name: str) -> torch.Tensor:
        """`s` [I] of a quantized weight, from its norm in the source (`precision.smoothing_of`)."""
        norm = smoothing_of(weight_name)
        width = self.source.shape(weight_name)[1]
        if norm is None or norm[0] not in self.source.keys():
            return smoothing(None, width, offset=True)
        return smoothing(self.source.get(norm[0]), width, offset=norm[1])

    def _pair(self, weight_name: str) -> tuple[torch.Tensor, torch.Tensor]:
        if self._last is None or self._last[0] != weight_name:
            weight = self.source.get(weight_name)
            self._last = (weight_name, self.quantize(weight_name, weight))
            release_pages(weight)
        return self._last[1]

    def quantize(self, weight_name: str, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return quantize_weight(weight, self.input_smoothing(weight_name))

    def get(self, name: str) -> torch.Tensor:
        if name in self._quantized:
            return self._pair(name)[0]
        if name not in self._derived:
            return self.source.get(name)
        weight, kind = self._derived[name]
        return self._pair(weight)[1] if kind == SCALE_SUFFIX else self.input_smoothing(weight)

    def quantized_names(self) -> Iterator[str]:
        return iter(sorted(self._quantized))


class Fp8QuantizingSource(QuantizingSource):
    """A tensor source seen in fp8: `x.weight` becomes e4m3 of the plain `W` per output channel, `x.weight_scale`
    appears (no smoothing, no rotation: `Fp8Linear`)."""

    weight_dtype = FP8
    smoothed = False

    def quantize(self, weight_name: str, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return quantize_fp8_per_channel(weight)
