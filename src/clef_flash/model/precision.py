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
as stored (gathered, never converted whole), and the kept projections (`KEPT_HIGH_PRECISION`) never
int8. A new precision is one row in `PRECISIONS` (and, for a new int8 mode, a kernel in checkpoint/quant.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

FP64, FP32, BF16, FP16, INT8 = torch.float64, torch.float32, torch.bfloat16, torch.float16, torch.int8

# -- what is int8, and what never is -----------------------------------------------------------------

WEIGHT_ONLY, W8A8 = "weight-only", "w8a8"  # int8 weights dequantized to the compute dtype; int8 activations too
INT8_MODES = (WEIGHT_ONLY, W8A8)
DEFAULT_INT8_MODE = WEIGHT_ONLY
SCALE_SUFFIX = "_scale"  # `x.weight` (int8) is stored beside `x.weight_scale` (fp32 [out])
SCALE_DTYPE = FP32
# The DeltaNet gate projections are tiny (hidden -> value heads) and feed a sigmoid and a softplus
# exponent: measured both ways (benchmarks/agreement.py), they stay 16-bit.
KEPT_HIGH_PRECISION = ("in_proj_a.weight", "in_proj_b.weight")
# The DeltaNet decay parameters are held in at least fp32, whatever the compute dtype (as transformers).
HIGH_PRECISION_PARAMETERS = ("A_log", "dt_bias")
HEAD_DTYPE = FP32
BUNDLE_EMBEDDING_DTYPE = BF16  # input and output embeddings in an 8-bit bundle


def is_quantized(name: str, shape: tuple[int, ...], keep: tuple[str, ...] | None = None) -> bool:
    """The int8 predicate: 2-D decoder projection weights (`*_proj.weight`, `in_proj_*.weight`), except `keep`."""
    keep = KEPT_HIGH_PRECISION if keep is None else keep
    module, _, leaf = name.rpartition(".")
    projection = module.rpartition(".")[2]  # q_proj, down_proj, in_proj_qkv, in_proj_z, out_proj, ...
    is_projection = projection.endswith("_proj") or projection.startswith("in_proj_")
    return leaf == "weight" and is_projection and len(shape) == 2 and not name.endswith(keep)


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

    @property
    def quantized(self) -> bool:
        return self.int8_mode is not None

    def dtype_of(self, name: str, stored: torch.dtype) -> torch.dtype:
        """The dtype a decoder tensor (name relative to the decoder) is held in, given how it is stored."""
        if stored == INT8:
            return INT8
        leaf = name.rsplit(".", 1)[-1]
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

    def on(self, device: torch.device) -> Precision:
        """The same precision for a device: int8 computes in fp32 on CPU and in bf16 on CUDA."""
        if not self.quantized:
            return self
        dtype = BF16 if device.type == "cuda" else FP32
        return Precision(self.name, dtype, self.int8_mode, self.reason)

    def with_reason(self, reason: str) -> Precision:
        return Precision(self.name, self.compute_dtype, self.int8_mode, reason)


def storage_dtype_of(name: str, shape: tuple[int, ...], stored: torch.dtype, *, part: str) -> torch.dtype:
    """The dtype an 8-bit bundle stores a tensor in. `part`: decoder, embeddings, lm_head or head."""
    if part == "head":
        return HEAD_DTYPE
    if part in ("embeddings", "lm_head"):
        return BUNDLE_EMBEDDING_DTYPE
    if is_quantized(name, shape):
        return INT8
    return SCALE_DTYPE if is_scale(name) else stored


PRECISIONS: dict[str, Precision] = {
    "fp32": Precision("fp32", FP32),
    "bf16": Precision("bf16", BF16),
    "fp64": Precision("fp64", FP64),
    **{f"int8-{mode}": Precision(f"int8-{mode}", FP32, mode) for mode in INT8_MODES},
}
ALIASES = {"int8": f"int8-{DEFAULT_INT8_MODE}"}
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


def default_precision(*, stored_int8: bool) -> Precision:
    """The precision `load(precision=None)` runs: the release's own bf16, or int8 for an 8-bit bundle."""
    if stored_int8:
        return PRECISIONS[ALIASES["int8"]].with_reason("an 8-bit bundle's default")
    return PRECISIONS["bf16"].with_reason("the release's own dtype")


def resolve_precision(requested: str | None, device: torch.device, *, stored_int8: bool) -> Precision:
    """The precision to run: `requested` (None: the default), checked against what the checkpoint stores."""
    precision = default_precision(stored_int8=stored_int8) if requested is None else parse_precision(requested)
    if stored_int8 and not precision.quantized:
        int8_names = [name for name, value in PRECISIONS.items() if value.quantized]
        raise ValueError(
            f"is an 8-bit bundle: use precision int8 (or {', '.join(int8_names)}); "
            f"for {requested}, load the release it was converted from"
        )
    return precision.on(device)
