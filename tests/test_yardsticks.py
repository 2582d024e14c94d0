"""benchmarks/yardsticks.py: llama.cpp's Q8_0 and Q4_0 and the scheme's weight groups, emulated for the agreement
table (issue 50): ggml's rounding rules on vectors made for them, the products against literal integer block sums, the
groups at the input's width against the scheme's own W8A8, and the same projections replaced as the int8 scheme."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import clef_flash
from clef_flash.checkpoint.quant import W8A8Linear, quantize_weight, replace_linears
from clef_flash.checkpoint.w8a8 import reference_kernel

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import yardsticks  # noqa: E402


def _block(*values: float) -> torch.Tensor:
    return torch.tensor([[*values] + [0.0] * (yardsticks.QK - len(values))])  # [1, 32]


def test_q8_0_weights_round_ties_away_and_activations_to_even():
    # amax 127: d = 1, so x * id is x (ggml's weights: roundf; its AVX2 activations: round to nearest even)
    x = _block(2.5, -2.5, 0.49999997, 127.0)
    weight, scale = yardsticks.quantize_q8_0_weight(x)
    activations, _ = yardsticks.quantize_q8_0_activations(x)
    assert weight[0, :4].tolist() == [3, -3, 0, 127]
    assert activations[0, :4].tolist() == [2, -2, 0, 127]
    assert scale.tolist() == [[1.0]]
    # the scale stored as fp16: amax 1 gives d = 1/127 rounded to fp16
    _, scale = yardsticks.quantize_q8_0_weight(_block(1.0))
    assert scale.item() == torch.tensor(1 / 127).to(torch.float16).item() != torch.tensor(1 / 127).item()


def test_q4_0_takes_the_first_largest_value_as_minus_8():
    weight, scale = yardsticks.quantize_q4_0_weight(torch.cat([_block(-3.0, 3.0, 0.2, 1.1), _block(3.0, -3.0, 0.2, 1.1)]))
    # d = max / -8: the first largest, -3, is -8 d and +3 clamps to 7 (MIN(15, (int8_t)(x * id + 8.5f)) - 8); and back
    assert weight[:, :4].tolist() == [[-8, 7, 1, 3], [-8, 7, -1, -3]]
    assert scale.flatten().tolist() == [0.375, -0.375]


@pytest.mark.parametrize("format", [yardsticks.Q8_0, yardsticks.Q4_0], ids=lambda format: format.key)
def test_llama_cpp_products_are_integer_block_sums_times_both_scales(format):
    generator = torch.Generator().manual_seed(0)
    weight, x = torch.randn(24, 96, generator=generator), 3 * torch.randn(5, 96, generator=generator)
    linear = yardsticks.EmulatedLinear(weight, format, None)
    xq, x_scales = yardsticks.quantize_q8_0_activations(x)
    expected = torch.zeros(5, 24, dtype=torch.float64)
    for block in range(96 // yardsticks.QK):  # ggml's vec_dot: per block sumi * d_x * d_w
        columns = slice(block * yardsticks.QK, (block + 1) * yardsticks.QK)
        sums = (xq[:, columns].long() @ linear.q[:, columns].long().t()).double()
        expected += sums * x_scales[:, block, None].double() * linear.scales[None, :, block].double()
    error = ((linear(x).double() - expected).abs().max() / expected.abs().max()).item()
    print(f"{format.key}: relative error against integer block sums {error:.1e}")
    assert error < 1e-6


def test_groups_as_wide_as_the_input_are_the_scheme():
    generator = torch.Generator().manual_seed(1)
    weight, x, smoothing = torch.randn(40, 256, generator=generator), 3 * torch.randn(7, 256, generator=generator), torch.rand(256, generator=generator) + 0.5
    emulated = yardsticks.EmulatedLinear(weight, yardsticks.groups_of(1024), smoothing)
    scheme = W8A8Linear(256, 40, reference_kernel("reference-127", 127))
    q, scale = quantize_weight(weight, smoothing)
    scheme.weight.copy_(q), scheme.weight_scale.copy_(scale), scheme.input_smoothing.copy_(smoothing)
    scheme.pack()
    assert torch.equal(emulated.q, q) and torch.equal(emulated.scales[:, 0], scale)
    error = ((emulated(x) - scheme(x)).abs().max() / scheme(x).abs().max()).item()
    print(f"groups of the input's width against the scheme's W8A8: relative error {error:.1e}")
    assert error < 1e-6
    assert yardsticks.EmulatedLinear(weight, yardsticks.groups_of(32), smoothing).scales.shape == (40, 8)


def test_the_projections_replaced_are_the_int8_schemes(tiny_dir):
    model = yardsticks.load_emulated(tiny_dir, yardsticks.Q4_0)
    emulated = {name.removeprefix("layers.") for name, module in model.parts.decoder.layers.named_modules() if isinstance(module, yardsticks.EmulatedLinear)}
    scheme = clef_flash.load(tiny_dir, device="cpu", precision="fp32")
    assert emulated == set(replace_linears(scheme.parts.decoder.layers, "weight-only")) and len(emulated) == 25  # 3 DeltaNet layers x 6, an attention layer x 7
    assert not any("in_proj_a" in name or "in_proj_b" in name for name in emulated)
