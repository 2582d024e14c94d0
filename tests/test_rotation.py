"""The randomized Hadamard rotation (checkpoint/rotation.py): the fast path against its dense twin, orthogonality,
invariance of a product, pinned signs, and an outlier channel spread over its block."""

from __future__ import annotations

import math

import pytest
import torch

from clef_flash.checkpoint.rotation import block_size, rotate, rotate_reference, rotation_matrix, signs

WIDTHS = (1, 2, 3, 64, 96, 256, 4096, 12288)
ROWS = (1, 7, 65)


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    expected = expected.double()
    return float((actual.double() - expected).norm() / expected.norm().clamp_min(1e-300))


@pytest.mark.parametrize("n, expected", [(1, 1), (2, 2), (3, 1), (64, 64), (96, 32), (4096, 4096), (12288, 4096)])
def test_block_size(n, expected):
    assert block_size(n) == expected


@pytest.mark.parametrize("n", [0, -4])
def test_block_size_rejects_nonpositive_widths(n):
    with pytest.raises(ValueError, match="positive width"):
        block_size(n)


@pytest.mark.parametrize("n", WIDTHS)
def test_rotate_matches_dense_reference(n):
    generator = torch.Generator().manual_seed(n)
    inputs = [torch.randn(rows, n, generator=generator) for rows in ROWS]
    expected = rotate_reference(torch.cat(inputs)).split(ROWS)  # one dense R per width (1.2 GB at 12288)
    for rows, x, reference in zip(ROWS, inputs, expected):
        actual = rotate(x)
        error = relative_error(actual, reference)
        print(f"n={n} M={rows}: relative error {error:.2e}")
        assert actual.dtype == torch.float32 and actual.shape == x.shape
        assert error < 1e-5


def test_rotate_keeps_leading_dimensions_and_reads_any_float_dtype():
    x = torch.randn(2, 5, 96, generator=torch.Generator().manual_seed(0)).bfloat16()  # [B, L, n]
    actual = rotate(x)
    assert actual.dtype == torch.float32 and actual.shape == (2, 5, 96)
    assert relative_error(actual, rotate_reference(x)) < 1e-6


@pytest.mark.parametrize("n", (2, 3, 64, 96, 256))
def test_rotation_is_orthogonal(n):
    rotation = rotate(torch.eye(n))  # row i: e_i R
    error = relative_error(rotation, rotation_matrix(n))
    gram = rotation.double() @ rotation.double().t()
    print(f"n={n}: R vs dense {error:.2e}, max |R R^T - I| {float((gram - torch.eye(n, dtype=torch.float64)).abs().max()):.2e}")
    assert error < 1e-6
    torch.testing.assert_close(gram, torch.eye(n, dtype=torch.float64), atol=1e-6, rtol=0)


@pytest.mark.parametrize("n", (96, 4096))
def test_rotating_both_sides_keeps_the_product(n):
    generator = torch.Generator().manual_seed(1)
    x, weight = torch.randn(7, n, generator=generator), torch.randn(33, n, generator=generator)  # [M, I], [O, I]
    rotated = rotate(x) @ rotate(weight).t()  # [M, O]
    error = relative_error(rotated, x.double() @ weight.double().t())
    print(f"n={n}: (xR)(WR)^T vs x W^T relative error {error:.2e}")
    assert error < 1e-5


def test_signs_are_pinned_and_stable():
    first = signs(4096)
    assert first.dtype == torch.float32 and set(first.unique().tolist()) == {-1.0, 1.0}
    assert torch.equal(signs(4096), first) and torch.equal(signs(12288)[:4096], first)
    assert first[:16].tolist() == [1, 1, 1, 1, -1, 1, -1, 1, 1, -1, 1, -1, 1, 1, -1, -1]
    assert float(first.sum()) == 38.0


@pytest.mark.parametrize("n, channel", [(4096, 17), (12288, 9000), (96, 95)])
def test_an_outlier_channel_is_spread_over_its_block(n, channel):
    b = block_size(n)
    outlier = torch.zeros(n).index_fill_(0, torch.tensor([channel]), 50.0)  # [n]: one channel 50, the rest 0
    spread = rotate(outlier)  # [n]
    in_block = spread[channel // b * b : (channel // b + 1) * b]
    assert float(spread.abs().max()) == pytest.approx(50.0 / math.sqrt(b), rel=1e-6)
    torch.testing.assert_close(in_block.abs(), torch.full((b,), 50.0 / math.sqrt(b)), rtol=1e-6, atol=0)
    assert int((spread != 0).sum()) == b  # and no further
