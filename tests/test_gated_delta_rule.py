"""The chunked gated delta rule against its token-by-token twin, and the short causal conv against F.conv1d."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from clef_flash.model.ops import gated_delta_rule as gdr
from clef_flash.model.ops.gated_delta_rule import (
    causal_conv1d_silu,
    chunk_gated_delta_rule,
    l2norm,
    naive_recurrent_gated_delta_rule,
)


def rel(actual: torch.Tensor, reference: torch.Tensor) -> float:
    """max|d| / max|ref|, in float64."""
    return ((actual.double() - reference.double()).abs().max() / reference.double().abs().max()).item()


def inputs(T, *, B=2, Hk=3, Hv=6, Dk=16, Dv=12, dtype=torch.float64, seed=0, max_decay=1.0, state=False):
    gen = torch.Generator().manual_seed(seed)
    randn = lambda *shape: torch.randn(*shape, generator=gen, dtype=dtype)  # noqa: E731
    q = l2norm(randn(B, T, Hk, Dk)) * Dk**-0.5
    k = l2norm(randn(B, T, Hk, Dk))
    v = randn(B, T, Hv, Dv)
    g = -torch.rand(B, T, Hv, generator=gen, dtype=dtype) * max_decay  # log-decay <= 0
    beta = torch.rand(B, T, Hv, generator=gen, dtype=dtype).clamp_(1e-3, 1 - 1e-3)  # in (0, 1)
    initial = randn(B, Hv, Dk, Dv) if state else None
    return q, k, v, g, beta, initial


@pytest.mark.parametrize("state", [False, True], ids=["zero-state", "initial-state"])
@pytest.mark.parametrize("T", [1, 63, 64, 65, 130])
def test_chunked_equals_recurrent_float64(T, state):
    q, k, v, g, beta, initial = inputs(T, state=state)
    o_ref, s_ref = naive_recurrent_gated_delta_rule(q, k, v, g, beta, initial)
    o, s = chunk_gated_delta_rule(q, k, v, g, beta, initial)
    err_o, err_s = rel(o, o_ref), rel(s, s_ref)
    print(f"T={T} state={state}: float64 chunked vs recurrent: out {err_o:.1e}, final state {err_s:.1e}")
    assert o.dtype == s.dtype == torch.float64
    assert o.shape == v.shape and s.shape == (2, 6, 16, 12)
    assert err_o <= 1e-10 and err_s <= 1e-10


@pytest.mark.parametrize("chunk_size", [1, 7, 16, 128])
def test_chunk_size_does_not_matter(chunk_size):
    q, k, v, g, beta, initial = inputs(100, Hk=2, Hv=2, state=True, seed=1)
    o_ref, s_ref = naive_recurrent_gated_delta_rule(q, k, v, g, beta, initial)
    o, s = chunk_gated_delta_rule(q, k, v, g, beta, initial, chunk_size=chunk_size)
    print(f"chunk {chunk_size}: out {rel(o, o_ref):.1e}, state {rel(s, s_ref):.1e}")
    assert rel(o, o_ref) <= 1e-10 and rel(s, s_ref) <= 1e-10


def test_strong_decay_stays_finite():
    # exp(gamma_r - gamma_s) above the diagonal would overflow: it must be masked before the exp.
    q, k, v, g, beta, initial = inputs(130, max_decay=40.0, state=True, seed=2)
    o_ref, s_ref = naive_recurrent_gated_delta_rule(q, k, v, g, beta, initial)
    o, s = chunk_gated_delta_rule(q, k, v, g, beta, initial)
    assert torch.isfinite(o).all() and torch.isfinite(s).all()
    print(f"g down to -40: out {rel(o, o_ref):.1e}, state {rel(s, s_ref):.1e}")
    assert rel(o, o_ref) <= 1e-10 and rel(s, s_ref) <= 1e-10


def test_two_segments_equal_one_pass():
    q, k, v, g, beta, initial = inputs(150, state=True, seed=3)
    o_ref, s_ref = chunk_gated_delta_rule(q, k, v, g, beta, initial)
    o1, s1 = chunk_gated_delta_rule(q[:, :70], k[:, :70], v[:, :70], g[:, :70], beta[:, :70], initial)
    o2, s2 = chunk_gated_delta_rule(q[:, 70:], k[:, 70:], v[:, 70:], g[:, 70:], beta[:, 70:], s1)
    assert rel(torch.cat((o1, o2), 1), o_ref) <= 1e-12 and rel(s2, s_ref) <= 1e-12


@pytest.mark.parametrize("piece", [64, 100])
def test_long_sequences_run_in_pieces_equal_one_call(monkeypatch, piece):
    """What the decoder calls (`gated_delta_rule`) runs a sequence longer than PIECE_TOKENS in pieces, each
    continuing the last one's state: equal to one chunked call (float64), whether or not pieces are whole chunks."""
    q, k, v, g, beta, initial = inputs(300, state=True, seed=4)
    o_ref, s_ref = chunk_gated_delta_rule(q, k, v, g, beta, initial)
    calls = []
    monkeypatch.setattr(gdr, "PIECE_TOKENS", piece)
    monkeypatch.setattr(gdr, "chunk_gated_delta_rule", lambda *args: calls.append(args[0].shape[1]) or chunk_gated_delta_rule(*args))
    o, s = gdr.gated_delta_rule(q, k, v, g, beta, initial)
    assert calls == [piece] * (300 // piece) + ([300 % piece] if 300 % piece else [])
    print(f"in pieces of {piece} vs one call (float64): out {rel(o, o_ref):.1e}, state {rel(s, s_ref):.1e}")
    assert rel(o, o_ref) <= 1e-12 and rel(s, s_ref) <= 1e-12


@pytest.mark.parametrize("T", [1, 65, 200])
def test_fp32_chunked_vs_float64_recurrent(T):
    q, k, v, g, beta, initial = inputs(T, Hk=4, Hv=8, Dk=64, Dv=64, state=True, seed=4)
    o_ref, s_ref = naive_recurrent_gated_delta_rule(q, k, v, g, beta, initial)
    as32 = [x.float() for x in (q, k, v, g, beta, initial)]
    o, s = chunk_gated_delta_rule(*as32[:5], as32[5])
    assert o.dtype == s.dtype == torch.float32
    print(f"T={T}: fp32 chunked vs float64 recurrent: out {rel(o, o_ref):.1e}, state {rel(s, s_ref):.1e}")
    assert rel(o, o_ref) <= 1e-5 and rel(s, s_ref) <= 1e-5


def test_low_precision_inputs_compute_in_fp32():
    q, k, v, g, beta, _ = inputs(70, dtype=torch.float32, seed=5)
    o, s = chunk_gated_delta_rule(q, k, v.bfloat16(), g, beta.bfloat16())
    assert o.dtype == torch.bfloat16 and s.dtype == torch.float32  # output in v's dtype, state in fp32
    o_ref, _ = naive_recurrent_gated_delta_rule(q, k, v.bfloat16(), g, beta.bfloat16())
    assert rel(o, o_ref) <= 1e-2


def test_l2norm_has_eps_inside_the_root():
    x = torch.tensor([[3.0, 4.0], [0.0, 0.0]], dtype=torch.float64)
    y = l2norm(x)
    assert torch.allclose(y[0], x[0] / (25 + 1e-6) ** 0.5, rtol=0, atol=1e-15)
    assert (y[1] == 0).all()


# The short conv ---------------------------------------------------------------------------------------


def conv_reference(x, weight):
    """HF's torch fallback: F.conv1d(groups=C, padding=K-1)[..., :L], then SiLU; x [B, L, C]."""
    L = x.shape[1]
    out = F.conv1d(x.transpose(1, 2), weight, padding=weight.shape[-1] - 1, groups=x.shape[-1])[..., :L]
    return F.silu(out).transpose(1, 2)


@pytest.mark.parametrize("L", [1, 2, 3, 37])
def test_conv_matches_conv1d_and_carries_state(L):
    torch.manual_seed(6)
    C, K = 10, 4
    x = torch.randn(2, L + 5, C, dtype=torch.float64)
    weight = torch.randn(C, 1, K, dtype=torch.float64)
    ref = conv_reference(x, weight)
    y, state = causal_conv1d_silu(x, weight, return_state=True)
    assert rel(y, ref) <= 1e-14
    assert torch.equal(state, x[:, -(K - 1) :].transpose(1, 2))  # [B, C, K-1]
    # the same sequence in two segments, the first L tokens then 5 more
    y1, s1 = causal_conv1d_silu(x[:, :L], weight, return_state=True)
    y2, s2 = causal_conv1d_silu(x[:, L:], weight, s1, return_state=True)
    assert rel(torch.cat((y1, y2), 1), ref) <= 1e-14 and torch.equal(s2, state)
    assert causal_conv1d_silu(x, weight)[1] is None


def test_conv_bf16_rounds_once_like_conv1d():
    torch.manual_seed(7)
    x = torch.randn(1, 50, 64).bfloat16()
    weight = torch.randn(64, 1, 4).bfloat16()
    y, _ = causal_conv1d_silu(x, weight)
    ref = conv_reference(x, weight)
    assert y.dtype == torch.bfloat16
    print(f"bf16 conv vs F.conv1d bf16: {rel(y, ref):.1e} (fraction bit-equal {(y == ref).float().mean():.3f})")
    assert rel(y, ref) <= 1e-2
