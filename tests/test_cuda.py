"""The same parity checks on a CUDA device (skipped where there is none)."""

from __future__ import annotations

import pytest
import torch

import clef_flash
from clef_flash.request.samples import random_requests

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")]


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_cuda_logits_match_cpu_fp32(tiny_dir, precision):
    cpu = clef_flash.load(tiny_dir, device="cpu", precision="fp32")
    gpu = clef_flash.load(tiny_dir, device="cuda", precision=precision)
    tolerance = 1e-4 if precision == "fp32" else 5e-2
    worst = 0.0
    for request in random_requests(11, 20):
        expected, got = cpu.logits(request), gpu.logits(request)
        for question_id, options in expected.items():
            scale = max(abs(value) for value in options.values())
            worst = max(worst, max(abs(got[question_id][k] - v) for k, v in options.items()) / scale)
    print(f"\ncuda {precision} vs cpu fp32: worst relative logit difference {worst:.2e}")
    assert worst <= tolerance


def test_fla_kernel_matches_torch_chunk_when_installed():
    from clef_flash.model.ops import gated_delta_rule as ops

    if ops._fla_chunk_kernel() is None:
        pytest.skip("fla is not installed")
    generator = torch.Generator(device="cuda").manual_seed(0)
    B, T, Hk, Hv, D = 2, 130, 2, 4, 64
    q = ops.l2norm(torch.randn(B, T, Hk, D, device="cuda", generator=generator)) * D**-0.5
    k = ops.l2norm(torch.randn(B, T, Hk, D, device="cuda", generator=generator))
    v = torch.randn(B, T, Hv, D, device="cuda", generator=generator)
    g = -torch.rand(B, T, Hv, device="cuda", generator=generator)
    beta = torch.rand(B, T, Hv, device="cuda", generator=generator)
    expected, expected_state = ops.chunk_gated_delta_rule(q, k, v, g, beta)
    got, got_state = ops.gated_delta_rule(q, k, v, g, beta)
    error = ((got - expected).abs().max() / expected.abs().max()).item()
    print(f"\nfla vs torch chunk: {error:.2e}")
    assert error <= 1e-3
    assert ((got_state - expected_state).abs().max() / expected_state.abs().max()).item() <= 1e-3
