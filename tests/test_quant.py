"""The int8 scheme: round trip per channel, smoothing and rotation, both compute classes beside their plain twins,
the predicate."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from clef_flash import machine
from clef_flash.checkpoint import quant
from clef_flash.checkpoint.quant import (
    Fp8Linear,
    Int8Linear,
    QuantizingSource,
    W8A8Linear,
    WeightOnlyLinear,
    dequantize,
    pack_int8,
    quantize_fp8_per_channel,
    quantize_per_channel,
    quantize_weight,
    replace_linears,
    smoothing,
    weight_only_linear,
)
from clef_flash.checkpoint.rotation import rotate
from clef_flash.checkpoint.w8a8 import W8A8_KERNELS, quantize_per_token, reference_kernel
from clef_flash.model.precision import is_quantized, smoothing_of


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


def _kernels_here():
    """Every kernel exact on this CPU, and the reference twin at 7 and at 8 bits (any CPU)."""
    here = [W8A8_KERNELS[name] for name in machine.rates().kernels]
    return here + [reference_kernel("reference-8"), reference_kernel("reference-7", 63)]


def _filled(linear: Int8Linear, weight: torch.Tensor, input_smoothing: torch.Tensor) -> Int8Linear:
    q, scale = quantize_weight(weight, input_smoothing)
    linear.load_state_dict({"weight": q, "weight_scale": scale, "input_smoothing": input_smoothing})
    pack_int8(linear)
    return linear


@pytest.mark.parametrize("rows", [1, 17, 64])
def test_w8a8_equals_its_float_simulation_on_every_kernel_here(rows):
    """W8A8Linear = the exact integer products of ((x / s) R) rounded per token and ((W diag(s)) R) per channel, on
    every kernel this CPU runs exactly (and the reference twins); and it approximates x W^T."""
    generator = torch.Generator().manual_seed(2)
    weight = torch.randn(48, 80, generator=generator)
    s = smoothing(torch.rand(80, generator=generator) * 4, 80, offset=True)  # a norm's 1 + w
    x = torch.randn(rows, 80, generator=generator) * 3
    for kernel in _kernels_here():
        q, scale = quantize_weight(weight, s)
        xq, x_scale = quantize_per_token(rotate(x / s), levels=kernel.levels)
        assert x_scale.shape == (rows, 1) and int(xq.abs().max()) == kernel.levels
        expected = (xq.double() @ q.double().t()) * x_scale.double() * scale.double()[None, :]  # exact integer products
        got = _filled(W8A8Linear(80, 48, kernel), weight, s)(x)
        error = ((got - expected).abs().max() / expected.abs().max()).item()
        relative = ((got - x @ weight.t()).norm() / (x @ weight.t()).norm()).item()
        print(f"\nw8a8 ({kernel.name}, {kernel.activation_bits}-bit activations) rows={rows}: vs integers {error:.1e}, vs x W^T {relative:.1e}")
        torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-5)
        assert relative < 0.03  # 7-bit activations (FBGEMM) included


def test_weight_only_equals_the_dequantized_rotated_product():
    generator = torch.Generator().manual_seed(3)
    weight, x_hat = torch.randn(24, 64, generator=generator), torch.randn(5, 64, generator=generator)
    s = smoothing(torch.randn(64, generator=generator), 64, offset=False)  # a plain norm's weight, some near 0
    x = x_hat * s  # what a projection reads: the norm's output
    linear = _filled(WeightOnlyLinear(64, 24), weight, s)
    expected = rotate(x / s) @ dequantize(linear.weight, linear.weight_scale).t()
    torch.testing.assert_close(linear(x), expected, rtol=1e-5, atol=1e-5)
    assert ((linear(x) - x @ weight.t()).norm() / (x @ weight.t()).norm()) < 0.01


def test_both_classes_keep_the_activation_dtype():
    weight, s = torch.randn(8, 16), torch.ones(16)
    for linear in (WeightOnlyLinear(16, 8), W8A8Linear(16, 8, reference_kernel("reference", 127))):
        assert _filled(linear, weight, s)(torch.randn(2, 16).bfloat16()).dtype == torch.bfloat16
    q, scale = quantize_per_channel(weight)
    assert weight_only_linear(torch.randn(2, 16).bfloat16(), q, scale).dtype == torch.bfloat16


def test_smoothing_and_rotation_take_the_outliers_out_of_the_int8_scale():
    """A norm that scales 3 of 256 channels by 50 (the outlier release's kind) and one large channel left in the
    input: per-token 7-bit W8A8 of the plain input errs several times the scheme's (smoothed, rotated)."""
    generator = torch.Generator().manual_seed(5)
    width = 256
    weight = torch.randn(64, width, generator=generator) / width**0.5
    norm = torch.zeros(width)
    norm[[40, 120, 200]] = 49.0  # the norm's 1 + w: 50 at three channels
    x_hat = torch.randn(32, width, generator=generator)
    x_hat[:, 7] *= 8.0  # a large channel the norm did not make
    x = x_hat * (1.0 + norm)  # what the projection reads
    exact = x @ weight.t()
    kernel = reference_kernel("reference-7", 63)
    q, scale = quantize_per_channel(weight)
    plain = kernel.linear(x, kernel.pack(q, scale), scale)
    scheme = _filled(W8A8Linear(width, 64, kernel), weight, smoothing(norm, width, offset=True))(x)
    plain_error = ((plain - exact).norm() / exact.norm()).item()
    scheme_error = ((scheme - exact).norm() / exact.norm()).item()
    print(f"\n7-bit per-token W8A8: plain input {plain_error:.2e}, smoothed and rotated {scheme_error:.2e}")
    assert scheme_error < plain_error / 2 and scheme_error < 0.02


def test_the_smoothing_names_each_projections_norm():
    layer = "model.language_model.layers.3."
    assert smoothing_of(layer + "self_attn.q_proj.weight") == (layer + "input_layernorm.weight", True)
    assert smoothing_of(layer + "linear_attn.in_proj_z.weight") == (layer + "input_layernorm.weight", True)
    assert smoothing_of(layer + "mlp.up_proj.weight") == (layer + "post_attention_layernorm.weight", True)
    assert smoothing_of("layers.0.mlp.gate_proj.weight") == ("layers.0.post_attention_layernorm.weight", True)
    for unsmoothed in ("mlp.down_proj.weight", "self_attn.o_proj.weight", "linear_attn.out_proj.weight"):
        assert smoothing_of(layer + unsmoothed) is None
    per_head = smoothing(torch.tensor([4.0, 0.0, -9.0]), 6, offset=False)  # a per-head norm repeats; 0 held off 0
    torch.testing.assert_close(per_head, torch.tensor([2.0, 3e-6, 3.0, 2.0, 3e-6, 3.0]))
    torch.testing.assert_close(smoothing(torch.tensor([3.0, -1.0]), 2, offset=True), torch.tensor([2.0, 1e-6 * 2.0]))


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
            self.post_attention_layernorm = nn.LayerNorm(8)  # stands for the norm `smoothing_of` names
            self.mlp = nn.Module()
            self.mlp.up_proj = nn.Linear(8, 16, bias=False)
            self.in_proj_a = nn.Linear(8, 2, bias=False)

    layers = nn.ModuleList([Block()])
    block = layers[0]
    with torch.no_grad():
        block.post_attention_layernorm.weight.uniform_(-0.5, 3.0)
    state = {f"layers.0.{name}": tensor.detach().clone() for name, tensor in block.state_dict().items()}

    class Source:
        def keys(self):
            return set(state)

        def shape(self, name):
            return tuple(state[name].shape)

        def dtype(self, name):
            return state[name].dtype

        def get(self, name):
            return state[name]

    replaced = replace_linears(layers, "weight-only")
    assert replaced == ["0.mlp.up_proj"] and isinstance(block.mlp.up_proj, WeightOnlyLinear)
    source = QuantizingSource(Source())
    assert source.keys() == {f"layers.{name}" for name in layers.state_dict()}
    assert source.dtype("layers.0.mlp.up_proj.weight") == torch.int8 and source.shape("layers.0.mlp.up_proj.weight_scale") == (16,)
    assert source.shape("layers.0.mlp.up_proj.input_smoothing") == (8,)
    norm = state["layers.0.post_attention_layernorm.weight"]
    assert torch.equal(source.get("layers.0.mlp.up_proj.input_smoothing"), smoothing(norm, 8, offset=True))
    layers.load_state_dict({name.removeprefix("layers."): source.get(name) for name in source.keys()}, strict=True)
    x = torch.randn(3, 8)
    torch.testing.assert_close(block.mlp.up_proj(x), x @ state["layers.0.mlp.up_proj.weight"].t(), rtol=0.02, atol=0.02)


def test_the_quantizers_leave_the_kernels_columns_free_and_fbgemm_fills_its_pins():
    """FBGEMM's two pin columns are written into room the quantizers leave (no second copy of the integers);
    the integers are those of the unpadded rounding, and the padded product is still exact."""
    from clef_flash.checkpoint.w8a8 import FBGEMM, FBGEMM_PINS

    generator = torch.Generator().manual_seed(4)
    x = torch.randn(5, 40, generator=generator) * 3
    plain, scale = quantize_per_token(x, levels=63, dtype=torch.float32)
    padded, same_scale = quantize_per_token(x, levels=63, dtype=torch.float32, pad=2)
    assert padded.shape == (5, 42) and torch.equal(padded[:, :40], plain) and torch.equal(scale, same_scale)
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
        linear = W8A8Linear(16, 8, W8A8_KERNELS[kernel])
        linear.load_state_dict({"weight": q, "weight_scale": scale, "input_smoothing": torch.ones(16)})
        pack_int8(linear)  # at load: never in a forward
        linear(torch.randn(3, 16))
        linear(torch.randn(3, 16))
        assert len(calls) == expected, kernel
        assert (linear.packed is linear.weight) == (kernel == "int_mm")


def test_projections_that_read_one_input_rotate_it_once(monkeypatch):
    """q/k/v (or gate/up) read one input with one smoothing: it is rotated once; an input changed in place, or another
    smoothing, is rotated again."""
    calls = []
    rotate_once = quant.rotate
    monkeypatch.setattr(quant, "rotate", lambda *args, **kwargs: calls.append(1) or rotate_once(*args, **kwargs))
    generator = torch.Generator().manual_seed(6)
    s = smoothing(torch.rand(16, generator=generator), 16, offset=True)
    first, second = (_filled(WeightOnlyLinear(16, 8), torch.randn(8, 16, generator=generator), s.clone()) for _ in range(2))
    other = _filled(WeightOnlyLinear(16, 8), torch.randn(8, 16, generator=generator), s * 2)
    attention = torch.nn.Module()  # as a layer's q and k: `share_smoothing` (at load) gives them one smoothing tensor
    attention.q_proj, attention.k_proj = first, second
    layer = torch.nn.Module()
    layer.self_attn = attention
    assert first.input_smoothing is not second.input_smoothing
    quant.share_smoothing(layer)
    assert first.input_smoothing is second.input_smoothing  # (known by identity in a forward: no device compare)
    x = torch.randn(3, 16, generator=generator)
    calls.clear()  # (quantizing the weights rotated them)
    first(x), second(x)
    assert len(calls) == 1
    x.mul_(2.0)
    torch.testing.assert_close(second(x), rotate_once(x / s) @ dequantize(second.weight, second.weight_scale).t())
    assert len(calls) == 2
    other(x)
    assert len(calls) == 3


@pytest.mark.parametrize("shape", [(1, 64), (3, 5, 64), (63, 64)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_linear_equals_its_float64_emulation(shape, dtype):
    """The same rounding (each row scaled to absmax 448 and cast to e4m3), then exact products and sums in float64:
    torch._scaled_mm differs only by its own accumulation and the output's rounding."""
    torch.manual_seed(3)
    weight = torch.randn(48, 64) * torch.logspace(-2, 1, 48)[:, None]
    weight[7] = 0.0  # an all-zero channel must not divide by zero
    x = torch.randn(shape).to(dtype)
    linear = Fp8Linear(64, 48)
    q, scale = quantize_fp8_per_channel(weight)
    linear.load_state_dict({"weight": q, "weight_scale": scale})
    x2d = x.reshape(-1, 64).double()
    x_scale = x2d.abs().amax(dim=1, keepdim=True) / 448  # [M, 1]
    w_scale = weight.double().abs().amax(dim=1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny) / 448  # [O, 1]
    x8 = (x2d / x_scale).to(torch.float8_e4m3fn).double() * x_scale  # the e4m3 values, exact in float64
    w8 = (weight.double() / w_scale).to(torch.float8_e4m3fn).double() * w_scale
    expected = (x8 @ w8.t()).view(*shape[:-1], 48)
    got = linear(x)
    error = ((got.double() - expected).abs().max() / expected.abs().max()).item()
    plain = ((x.double() @ weight.double().t()) - expected).abs().max() / expected.abs().max()
    print(f"\nfp8 {tuple(shape)} {dtype}: max |d| / max |y| {error:.2e} (fp8 itself from the exact product: {plain:.2e})")
    assert got.dtype == dtype and got.shape == (*shape[:-1], 48) and int(torch.count_nonzero(got[..., 7])) == 0
    assert error < (1e-6 if dtype == torch.float32 else 1e-2)
    assert torch.equal(q.float().abs().amax(dim=1)[[0, 47]], torch.tensor([448.0, 448.0]))  # each row reaches 448


def test_fp8_linear_pads_rows_as_cuda_needs_without_changing_them():
    """On CUDA torch._scaled_mm wants M a multiple of 16: zero rows are added and dropped; the rows are the same."""
    torch.manual_seed(4)
    q, scale = quantize_fp8_per_channel(torch.randn(48, 64))
    x = torch.randn(17, 64)
    assert torch.equal(quant.fp8_linear(x, q, scale, torch.float32, row_multiple=16), quant.fp8_linear(x, q, scale, torch.float32))


def test_rotate_in_bf16_and_fp32():
    """`rotate` in fp32 (every projection's input) and in bf16 (measured for a GPU's tensor cores, not kept: README), each
    within its dtype's rounding of the dense float64 rotation."""
    from clef_flash.checkpoint.rotation import rotate_reference

    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(50))
    assert quant.ROTATION_DTYPE == torch.float32
    for dtype, tolerance in ((torch.float32, 1e-6), (torch.bfloat16, 2e-2)):
        got = quant.rotate(x.to(dtype), dtype=dtype)
        expected = rotate_reference(x.to(dtype).float())
        error = ((got.double() - expected).abs().max() / expected.abs().max()).item()
        print(f"\nrotation in {dtype}: {error:.1e} of the largest element")
        assert got.dtype == dtype and error <= tolerance
