"""8-bit decoder weights: one storage scheme, two ways to compute with it.

Scheme: symmetric int8, one fp32 scale per output channel, `w ~ q * scale[:, None]`, `|q| <= 127`.
What is quantized is one explicit predicate, `model.precision.is_quantized`: the decoder's 2-D projection
weights (`*_proj.weight`, `in_proj_*.weight`), except `KEPT_HIGH_PRECISION`. Everything else stays as stored: norms, the
depthwise conv, `A_log`, `dt_bias`; the input embeddings are 16-bit and gathered by row; the head and
the output-embedding rows it reads are never quantized.

Compute modes (`Int8Linear.mode`):
- `weight-only`: the int8 weight is dequantized tile by tile (a block of output rows at a time) to the
  activations' dtype and multiplied there; only the weight's rounding is added.
- `w8a8`: activations are quantized per token (one scale per row, absmax / 127) and multiplied with
  `torch._int_mm` (int32 accumulation); fast on CPUs with VNNI and on CUDA, slow elsewhere.

`QuantizingSource` wraps any tensor source (a release's safetensors) and presents the quantized
names, so loading a release as int8 and converting it to a bundle are the same code path.
"""

from __future__ import annotations

from typing import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from ..model.precision import FP32, INT8, INT8_MODES, SCALE_DTYPE, SCALE_SUFFIX, W8A8, WEIGHT_ONLY, is_quantized

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


def weight_only_linear(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [..., I] @ dequantize(q, scale).T -> [..., O] in x.dtype, dequantizing a tile of output rows at a time."""
    x2d = x.reshape(-1, x.shape[-1])  # [M, I]
    out = torch.empty(x2d.shape[0], q.shape[0], dtype=x.dtype, device=x.device)  # [M, O]
    rows = max(1, TILE_ELEMENTS // q.shape[1])
    for start in range(0, q.shape[0], rows):
        tile = dequantize(q[start : start + rows], scale[start : start + rows], x.dtype)  # [r, I]
        out[:, start : start + rows] = x2d @ tile.t()
    return out.view(*x.shape[:-1], q.shape[0])


def quantize_per_token(x2d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, I] -> (int8 [M, I], fp32 scale [M, 1]): absmax per row / 127."""
    x32 = x2d.float()
    scale = x32.abs().amax(dim=1, keepdim=True).clamp_min(torch.finfo(FP32).tiny) / 127.0  # [M, 1]
    return torch.round(x32 / scale).clamp_(-127, 127).to(INT8), scale


def w8a8_linear(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Per-token int8 activations times per-channel int8 weights, int32 accumulation -> [..., O] in x.dtype."""
    x2d = x.reshape(-1, x.shape[-1])  # [M, I]
    rows = x2d.shape[0]
    xq, x_scale = quantize_per_token(x2d)
    if x.device.type == "cuda":  # cuBLAS int8 wants M > 16 and a multiple of 8
        padded = max(32, -(-rows // 8) * 8)
        xq = F.pad(xq, (0, 0, 0, padded - rows))
    accumulated = torch._int_mm(xq, q.t())[:rows]  # [M, O] int32
    out = accumulated.float().mul_(x_scale).mul_(scale[None, :])
    return out.to(x.dtype).view(*x.shape[:-1], q.shape[0])


KERNELS = {WEIGHT_ONLY: weight_only_linear, W8A8: w8a8_linear}


class Int8Linear(nn.Module):
    """A bias-free linear with int8 weights [O, I] and fp32 scales [O]: a drop-in for `nn.Linear`."""

    def __init__(self, in_features: int, out_features: int, mode: str):
        super().__init__()
        if mode not in INT8_MODES:
            raise ValueError(f"unknown int8 mode {mode!r}: use one of {', '.join(INT8_MODES)}")
        self.in_features, self.out_features, self.mode = in_features, out_features, mode
        self.register_buffer("weight", torch.empty(out_features, in_features, dtype=INT8))
        self.register_buffer("weight" + SCALE_SUFFIX, torch.empty(out_features, dtype=SCALE_DTYPE))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return KERNELS[self.mode](x, self.weight, self.weight_scale)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, mode={self.mode}"


def replace_linears(module: nn.Module, mode: str, keep: tuple[str, ...] | None = None) -> list[str]:
    """Swap every `nn.Linear` whose weight `is_quantized` for an `Int8Linear` (on the same device); returns their names."""
    replaced = []
    for name, child in list(module.named_modules()):
        for child_name, linear in list(child.named_children()):
            full = f"{name}.{child_name}" if name else child_name
            if isinstance(linear, nn.Linear) and is_quantized(f"{full}.weight", tuple(linear.weight.shape), keep):
                if linear.bias is not None:
                    raise ValueError(f"{full} has a bias: the int8 scheme covers bias-free projections only")
                with torch.device(linear.weight.device):
                    setattr(child, child_name, Int8Linear(linear.in_features, linear.out_features, mode))
                replaced.append(full)
    return replaced


class QuantizingSource:
    """A tensor source seen through the scheme: `x.weight` becomes int8 and `x.weight_scale` appears.

    The last quantized tensor is kept so that reading a weight and then its scale quantizes once.
    """

    def __init__(self, source, keep: tuple[str, ...] | None = None, prefix: str = ""):
        self.source, self.keep, self.prefix = source, keep, prefix
        self._quantized = {
            name for name in source.keys() if name.startswith(prefix) and is_quantized(name, source.shape(name), keep)
        }
        self._last: tuple[str, tuple[torch.Tensor, torch.Tensor]] | None = None

    def keys(self) -> set[str]:
        return set(self.source.keys()) | {name + SCALE_SUFFIX for name in self._quantized}

    def shape(self, name: str) -> tuple[int, ...]:
        if name.endswith(SCALE_SUFFIX) and name[: -len(SCALE_SUFFIX)] in self._quantized:
            return (self.source.shape(name[: -len(SCALE_SUFFIX)])[0],)
        return self.source.shape(name)

    def dtype(self, name: str) -> torch.dtype:
        if name in self._quantized:
            return INT8
        if name.endswith(SCALE_SUFFIX) and name[: -len(SCALE_SUFFIX)] in self._quantized:
            return SCALE_DTYPE
        return self.source.dtype(name)

    def _pair(self, weight_name: str) -> tuple[torch.Tensor, torch.Tensor]:
        if self._last is None or self._last[0] != weight_name:
            self._last = (weight_name, quantize_per_channel(self.source.get(weight_name)))
        return self._last[1]

    def get(self, name: str) -> torch.Tensor:
        if name in self._quantized:
            return self._pair(name)[0]
        if name.endswith(SCALE_SUFFIX) and name[: -len(SCALE_SUFFIX)] in self._quantized:
            return self._pair(name[: -len(SCALE_SUFFIX)])[1]
        return self.source.get(name)

    def quantized_names(self) -> Iterator[str]:
        return iter(sorted(self._quantized))
