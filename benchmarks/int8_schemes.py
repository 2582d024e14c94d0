"""The table that decided the int8 scheme (issue 40): candidate schemes' agreement, and their predicted AVX2 speed.

    python benchmarks/int8_schemes.py [--configs 9b-heads,9b-heads-outliers] [--seeds 1,2] [--requests 30] [--json OUT]

Each candidate replaces every projection that `precision.is_quantized` names, in the release loaded in fp32, by an
emulation of an exact int8 kernel: the weight (optionally smoothed, `W diag(s)`, and rotated, `. R`) quantized per
output channel to `weight_levels`, the input (`(x / s) R`) per token to `levels` (None: kept fp32, weight-only), the
integer products summed in float64 (exact here, so the figures are those of any exact kernel and any CPU). Smoothing:
s = |g| ** exponent, g the per-channel scale of the norm a projection reads (`precision.SMOOTHED_BY`). A 7-bit weight
is the 8-bit one halved (what FBGEMM would need with 8-bit activations: exact with weights within 7 bits).
Rows and the summary as benchmarks/agreement.py.

Predicted AVX2 speed: a 9b-part record on an AMD EPYC Zen 3 (issue 40's figures, 2 threads): today's default (7-bit
activations, one int8 digit at gate/up and two elsewhere) 81.4 tok/s, every projection one FBGEMM product 122.5,
the exact 8-bit u8/u8 ONNX Runtime kernel in every projection 80.3, int8 weight-only ~ the fp32 release 78.6;
llama.cpp Q4_0 84.1 the same day. A scheme runs on FBGEMM in one product per projection where its integers are
a8w7 or a7w8 (FBGEMM exact either way), needs ONNX Runtime's kernel for a8w8.
"""

from __future__ import annotations

import torch
from torch import nn

import agreement
import clef_flash
from clef_flash.checkpoint.rotation import rotate
from clef_flash.model.precision import SMOOTHED_BY, is_quantized

ONLY = None  # a set of candidate names to run (all: None); `--only NAME` on the command line
LLAMA_CPP_Q4_0 = 84.1  # tok/s, Zen 3, the same day as the figures below (issue 40)
AVX2_TOKENS_PER_S = {"one FBGEMM product": 122.5, "ONNX Runtime u8/u8": 80.3, "weight-only": 78.6, "mixed digits": 81.4}

SEVEN_BIT_MIXED = {"mlp.gate_proj": 63, "mlp.up_proj": 63}  # one 7-bit digit there, two (63 * 126 levels) elsewhere
# one 7-bit digit at every projection that reads a norm (smoothed), two at the ones that do not (down, o, out)
SEVEN_BIT_SMOOTHED = {name: 63 for name in SMOOTHED_BY}
# one 7-bit digit everywhere but down_proj (the input with the largest outliers: act(gate) * up)
SEVEN_BIT_BUT_DOWN = SEVEN_BIT_SMOOTHED | {"self_attn.o_proj": 63, "linear_attn.out_proj": 63}
TWO_DIGIT_LEVELS = 63 * 126

# name -> (activation levels (a dict: by projection, the rest TWO_DIGIT_LEVELS) or None, weight levels, rotated,
# smoothing exponent or None), and how it runs on AVX2
CANDIDATES = {
    "a8w8 plain (per-token, no rotation)": ((127, 127, False, None), "ONNX Runtime u8/u8"),
    "a7w8 plain": ((63, 127, False, None), "one FBGEMM product"),
    "a7w8 rotated": ((63, 127, True, None), "one FBGEMM product"),
    "a7w8 rotated, smoothed 0.5": ((63, 127, True, 0.5), "one FBGEMM product"),
    "a8w8 rotated": ((127, 127, True, None), "ONNX Runtime u8/u8"),
    "a8w8 rotated, smoothed 0.5 (the scheme)": ((127, 127, True, 0.5), "ONNX Runtime u8/u8"),
    "a8w7 rotated": ((127, 63, True, None), "one FBGEMM product"),
    "a8w7 rotated, smoothed 0.5": ((127, 63, True, 0.5), "one FBGEMM product"),
    "weight-only rotated, smoothed 0.5": ((None, 127, True, 0.5), "weight-only"),
    "a7w8 at gate/up, two 7-bit digits elsewhere, rotated, smoothed 0.5": ((SEVEN_BIT_MIXED, 127, True, 0.5), "mixed digits"),
    "a7w8 where a norm is read, two digits at down/o/out, rotated, smoothed 0.5": ((SEVEN_BIT_SMOOTHED, 127, True, 0.5), "mixed digits"),
    "a7w8 but two digits at down, rotated, smoothed 0.5": ((SEVEN_BIT_BUT_DOWN, 127, True, 0.5), "mixed digits"),
}


class EmulatedLinear(nn.Module):
    """An exact int8 kernel, emulated (see the module's docstring)."""

    def __init__(self, weight: torch.Tensor, s: torch.Tensor, levels: int | None, weight_levels: int, rotated: bool):
        super().__init__()
        self.levels, self.rotated, self.s = levels, rotated, s
        self.out_features, self.in_features = weight.shape
        smoothed = weight.float() * s  # [O, I]
        w = rotate(smoothed) if rotated else smoothed
        scale = w.abs().amax(dim=1).clamp_min(torch.finfo(torch.float32).tiny) / 127  # [O]
        q = torch.round(w / scale[:, None]).clamp_(-127, 127)
        if weight_levels != 127:  # the 8-bit weight halved, as FBGEMM's kernel packs it
            factor = 127 / weight_levels
            q, scale = torch.round(q / factor), scale * factor
        self.q, self.scale = q.double(), scale.double()  # float64: the integer sums are exact

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        inputs = x.reshape(-1, self.in_features).float() / self.s  # [M, I]
        inputs = rotate(inputs) if self.rotated else inputs
        if self.levels is None:
            out = inputs.double() @ (self.q * self.scale[:, None]).t()
        else:
            token_scale = inputs.abs().amax(dim=1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny) / self.levels
            integers = torch.round(inputs / token_scale).clamp_(-self.levels, self.levels)  # [M, I]
            out = (integers.double() @ self.q.t()) * token_scale.double() * self.scale
        return out.to(x.dtype).view(*x.shape[:-1], self.out_features)


def load_emulated(root, levels, weight_levels, rotated, exponent) -> clef_flash.Clef:
    model = clef_flash.load(root, device="cpu", precision="fp32")
    for layer in model.parts.decoder.layers:
        for name, linear in list(layer.named_modules()):
            if not (isinstance(linear, nn.Linear) and is_quantized(f"{name}.weight", tuple(linear.weight.shape))):
                continue
            s = torch.ones(linear.in_features)
            if exponent is not None and name in SMOOTHED_BY:
                norm, offset = SMOOTHED_BY[name]
                g = layer.get_parameter(norm).detach().float() + (1.0 if offset else 0.0)
                s = g.abs().pow(exponent).clamp_min(1e-6)
            parent, _, child = name.rpartition(".")
            own_levels = levels.get(name, TWO_DIGIT_LEVELS) if isinstance(levels, dict) else levels
            setattr(layer.get_submodule(parent), child, EmulatedLinear(linear.weight.detach(), s, own_levels, weight_levels, rotated))
    return model


def candidates(root, bundle, module) -> dict:
    """name -> a function building that row's logits function (agreement.compare builds one row at a time)."""
    rows = {
        agreement.REFERENCE: lambda: agreement.ReferenceModel(module, root, torch.bfloat16).logits,
        "int8 weight-only (the scheme, release)": lambda: clef_flash.load(root, device="cpu", precision="int8-weight-only").logits,
    }
    for name, ((levels, weight_levels, rotated, exponent), _) in CANDIDATES.items():
        if ONLY is None or name in ONLY:
            rows[name] = lambda spec=(levels, weight_levels, rotated, exponent): load_emulated(root, *spec).logits
    return rows


def two_digit_share(levels: dict) -> float:
    """The share of the 9B's int8 multiply-adds at projections that take two digits under `levels` (by name)."""
    from clef_flash.checkpoint.random_release import tensor_table

    sizes = {}  # projection name ("mlp.up_proj") -> its multiply-adds per token over all layers
    for spec in tensor_table("9b", mtp=False):
        if is_quantized(spec.name, tuple(spec.shape)):
            projection = ".".join(spec.name.split(".")[-3:-1])
            sizes[projection] = sizes.get(projection, 0) + spec.shape[0] * spec.shape[1]
    return sum(size for name, size in sizes.items() if levels.get(name, TWO_DIGIT_LEVELS) > 127) / sum(sizes.values())


def predicted_tokens_per_s(levels, runs_as: str) -> float:
    """Zen 3 tok/s: the measured rate, or for a mix of one and two digits, the line through the two measured mixes
    (time per token = fixed + per-work * work, work = 1 + two-digit share: gate/up one digit = 1.53 at 81.4, every
    projection one digit = 1.0 at 122.5)."""
    if runs_as != "mixed digits":
        return AVX2_TOKENS_PER_S[runs_as]
    one, mixed = 1.0 / AVX2_TOKENS_PER_S["one FBGEMM product"], 1.0 / AVX2_TOKENS_PER_S["mixed digits"]
    per_work = (mixed - one) / two_digit_share(SEVEN_BIT_MIXED)
    return 1.0 / (one + per_work * two_digit_share(levels))


def print_speed() -> None:
    print("\npredicted on an AVX2-only CPU (Zen 3, 9b-part, ~370-token records), from issue 40's measured rates:")
    for name, ((levels, *_), runs_as) in CANDIDATES.items():
        rate = predicted_tokens_per_s(levels, runs_as)
        print(f"{name:>42}: {runs_as:>20}, ~{rate:.1f} tok/s = {rate / LLAMA_CPP_Q4_0:.2f}x llama.cpp Q4_0")


if __name__ == "__main__":
    import sys

    if "--only" in sys.argv:  # (taken out before agreement.run parses the rest)
        at = sys.argv.index("--only")
        ONLY = set(sys.argv[at + 1].split(";"))
        del sys.argv[at : at + 2]
    print_speed()
    agreement.run(candidates, __doc__)
