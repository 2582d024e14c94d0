"""The Qwen3.5 vision tower (transformers' `Qwen3_5VisionModel`) and the decoder's 3-D M-RoPE positions.

Parameter names are the checkpoint names under `model.visual.` (patch_embed.proj, pos_embed, blocks.{i}.norm1 /
attn.qkv / attn.proj / norm2 / mlp.linear_fc1 / mlp.linear_fc2, merger.norm / linear_fc1 / linear_fc2), so a
loader fills it by name, strictly, as the decoder.

    pixel_values [N, C*T*p*p] (request/images.py, request/videos.py) -> patch embedding (the Conv3d with stride =
    kernel as the matmul it is; T: an image repeated, or a video's frame pair) + the learned position table
    resampled bilinearly (align_corners) to each image's grid -> `depth` pre-norm blocks (LayerNorm eps 1e-6;
    attention within each image or frame pair only, 2-D rotary over (row, col); tanh-GELU MLP) -> merger:
    LayerNorm, each 2x2 block of patches concatenated, Linear, GELU, Linear -> [N / 4, out_hidden_size], one
    row per image or video pad token.

Patches arrive in merge-block order (request/ writes them so; a video's frame pairs one after the other): the 4
patches of a 2x2 block are consecutive, so the merger is a reshape.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["VisionConfig", "VisionTower", "rope_positions"]


@dataclass(frozen=True)
class VisionConfig:
    """`vision_config` of a release (the keys the tower reads)."""

    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    out_hidden_size: int
    num_position_embeddings: int
    patch_size: int = 16
    spatial_merge_size: int = 2
    temporal_patch_size: int = 2
    in_channels: int = 3
    hidden_act: str = "gelu_pytorch_tanh"
    rope_theta: float = 10000.0

    @classmethod
    def from_release_config(cls, config: Mapping) -> VisionConfig:
        vision = config["vision_config"]
        known = {name for name in cls.__dataclass_fields__ if name != "rope_theta"}
        kwargs = {key: value for key, value in vision.items() if key in known}
        rope = vision.get("rope_parameters") or {}
        if rope.get("rope_type", "axial") != "axial":
            raise ValueError(f"vision rope_type {rope.get('rope_type')!r} is not supported (only 'axial')")
        if kwargs.get("hidden_act", "gelu_pytorch_tanh") != "gelu_pytorch_tanh":
            raise ValueError(f"vision hidden_act {kwargs['hidden_act']!r} is not supported")
        return cls(**kwargs, rope_theta=float(rope.get("rope_theta", 10000.0)))

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_dim(self) -> int:
        return self.in_channels * self.temporal_patch_size * self.patch_size**2


class PatchEmbed(nn.Module):
    def __init__(self, config: VisionConfig):
        super().__init__()
        p, t = config.patch_size, config.temporal_patch_size
        self.proj = nn.Conv3d(config.in_channels, config.hidden_size, kernel_size=(t, p, p), stride=(t, p, p), bias=True)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        # A stride-equals-kernel Conv3d over one patch is a matmul with the flattened kernel [h, C*T*p*p].
        weight = self.proj.weight
        return F.linear(pixels.to(weight.dtype), weight.reshape(weight.shape[0], -1), self.proj.bias)  # [N, h]


class VisionAttention(nn.Module):
    def __init__(self, config: VisionConfig):
        super().__init__()
        self.heads = config.num_heads
        self.qkv = nn.Linear(config.hidden_size, 3 * config.hidden_size, bias=True)
        self.proj = nn.Linear(config.hidden_size, config.hidden_size, bias=True)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        N = x.shape[0]
        query, key, value = self.qkv(x).reshape(N, 3, self.heads, -1).unbind(1)  # [N, H, hd] each
        query, key = _rotate(query, cos, sin), _rotate(key, cos, sin)
        outputs = []
        for q, k, v in zip(*(t.transpose(0, 1).split(lengths, dim=1) for t in (query, key, value))):  # per image
            outputs.append(F.scaled_dot_product_attention(q[None], k[None], v[None])[0])  # [H, n, hd]
        return self.proj(torch.cat(outputs, dim=1).transpose(0, 1).reshape(N, -1))


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Full-width NeoX rotation in fp32 (as HF's apply_rotary_pos_emb_vision); x [N, H, hd], cos/sin [N, hd]."""
    dtype, x = x.dtype, x.float()
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return (x * cos[:, None] + rotated * sin[:, None]).to(dtype)


class VisionMLP(nn.Module):
    def __init__(self, config: VisionConfig):
        super().__init__()
        self.linear_fc1 = nn.Linear(config.hidden_size, config.intermediate_size, bias=True)
        self.linear_fc2 = nn.Linear(config.intermediate_size, config.hidden_size, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(F.gelu(self.linear_fc1(x), approximate="tanh"))


class VisionBlock(nn.Module):
    def __init__(self, config: VisionConfig):
        super().__init__()
        self.norm1 = nn.LayerNorm(config.hidden_size, eps=1e-6)
        self.norm2 = nn.LayerNorm(config.hidden_size, eps=1e-6)
        self.attn = VisionAttention(config)
        self.mlp = VisionMLP(config)

    def forward(self, x, cos, sin, lengths):
        x = x + self.attn(self.norm1(x), cos, sin, lengths)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    def __init__(self, config: VisionConfig):
        super().__init__()
        merged = config.hidden_size * config.spatial_merge_size**2
        self.norm = nn.LayerNorm(config.hidden_size, eps=1e-6)
        self.linear_fc1 = nn.Linear(merged, merged)
        self.linear_fc2 = nn.Linear(merged, config.out_hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(x).reshape(-1, self.linear_fc1.in_features)  # [N/4, 4h]: a 2x2 block per row
        return self.linear_fc2(F.gelu(self.linear_fc1(x)))


class VisionTower(nn.Module):
    """pixel_values [N, patch_dim] and grid_thw (one (t, h, w) per image or video; t: a video's frame pairs)
    -> [N / merge², out_hidden_size]."""

    def __init__(self, config: VisionConfig):
        super().__init__()
        self.config = config
        self.patch_embed = PatchEmbed(config)
        self.pos_embed = nn.Embedding(config.num_position_embeddings, config.hidden_size)
        self.blocks = nn.ModuleList(VisionBlock(config) for _ in range(config.depth))
        self.merger = PatchMerger(config)

    @property
    def dtype(self) -> torch.dtype:
        return self.pos_embed.weight.dtype

    def forward(self, pixel_values: torch.Tensor, grid_thw: Sequence[Sequence[int]]) -> torch.Tensor:
        device = self.pos_embed.weight.device
        rows, cols = _patch_coordinates(grid_thw, self.config.spatial_merge_size, device)  # [N] each
        x = self.patch_embed(pixel_values.to(device))
        x = x + self._position_table(grid_thw, rows, cols).to(x.dtype)
        cos, sin = self._rotary(rows, cols)
        lengths = [h * w for t, h, w in grid_thw for _ in range(t)]  # attention within each image and frame pair
        for block in self.blocks:
            x = block(x, cos, sin, lengths)
        return self.merger(x)

    def _position_table(self, grid_thw, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
        """The square learned table resampled to each grid: bilinear, align_corners=True, border taps clamped."""
        side = int(self.config.num_position_embeddings**0.5)
        heights = torch.cat([torch.full((t * h * w,), h) for t, h, w in grid_thw]).to(rows.device)
        widths = torch.cat([torch.full((t * h * w,), w) for t, h, w in grid_thw]).to(rows.device)
        h_taps, h_weights = _bilinear_taps(rows, heights, side)
        w_taps, w_weights = _bilinear_taps(cols, widths, side)
        indices = (h_taps[:, :, None] * side + w_taps[:, None, :]).reshape(-1, 4)  # [N, 4]
        weights = (h_weights[:, :, None] * w_weights[:, None, :]).reshape(-1, 4)
        return (self.pos_embed(indices) * weights[:, :, None]).sum(1)  # [N, h]

    def _rotary(self, rows: torch.Tensor, cols: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [N, head_dim] (fp32): frequencies over head_dim/2 shared by rows and columns, [rows | cols] twice."""
        spatial = self.config.head_dim // 2
        inv_freq = 1.0 / (self.config.rope_theta ** (torch.arange(0, spatial, 2, dtype=torch.float, device=rows.device) / spatial))
        angles = torch.cat([rows[:, None].float() * inv_freq, cols[:, None].float() * inv_freq], dim=-1)
        angles = torch.cat([angles, angles], dim=-1)
        return angles.cos(), angles.sin()


def _patch_coordinates(grid_thw, merge: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, col) of every patch in merge-block order (block row, block col, row in block, col in block)."""
    rows, cols = [], []
    for t, h, w in grid_thw:
        r, c = torch.meshgrid(torch.arange(h, device=device), torch.arange(w, device=device), indexing="ij")
        shape = (h // merge, merge, w // merge, merge)
        rows.append(r.reshape(shape).transpose(1, 2).flatten().repeat(t))
        cols.append(c.reshape(shape).transpose(1, 2).flatten().repeat(t))
    return torch.cat(rows), torch.cat(cols)


def _bilinear_taps(index: torch.Tensor, size: torch.Tensor, side: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Two taps into a `side`-long table for positions `index` of an axis of `size`, align_corners=True."""
    source = index.float() * (side - 1) / torch.clamp(size - 1, min=1)
    floor = torch.floor(source)
    offsets = torch.arange(0, 2, device=index.device)
    taps = (floor.long()[:, None] + offsets).clamp(0, side - 1)
    weights = (1 - (source[:, None] - floor[:, None] - offsets).abs()).clamp(min=0)
    return taps, weights


def rope_positions(
    input_ids: Sequence[int], grids: Sequence[Sequence[int]], media_ids: set[int], merge: int
) -> torch.Tensor:
    """The decoder's (temporal, height, width) positions [3, T] of a record, as `get_rope_index`: text runs count
    on from the last position on all three axes; a run of media pad tokens (one per grid, in order) takes
    t, start + row, start + col over its merged grid, and moves the next position on by max(h, w) / merge."""
    pieces: list[torch.Tensor] = []
    grid_iter = iter(grids)
    position = 0
    for is_media, run in itertools.groupby(input_ids, key=lambda token: token in media_ids):
        count = len(list(run))
        if not is_media:
            pieces.append(torch.arange(position, position + count).expand(3, -1))
            position += count
            continue
        t, h, w = next(grid_iter)
        h, w = h // merge, w // merge
        if t * h * w != count:
            raise ValueError(f"a run of {count} media tokens for a grid of {t}x{h}x{w} merged patches")
        temporal, height, width = torch.meshgrid(torch.arange(t), torch.arange(h), torch.arange(w), indexing="ij")
        pieces.append(torch.stack([temporal, height, width]).reshape(3, -1) + position)
        position += max(h, w)
    return torch.cat(pieces, dim=1)
