"""The precision policy: what every tensor of the model is held in and computed in, decided here only.

A `Precision` is parsed once from the user's string (`parse_precision`) and read by everything that
touches dtypes: the loader (`dtype_of`), the bundle writer (`storage_dtype_of`), the engine and the
command line (`PRECISION_CHOICES`). The model's modules take their dtypes from their weights, and the
numerical floor of the formulas (norms, RoPE and the delta rule in at least fp32) is `compute_dtype`.

    name               compute dtype        decoder projections          everything else in the decoder
    fp32 / bf16 / fp64 that dtype           that dtype                   that dtype, A_log / dt_bias in >= fp32
    int8-weight-only   fp32 (CPU), bf16 (CUDA)  int8 + fp32 scale / channel  as above; embeddings as stored
    int8-w8a8          fp32 (CPU), bf16 (CUDA)  int8, activations int8 per token (7 bits on FBGEMM)
    fp8 (opt-in)       fp32 (CPU), bf16 (CUDA)  e4m3 + fp32 scale / channel, activations e4m3 per token

Both int8 modes hold one scheme (checkpoint/quant.py): each projection's input divided by its norm's scale
(`smoothing_of`) and rotated by a fixed randomized Hadamard transform (checkpoint/rotation.py), the weight
likewise, so that no few channels set a token's int8 scale. `fp8` is plain row-wise e4m3 (what GPU servers ship,
torch._scaled_mm), never a default: measured, it flips more decisions than the int8 scheme (README "Numbers").

Always: the joint head in fp32 (it is small and decides the answer), the output-embedding rows it reads
as stored (gathered, never converted whole), the kept projections (`KEPT_HIGH_PRECISION`) never int8, and
the vision tower never int8 (under int8 it stays as released, in a bundle too). A new precision is one row in `PRECISIONS` (and, for a new int8 mode, a kernel in checkpoint/quant.py).
What carries a precision through the runtime, with its W8A8 kernel, device and backend, is plan.py's `Plan`.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

FP64, FP32, BF16, FP16, INT8 = torch.float64, torch.float32, torch.bfloat16, torch.float16, torch.int8
FP8 = torch.float8_e4m3fn  # the fp8 precision's weights and activations (max 448)

# -- what is int8, and what never is -----------------------------------------------------------------

WEIGHT_ONLY, W8A8 = "weight-only", "w8a8"  # int8 weights dequantized to the compute dtype; int8 activations too
INT8_MODES = (WEIGHT_ONLY, W8A8)
DEFAULT_INT8_MODE = WEIGHT_ONLY
FP8_MODE = "fp8"  # the 8-bit mode of the fp8 precision: e4m3 weights per channel, e4m3 activations per token
SCALE_SUFFIX = "_scale"  # `x.weight` (int8) is stored beside `x.weight_scale` (fp32 [out])
SCALE_DTYPE = FP32
# The DeltaNet gate projections are tiny (hidden -> value heads) and feed a sigmoid and a softplus
# exponent: measured both ways (benchmarks/agreement.py), they stay 16-bit.
KEPT_HIGH_PRECISION = ("in_proj_a.weight", "in_proj_b.weight")
# The DeltaNet decay parameters are held in at least fp32, whatever the compute dtype (as transformers).
HIGH_PRECISION_PARAMETERS = ("A_log", "dt_bias")
TWO_DIGITS = "w8a8-two-digit"  # W8A8 with each activation in two int8 digits (checkpoint/w8a8.py)
INT8_SCHEME_VERSION = 2  # 1: plain per-channel int8 (+ calibrated outlier channels); 2: smoothed and rotated
SMOOTHING_SUFFIX = "input_smoothing"  # `x.input_smoothing` fp32 [I]: the scale `x`'s input was multiplied by
HEAD_DTYPE = FP32
BUNDLE_EMBEDDING_DTYPE = BF16  # input and output embeddings in an 8-bit bundle
# Core ML export (clef_flash/coreml/): the twins are traced in fp32; Core ML computes the decoder parts in
# fp16 on int8 weights (`is_quantized`'s tensors; the rest fp16), the head in fp32; the host's tables are fp16.
EXPORT_DTYPE = FP32
COREML_PART_DTYPE = FP16
COREML_HEAD_DTYPE = FP32
COREML_TABLE_DTYPE = FP16
# The op families (model/export.py, FAMILIES) the parts compute in fp32, everything else fp16: measured, each family
# alone in fp16 and alone kept in fp32 (tests/test_coreml.py, test_fp16_twin_error_per_part_and_op_family), only the
# DeltaNet's gated RMSNorm matters. It reads the delta rule's small outputs, and its overflow-safe form's
# eps / absmax^2 falls to fp16 subnormals there: all in fp16 the twins err 1.75e-1 (tiny) and 7.8e-2 (9b-heads),
# with it in fp32 1.5e-3.
COREML_FP32_FAMILIES = ("gated_norm",)


def is_quantized(name: str, shape: tuple[int, ...], keep: tuple[str, ...] | None = None) -> bool:
    """The int8 predicate: 2-D decoder projection weights (`*_proj.weight`, `in_proj_*.weight`), except `keep`."""
    keep = KEPT_HIGH_PRECISION if keep is None else keep
    module, _, leaf = name.rpartition(".")
    projection = module.rpartition(".")[2]  # q_proj, down_proj, in_proj_qkv, in_proj_z, out_proj, ...
    is_projection = projection.endswith("_proj") or projection.startswith("in_proj_")
    return leaf == "weight" and is_projection and len(shape) == 2 and not name.endswith(keep)


# Smoothing (the int8 scheme, checkpoint/quant.py): a projection that reads a norm's output takes its input divided by
# s = |g| ** SMOOTHING_EXPONENT (g: that norm's per-channel scale) and its weight's columns multiplied by s
# (x W^T = (x / s)(W diag(s))^T): half of the norm's large channels (activation outliers, mostly made there) moves to
# the weight, from the weights alone, no calibration. Measured (benchmarks/agreement.py, 9b-heads-outliers): all of g
# (exponent 1) flipped more decisions than none, half fewest. Projection -> (its norm's parameter relative to the
# layer, whether the norm scales by 1 + w).
SMOOTHING_EXPONENT = 0.5
SMOOTHED_BY = {
    "self_attn.q_proj": ("input_layernorm.weight", True),
    "self_attn.k_proj": ("input_layernorm.weight", True),
    "self_attn.v_proj": ("input_layernorm.weight", True),
    "linear_attn.in_proj_qkv": ("input_layernorm.weight", True),
    "linear_attn.in_proj_z": ("input_layernorm.weight", True),
    "mlp.gate_proj": ("post_attention_layernorm.weight", True),
    "mlp.up_proj": ("post_attention_layernorm.weight", True),
}

# On a kernel with 7-bit activations (FBGEMM, the only exact one of AVX2-only CPUs) one digit qualifies at the
# projections that read a norm (smoothed: q/k/v, in_proj_qkv/z, gate/up); down_proj, o_proj and out_proj, whose
# inputs no norm evens out, take two (benchmarks/int8_schemes.py: one digit there too flips decisions). The one-digit
# ones are 69% of the 9B's int8 multiply-adds.
SEVEN_BIT_ONE_DIGIT = tuple(name.rpartition(".")[2] for name in SMOOTHED_BY)
SEVEN_BIT_ONE_DIGIT_SHARE = 0.69


def w8a8_digits(linear_name: str, activation_bits: int) -> int:
    """How many int8 digits per activation a projection takes under W8A8 on a kernel with `activation_bits`."""
    return 1 if activation_bits >= 8 or linear_name.rpartition(".")[2] in SEVEN_BIT_ONE_DIGIT else 2


def smoothing_of(weight_name: str) -> tuple[str, bool] | None:
    """A quantized projection's weight name (any prefix, `...layers.N.<projection>.weight`) -> (the name of the norm
    weight its input is smoothed by, whether that norm scales by 1 + w); None: not smoothed (o_proj, down_proj)."""
    layer, marker, rest = weight_name.rpartition("layers.")
    index, _, projection = rest.partition(".")
    entry = SMOOTHED_BY.get(projection.removesuffix(".weight")) if marker and index.isdigit() else None
    return None if entry is None else (f"{layer}layers.{index}.{entry[0]}", entry[1])


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
    int8_mode: str | None = None  # the 8-bit mode (INT8_MODES, or FP8_MODE); None: no 8-bit weights
    reason: str = "asked for"

    @property
    def quantized(self) -> bool:
        return self.int8_mode is not None

    @property
    def int8(self) -> bool:
        """The int8 scheme (what an 8-bit bundle stores), as opposed to fp8."""
        return self.int8_mode in INT8_MODES

    def dtype_of(self, name: str, stored: torch.dtype) -> torch.dtype:
        """The dtype a decoder tensor (name relative to the decoder) is held in, given how it is stored."""
        leaf = name.rsplit(".", 1)[-1]
        if stored in (INT8, FP8):
            return stored
        if is_scale(leaf) or leaf == SMOOTHING_SUFFIX:
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
        """The same precision for a device: int8 and fp8 compute in fp32 on CPU and in bf16 on CUDA."""
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
    return SCALE_DTYPE if is_scale(name) or name.endswith(SMOOTHING_SUFFIX) else stored


PRECISIONS: dict[str, Precision] = {
    "fp32": Precision("fp32", FP32),
    "bf16": Precision("bf16", BF16),
    "fp64": Precision("fp64", FP64),
    **{f"int8-{mode}": Precision(f"int8-{mode}", FP32, mode) for mode in INT8_MODES},
    "fp8": Precision("fp8", FP32, FP8_MODE),  # opt-in, never QUALIFIED: row-wise e4m3 (checkpoint/quant.py Fp8Linear)
}
ALIASES = {"int8": f"int8-{DEFAULT_INT8_MODE}"}
# The Core ML packages run as exported: 8-bit weights, fp16 compute (not a choice: never in PRECISION_CHOICES).
COREML_PRECISION = Precision("coreml-int8-fp16", COREML_PART_DTYPE, WEIGHT_ONLY, reason="the Core ML packages: 8-bit weights, fp16 compute")
# What `--precision` and `load(precision=...)` accept: the plain precisions, the aliases, the int8 modes.
PRECISION_CHOICES = (
    *(name for name, value in PRECISIONS.items() if not value.quantized),
    *ALIASES,
    *(name for name, value in PRECISIONS.items() if value.quantized),
)


def parse_precision(text: str) -> Precision:
    """A precision by name (`PRECISION_CHOICES`); a clear error for any other."""
    name = ALIASES.get(text, text)
    if name not in PRECISIONS:
        raise ValueError(f"unknown precision {text!r}: use one of {', '.join(PRECISION_CHOICES)}")
    return PRECISIONS[name]


# -- the default: the fastest qualified path on this machine -------------------------------------------

# Qualified: agrees with fp32 at least as well as the reference's own bf16 path on the plain and the outlier-injected
# random releases, two seeds each (no more decisions differing, median |dp| at most 1.5x its; benchmarks/agreement.py
# and int8_schemes.py; README "Numbers"). Exact kernels: the figures hold on any CPU. The smoothed and rotated int8
# scheme (checkpoint/quant.py) qualifies without calibration in weight-only and in W8A8 with 8-bit activations: one
# int8 product per projection, 1 byte a weight. With 7-bit integers on either side (FBGEMM, the only exact kernel of
# AVX2-only CPUs) one product per projection did not (4 to 8 decisions differing where the reference's bf16 had 2,
# median |dp| 2-3x); one 7-bit digit where a norm is read and two at down/o/out (`w8a8_digits`) did (4 flips where the
# reference's bf16 had 5, median |dp| at most 1.34x its). A release quantizes while loading.
QUALIFIED = ("fp32", "bf16", "int8-w8a8", "int8-weight-only")
WEIGHT_ONLY_OVERHEAD = 1.15  # dequantizing tiles costs ~15% over the fp32 product it feeds (measured)
ENVIRONMENT = "CLEF_FLASH_PRECISION"


class Rates(Protocol):
    """The probe's figures (machine.Rates): G(FL)OP/s of one decoder-sized product."""

    fp32: float
    bf16: float
    int8: float  # W8A8 as a projection runs it (smoothing, rotation and activation quantization included)
    int8_kernel: str | None  # W8A8's kernel: the fastest exact one with 8-bit activations, else the fastest exact one
    int8_bits: int  # its activation bits (7 on FBGEMM; 0: no kernel is exact here)
    excluded: dict[str, str]


class Gpu(Protocol):
    """A CUDA device as the default reads it (machine.Gpu)."""

    name: str
    capability: tuple[int, int]  # (major, minor): 9.0 is sm_90


# int8 tensor cores through cuBLASLt (torch._int_mm): compute capability 8.0 (Ampere) and newer. Turing (7.5) has int8
# tensor cores too, but _int_mm there is unproven: not assumed.
INT8_TENSOR_CORES = (8, 0)
CUDA_W8A8_KERNEL, CUDA_W8A8_BITS = "int_mm", 8  # checkpoint/w8a8.py's INT_MM: 8-bit activations, exact int32 sums


# Bytes a decoder projection's parameter takes in memory, by precision (int8: the weight and its scales). What the
# default checks against the machine's memory, with `WeightCounts` for the rest of the model.
BYTES_PER_PARAMETER = {"fp64": 8.0, "fp32": 4.0, "bf16": 2.0, "int8-weight-only": 1.0, "int8-w8a8": 1.0, "fp8": 1.0}
MEMORY_SHARE = 0.8  # of the memory available when loading, what the model's weights may take
RELEASED_BYTES = 2  # a release's 16-bit tensors: the vision tower stays so under int8


@dataclass(frozen=True)
class WeightCounts:
    """A checkpoint's parameters by how a precision holds them in memory (`bytes_in`): what the default weighs
    against the machine's memory. The output embeddings are not counted: only their option rows are ever read."""

    projections: int = 0  # the decoder's 2-D projections (`is_quantized`): a byte under int8, else the compute dtype's
    embeddings: int = 0  # the input embeddings: gathered by row from the memory map under int8, else held whole
    vision: int = 0  # the vision tower (when it is loaded): as released under int8, else the compute dtype's
    head: int = 0  # the joint head: always fp32
    other: int = 0  # norms, convolutions, the kept gate projections, A_log: the compute dtype's

    @property
    def total(self) -> int:
        return self.projections + self.embeddings + self.vision + self.head + self.other

    def bytes_in(self, name: str) -> float:
        """The bytes these weights take in memory in precision `name` on a CPU (int8 computes in fp32 there)."""
        precision = PRECISIONS[name]
        compute = precision.compute_dtype.itemsize
        held = {
            "projections": BYTES_PER_PARAMETER[name],
            "embeddings": 0 if precision.quantized else compute,
            "vision": RELEASED_BYTES if precision.quantized else compute,
            "head": HEAD_DTYPE.itemsize,
            "other": compute,
        }
        return sum(getattr(self, part) * size for part, size in held.items())


class TooBig(ValueError):
    """No qualified precision fits the machine's memory whole (the message has the sizes): where plan.py streams."""


def weight_only_rate(measured: Rates) -> float:
    """int8 weight-only's rate: the fp32 product, plus dequantizing its tiles."""
    return measured.fp32 / WEIGHT_ONLY_OVERHEAD


def w8a8_kernel(measured: Rates) -> str:
    """The kernel a CPU runs W8A8 on: the probe's fastest exact one, or a one-line refusal that says why."""
    if measured.int8_kernel is None:
        reasons = "; ".join(f"{name}: {why}" for name, why in measured.excluded.items())
        raise ValueError(f"int8-w8a8 cannot run on this CPU: no W8A8 kernel is exact here ({reasons}); use int8-weight-only")
    return measured.int8_kernel


def qualified(*, stored_int8: bool) -> tuple[str, ...]:
    return tuple(name for name in QUALIFIED if PRECISIONS[name].quantized or not stored_int8)


def choose_on_gpu(device: torch.device, found: Gpu | None, *, stored_int8: bool) -> Precision:
    """On CUDA: int8-w8a8 on int8 tensor cores (`INT8_TENSOR_CORES`), which keeps the scheme's agreement (exact int32
    sums, as on a CPU); without them bf16, or an 8-bit bundle's weight-only. `found`: the device (None: unknown)."""
    cores = found is not None and tuple(found.capability) >= INT8_TENSOR_CORES
    name = "int8-w8a8" if cores else "int8-weight-only" if stored_int8 else "bf16"
    if found is None:
        return PRECISIONS[name].with_reason(f"on {device.type}: {name}; its compute capability unknown, no int8 tensor cores assumed")
    where = f"on {device.type} ({found.name}, sm_{found.capability[0]}{found.capability[1]})"
    floor = f"sm_{INT8_TENSOR_CORES[0]}{INT8_TENSOR_CORES[1]}"
    if cores:
        reason = f"{where}: int8-w8a8 on int8 tensor cores (torch._int_mm), the scheme's agreement; "
        reason += "int8-weight-only without them" if stored_int8 else "bf16 without them"
        if not stored_int8:
            reason += "; quantized while loading (`clef-flash convert` writes it once, to load in seconds)"
        return PRECISIONS[name].with_reason(reason)
    return PRECISIONS[name].with_reason(f"{where}: {name}; no int8 tensor cores for torch._int_mm (taken from {floor} on)")


def choose_precision(
    device: torch.device,
    *,
    stored_int8: bool,
    rates: Callable[[], Rates],
    weights: WeightCounts | None = None,
    memory_bytes: int | None = None,
    gpu: Callable[[torch.device], Gpu | None] | None = None,
) -> Precision:
    """The fastest qualified precision that fits: on CUDA by the device (`choose_on_gpu`; `gpu` reads it, machine.py
    `cuda_gpu`); on a CPU by the probe, among those whose `weights` (held as `WeightCounts.bytes_in` says) fit in
    MEMORY_SHARE of `memory_bytes` (None: no bound). Nothing fitting is `TooBig`, one line with the sizes."""
    candidates = qualified(stored_int8=stored_int8)
    if device.type != "cpu":
        return choose_on_gpu(device, gpu(device) if gpu else None, stored_int8=stored_int8)
    measured = rates()
    if measured.int8_kernel is None or measured.int8 <= 0:
        candidates = tuple(name for name in candidates if name != "int8-w8a8")
    rate = {"fp32": measured.fp32, "bf16": measured.bf16, "int8-w8a8": measured.int8, "int8-weight-only": weight_only_rate(measured)}
    needs = {name: weights.bytes_in(name) if weights else 0.0 for name in candidates}
    room = None if memory_bytes is None or not weights else MEMORY_SHARE * memory_bytes
    fitting_ones = [name for name in candidates if room is None or needs[name] <= room]
    if not fitting_ones:
        sizes = ", ".join(f"{name} {needs[name] / 2**30:.1f} GiB" for name in candidates)
        raise TooBig(
            f"no qualified precision fits this machine's memory: {sizes} of weights, {room / 2**30:.1f} GiB usable "
            f"({MEMORY_SHARE:.0%} of {memory_bytes / 2**30:.1f} GiB available); free memory, or use a machine with more"
        )
    best = max(fitting_ones, key=lambda name: (rate[name], -candidates.index(name)))
    figures = ", ".join(f"{name} {rate[name]:.0f}" for name in candidates)
    kernel = f" ({measured.int8_kernel})" if best == "int8-w8a8" else ""
    reason = f"fastest qualified on this CPU{kernel}; probe G(FL)OP/s: {figures}"
    if "int8-w8a8" not in candidates:
        reason += "; int8-w8a8 left out: no exact W8A8 kernel here"
    if best == "int8-w8a8" and measured.int8_bits < 8:
        reason += (
            f"; {measured.int8_bits}-bit activations: one int8 digit at the projections that read a norm "
            f"({', '.join(SEVEN_BIT_ONE_DIGIT)}), two at the others, 1 byte a weight"
        )
    left_out = [name for name in candidates if name not in fitting_ones]
    if left_out:
        reason += "; too big for memory: " + ", ".join(f"{name} {needs[name] / 2**30:.1f} GiB" for name in left_out)
        reason += f" of {room / 2**30:.1f} GiB usable"
    if PRECISIONS[best].quantized and not stored_int8:
        reason += "; quantized while loading (`clef-flash convert` writes it once, to load in seconds)"
    return PRECISIONS[best].with_reason(reason)


def resolve_precision(
    requested: str | None,
    device: torch.device,
    *,
    stored_int8: bool,
    rates: Callable[[], Rates] | None = None,
    weights: WeightCounts | None = None,
    memory_bytes: int | None = None,
    gpu: Callable[[torch.device], Gpu | None] | None = None,
) -> Precision:
    """The precision to run: `requested`, else $CLEF_FLASH_PRECISION, else the fastest qualified one
    (`rates` gives the machine's probe), checked against what the checkpoint stores."""
    if requested is None and os.environ.get(ENVIRONMENT):
        precision = parse_precision(os.environ[ENVIRONMENT]).with_reason(f"${ENVIRONMENT}")
    elif requested is None:
        if rates is None:
            raise ValueError("choosing a precision needs the machine's rates")
        precision = choose_precision(
            device, stored_int8=stored_int8, rates=rates, weights=weights, memory_bytes=memory_bytes, gpu=gpu
        )
    else:
        precision = parse_precision(requested)
    if stored_int8 and precision.int8_mode == FP8_MODE:
        raise ValueError("is an 8-bit bundle (stored int8): it cannot run in fp8; load the release it was converted from with precision fp8, or use int8 here")
    if stored_int8 and not precision.quantized:
        int8_names = [name for name, value in PRECISIONS.items() if value.int8]
        raise ValueError(
            f"is an 8-bit bundle: use precision int8 (or {', '.join(int8_names)}); "
            f"for {precision.name}, load the release it was converted from"
        )
    return precision.on(device)
