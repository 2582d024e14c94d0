"""The gated delta rule (Gated DeltaNet's token mixer) and its short causal conv, in plain torch.

Two twins with one signature, flash-linear-attention style:

* `naive_recurrent_gated_delta_rule`: token by token, the obviously correct one (qwen35.md §6 step 5);
* `chunk_gated_delta_rule`: the chunked (UT) form, what the decoder runs.

Per value head, with state S [Dk, Dv] (zero unless given) and for each token t:

    S <- exp(g_t) S;   u_t = beta_t (v_t - S^T k_t);   S <- S + k_t u_t^T;   o_t = S^T q_t

Conventions shared by both:

* q, k are used **as given**. The caller l2-normalises q and k (`l2norm`) and scales q by Dk^-0.5
  beforehand; the decoder does it on the key heads, before the grouping, where it is cheapest.
* Grouped heads: q, k have Hk heads, v, g, beta have Hv = r * Hk; value head j reads key head j // r
  (HF's repeat_interleave layout). The chunked twin never repeats q or k: the key-key and query-key
  products are taken once per key head and shared by its r value heads.
* Compute dtype: fp32, or float64 when any input is float64 (`compute_dtype`). The output `o` comes
  back in v's dtype (HF casts its kernel output to the model dtype too); the final state stays in the
  compute dtype.
"""

from __future__ import annotations

from functools import lru_cache

import torch
import torch.nn.functional as F

from ..precision import compute_dtype
from .static_delta_rule import static_chunk_gated_delta_rule

__all__ = [
    "causal_conv1d_silu",
    "chunk_gated_delta_rule",
    "compute_dtype",
    "l2norm",
    "naive_recurrent_gated_delta_rule",
]


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """`x * rsqrt(sum(x^2) + eps)` over the last dim, in the compute dtype (eps inside the root, on the sum)."""
    x = x.to(compute_dtype(x.dtype))
    return x * torch.rsqrt(x.square().sum(-1, keepdim=True) + eps)


def _check_shapes(q, k, v, g, beta, initial_state):
    B, T, Hk, Dk = k.shape
    Hv, Dv = v.shape[-2:]
    if q.shape != k.shape or v.shape[:2] != (B, T) or Hv % Hk:
        raise ValueError(
            f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}: need q, k [B,T,Hk,Dk], v [B,T,Hv,Dv], Hk | Hv"
        )
    if g.shape != (B, T, Hv) or beta.shape != (B, T, Hv):
        raise ValueError(f"g {tuple(g.shape)}, beta {tuple(beta.shape)}: need [B,T,Hv] = {(B, T, Hv)}")
    if initial_state is not None and initial_state.shape != (B, Hv, Dk, Dv):
        raise ValueError(f"initial_state {tuple(initial_state.shape)}: need [B,Hv,Dk,Dv] = {(B, Hv, Dk, Dv)}")
    return B, T, Hk, Dk, Hv, Dv


def naive_recurrent_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference: one token at a time. q, k [B,T,Hk,Dk]; v [B,T,Hv,Dv]; g, beta [B,T,Hv];
    state [B,Hv,Dk,Dv]. Returns (o [B,T,Hv,Dv] in v's dtype, final state in the compute dtype)."""
    B, T, Hk, Dk, Hv, Dv = _check_shapes(q, k, v, g, beta, initial_state)
    dtype = compute_dtype(q.dtype, k.dtype, v.dtype, g.dtype, beta.dtype)
    r = Hv // Hk
    q, k = (x.to(dtype).repeat_interleave(r, dim=2) for x in (q, k))  # [B,T,Hv,Dk]
    out_dtype = v.dtype
    v, g, beta = (x.to(dtype) for x in (v, g, beta))
    S = q.new_zeros(B, Hv, Dk, Dv) if initial_state is None else initial_state.to(dtype).clone()
    o = v.new_empty(B, T, Hv, Dv)
    for t in range(T):
        S = S * g[:, t].exp()[..., None, None]
        u = beta[:, t, :, None] * (v[:, t] - torch.einsum("bhkv,bhk->bhv", S, k[:, t]))  # [B,Hv,Dv]
        S = S + k[:, t, :, :, None] * u[:, :, None, :]
        o[:, t] = torch.einsum("bhkv,bhk->bhv", S, q[:, t])
    return o.to(out_dtype), S


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunked (UT) form; same contract as `naive_recurrent_gated_delta_rule`.

    For a chunk of C tokens with entry state S0, gamma = cumsum(g) inside the chunk, D_rs = exp(gamma_r - gamma_s)
    for s <= r (0 above), A = strictly-lower(beta_r (k_r . k_s) D_rs), T = (I + A)^-1:

        U0 = T beta V,   W = T beta e^gamma K        the delta-rule values are U = U0 - W S0
        O      = (e^gamma Q) S0 + (Q K^T * D) U
        S_next = e^gamma_C S0 + (e^(gamma_C - gamma) K)^T U

    Everything that does not depend on S0 (A, T, U0, W, the decays, Q K^T) is computed for all chunks at once;
    only S0 -> S_next (two batched matmuls per chunk) is a Python loop, and the outputs of every chunk are then
    read from the stacked entry states in two more batched matmuls. K K^T, Q K^T and T K are taken per key head
    (a key head's r value heads are stacked along the rows). Tensors are laid out chunk-major, [N, B, Hk, r, C, *],
    so that each chunk's slice in the loop is contiguous. The sequence is zero-padded to whole chunks
    (g = 0, beta = 0, k = 0 there: inert).
    """
    B, T, Hk, Dk, Hv, Dv = _check_shapes(q, k, v, g, beta, initial_state)
    dtype = compute_dtype(q.dtype, k.dtype, v.dtype, g.dtype, beta.dtype)
    r = Hv // Hk
    C = max(1, min(chunk_size, T))  # a short sequence is one chunk of its own length
    N = -(-T // C)
    BH = B * Hv

    q_ = _chunk_major(q, N, C, dtype)  # [N, B, Hk, C, Dk]
    k_ = _chunk_major(k, N, C, dtype)  # [N, B, Hk, C, Dk]
    v_ = _chunk_major(v.reshape(B, T, Hk, r, Dv), N, C, dtype)  # [N, B, Hk, r, C, Dv]
    g_ = _chunk_major(g.reshape(B, T, Hk, r), N, C, dtype, features=False)  # [N, B, Hk, r, C]
    beta_ = _chunk_major(beta.reshape(B, T, Hk, r), N, C, dtype, features=False)  # [N, B, Hk, r, C]

    gamma = g_.cumsum(-1)  # [N, B, Hk, r, C] log-decay from the chunk start to (and including) each token
    exp_gamma = gamma.exp()
    k3 = k_.view(-1, C, Dk)
    kk = torch.bmm(k3, k3.mT).view(N, B, Hk, 1, C, C)  # once per key head
    qk = torch.bmm(q_.view(-1, C, Dk), k3.mT).view(N, B, Hk, 1, C, C)
    upper = torch.ones(C, C, dtype=torch.bool, device=q.device).triu_(1)
    decay = (gamma[..., :, None] - gamma[..., None, :]).masked_fill_(upper, float("-inf")).exp_()  # [N,B,Hk,r,C,C]
    attn = (qk * decay).view(N * BH, C, C)  # (Q K^T * D), lower incl. the diagonal
    # A with its diagonal: solve_triangular(unitriangular=True) reads the strictly-lower part only.
    system = decay.mul_(kk).mul_(beta_[..., :, None]).view(-1, C, C)
    eye = torch.eye(C, dtype=dtype, device=q.device).expand_as(system)
    inverse = torch.linalg.solve_triangular(system, eye, upper=False, unitriangular=True)  # T [N*BH, C, C]
    # T diag(beta), written row-major (the solve returns column-major) so the r value heads stack as rows below
    inverse = torch.mul(inverse.view(N, B, Hk, r, C, C), beta_[..., None, :], out=system.new_empty(N, B, Hk, r, C, C))
    u0 = torch.bmm(inverse.view(-1, C, C), v_.view(-1, C, Dv)).view(N, BH, C, Dv)
    w = torch.bmm((inverse * exp_gamma[..., None, :]).view(-1, r * C, C), k3).view(N, BH, C, Dk)  # r rows per key head
    gamma_last = gamma[..., -1:]  # [N, B, Hk, r, 1]
    k_decayed_t = (k_[:, :, :, None] * (gamma_last - gamma).exp_()[..., None]).view(N, BH, C, Dk).mT
    chunk_decay = gamma_last.exp().view(N, BH, 1, 1)

    # The only sequential part: the entry state of each chunk, and its delta-rule values U = U0 - W S0
    # (computed in place in u0, which then holds U).
    states = q_.new_empty(N + 1, BH, Dk, Dv)  # states[n] enters chunk n; states[N] is the final state
    if initial_state is None:
        states[0].zero_()
    else:
        states[0].copy_(initial_state.reshape(BH, Dk, Dv))
    for n in range(N):
        u0[n].baddbmm_(w[n], states[n], alpha=-1)
        torch.mul(states[n], chunk_decay[n], out=states[n + 1]).baddbmm_(k_decayed_t[n], u0[n])

    q_decayed = (q_[:, :, :, None] * exp_gamma[..., None]).view(N * BH, C, Dk)
    out = torch.bmm(attn, u0.view(N * BH, C, Dv))
    out = out.baddbmm_(q_decayed, states[:N].view(N * BH, Dk, Dv))  # [N*BH, C, Dv]
    # back to [B, T, Hv, Dv] in v's dtype, in one copy
    out = out.view(N, B, Hv, C, Dv).permute(1, 0, 3, 2, 4)  # [B, N, C, Hv, Dv]
    result = v.new_empty(B, T, Hv, Dv)
    full = T // C
    if full:
        result[:, : full * C].view(B, full, C, Hv, Dv).copy_(out[:, :full])
    if full < N:
        result[:, full * C :].copy_(out[:, full, : T - full * C])
    # a copy: a view would keep all N + 1 chunk states alive with the carried state (64 MB per layer at 2,048 tokens)
    return result, states[N].view(B, Hv, Dk, Dv).clone()


def _chunk_major(x: torch.Tensor, N: int, C: int, dtype: torch.dtype, features: bool = True) -> torch.Tensor:
    """[B, T, *heads, (D)] -> [N, B, *heads, C, (D)] contiguous in `dtype`, zero-padded to N*C tokens, in one copy.

    `features`: whether the last dim is a feature dim (q, k, v), which stays last; g and beta have none.
    """
    B, T = x.shape[:2]
    rest = x.shape[2:]
    heads = rest[:-1] if features else rest
    nh = len(heads)
    out = x.new_empty(N, B, *heads, C, *rest[nh:], dtype=dtype)
    # out seen in the input's order [B, N, C, *heads, (D)]
    as_input = out.permute(1, 0, 2 + nh, *range(2, 2 + nh), *range(3 + nh, out.dim()))
    full = T // C
    if full:
        as_input[:, :full].copy_(x[:, : full * C].view(B, full, C, *rest))
    if full < N:
        rem = T - full * C
        as_input[:, full, :rem].copy_(x[:, full * C :])
        as_input[:, full, rem:].zero_()
    return out


def causal_conv1d_silu(
    x: torch.Tensor,
    weight: torch.Tensor,
    conv_state: torch.Tensor | None = None,
    return_state: bool = False,
    ends: tuple[int, ...] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Depthwise causal conv (no bias) then SiLU, channels last.

    x [B,L,C] (as the input projection makes it); weight [C,K] or [C,1,K], weight[:, K-1] multiplies the current
    token; conv_state [B,C,K-1] holds the K-1 inputs before x (zeros when None). The taps are accumulated in at
    least fp32 and rounded once to x's dtype before the SiLU (as F.conv1d does in HF). Returns (y [B,L,C], the new
    conv state [B,C,K-1] of the last K-1 inputs, or None unless return_state). `ends` [B]: each row's real
    length when the rows are right-padded (the state is then taken before each row's padding).
    """
    B, L, C = x.shape
    weight = weight.reshape(C, -1)
    K = weight.shape[-1]
    if conv_state is None:
        padded = F.pad(x, (0, 0, K - 1, 0))  # [B,K-1+L,C]
    else:
        padded = torch.cat((conv_state.transpose(1, 2).to(x.dtype), x), dim=1)
    dtype = compute_dtype(x.dtype, weight.dtype)
    taps = weight.to(dtype).t()  # [K,C]
    wide = padded if padded.dtype == dtype else padded.to(dtype)
    y = wide[:, K - 1 :] * taps[K - 1]
    for i in range(K - 1):
        y.addcmul_(wide[:, i : i + L], taps[i])
    y = F.silu(y.to(x.dtype), inplace=True)
    if not return_state:
        return y, None
    if ends is None:  # a copy: a view would keep the whole padded input [B,K-1+L,C] alive with the state
        return y, padded[:, L:].transpose(1, 2).clone()  # [B,C,K-1]
    tails = torch.stack([padded[row, end : end + K - 1] for row, end in enumerate(ends)])  # [B,K-1,C]
    return y, tails.transpose(1, 2)


@lru_cache(maxsize=1)
def _fla_chunk_kernel():
    """fla's Triton chunk kernel, when fla (and triton) are installed; None otherwise (never on CPU)."""
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_chunk
    except Exception:  # ImportError, or triton failing to find a driver
        return None
    return fla_chunk


# The chunked form holds ~10 buffers of the whole sequence at once (chunk states, decays, U, W, ...): 0.4 GB for
# the 9B's 32 value heads at 2,048 tokens, the largest transient of a decoder step. A longer sequence runs in
# pieces of this many tokens (whole chunks), each continuing the state of the one before: the same recurrence,
# equal within float rounding (float64 to 1e-12, tests/test_gated_delta_rule.py), a quarter of the memory.
PIECE_TOKENS = 512


def _in_pieces(q, k, v, g, beta, initial_state):
    """`chunk_gated_delta_rule` over the sequence PIECE_TOKENS at a time (one call when it is not longer)."""
    T = q.shape[1]
    if T <= PIECE_TOKENS:
        return chunk_gated_delta_rule(q, k, v, g, beta, initial_state)
    out = v.new_empty(v.shape)  # [B, T, Hv, Dv]
    state = initial_state
    for start in range(0, T, PIECE_TOKENS):
        piece = slice(start, start + PIECE_TOKENS)
        out[:, piece], state = chunk_gated_delta_rule(q[:, piece], k[:, piece], v[:, piece], g[:, piece], beta[:, piece], state)
    return out, state


def gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The prefill delta rule: fla's chunk kernel on CUDA when installed, else `chunk_gated_delta_rule`; under
    autograd, a differentiable twin (below; from a zero state it returns no final state).

    Same contract as the twins above (q, k already l2-normalised and q scaled, so fla gets scale=1).
    fla is handed q and k repeated to the value heads, as transformers does.
    """
    if torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v, g, beta)):
        # Gradients (explain's token attributions): the chunked form writes into buffers (out=, in place), which
        # autograd refuses. Whole records from a zero state take the Core ML twin's chunked form (plain ops, as
        # differentiable as written; it keeps no final state: returned as None), anything else the token-by-token one.
        if initial_state is not None:
            return naive_recurrent_gated_delta_rule(q, k, v, g, beta, initial_state)
        work = compute_dtype(q.dtype, k.dtype, v.dtype, g.dtype, beta.dtype)
        out = static_chunk_gated_delta_rule(*(x.to(work) for x in (q, k, v, g, beta)))
        return out.to(v.dtype), None
    kernel = _fla_chunk_kernel() if q.is_cuda else None
    if kernel is None:
        return _in_pieces(q, k, v, g, beta, initial_state)
    ratio = v.shape[2] // q.shape[2]
    work = compute_dtype(q.dtype, v.dtype)
    out, final_state = kernel(
        q.repeat_interleave(ratio, dim=2).to(v.dtype),
        k.repeat_interleave(ratio, dim=2).to(v.dtype),
        v,
        g=g.to(work),
        beta=beta.to(v.dtype),
        scale=1.0,
        initial_state=None if initial_state is None else initial_state.to(work),
        output_final_state=True,
    )
    return out.to(v.dtype), final_state.to(work)
