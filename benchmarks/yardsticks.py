"""Weight formats people know, emulated on our fp32 model for the agreement table (issue 50): llama.cpp's Q8_0 and
Q4_0, and this project's int8 scheme with one weight scale per group of G input columns instead of per output channel.

Each `Format` replaces exactly the projections the int8 scheme quantizes (`precision.is_quantized`: the decoder's 2-D
projection weights but `KEPT_HIGH_PRECISION`, in_proj_a / in_proj_b) in the release loaded in fp32; everything the
precision policy keeps high (norms, A_log, dt_bias, the conv, the embeddings, the lm_head rows, the head, the vision
tower) stays fp32 as loaded. What is emulated is the weight format and the activations' quantization, not the rest of
llama.cpp's forward (its f16 KV cache, its own attention): the figures are the formats', on our decoder.

Every product is the sum an integer kernel computes, `out[m, o] = sum_b dx[m, b] dw[o, b] sum_(i in b) xq[m, i] q[o, i]`
over blocks (groups) b, taken as the float64 product of the dequantized values `dx * xq` and `dw * q`: each is an
integer times a scale, exact in float64 (8 + 24 bits), so the sums differ from the integer ones by float64 rounding
alone (~1e-16 relative). ggml adds its blocks in fp32, an order that moves a sum by ~1e-7 relative: far below any
format's own rounding (~1e-2), and not emulated.

The ggml rules (ggml/src/ggml-quants.c, ggml-cpu/arch/x86/quants.c; llama.cpp as of 2025-2026, `QK8_0 = QK4_0 = 32`):

- Q8_0 weights, `quantize_row_q8_0_ref` (what llama-quantize writes): per block of 32 along the input dimension,
  `amax = max |x|`, `d = amax / 127`, `id = d ? 1 / d : 0`, `q = roundf(x * id)` (ties away from zero), the scale
  stored as fp16(d), in fp32 arithmetic throughout.
- Q8_0 activations, `quantize_row_q8_0` (the CPU's `from_float` for Q8_0 and Q4_0's `vec_dot_type`; its AVX2 path):
  per block of 32 of a token's row, `d = amax / 127` stored as fp16(d), `id = 127 / amax`, `q = round(x * id)` to
  nearest even (`_mm256_round_ps(_MM_ROUND_NEAREST)`). (The reference differs in id's last bit and ties only.)
- Q4_0 weights, `quantize_row_q4_0_ref`: per block of 32, `max` = the first value of largest magnitude (sign kept),
  `d = max / -8`, `id = d ? 1 / d : 0`, `q = MIN(15, (int8_t)(x * id + 8.5f))` (a truncation: x * id + 8.5 >= 0 here,
  so floor), the value `(q - 8) * fp16(d)`: integers in [-8, 7], the block's largest-magnitude value exactly -8 * d.
- the dot products, `ggml_vec_dot_q8_0_q8_0` and `ggml_vec_dot_q4_0_q8_0`: per block the integer sum of products,
  times both fp16 scales, the blocks summed in fp32 (here: float64, above).

The grouped rows are this project's scheme (checkpoint/quant.py: the weight `(W diag(s)) R`, the input `(x / s) R`
through `Int8Linear.inputs`, 8-bit activations per token as oneDNN's and _int_mm's `quantize_per_token`) with the
weight's scale per output channel and group of G input columns, `absmax / 127` in fp32, rounded as `_quantize_rows`
rounds (to nearest even): G = the input width is the scheme itself.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

import clef_flash
from clef_flash.checkpoint.quant import smoothing
from clef_flash.checkpoint.rotation import rotate
from clef_flash.checkpoint.w8a8 import quantize_per_token
from clef_flash.model.precision import FP16, FP32, FP64, SMOOTHED_BY, is_quantized

QK = 32  # ggml's QK8_0 and QK4_0: the values a block's one scale covers
TILE_ELEMENTS = 1 << 22  # weight elements dequantized to float64 at once (32 MB)


def fp16_scale(d: torch.Tensor) -> torch.Tensor:
    """A scale as ggml stores it (GGML_FP32_TO_FP16, round to nearest even) and reads it back, in fp32."""
    return d.to(FP16).to(FP32)


def blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    """x [R, I] -> [R, I / block, block]; I must be a multiple of `block` (every width of the 9B's is of 32)."""
    rows, width = x.shape
    if width % block:
        raise ValueError(f"an input width of {width} is not a multiple of the block of {block}")
    return x.reshape(rows, width // block, block)


def round_half_away(x: torch.Tensor) -> torch.Tensor:
    """C's roundf: to nearest, ties away from zero (torch.round takes ties to even; floor(|x| + 0.5) misrounds
    0.49999997, whose sum with 0.5 rounds up to 1 in fp32)."""
    truncated = x.trunc()
    return torch.where((x - truncated).abs() == 0.5, truncated + x.sign(), x.round())


def quantize_q8_0_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """ggml's `quantize_row_q8_0_ref`: weight [O, I] -> (integers [O, I] in [-127, 127], fp16 scales as fp32 [O, I / 32])."""
    x = blocks(weight.to(FP32), QK)  # [O, B, 32]
    d = x.abs().amax(dim=2) / 127  # [O, B]
    inverse = torch.where(d != 0, 1.0 / d, torch.zeros_like(d))
    return round_half_away(x * inverse[..., None]).reshape(weight.shape).to(torch.int8), fp16_scale(d)


def quantize_q8_0_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """ggml's `quantize_row_q8_0` (x86 AVX2): x [M, I] -> (integers [M, I], fp16 scales as fp32 [M, I / 32])."""
    grouped = blocks(x.to(FP32), QK)  # [M, B, 32]
    amax = grouped.abs().amax(dim=2)  # [M, B]
    inverse = torch.where(amax != 0, 127 / amax, torch.zeros_like(amax))
    q = torch.round(grouped * inverse[..., None])  # nearest, ties to even
    return q.reshape(x.shape), fp16_scale(amax / 127)


def quantize_q4_0_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """ggml's `quantize_row_q4_0_ref`: weight [O, I] -> (integers [O, I] in [-8, 7], fp16 scales as fp32 [O, I / 32])."""
    x = blocks(weight.to(FP32), QK)  # [O, B, 32]
    first_largest = x.abs().argmax(dim=2, keepdim=True)  # torch's argmax: the first of equal maxima, as ggml's strict `<`
    d = x.gather(2, first_largest)[..., 0] / -8  # [O, B]
    inverse = torch.where(d != 0, 1.0 / d, torch.zeros_like(d))
    shifted = (x * inverse[..., None] + 8.5).floor().clamp_(max=15)  # (x * id + 8.5f) in fp32, truncated, MIN(15, .)
    return (shifted - 8).reshape(weight.shape).to(torch.int8), fp16_scale(d)


def quantize_weight_groups(weight: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The scheme's weight rounding with a scale per group: [O, I] -> (integers in [-127, 127], fp32 scales [O, I / G]),
    G = min(group, I): a group as wide as the input is the scheme's one scale per output channel."""
    x = blocks(weight.to(FP32), min(group, weight.shape[1]))  # [O, B, G]
    scale = x.abs().amax(dim=2).clamp_min(torch.finfo(FP32).tiny) / 127  # [O, B]
    q = (x / scale[..., None]).round_().clamp_(-127, 127)
    return q.reshape(weight.shape).to(torch.int8), scale


def per_token_8_bit(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The scheme's 8-bit activations (checkpoint/w8a8.py `quantize_per_token`): one scale per token, as [M, 1]."""
    return quantize_per_token(x, 127, dtype=FP32)


def dequantize(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """q [R, I], scales [R, B] (one per block of I / B columns) -> float64 [R, I]: exact (an integer times a scale)."""
    return (blocks(q.to(FP64), q.shape[1] // scales.shape[1]) * scales.to(FP64)[..., None]).reshape(q.shape)


@dataclass(frozen=True)
class Format:
    """One emulated weight format: how a weight and a token's activations are rounded, and whether the scheme's
    smoothing and rotation come first."""

    key: str  # its row in clef_flash/agreement_table.py's ROWS
    weight: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]  # [O, I] -> (integers, scales [O, B])
    activations: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]  # [M, I] -> (integers, scales [M, B'])
    rotated: bool  # the scheme's frame: (W diag(s)) R and (x / s) R


def groups_of(size: int) -> Format:
    return Format(
        f"groups-{size}",
        lambda weight: quantize_weight_groups(weight, size),
        per_token_8_bit,
        rotated=True,
    )


Q8_0 = Format("q8_0", quantize_q8_0_weight, quantize_q8_0_activations, rotated=False)
Q4_0 = Format("q4_0", quantize_q4_0_weight, quantize_q8_0_activations, rotated=False)
GROUP_SIZES = (32, 128, 256)
FORMATS = (Q8_0, Q4_0, *(groups_of(size) for size in GROUP_SIZES))


class EmulatedLinear(nn.Module):
    """A bias-free projection in `format`, a drop-in for `nn.Linear`: the integers and scales of its weight held as
    the format stores them, each forward the exact sums of an integer kernel (the module's docstring)."""

    def __init__(self, weight: torch.Tensor, format: Format, input_smoothing: torch.Tensor | None):
        super().__init__()
        self.format = format
        self.out_features, self.in_features = weight.shape
        self.input_smoothing = input_smoothing  # `s` [I] where rotated, else None
        frame = rotate(weight, column_scale=input_smoothing) if format.rotated else weight.float()  # [O, I]
        self.q, self.scales = format.weight(frame)  # int8 [O, I], fp32 [O, B]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2d = x.reshape(-1, self.in_features).float()  # [M, I]
        if self.format.rotated:
            x2d = rotate(x2d, column_scale=1.0 / self.input_smoothing)
        xq, x_scales = self.format.activations(x2d)
        inputs = dequantize(xq, x_scales)  # [M, I] float64
        out = torch.empty(x2d.shape[0], self.out_features, dtype=FP64)  # [M, O]
        rows = max(1, TILE_ELEMENTS // self.in_features)
        for start in range(0, self.out_features, rows):
            tile = slice(start, start + rows)
            out[:, tile] = inputs @ dequantize(self.q[tile], self.scales[tile]).t()
        return out.to(x.dtype).view(*x.shape[:-1], self.out_features)


def replace_projections(model: clef_flash.Clef, format: Format) -> list[str]:
    """Swap every projection of `model`'s decoder that `is_quantized` names for an `EmulatedLinear` in `format`, its
    smoothing (where rotated) from the norm it reads, as `QuantizingSource.input_smoothing` takes it; their names."""
    replaced = []
    for index, layer in enumerate(model.parts.decoder.layers):
        for name, linear in list(layer.named_modules()):
            if not (isinstance(linear, nn.Linear) and is_quantized(f"{name}.weight", tuple(linear.weight.shape))):
                continue
            s = None
            if format.rotated:
                norm = SMOOTHED_BY.get(name)
                norm_weight = layer.get_parameter(norm[0]).detach() if norm else None
                s = smoothing(norm_weight, linear.in_features, offset=norm[1] if norm else True)
            parent, _, child = name.rpartition(".")
            setattr(layer.get_submodule(parent), child, EmulatedLinear(linear.weight.detach(), format, s))
            replaced.append(f"layers.{index}.{name}")
    return replaced


def load_emulated(root, format: Format) -> clef_flash.Clef:
    """The release at `root` in fp32, its int8 projections in `format`."""
    model = clef_flash.load(root, device="cpu", precision="fp32")
    replace_projections(model, format)
    return model
