"""The precision policy: what every tensor of the model is held in and computed in, decided here only.

A `Precision` is parsed once from the user's string (`parse_precision`) and read by everything that
touches dtypes: the loader (`dtype_of`), the bundle writer (`storage_dtype_of`), the engine and the
command line (`PRECISION_CHOICES`). The model's modules take their dtypes from their weights, and the
numerical floor of the formulas (norms, RoPE and the delta rule in at least fp32) is `compute_dtype`.

    name               compute dtype        decoder projections          everything else in the decoder
    fp32 / bf16 / fp64 that dtype           that dtype                   that dtype, A_log / dt_bias in >= fp32
    int8-weight-only   fp32 (CPU), bf16 (CUDA)  int8 + fp32 scale / channel  as above; embeddings as stored
    int8-w8a8          fp32 (CPU), bf16 (CUDA)  int8, activations int8 per token

Always: the joint head in fp32 (it is small and decides the answer), the output-embedding rows it reads
as stored (gathered, never converted whole), the kept projections (`KEPT_HIGH_PRECISION`) never int8, and
the vision tower never int8 (under int8 it stays as released, in a bundle too). A new precision is one row in `PRECISIONS` (and, for a new int8 mode, a kernel in checkpoint/quant.py).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

FP64, FP32, BF16, FP16, INT8 = torch.float64, torch.float32, torch.bfloat16, torch.float16, torch.int8

# -- what is int8, and what never is -----------------------------------------------------------------

WEIGHT_ONLY, W8A8 = "weight-only", "w8a8"  # int8 weights dequantized to the compute dtype; int8 activations too
INT8_MODES = (WEIGHT_ONLY, W8A8)
DEFAULT_INT8_MODE = WEIGHT_ONLY
SCALE_SUFFIX = "_scale"  # `x.weight` (int8) is stored beside `x.weight_scale` (fp32 [out])
SCALE_DTYPE = FP32
# Calibrated outlier channels of a projection (checkpoint/outliers.py): their indices [n] and the weight's
# columns there [O, n], multiplied densely in fp32 beside the int8 product.
OUTLIER_CHANNELS, OUTLIER_WEIGHT = "outlier_channels", "outlier_weight"
OUTLIER_DTYPE = FP32
# The DeltaNet gate projections are tiny (hidden -> value heads) and feed a sigmoid and a softplus
# exponent: measured both ways (benchmarks/agreement.py), they stay 16-bit.
KEPT_HIGH_PRECISION = ("in_proj_a.weight", "in_proj_b.weight")
# The DeltaNet decay parameters are held in at least fp32, whatever the compute dtype (as transformers).
HIGH_PRECISION_PARAMETERS = ("A_log", "dt_bias")
# In W8A8, the projections that read a gated product (the MLP's down_proj, the DeltaNet's out_proj,
# attention's o_proj) keep int8 weights but 16/32-bit activations: their inputs are heavy-tailed per
# token, and per-token int8 there cost 1.5-2.5e-2 relative error each on the outlier release, 4 decisions
# of 75 where weight-only there gives 1 (benchmarks/agreement.py). They are a quarter to a third of the FLOPs.
W8A8_WEIGHT_ONLY = ("down_proj", "out_proj", "o_proj")
# ... unless two int8 digits per activation (~15 bits, checkpoint/w8a8.py) run them faster than their 2-byte dense
# form on this CPU: then they stay 1 byte a weight through the W8A8 kernel (`Plan.gated_mode`, `gated_mode_for`).
TWO_DIGITS = "w8a8-two-digit"
# ... or, where the CPU multiplies bf16 fast (AMX, AVX-512 BF16) and the 2-byte copies do not fit (compact): the int8
# weight widened to bf16 on every forward into one scratch buffer per shape (exact: |q| <= 127 is a bf16), the product
# in bf16, the per-channel scale applied to the output; 1 byte a weight. The widening is memory-bound: on E it cost
# 22-28% over the bf16 product at 272-370 tokens (down_proj and out_proj shapes), where two digits cost 2x; +5% on
# the 9B record (README).
BF16_SCRATCH = "weight-only-bf16-scratch"
SCRATCH_OVERHEAD = 1.3  # the widened product's time over the kept copy's, 272-370 tokens (E, measured)
LINEAR_MODES = (*INT8_MODES, TWO_DIGITS, BF16_SCRATCH)  # what an Int8Linear runs in
HEAD_DTYPE = FP32
BUNDLE_EMBEDDING_DTYPE = BF16  # input and output embeddings in an 8-bit bundle
# Core ML export (clef_flash/coreml/): the twins are traced in fp32; Core ML computes the decoder parts in
# fp16 on int8 weights (`is_quantized`'s tensors; the rest fp16), the head in fp32; the host's tables are fp16.
EXPORT_DTYPE = FP32
COREML_PART_DTYPE = FP16
COREML_HEAD_DTYPE = FP32
COREML_TABLE_DTYPE = FP16
# The op families (model/export.py, FAMILIES) the parts compute in fp32, everything else fp16: measured, each family
# alone in fp16 and alone kept in fp32 (tests/test_coreml_precision.py), only the DeltaNet's gated RMSNorm
# matters. It reads the delta rule's small outputs, and its overflow-safe form's eps / absmax^2 falls to fp16
# subnormals there: all in fp16 the twins err 1.75e-1 (tiny) and 7.8e-2 (9b-heads), with it in fp32 1.5e-3.
COREML_FP32_FAMILIES = ("gated_norm",)


def is_quantized(name: str, shape: tuple[int, ...], keep: tuple[str, ...] | None = None) -> bool:
    """The int8 predicate: 2-D decoder projection weights (`*_proj.weight`, `in_proj_*.weight`), except `keep`."""
    keep = KEPT_HIGH_PRECISION if keep is None else keep
    module, _, leaf = name.rpartition(".")
    projection = module.rpartition(".")[2]  # q_proj, down_proj, in_proj_qkv, in_proj_z, out_proj, ...
    is_projection = projection.endswith("_proj") or projection.startswith("in_proj_")
    return leaf == "weight" and is_projection and len(shape) == 2 and not name.endswith(keep)


def int8_mode_of(linear_name: str, mode: str, gated_mode: str = WEIGHT_ONLY, kernel: str | None = None) -> str:
    """The mode one projection runs in under `mode`: W8A8 runs W8A8_WEIGHT_ONLY in `gated_mode` (weight-only,
    or two int8 digits per activation); on a kernel with 7-bit activations (SEVEN_BIT_KERNELS), everything but
    SEVEN_BIT_ONE_DIGIT in two digits."""
    if mode != W8A8:
        return mode
    projection = linear_name.rpartition(".")[2]
    if kernel in SEVEN_BIT_KERNELS:
        return W8A8 if projection in SEVEN_BIT_ONE_DIGIT else TWO_DIGITS
    return gated_mode if projection in W8A8_WEIGHT_ONLY else mode


def is_scale(name: str) -> bool:
    return name.endswith(SCALE_SUFFIX)


def compute_dtype(*dtypes: torch.dtype) -> torch.dtype:
    """The dtype norms, RoPE and the delta rule compute in: fp32, or float64 when any input is float64."""
    out = FP32
    for dtype in dtypes:
        out = torch.promote_types(out, dtype)
    return out


# -- the policy --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Precision:
    """One way to run the model. `name` is what `Clef.precision` reports; `reason` says why it was chosen."""

    name: str
    compute_dtype: torch.dtype  # activations and 16/32-bit weights
    int8_mode: str | None = None  # None: no int8 weights
    reason: str = "asked for"
    # W8A8 only: its gated-product projections (W8A8_WEIGHT_ONLY) stay at 1 byte, in two int8 digits per
    # activation, even where a 2-byte dense copy is faster (the default takes this where the copies do not fit)
    compact: bool = False

    @property
    def quantized(self) -> bool:
        return self.int8_mode is not None

    def dtype_of(self, name: str, stored: torch.dtype) -> torch.dtype:
        """The dtype a decoder tensor (name relative to the decoder) is held in, given how it is stored."""
        leaf = name.rsplit(".", 1)[-1]
        if stored == INT8 or leaf == OUTLIER_CHANNELS:
            return stored  # int8 weights, int64 indices
        if leaf == OUTLIER_WEIGHT:
            return OUTLIER_DTYPE
        if is_scale(leaf):
            return SCALE_DTYPE
        if leaf in HIGH_PRECISION_PARAMETERS:
            return compute_dtype(self.compute_dtype)
        if self.quantized and name == "embed_tokens.weight":
            return stored  # rows are gathered from the (memory-mapped) table and cast per batch
        return self.compute_dtype

    @staticmethod
    def head_dtype_of(name: str, stored: torch.dtype) -> torch.dtype:
        return HEAD_DTYPE

    @staticmethod
    def lm_head_dtype(stored: torch.dtype) -> torch.dtype:
        return stored  # the head gathers the option tokens' rows and casts them itself

    def vision_dtype(self, stored: torch.dtype) -> torch.dtype:
        """The vision tower (`model.visual.*`): the float precision's dtype; under int8 it stays as released
        (not quantized, not measured safe to; an int8 bundle stores it as released)."""
        return stored if self.quantized else self.compute_dtype

    def on(self, device: torch.device) -> Precision:
        """The same precision for a device: int8 computes in fp32 on CPU and in bf16 on CUDA."""
        if not self.quantized:
            return self
        return dataclasses.replace(self, compute_dtype=BF16 if device.type == "cuda" else FP32)

    def with_reason(self, reason: str) -> Precision:
        return dataclasses.replace(self, reason=reason)


def storage_dtype_of(name: str, shape: tuple[int, ...], stored: torch.dtype, *, part: str) -> torch.dtype:
    """The dtype an 8-bit bundle stores a tensor in. `part`: decoder, embeddings, lm_head, head or vision."""
    if part == "head":
        return HEAD_DTYPE
    if part == "vision":
        return stored  # the vision tower, as released
    if part in ("embeddings", "lm_head"):
        return BUNDLE_EMBEDDING_DTYPE
    if is_quantized(name, shape):
        return INT8
    if name.endswith(OUTLIER_WEIGHT):
        return OUTLIER_DTYPE
    return SCALE_DTYPE if is_scale(name) else stored


PRECISIONS: dict[str, Precision] = {
    "fp32": Precision("fp32", FP32),
    "bf16": Precision("bf16", BF16),
    "fp64": Precision("fp64", FP64),
    **{f"int8-{mode}": Precision(f"int8-{mode}", FP32, mode) for mode in INT8_MODES},
}
ALIASES = {"int8": f"int8-{DEFAULT_INT8_MODE}"}
# W8A8 at 1 byte a weight throughout, asked for: what the default takes where the 2-byte copies do not fit
# (9B bundle: ~7.7 GB peak instead of ~9.6; on Zen 4 within 2% of the copies' time, on AMX (E) 5% slower)
COMPACT_CHOICE = "int8-w8a8-compact"
# The Core ML packages run as exported: 8-bit weights, fp16 compute (not a choice: never in PRECISION_CHOICES).
COREML_PRECISION = Precision("coreml-int8-fp16", COREML_PART_DTYPE, WEIGHT_ONLY, reason="the Core ML packages: 8-bit weights, fp16 compute")
# What `--precision` and `load(precision=...)` accept: the plain precisions, the aliases, the int8 modes.
PRECISION_CHOICES = (
    *(name for name, value in PRECISIONS.items() if not value.quantized),
    *ALIASES,
    *(name for name, value in PRECISIONS.items() if value.quantized),
    COMPACT_CHOICE,
)


def parse_precision(text: str) -> Precision:
    """A precision by name (`PRECISION_CHOICES`); a clear error for any other."""
    if text == COMPACT_CHOICE:
        return dataclasses.replace(PRECISIONS["int8-w8a8"], compact=True)
    name = ALIASES.get(text, text)
    if name not in PRECISIONS:
        raise ValueError(f"unknown precision {text!r}: use one of {', '.join(PRECISION_CHOICES)}")
    return PRECISIONS[name]


TORCH, COREML = "torch", "coreml"
BACKENDS = (TORCH, COREML)


@dataclass(frozen=True)
class Plan:
    """How a model runs (resolved once by plan.py's `resolve`). `key` is the whole plan: what the state cache's identity includes."""

    precision: Precision
    device: torch.device
    kernel: str | None = None  # the W8A8 kernel (checkpoint/w8a8.py); None unless W8A8 on a CPU
    dense_dtype: torch.dtype | None = None  # W8A8's weight-only projections; None: tile by tile per forward
    backend: str = TORCH
    gated_mode: str = WEIGHT_ONLY  # how W8A8 runs W8A8_WEIGHT_ONLY: weight-only (dense_dtype), TWO_DIGITS or BF16_SCRATCH

    @property
    def name(self) -> str:
        return self.precision.name

    @property
    def reason(self) -> str:
        return self.precision.reason

    @property
    def compute_dtype(self) -> torch.dtype:
        return self.precision.compute_dtype

    @property
    def int8_mode(self) -> str | None:
        return self.precision.int8_mode

    @property
    def key(self) -> str:
        return "|".join(
            map(str, (self.backend, self.name, self.compute_dtype, self.int8_mode, self.kernel, self.gated_mode, self.dense_dtype, self.device))
        )

    def describe(self) -> dict[str, Any]:
        """What `info`, `/health` and `Clef.plan` show."""
        return {
            "backend": self.backend,
            "precision": self.name,
            "compute_dtype": str(self.compute_dtype).removeprefix("torch."),
            "int8_mode": self.int8_mode,
            "kernel": self.kernel,
            "gated_mode": self.gated_mode if self.int8_mode == W8A8 else None,
            "one_digit": self.one_digit,
            "dense_dtype": str(self.dense_dtype).removeprefix("torch.") if self.dense_dtype is not None else None,
            "device": str(self.device),
            "reason": self.reason,
        }

    @property
    def one_digit(self) -> str | None:
        """Under W8A8, which projections take their activations in one int8 digit (`int8_mode_of`)."""
        if self.int8_mode != W8A8:
            return None
        if self.kernel in SEVEN_BIT_KERNELS:
            return ", ".join(SEVEN_BIT_ONE_DIGIT) + " (7-bit activations; the rest in two digits)"
        return "all but " + ", ".join(W8A8_WEIGHT_ONLY)

    def with_reason(self, reason: str) -> Plan:
        return dataclasses.replace(self, precision=self.precision.with_reason(reason))


# -- the default: the fastest qualified path on this machine -------------------------------------------

# Qualified: agrees with fp32 at least as well as the reference's own bf16 path (no more decisions
# differing, median |dp| at most 2x its) on the plain and the outlier-injected random releases
# (benchmarks/agreement.py; README "Numbers"). Per-token W8A8 without calibrated outlier channels fails on outliers.
# A release may also run int8 weight-only, quantized while loading: the same numbers as an uncalibrated bundle,
# qualified as one; the default takes it only where a dense copy does not fit in memory (it is slower than fp32).
QUALIFIED_RELEASE = ("fp32", "bf16", "int8-weight-only")
QUALIFIED_BUNDLE = ("int8-weight-only",)
QUALIFIED_CALIBRATED_BUNDLE = ("int8-w8a8", "int8-weight-only")
# On a kernel that rounds activations to 7 bits (FBGEMM's, checkpoint/w8a8.py; the only exact one on AVX2-only CPUs),
# W8A8 with 7-bit activations at every projection but the gated products did not qualify: 2 decisions differing
# where the reference's bf16 had 1 (plain release), median |dp| 1.9x the reference's (outliers). Measured family by
# family (benchmarks/agreement.py, two seeds; exact kernels, so the figures hold on every CPU), only the MLP's inputs
# keep the bundle's int8 weight-only decisions in 7 bits: there W8A8 runs one 7-bit digit at SEVEN_BIT_ONE_DIGIT
# and two (13 bits, ~weight-only's numbers) at every other projection; calibrated bundles only (without the outlier
# channels the MLP's 7-bit inputs flip 5 decisions of 60 on the outlier release).
SEVEN_BIT_KERNELS = ("fbgemm",)
SEVEN_BIT_ONE_DIGIT = ("gate_proj", "up_proj")
SEVEN_BIT_ONE_DIGIT_SHARE = 0.47  # of a 9B layer block's projection FLOPs, those of SEVEN_BIT_ONE_DIGIT
W8A8_INT8_SHARE = 0.69  # of a 9B layer block's projection FLOPs, those W8A8 runs in int8 (the rest: W8A8_WEIGHT_ONLY)
WEIGHT_ONLY_OVERHEAD = 1.15  # dequantizing tiles costs ~15% over the fp32 product it feeds (measured)
ENVIRONMENT = "CLEF_FLASH_PRECISION"


class Rates(Protocol):
    """The probe's figures (machine.Rates): G(FL)OP/s of one decoder-sized product."""

    fp32: float
    bf16: float
    int8: float
    int8_kernel: str | None  # W8A8's kernel: the fastest exact one with 8-bit activations, else the fastest exact
    # one (SEVEN_BIT_KERNELS: W8A8 then runs most projections in two digits, `int8_mode_of`); None: none is exact here
    excluded: dict[str, str]
    fp16_packed: float  # FBGEMM's fp16-packed linear (fp32 arithmetic, 2 bytes a weight); 0.0: not in this build
    two_digit: float  # the fastest exact kernel with two int8 digits per activation (effective rate); 0.0: none


# W8A8's weight-only projections (W8A8_WEIGHT_ONLY) hold their weight once in a 2-byte form: bf16 where the
# CPU multiplies bf16 fast (AMX, AVX-512 BF16); elsewhere FBGEMM's fp16-packed weights with fp32 arithmetic
# (PACKED_FP16: fp16 is only the storage, never the arithmetic); without FBGEMM, int8 dequantized tile by tile.
PACKED_FP16 = FP16


def dense_dtype_for(rates: Rates) -> torch.dtype | None:
    """The form of W8A8's weight-only projections on this CPU (see PACKED_FP16); never an fp32 copy."""
    if rates.bf16 > 2 * rates.fp32:
        return BF16
    return PACKED_FP16 if rates.fp16_packed > 0 else None


def dense_gated_rate(rates: Rates) -> float:
    """The probe's rate of W8A8's gated products in their weight-only form (`dense_dtype_for`)."""
    dense = dense_dtype_for(rates)
    return rates.bf16 if dense == BF16 else rates.fp16_packed if dense == PACKED_FP16 else weight_only_rate(rates)


def gated_mode_for(rates: Rates, *, compact: bool = False) -> str:
    """How W8A8 runs its gated products here. Where bf16 is fast (AMX, AVX-512 BF16): a kept bf16 copy, or when
    `compact` the int8 weight widened to bf16 per forward (BF16_SCRATCH); int8 runs at most twice bf16's peak there,
    so two int8 products are one of bf16 at best (on E the 9B record took 14-23% longer in two digits). Elsewhere:
    two int8 digits (1 byte a weight) where `compact`, or where their 2-byte form computes in fp32 (fp16-packed,
    tiles) and the probe measured two digits at least as fast; else weight-only."""
    if rates.two_digit > 0 and rates.int8_kernel in SEVEN_BIT_KERNELS:  # (a 7-bit kernel: `int8_mode_of`)
        return TWO_DIGITS
    if dense_dtype_for(rates) == BF16:
        return BF16_SCRATCH if compact else WEIGHT_ONLY
    if rates.two_digit <= 0:
        return WEIGHT_ONLY
    if compact:
        return TWO_DIGITS
    return TWO_DIGITS if rates.two_digit >= dense_gated_rate(rates) else WEIGHT_ONLY


def gated_rate(rates: Rates, *, compact: bool = False) -> float:
    """The probe's rate of W8A8's gated products in the form `gated_mode_for` gives them."""
    mode = gated_mode_for(rates, compact=compact)
    if mode == TWO_DIGITS:
        return rates.two_digit
    if mode == BF16_SCRATCH:
        return rates.bf16 / SCRATCH_OVERHEAD
    return weight_only_rate(rates) if compact else dense_gated_rate(rates)  # compact: dequantized tile by tile


# Bytes a decoder parameter takes in memory, by precision (int8: the weight and its scales; W8A8: its
# weight-only share held in a 2-byte form, unless `gated_mode_for` runs it in two digits; compact W8A8
# (Precision.compact): 1 byte throughout). What the default checks against the machine's memory.
COMPACT_W8A8 = "int8-w8a8 compact"  # a candidate of the default, run as int8-w8a8 with compact=True
BYTES_PER_PARAMETER = {"fp64": 8.0, "fp32": 4.0, "bf16": 2.0, "int8-weight-only": 1.0, "int8-w8a8": 1.35, COMPACT_W8A8: 1.0}
MEMORY_SHARE = 0.8  # of the memory available when loading, what the model's weights may take


def weight_only_rate(measured: Rates) -> float:
    """int8 weight-only's rate: the fp32 product, plus dequantizing its tiles."""
    return measured.fp32 / WEIGHT_ONLY_OVERHEAD


def w8a8_rate(measured: Rates, *, compact: bool = False) -> float:
    """W8A8's rate: the int8 kernel for the int8 share of the FLOPs, the gated products' form
    (`gated_mode_for`) for W8A8_WEIGHT_ONLY; 0 where no kernel is exact."""
    if measured.int8_kernel is None or measured.int8 <= 0:
        return 0.0
    if measured.int8_kernel in SEVEN_BIT_KERNELS:  # one 7-bit digit at SEVEN_BIT_ONE_DIGIT, two elsewhere
        if measured.two_digit <= 0:
            return 0.0
        return 1 / (SEVEN_BIT_ONE_DIGIT_SHARE / measured.int8 + (1 - SEVEN_BIT_ONE_DIGIT_SHARE) / measured.two_digit)
    return 1 / (W8A8_INT8_SHARE / measured.int8 + (1 - W8A8_INT8_SHARE) / gated_rate(measured, compact=compact))


def w8a8_bytes(measured: Rates) -> float:
    """Bytes a parameter takes under the default's W8A8: 1 where its gated products run in two digits."""
    return BYTES_PER_PARAMETER[COMPACT_W8A8 if gated_mode_for(measured) == TWO_DIGITS else "int8-w8a8"]


def w8a8_kernel(measured: Rates) -> str:
    """The kernel a CPU runs W8A8 on: the probe's fastest exact one, or a one-line refusal that says why."""
    if measured.int8_kernel is None:
        reasons = "; ".join(f"{name}: {why}" for name, why in measured.excluded.items())
        raise ValueError(f"int8-w8a8 cannot run on this CPU: no W8A8 kernel is exact here ({reasons}); use int8-weight-only")
    return measured.int8_kernel


def qualified(*, stored_int8: bool, calibrated: bool) -> tuple[str, ...]:
    if not stored_int8:
        return QUALIFIED_RELEASE
    return QUALIFIED_CALIBRATED_BUNDLE if calibrated else QUALIFIED_BUNDLE


def choose_precision(
    device: torch.device,
    *,
    stored_int8: bool,
    calibrated: bool,
    rates: Callable[[], Rates],
    parameters: int | None = None,
    memory_bytes: int | None = None,
) -> Precision:
    """The fastest qualified precision that fits: on CUDA bf16 (or an 8-bit bundle's weight-only); on a CPU
    by the probe, among those whose weights (`parameters` x BYTES_PER_PARAMETER) fit in MEMORY_SHARE of
    `memory_bytes` (None: no bound). Nothing fitting is a one-line error with the sizes."""
    candidates = qualified(stored_int8=stored_int8, calibrated=calibrated)
    if device.type != "cpu":
        name = "bf16" if not stored_int8 else "int8-weight-only"
        return PRECISIONS[name].with_reason(f"on {device.type}: {name} until an 8-bit path qualifies there")
    measured = rates()
    seven_bit = measured.int8_kernel in SEVEN_BIT_KERNELS
    if seven_bit and measured.two_digit <= 0:  # 7-bit activations throughout: not qualified
        candidates = tuple(name for name in candidates if name != "int8-w8a8")
    if "int8-w8a8" in candidates and gated_mode_for(measured) != TWO_DIGITS:
        # its 1-byte form (gated products in two digits), right after it: chosen when the 2-byte copies do not fit
        at = candidates.index("int8-w8a8") + 1
        candidates = (*candidates[:at], COMPACT_W8A8, *candidates[at:])
    rate = {
        "fp32": measured.fp32,
        "bf16": measured.bf16,
        # int8 for the int8 share of the FLOPs, the dense product (bf16 or fp32) for W8A8_WEIGHT_ONLY
        "int8-w8a8": w8a8_rate(measured),
        COMPACT_W8A8: w8a8_rate(measured, compact=True),
        "int8-weight-only": weight_only_rate(measured),
    }
    bytes_per_parameter = {**BYTES_PER_PARAMETER, "int8-w8a8": w8a8_bytes(measured)}
    needs = {name: (parameters or 0) * bytes_per_parameter[name] for name in candidates}
    room = None if memory_bytes is None or not parameters else MEMORY_SHARE * memory_bytes
    fitting_ones = [name for name in candidates if room is None or needs[name] <= room]
    if "int8-w8a8" in fitting_ones and COMPACT_W8A8 in fitting_ones:  # compact only where the copies do not fit
        fitting_ones.remove(COMPACT_W8A8)
    if not fitting_ones:
        sizes = ", ".join(f"{name} {needs[name] / 2**30:.1f} GiB" for name in candidates)
        raise ValueError(
            f"no qualified precision fits this machine's memory: {sizes} of weights, {room / 2**30:.1f} GiB usable "
            f"({MEMORY_SHARE:.0%} of {memory_bytes / 2**30:.1f} GiB available); free memory, or use a machine with more"
        )
    best = max(fitting_ones, key=lambda name: (rate[name], -candidates.index(name)))
    shown = [name for name in candidates if name != COMPACT_W8A8 or best == COMPACT_W8A8]  # the 1-byte form when it counts
    figures = ", ".join(f"{name} {rate[name]:.0f}" for name in shown)
    kernel = f" ({measured.int8_kernel})" if best in ("int8-w8a8", COMPACT_W8A8) else ""
    reason = f"fastest qualified on this CPU{kernel}; probe G(FL)OP/s: {figures}"
    if seven_bit and "int8-w8a8" not in candidates and stored_int8 and calibrated:
        reason += f"; int8-w8a8 left out: its kernel here ({measured.int8_kernel}) rounds activations to 7 bits and has no two-digit rate"
    left_out = [name for name in shown if name not in fitting_ones]
    if left_out:
        reason += "; too big for memory: " + ", ".join(f"{name} {needs[name] / 2**30:.1f} GiB" for name in left_out)
        reason += f" of {room / 2**30:.1f} GiB usable"
    if best == "int8-w8a8" and seven_bit:
        reason += (
            f"; 7-bit activations: one int8 digit at {', '.join(SEVEN_BIT_ONE_DIGIT)} ({measured.int8:.0f}), two at every other "
            f"projection ({measured.two_digit:.0f}): 1 byte a weight"
        )
    elif best == "int8-w8a8" and gated_mode_for(measured) == TWO_DIGITS:
        reason += (
            f"; its gated products in two int8 digits ({measured.two_digit:.0f}, against {dense_gated_rate(measured):.0f} "
            "for a 2-byte copy): 1 byte a weight"
        )
    if best == COMPACT_W8A8:
        form = {
            TWO_DIGITS: "in two int8 digits per activation",
            BF16_SCRATCH: "widened to bf16 per forward",
        }.get(gated_mode_for(measured, compact=True), "dequantized tile by tile")
        reason += f"; compact: W8A8's gated products stay 1 byte, {form}"
        return dataclasses.replace(PRECISIONS["int8-w8a8"], compact=True, reason=reason)
    return PRECISIONS[best].with_reason(reason)


def resolve_precision(
    requested: str | None,
    device: torch.device,
    *,
    stored_int8: bool,
    calibrated: bool = False,
    rates: Callable[[], Rates] | None = None,
    parameters: int | None = None,
    memory_bytes: int | None = None,
) -> Precision:
    """The precision to run: `requested`, else $CLEF_FLASH_PRECISION, else the fastest qualified one
    (`rates` gives the machine's probe), checked against what the checkpoint stores."""
    if requested is None and os.environ.get(ENVIRONMENT):
        precision = parse_precision(os.environ[ENVIRONMENT]).with_reason(f"${ENVIRONMENT}")
    elif requested is None:
        if rates is None:
            raise ValueError("choosing a precision needs the machine's rates")
        precision = choose_precision(
            device, stored_int8=stored_int8, calibrated=calibrated, rates=rates, parameters=parameters, memory_bytes=memory_bytes
        )
    else:
        precision = parse_precision(requested)
    if stored_int8 and not precision.quantized:
        int8_names = [name for name, value in PRECISIONS.items() if value.quantized]
        raise ValueError(
            f"is an 8-bit bundle: use precision int8 (or {', '.join(int8_names)}); "
            f"for {precision.name}, load the release it was converted from"
        )
    return precision.on(device)
