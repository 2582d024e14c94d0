"""The gated delta rule in ops that Core ML converts: fixed-size chunks, no data-dependent control flow.

A twin of `gated_delta_rule.chunk_gated_delta_rule` (same contract for q, k, v, g, beta; no initial state)
for the export modules (model/export.py). What differs, and why:

* The triangular system (I + A)^-1 is inverted by block recursion (`unit_lower_inverse`) with matmuls and
  constant masks, instead of `solve_triangular` (no Core ML op) or a power series (it overflows in fp16
  on real layers, as the Core ML port found).
* The chunk count is fixed by the traced length, so the loop over chunks unrolls into a static graph.
* Decays are masked *before* the exp with a large finite negative (no inf, no NaN in fp16).
* Grouped heads are expanded to the value heads (expand + reshape, no repeat_interleave).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

MASKED_LOG = -1.0e4  # exp() of it is 0 in fp16 and fp32; finite, so `x * 0` never makes a NaN


def static_shape(x: torch.Tensor) -> tuple[int, ...]:
    """x's sizes as plain ints: a trace records them as constants (each export function has a fixed shape),
    not as size ops, which coremltools 9.0 fails to fold under NumPy >= 2.4."""
    return tuple(int(size) for size in x.shape)


def unit_lower_inverse(strict_lower: torch.Tensor) -> torch.Tensor:
    """(I + A)^-1 for A [..., C, C] strictly lower triangular; C a power of two.

    Block recursion: X starts as the inverse of the 1 x 1 diagonal blocks (I). With X the inverse of the
    b x b diagonal blocks, the 2b x 2b blocks' inverse is X - X (A restricted to the blocks below those
    diagonal blocks, inside each 2b block) X, since [[P, 0], [M, R]]^-1 = [[P^-1, 0], [-R^-1 M P^-1, R^-1]].
    log2(C) steps of two matmuls each; exact in exact arithmetic, no growing powers of A.
    """
    size = static_shape(strict_lower)[-1]
    if size & (size - 1):
        raise ValueError(f"unit_lower_inverse needs a power-of-two size, not {size}")
    rows = torch.arange(size)

    def below(block: int) -> torch.Tensor:  # [C, C] constant: the blocks under each b x b diagonal block
        same_pair = (rows[:, None] // (2 * block)) == (rows[None, :] // (2 * block))
        other_half = (rows[:, None] // block) != (rows[None, :] // block)
        return (same_pair & other_half).to(strict_lower.dtype)

    eye = (rows[:, None] == rows[None, :]).to(strict_lower.dtype)
    inverse = eye - strict_lower * below(1)  # the first step with X = I, broadcast (no constant of A's size)
    block = 2
    while block < size:
        inverse = inverse - inverse @ (strict_lower * below(block)) @ inverse
        block *= 2
    return inverse


def static_chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    chunk_size: int = 64,
) -> torch.Tensor:
    """q, k [B, T, Hk, Dk] (l2-normalised, q scaled); v [B, T, Hv, Dv]; g, beta [B, T, Hv] -> o [B, T, Hv, Dv].

    The chunked (UT) form of `chunk_gated_delta_rule` from a zero state, computed in the inputs' dtype
    (the caller traces it in fp32; Core ML runs it in fp16). T is zero-padded to whole chunks (inert).
    """
    B, T, Hk, Dk = static_shape(k)
    Hv, Dv = static_shape(v)[-2:]
    ratio = Hv // Hk
    C = chunk_size
    N = -(-T // C)
    pad = N * C - T

    def chunked(x: torch.Tensor) -> torch.Tensor:  # [B, T, Hv, *] -> [B, Hv, N, C, *]
        x = F.pad(x, (0, 0) * (x.dim() - 2) + (0, pad)) if pad else x
        x = x.reshape(B, N, C, Hv, *static_shape(x)[3:])
        return x.permute(0, 3, 1, 2, *range(4, x.dim()))

    def grouped(x: torch.Tensor) -> torch.Tensor:  # [B, T, Hk, Dk] -> [B, T, Hv, Dk], value head j reads j // ratio
        return x[:, :, :, None, :].expand(B, T, Hk, ratio, Dk).reshape(B, T, Hv, Dk)

    q_, k_, v_ = chunked(grouped(q)), chunked(grouped(k)), chunked(v)  # [B, Hv, N, C, D]
    g_, beta_ = chunked(g), chunked(beta)  # [B, Hv, N, C]

    rows = torch.arange(C)
    lower = (rows[:, None] >= rows[None, :]).to(q.dtype)  # incl. the diagonal [C, C]
    strict = (rows[:, None] > rows[None, :]).to(q.dtype)
    gamma = g_.cumsum(-1)  # [B, Hv, N, C] log-decay from the chunk start, incl. each token
    exp_gamma = gamma.exp()
    # gamma_r - gamma_s summed directly over s < t <= r, not subtracted: two large cumsums that nearly cancel
    # lose their difference in fp16 (|gamma| ~ 30 leaves it ~2% wrong; exp() turns that into the decay's error).
    # log_decay[r, s] = sum_t g_t [t <= r] [s < t] = (g masked to t <= r) @ strict, as strict[t, s] = [s < t]
    log_decay = (g_[..., None, :] * lower) @ strict  # [B, Hv, N, C, C]
    decay = (log_decay * lower + (1.0 - lower) * MASKED_LOG).exp()  # D [B, Hv, N, C, C], 0 above the diagonal

    system = (k_ @ k_.transpose(-1, -2)) * decay * beta_[..., :, None] * strict  # A, strictly lower
    inverse = unit_lower_inverse(system) * beta_[..., None, :]  # T diag(beta)
    u0 = inverse @ v_  # [B, Hv, N, C, Dv]
    w = (inverse * exp_gamma[..., None, :]) @ k_  # [B, Hv, N, C, Dk]
    attn = (q_ @ k_.transpose(-1, -2)) * decay  # (Q K^T * D)
    q_decayed = q_ * exp_gamma[..., None]
    to_end = decay[..., -1, :]  # exp(gamma_C - gamma_s) [B, Hv, N, C], the last row of D
    k_decayed_t = (k_ * to_end[..., None]).transpose(-1, -2)  # [B, Hv, N, Dk, C]
    chunk_decay = exp_gamma[..., -1:, None]  # exp(gamma_C) [B, Hv, N, 1, 1]

    outputs = [attn[:, :, 0] @ u0[:, :, 0]]  # the first chunk enters with S = 0
    state = k_decayed_t[:, :, 0] @ u0[:, :, 0]  # [B, Hv, Dk, Dv]
    for n in range(1, N):  # N is fixed by the traced length: this unrolls
        u = u0[:, :, n] - w[:, :, n] @ state
        outputs.append(attn[:, :, n] @ u + q_decayed[:, :, n] @ state)
        state = state * chunk_decay[:, :, n] + k_decayed_t[:, :, n] @ u
    out = torch.stack(outputs, dim=2)  # [B, Hv, N, C, Dv]
    out = out.permute(0, 2, 3, 1, 4).reshape(B, N * C, Hv, Dv)
    return out[:, :T] if pad else out
