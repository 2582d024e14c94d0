"""The W8A8 kernels: per-token int8 activations times per-channel int8 weights, with int32 sums.

Every kernel here computes the same thing, `out[m, o] = x_scale[m] * scale[o] * sum_i xq[m, i] q[o, i]`,
with `xq` the activations rounded per token to integers in [-levels, levels]; they differ in the library
that multiplies and in `levels`:

    kernel     library                                        levels  where it is exact
    onednn     oneDNN's int8 linear (AMX, AVX-512 VNNI, AVX2)  127     with VNNI / AMX; not on AVX2 alone
    int_mm     torch._int_mm (oneDNN or a reference loop)      127     where it avoids AVX2's int16 pair sums
    onednn-u7  oneDNN's int8 linear, unsigned activations      63      everywhere (7-bit activations)
    fbgemm     FBGEMM's dynamic linear (vpmaddubsw kernels)    63      everywhere (7-bit activations)

Without VNNI, x86 int8 products multiply u8 by s8 and add adjacent pairs in int16 (`vpmaddubsw`), which
saturates when both factors are near their limits (255 * 127 * 2 > 32767): a kernel that feeds it 8-bit
activations and 8-bit weights returns wrong sums on such CPUs. So a kernel is never trusted by name:
`exactness_error` runs it on an adversarial trial (activations and weights at their limits, and random ones)
against exact integer products, and the machine's probe (machine.py) accepts only kernels whose error there is 0.
(FBGEMM is also exact with 8-bit activations and weights within 7 bits, 255 * 63 * 2 < 32767; measured
(benchmarks/int8_schemes.py), 7-bit weights lose more agreement than 7-bit activations, so it keeps the latter.)

Two digits (`W8A8Kernel.two_digit_linear`, where 7-bit activations are not enough: precision.SEVEN_BIT_ONE_DIGIT):
each row is rounded to integers t in [-levels * base, levels * base] (base = 2 * levels: ~13 bits for FBGEMM's 63)
and written t = hi * base + lo with both digits within [-levels, levels]; the rows [hi; lo] go through the same int8
kernel as one product of twice the rows, and out = base * P_hi + P_lo: exact integer sums, 1 byte a weight.

onednn-u7 hands oneDNN the same integers shifted to unsigned bytes, xq + 63 in [0, 126] with zero point 63 (oneDNN
subtracts 63 * sum(q) in int32): 126 * 127 * 2 < 32767, so AVX2's pair sums never saturate. Its sums are FBGEMM's to the
bit, and oneDNN packs a weight ~8x faster than FBGEMM (the probe's 4096 x 4096 weight under the AVX2 emulation on Zen 4:
16 ms against 125; `clef-flash info --json`, probe.int8_pack_ms), and packing is most of an AVX2 machine's load.

FBGEMM quantizes activations itself, per tensor, as u8 with a zero point (`reduce_range`: 0..127). Its
rounding is made to be ours exactly: each row is scaled to integers in [-63, 63] first, and two extra
columns (-64 and 63, against zero weight columns) pin the tensor's range, so FBGEMM's scale is 1 and its
zero point 64; the per-token scales are applied to the output rows after (a linear map lets them factor out). The
quantizers leave the two columns free after the integers (`W8A8Kernel.pad`), so the integers are written once.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from .. import device_io
from ..model.precision import FP32, INT8

ONEDNN, INT_MM, ONEDNN_U7, FBGEMM = "onednn", "int_mm", "onednn-u7", "fbgemm"


def quantize_per_token(x2d: torch.Tensor, levels: int = 127, dtype: torch.dtype = INT8, pad: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, I] -> (integers in [-levels, levels] as `dtype` [M, I + pad], fp32 scale [M, 1]): absmax per row / levels;
    the `pad` last columns are left for the kernel to fill (FBGEMM's pins), so that it need not copy the integers again."""
    x32 = x2d.float()
    scale = x32.abs().amax(dim=1, keepdim=True).clamp_min(torch.finfo(FP32).tiny) / levels  # [M, 1]
    units = (x32 / scale).round_().clamp_(-levels, levels)  # [M, I]; not in place: x32 may be x itself
    if not pad:
        return units.to(dtype), scale
    integers = units.new_empty((units.shape[0], units.shape[1] + pad), dtype=dtype)  # [M, I + pad]
    integers[:, : units.shape[1]] = units
    return integers, scale


def quantize_two_digits(x2d: torch.Tensor, levels: int = 127, dtype: torch.dtype = INT8, pad: int = 0) -> tuple[torch.Tensor, torch.Tensor, int]:
    """x [M, I] -> (digits [2M, I + pad] as `dtype`: the rows [hi; lo], fp32 scale [M, 1], base) with
    hi * base + lo = round(x / scale) (but for the odd tie, one unit off), |hi|, |lo| <= levels; the `pad` last
    columns as in `quantize_per_token`."""
    base = 2 * levels
    x32 = x2d.float()
    scale = x32.abs().amax(dim=1, keepdim=True).clamp_min(torch.finfo(FP32).tiny) / (levels * base)  # [M, 1]
    rows, inner = x32.shape
    units = x32 / (scale * base)  # [M, I] in [-levels, levels]: the integers round(x / scale), divided by base
    hi = units.round()  # [M, I]
    lo = units.sub_(hi).mul_(base).round_()  # (x / scale - hi * base) rounded: [M, I] in [-levels, levels]
    digits = torch.empty(2 * rows, inner + pad, dtype=dtype, device=x32.device)  # [2M, I + pad]
    digits[:rows, :inner].copy_(hi)
    digits[rows:, :inner].copy_(lo)
    return digits, scale, base


# -- the kernels: (xq integers [M, I], packed weight, weight scale [O]) -> fp32 [M, O] ------------------------


def _int_mm_pack(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return q


def _int_mm_multiply(xq: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    if device_io.is_gpu(xq.device) and not int_mm_shape_ok(*xq.shape, q.shape[0]):
        raise ValueError(
            f"torch._int_mm on a GPU takes M > 16 and M, K, N multiples of 8; got M={xq.shape[0]}, K={xq.shape[1]}, "
            f"N={q.shape[0]} (the GPU path pads every step to a sequence bucket: engine/buckets.py)"
        )
    return torch._int_mm(xq, q.t()).float().mul_(scale[None, :])  # [M, O]


def int_mm_shape_ok(rows: int, inner: int, out: int) -> bool:
    """cuBLASLt's int8 product as torch._int_mm takes it on CUDA: more than 16 rows, every dimension a multiple of 8."""
    return rows > 16 and rows % 8 == 0 and inner % 8 == 0 and out % 8 == 0


def _onednn_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.onednn, "qlinear_pointwise")


def _onednn_pack(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return torch.ops.onednn.qlinear_prepack(q, None)  # oneDNN's blocked layout for this CPU (opaque)


def _onednn_product(x: torch.Tensor, zero_point: int, packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """oneDNN's int8 linear: (x - zero_point) [M, I] (int8, or uint8 with a zero point) times the packed weight, fp32 out."""
    weight_zero_points = torch.zeros(scale.shape[0], dtype=torch.int32)
    return torch.ops.onednn.qlinear_pointwise(x, 1.0, zero_point, packed, scale, weight_zero_points, None, 1.0, 0, FP32, "none", [], "")


def _onednn_multiply(xq: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return _onednn_product(xq, 0, packed, scale)


UNSIGNED_ZERO = 63  # onednn-u7: the activations xq + 63 in [0, 126] as uint8


def _onednn_unsigned_multiply(xq: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """xq int8 [M, I] in [-63, 63]: shifted in place to [0, 126] and read as uint8 (the same bits), zero point 63."""
    return _onednn_product(xq.add_(UNSIGNED_ZERO).view(torch.uint8), UNSIGNED_ZERO, packed, scale)


FBGEMM_PINS = (-64.0, 63.0)  # the extra activation columns that fix FBGEMM's range: scale 1, zero point 64


def _fbgemm_available() -> bool:
    return "fbgemm" in torch.backends.quantized.supported_engines and hasattr(torch.ops.quantized, "linear_dynamic")


def _fbgemm_pack(q: torch.Tensor, scale: torch.Tensor) -> Any:
    """The bundle's own int8 values and scales (no requantization), two zero columns appended, packed once."""
    out_features = q.shape[0]
    padded = torch.cat([q, q.new_zeros(out_features, len(FBGEMM_PINS))], dim=1)  # [O, I + 2]
    with warnings.catch_warnings():  # quantized tensors are deprecated as a user API; the op still takes them
        warnings.simplefilter("ignore", UserWarning)
        weight = torch._make_per_channel_quantized_tensor(
            padded, scale.double(), torch.zeros(out_features, dtype=torch.long), 0
        )
    return torch.ops.quantized.linear_prepack(weight, None)


def _fbgemm_multiply(xq: torch.Tensor, packed: Any, scale: torch.Tensor) -> torch.Tensor:
    """xq [M, I + 2]: the integers and two columns for the pins (`W8A8Kernel.pad`), filled here."""
    xq[:, -len(FBGEMM_PINS) :] = xq.new_tensor(FBGEMM_PINS)
    return torch.ops.quantized.linear_dynamic(xq, packed, True)  # [M, O] fp32


@dataclass(frozen=True)
class W8A8Kernel:
    name: str
    levels: int  # activations are rounded per token to [-levels, levels]
    activation_dtype: torch.dtype  # what the integers are handed over as
    available: Callable[[], bool]
    pack: Callable[[torch.Tensor, torch.Tensor], Any]  # (q int8 [O, I], scale [O]) -> the weight as it runs; once
    multiply: Callable[[torch.Tensor, Any, torch.Tensor], torch.Tensor]  # may write into xq: the quantizers' own
    pad: int = 0  # columns the quantizers leave after the integers, for `multiply` to fill

    @property
    def activation_bits(self) -> int:
        return self.levels.bit_length() + 1

    def two_digit_linear(self, x2d: torch.Tensor, packed: Any, scale: torch.Tensor) -> torch.Tensor:
        """As `linear`, with each activation in two int8 digits (see the module's docstring)."""
        rows = x2d.shape[0]
        digits, x_scale, base = quantize_two_digits(x2d, self.levels, self.activation_dtype, self.pad)
        products = self.multiply(digits, packed, scale)  # [2M, O]: the hi rows, then the lo rows
        return products[:rows].mul_(base).add_(products[rows:]).mul_(x_scale)

    def linear(self, x2d: torch.Tensor, packed: Any, scale: torch.Tensor) -> torch.Tensor:
        """x [M, I] -> fp32 [M, O]: x rounded per token to [-levels, levels], the integer product, both scales."""
        xq, x_scale = quantize_per_token(x2d, self.levels, self.activation_dtype, self.pad)
        return self.multiply(xq, packed, scale).mul_(x_scale)


def _reference_multiply(xq: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (xq.double() @ q.double().t()).float().mul_(scale[None, :])  # float64 sums of int8 products are exact


def reference_kernel(name: str, levels: int = 127) -> W8A8Kernel:
    """The slow, obviously-correct twin of a kernel: the same integers (`levels`), exact sums in float64, on any
    CPU. Never one of W8A8_KERNELS (the probe never times or chooses it); tests stand it in for a kernel of an
    imagined CPU that is not exact on the one they run on (exact kernels all give the same sums)."""
    return W8A8Kernel(name, levels, INT8, lambda: True, lambda q, scale: q, _reference_multiply)


W8A8_KERNELS: dict[str, W8A8Kernel] = {
    ONEDNN: W8A8Kernel(ONEDNN, 127, INT8, _onednn_available, _onednn_pack, _onednn_multiply),
    INT_MM: W8A8Kernel(INT_MM, 127, INT8, lambda: True, _int_mm_pack, _int_mm_multiply),
    ONEDNN_U7: W8A8Kernel(ONEDNN_U7, UNSIGNED_ZERO, INT8, _onednn_available, _onednn_pack, _onednn_unsigned_multiply),
    FBGEMM: W8A8Kernel(FBGEMM, 63, FP32, _fbgemm_available, _fbgemm_pack, _fbgemm_multiply, pad=len(FBGEMM_PINS)),
}


# -- exactness ---------------------------------------------------------------------------------------------


def adversarial_trial(levels: int, inner: int = 512, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(activations [12, inner] fp32 integers, weights int8 [12, inner]) at their limits and at random.

    Rows of activations: all +levels, all -levels, alternating signs, pairs of the same sign, then random
    integers; weights alike at +-127. Every activation row reaches `levels`, so per-token rounding keeps
    it as it is (scale 1). Sums stay below 2**24 (exact in fp32) for inner <= 1024.
    """
    generator = torch.Generator().manual_seed(seed)
    signs = torch.ones(4, inner)
    signs[1] = -1
    signs[2, 1::2] = -1
    signs[3, (torch.arange(inner) // 2) % 2 == 1] = -1
    x = torch.cat([signs * levels, torch.randint(-levels, levels + 1, (8, inner), generator=generator).float()])
    x[4:, 0] = levels  # every row at the limit: scale 1
    q = torch.cat([signs * 127, torch.randint(-127, 128, (8, inner), generator=generator).float()]).to(INT8)
    return x, q


def exactness_error(kernel: W8A8Kernel) -> float:
    """The largest |kernel - exact integer product| on the adversarial trial (0.0: exact), through the same
    `linear` the model runs; an exception from the kernel is an error too (inf)."""
    x, q = adversarial_trial(kernel.levels)
    scale = torch.ones(q.shape[0])
    exact = x.double() @ q.double().t()  # [12, 12]
    try:
        got = kernel.linear(x, kernel.pack(q, scale), scale)
    except (RuntimeError, NotImplementedError):
        return float("inf")
    return (got.double() - exact).abs().max().item()

