"""The int8 scheme: round trip per channel, both compute modes beside their plain twins, the predicate."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from clef_flash import machine
from clef_flash.checkpoint import quant
from clef_flash.checkpoint.quant import (
    Int8Linear,
    QuantizingSource,
    dequantize,
    quantize_per_channel,
    replace_linears,
    weight_only_linear,
)
from clef_flash.checkpoint.w8a8 import W8A8_KERNELS, quantize_per_token
from clef_flash.model.precision import is_quantized


def test_round_trip_error_is_at_most_half_a_step_per_channel():
    torch.manual_seed(0)
    weight = torch.randn(37, 129) * torch.logspace(-3, 1, 37)[:, None]  # channels of very different ranges
    weight[5] = 0.0  # an all-zero channel must not divide by zero
    q, scale = quantize_per_channel(weight, rows_at_once=8)  # several blocks, the last one short
    assert q.dtype == torch.int8 and scale.dtype == torch.float32 and scale.shape == (37,)
    assert int(q.abs().max()) == 127 and int(q[5].abs().max()) == 0
    error = (dequantize(q, scale) - weight).abs().amax(dim=1)  # [O]
    ratio = error / (scale / 2)
    print(f"\nworst per-channel error / half step: {ratio.max():.4f}")
    assert bool((error <= scale / 2 * (1 + 1e-5) + 1e-12).all())


def test_quantize_reads_bf16_weights():
    weight = torch.randn(16, 32).bfloat16()
    q, scale = quantize_per_channel(weight)
    assert (dequantize(q, scale) - weight.float()).abs().max() <= scale.max() / 2 + 1e-6


@pytest.mark.parametrize("shape", [(1, 64), (3, 5, 64), (65, 64)])
def test_weight_only_equals_dequantize_then_matmul(shape, monkeypatch):
    torch.manual_seed(1)
    monkeypatch.setattr(quant, "TILE_ELEMENTS", 64 * 7)  # 7 rows a tile: 100 rows in 15 tiles, the last short
    q, scale = quantize_per_channel(torch.randn(100, 64))
    x = torch.randn(shape)
    expected = x @ dequantize(q, scale).t()
    got = weight_only_linear(x, q, scale)
    print(f"\nweight-only {shape}: max |d| {(got - expected).abs().max():.2e}")
    assert got.shape == (*shape[:-1], 100)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows", [1, 17, 64])
def test_w8a8_equals_its_float_simulation(rows):
    torch.manual_seed(2)
    q, scale = quantize_per_channel(torch.randn(48, 80))
    x = torch.randn(rows, 80) * 3
    kernel = W8A8_KERNELS[machine.rates().int8_kernel]  # the exact one this CPU runs
    xq, x_scale = quantize_per_token(x, levels=kernel.levels)
    assert x_scale.shape == (rows, 1) and int(xq.abs().max()) == kernel.levels
    expected = (xq.double() @ q.double().t()) * x_scale.double() * scale.double()[None, :]  # exact integer products
    linear = Int8Linear(80, 48, "w8a8", kernel=kernel.name)
    linear.load_state_dict({"weight": q, "weight_scale": scale})
    got = linear(x)
    print(f"\nw8a8 ({kernel.name}) rows={rows}: max rel |d| {((got - expected).abs().max() / expected.abs().max()):.2e}")
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-5)
    # and it approximates the float product
    relative = (got - x @ dequantize(q, scale).t()).norm() / (x @ dequantize(q, scale).t()).norm()
    assert relative < 0.03  # 7-bit activations (fbgemm) included


def test_w8a8_keeps_the_activation_dtype():
    q, scale = quantize_per_channel(torch.randn(8, 16))
    linear = Int8Linear(16, 8, "w8a8", kernel=machine.rates().int8_kernel)
    linear.load_state_dict({"weight": q, "weight_scale": scale})
    assert linear(torch.randn(2, 16).bfloat16()).dtype == torch.bfloat16
    assert weight_only_linear(torch.randn(2, 16).bfloat16(), q, scale).dtype == torch.bfloat16


def test_the_predicate_names_what_stays_high_precision():
    assert is_quantized("model.language_model.layers.0.mlp.down_proj.weight", (4, 8))
    assert is_quantized("model.language_model.layers.0.linear_attn.in_proj_qkv.weight", (4, 8))
    for kept in (
        "model.language_model.layers.0.linear_attn.in_proj_a.weight",
        "model.language_model.layers.0.linear_attn.in_proj_b.weight",
        "model.language_model.layers.0.linear_attn.conv1d.weight",
        "model.language_model.layers.0.input_layernorm.weight",
        "model.language_model.layers.0.linear_attn.A_log",
        "model.language_model.embed_tokens.weight",
        "lm_head.weight",
    ):
        assert not is_quantized(kept, (4, 8)), kept
    assert is_quantized("x.in_proj_a.weight", (4, 8), keep=())  # measured both ways: keep is a parameter


def test_replace_linears_and_quantizing_source_agree_on_names():
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.up_proj = nn.Linear(8, 16, bias=False)
            self.in_proj_a = nn.Linear(8, 2, bias=False)
            self.norm = nn.LayerNorm(8)

    block = Block()
    state = {name: tensor.detach().clone() for name, tensor in block.state_dict().items()}

    class Source:
        def keys(self):
            return set(state)

        def shape(self, name):
            return tuple(state[name].shape)

        def dtype(self, name):
            return state[name].dtype

        def get(self, name):
            return state[name]

    replaced = replace_linears(block, "weight-only")
    assert replaced == ["up_proj"] and isinstance(block.up_proj, Int8Linear)
    source = QuantizingSource(Source())
    assert source.keys() == set(block.state_dict())
    assert source.dtype("up_proj.weight") == torch.int8 and source.shape("up_proj.weight_scale") == (16,)
    block.load_state_dict({name: source.get(name) for name in source.keys()}, strict=True)
    x = torch.randn(3, 8)
    torch.testing.assert_close(block.up_proj(x), x @ state["up_proj.weight"].t(), rtol=0.02, atol=0.02)


def test_the_quantizers_leave_the_kernels_columns_free_and_fbgemm_fills_its_pins():
    """FBGEMM's two pin columns are written into room the quantizers leave (no second copy of the integers);
    the integers are those of the unpadded rounding, and the padded product is still exact."""
    from clef_flash.checkpoint.w8a8 import FBGEMM, FBGEMM_PINS, quantize_two_digits

    generator = torch.Generator().manual_seed(4)
    x = torch.randn(5, 40, generator=generator) * 3
    plain, scale = quantize_per_token(x, levels=63, dtype=torch.float32)
    padded, same_scale = quantize_per_token(x, levels=63, dtype=torch.float32, pad=2)
    assert padded.shape == (5, 42) and torch.equal(padded[:, :40], plain) and torch.equal(scale, same_scale)
    digits, _, _ = quantize_two_digits(x, levels=63, dtype=torch.float32, pad=2)
    assert torch.equal(digits[:, :40], quantize_two_digits(x, levels=63, dtype=torch.float32)[0])
    kernel = W8A8_KERNELS[FBGEMM]
    if not kernel.available():
        pytest.skip("FBGEMM is not in this torch build")
    assert kernel.pad == len(FBGEMM_PINS)
    q, w_scale = quantize_per_channel(torch.randn(12, 40, generator=generator))
    expected = (plain.double() @ q.double().t()) * scale.double() * w_scale.double()[None, :]
    torch.testing.assert_close(kernel.linear(x, kernel.pack(q, w_scale), w_scale).double(), expected, rtol=1e-6, atol=1e-6)


def test_packing_a_weight_hands_the_heaps_free_pages_back(monkeypatch):
    """Packing's temporaries leave holes in glibc's heap that stay resident (0.9 GB on the 9B bundle on FBGEMM):
    each weight packed (or copied) hands them back; a kernel that reads the weight as it is has nothing to give."""
    import clef_flash.checkpoint.quant as quant

    calls = []
    monkeypatch.setattr(quant, "return_free_heap", lambda: calls.append(1))
    q, scale = quantize_per_channel(torch.randn(8, 16))
    for kernel, expected in (("fbgemm", 1), ("int_mm", 0)):
        if not W8A8_KERNELS[kernel].available():
            continue
        calls.clear()
        linear = Int8Linear(16, 8, "w8a8", kernel=kernel)
        linear.load_state_dict({"weight": q, "weight_scale": scale})
        linear(torch.randn(3, 16))
        linear(torch.randn(3, 16))  # packed once
        assert len(calls) == expected, kernel
