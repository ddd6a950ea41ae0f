"""A small Qwen-VL-shaped vision tower for tests and benchmarks (no distributed code).

Legend: N pixel rows (patches), C*T*p*p values each; F hidden width; m merge size; a unit of grid
(t, h, w) gives t*h*w/m**2 output rows.

Same interface and layout as the Qwen2.5-VL / Qwen3-VL towers: pixel rows in merge-window order,
frame-major; a Conv3d patch embedding; attention within each temporal frame; a merger of m x m
patches; optional deepstack taps (a merger on the output of chosen blocks). Because every frame
is processed independently, a video's frames can be encoded on different ranks.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import nn

from cpvlm.encoders.cost import EncoderCost, block_linear_macs


def frame_positions(grid_thw: torch.Tensor, merge_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, column) of every patch within its frame, in merge-window order, frame-major."""
    hs, ws = [], []
    for t, h, w in grid_thw.tolist():
        rows, cols = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
        block = (h // merge_size, merge_size, w // merge_size, merge_size)
        hs.append(rows.reshape(block).transpose(1, 2).flatten().repeat(t))
        ws.append(cols.reshape(block).transpose(1, 2).flatten().repeat(t))
    empty = torch.empty(0, dtype=torch.long)
    return (torch.cat(hs) if hs else empty), (torch.cat(ws) if ws else empty)


class _Block(nn.Module):
    def __init__(self, hidden: int, heads: int):
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(hidden)
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)
        self.norm2 = nn.LayerNorm(hidden)
        self.mlp = nn.Sequential(
            nn.Linear(hidden, 2 * hidden), nn.GELU(), nn.Linear(2 * hidden, hidden)
        )

    def forward(self, x_NF: torch.Tensor, frame_lens: list[int]) -> torch.Tensor:
        n, f = x_NF.shape
        q, k, v = self.qkv(self.norm1(x_NF)).view(n, 3, self.heads, f // self.heads).unbind(1)
        outs = []
        for qs, ks, vs in zip(q.split(frame_lens), k.split(frame_lens), v.split(frame_lens)):
            scores_HNN = torch.einsum("nhd,mhd->hnm", qs, ks) / math.sqrt(f // self.heads)
            outs.append(torch.einsum("hnm,mhd->nhd", scores_HNN.softmax(-1), vs).reshape(-1, f))
        attn = torch.cat(outs) if outs else x_NF[:0]
        x_NF = x_NF + self.proj(attn)
        return x_NF + self.mlp(self.norm2(x_NF))


class _Merger(nn.Module):
    def __init__(self, hidden: int, merge_size: int, out_dim: int):
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        width = hidden * merge_size**2
        self.mlp = nn.Sequential(nn.Linear(width, width), nn.GELU(), nn.Linear(width, out_dim))
        self.width = width

    def forward(self, x_NF: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.norm(x_NF).reshape(-1, self.width))


class ToyVisionTower(nn.Module):
    """``tower(pixel_values [N, C*T*p*p], grid_thw [U, 3])`` -> ``[N/m**2, out_dim]``.

    With ``deepstack`` block indexes it returns ``(embeddings, [one [N/m**2, out_dim] per tap])``
    like Qwen3-VL's tower.
    """

    def __init__(
        self,
        *,
        in_channels: int = 3,
        temporal_patch_size: int = 2,
        patch_size: int = 2,
        hidden: int = 16,
        heads: int = 2,
        depth: int = 2,
        merge_size: int = 2,
        out_dim: int = 12,
        deepstack: Sequence[int] = (0,),
        max_side: int = 64,
    ):
        super().__init__()
        self.in_channels, self.temporal_patch_size = in_channels, temporal_patch_size
        self.patch_size, self.merge_size = patch_size, merge_size
        self.patch_embed = nn.Conv3d(
            in_channels,
            hidden,
            kernel_size=(temporal_patch_size, patch_size, patch_size),
            stride=(temporal_patch_size, patch_size, patch_size),
            bias=False,
        )
        self.pos_h = nn.Embedding(max_side, hidden)
        self.pos_w = nn.Embedding(max_side, hidden)
        self.blocks = nn.ModuleList(_Block(hidden, heads) for _ in range(depth))
        self.merger = _Merger(hidden, merge_size, out_dim)
        self.deepstack = tuple(deepstack)
        self.deepstack_mergers = nn.ModuleList(
            _Merger(hidden, merge_size, out_dim) for _ in self.deepstack
        )

    @property
    def pixel_dim(self) -> int:
        return self.in_channels * self.temporal_patch_size * self.patch_size**2

    def vision_cost(self) -> EncoderCost:
        """Forward MACs from the tower's shape (EncoderDataParallel balances units by it)."""
        width, m = self.patch_embed.out_channels, self.merge_size
        merger = m * m * width * width + width * self.merger.mlp[-1].out_features
        linear = (
            self.pixel_dim * width
            + len(self.blocks) * block_linear_macs(width, 2 * width, gated=False)
            + (1 + len(self.deepstack)) * merger
        )
        return EncoderCost(linear_per_patch=linear, pair=2 * width, full_blocks=len(self.blocks))

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor):
        c, t, p = self.in_channels, self.temporal_patch_size, self.patch_size
        x = pixel_values.to(self.patch_embed.weight.dtype).view(-1, c, t, p, p)
        x_NF = self.patch_embed(x).flatten(1)
        rows, cols = frame_positions(grid_thw, self.merge_size)
        x_NF = x_NF + self.pos_h(rows.to(x_NF.device)) + self.pos_w(cols.to(x_NF.device))
        frame_lens = [h * w for t_, h, w in grid_thw.tolist() for _ in range(t_)]
        taps = []
        for i, block in enumerate(self.blocks):
            x_NF = block(x_NF, frame_lens)
            if i in self.deepstack:
                taps.append(self.deepstack_mergers[self.deepstack.index(i)](x_NF))
        out = self.merger(x_NF)
        return (out, taps) if self.deepstack else out
