"""A fixed orthogonal randomized Hadamard rotation of a projection's input (QuaRot's trick for int8 activations).

`y = x W^T = (x R)(W R)^T` for any orthogonal R. With `R = D H` (D a fixed diagonal of +-1 signs, H the
normalized Sylvester Hadamard, block-diagonal with blocks of `block_size(n)`), every output channel of `x R` is a
signed mix of a whole block of input channels, so one channel tens of times larger than the rest is spread over
the block instead of setting the per-token scale alone: per-token int8 (or 7-bit) activations round far less.
`W R` is computed once (at conversion or load) and quantized per output channel like any weight; `x R` on the fly.

`rotate` is the fast path (two small matmuls per block, by the Kronecker factorization of H); `rotate_reference`
its slow twin that builds the dense n x n matrix.
"""

from __future__ import annotations

import functools
import math

import torch

from ..model.precision import FP32, FP64

SIGN_SEED = 0x5EED_C1EF  # the signs are a pure function of (this seed, channel index): no RNG, same on every machine
_GOLDEN = 0x9E3779B97F4A7C15  # splitmix64's increment
_MASK64 = (1 << 64) - 1


def block_size(n: int) -> int:
    """The largest power of two dividing n: the size of the rotation's Hadamard blocks (4096 -> 4096, 96 -> 32)."""
    if n <= 0:
        raise ValueError(f"a rotation needs a positive width, got {n}")
    return n & -n


def _splitmix64(state: int) -> int:
    z = state & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


@functools.lru_cache(maxsize=None)
def signs(n: int) -> torch.Tensor:
    """fp32 [n] of +-1: channel i's sign is the top bit of splitmix64(SIGN_SEED + (i + 1) * golden), so the signs
    are identical on every machine, torch version and call (and `signs(n)[:m] == signs(m)`). Cached: do not modify."""
    block_size(n)  # rejects n <= 0
    bits = [_splitmix64(SIGN_SEED + (i + 1) * _GOLDEN) >> 63 for i in range(n)]
    return 1.0 - 2.0 * torch.tensor(bits, dtype=FP32)  # bit 0 -> +1, bit 1 -> -1


def sylvester(size: int, dtype: torch.dtype = FP64) -> torch.Tensor:
    """The unnormalized Sylvester Hadamard matrix [size, size] of +-1 (size a power of two): H_2 (x) ... (x) H_2."""
    if size <= 0 or size & (size - 1):
        raise ValueError(f"a Sylvester Hadamard matrix needs a power-of-two size, got {size}")
    h2 = torch.tensor([[1.0, 1.0], [1.0, -1.0]], dtype=FP64)
    matrix = torch.ones(1, 1, dtype=FP64)
    while matrix.shape[0] < size:
        matrix = torch.kron(h2, matrix)
    return matrix.to(dtype)


@functools.lru_cache(maxsize=None)
def _normalized_hadamard(size: int) -> torch.Tensor:
    """H_size / sqrt(size), fp32 (exact: its entries are +-2^-k/2 rounded once). Cached: do not modify."""
    return (sylvester(size) / math.sqrt(size)).float()


# Each device's copy of the signs and Hadamard factors, made once: a forward sends nothing up (a GPU's would wait for
# the copy at every projection, and a CUDA graph cannot capture one).
@functools.lru_cache(maxsize=None)
def _signs_on(n: int, device: torch.device) -> torch.Tensor:
    return signs(n).to(device)


@functools.lru_cache(maxsize=None)
def _hadamard_on(size: int, device: torch.device, dtype: torch.dtype = FP32) -> torch.Tensor:
    return _normalized_hadamard(size).to(device=device, dtype=dtype)  # (entries +-2^-k/2: exact in bf16 for even k)


def _block_hadamard(x: torch.Tensor) -> torch.Tensor:
    """x [..., n] fp32 (or bf16) -> x H in x's dtype, H block-diagonal with orthonormal blocks of `block_size(n)`.

    A block b = b1 * b2 is H_b = H_b1 (x) H_b2 (channel i = i1 * b2 + i2), so x_block H_b is H_b1^T X H_b2 with X
    the block as a [b1, b2] matrix; both factors are symmetric. Two matmuls of sqrt(b) per block instead of one of b.
    """
    n = x.shape[-1]
    b = block_size(n)
    b1 = 1 << ((b.bit_length() - 1) // 2)  # b = 2^k: b1 = 2^(k//2)
    b2 = b // b1
    h1 = _hadamard_on(b1, x.device, x.dtype)  # [b1, b1]
    h2 = _hadamard_on(b2, x.device, x.dtype)  # [b2, b2]
    blocks = x.reshape(-1, b2)  # [M * n/b * b1, b2]: every block's rows of b2
    rows = (blocks @ h2).view(-1, b1, b2)  # H_b2 on the last axis, one flat GEMM: [M * n/b, b1, b2]
    return torch.matmul(h1, rows).reshape(x.shape)  # H_b1 on the middle axis (1.5x faster than h1 @ X @ h2 batched)


def rotate(x: torch.Tensor, column_scale: torch.Tensor | None = None, dtype: torch.dtype = FP32) -> torch.Tensor:
    """x [..., n] (any float dtype) -> x R = (x D) H in `dtype` (R orthogonal: D the signs, H `_block_hadamard`'s);
    with `column_scale` [n], (x diag(column_scale)) R, the scaling folded into the signs' pass (in fp32). `dtype` bf16:
    the two products on a GPU's bf16 tensor cores (fp32 sums, each output rounded to bf16), for the activations only."""
    n = x.shape[-1]
    factors = _signs_on(n, x.device) if column_scale is None else _signs_on(n, x.device) * column_scale  # [n]
    return _block_hadamard((x.float() * factors).to(dtype))


def unrotate(y: torch.Tensor) -> torch.Tensor:
    """y [..., n] -> y R^T = (y H) D in fp32: `rotate`'s inverse (H is symmetric and orthogonal)."""
    return _block_hadamard(y.float()) * _signs_on(y.shape[-1], y.device)


def rotation_matrix(n: int) -> torch.Tensor:
    """The dense R = diag(signs) @ blockdiag(H_b / sqrt(b), ...) [n, n] in float64: rotate's matrix, built plainly."""
    b = block_size(n)
    block = sylvester(b) / math.sqrt(b)  # [b, b]
    row_signs = signs(n).double()  # [n]
    matrix = torch.zeros(n, n, dtype=FP64)
    for start in range(0, n, b):  # diag(signs) @ blockdiag: the rows of block j times their signs
        matrix[start : start + b, start : start + b] = row_signs[start : start + b, None] * block
    return matrix


def rotate_reference(x: torch.Tensor) -> torch.Tensor:
    """rotate's slow twin: x [..., n] -> x @ R in float64, with R built densely (`rotation_matrix`)."""
    return x.double() @ rotation_matrix(x.shape[-1])
