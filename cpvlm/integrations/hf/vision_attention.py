"""The vision tower under ``vision="split"``: its attention through AttentionInterface, its inputs
for exactly the local patches.

Legend: n local patches, m merge size, H heads, D head width.

The towers that split take precomputed per-patch inputs as keywords (transformers' ``vision_utils``:
``position_ids``, ``cu_seqlens``, ``window_index``, ``interp_indices``...): ``SplitTower`` computes
them with the same functions for each whole unit and takes the rows of the local patches, so the
rotary angles and interpolated position embeddings are those of the one-process tower. It passes
``cu_seqlens = [0, n]`` (and the same for windows, with the identity window order: the patches
arrive in window order already), so the tower's non-flash path makes one attention call per block
with all local patches, and ``SPLIT_ATTENTION``, selected for the tower only, replaces it with
``SplitAttention.attend`` (SDPA over whole units, ``cp_attention(causal=False)`` over sharded
ones). Without the ``cpvlm_vision`` keyword it is transformers' sdpa attention: the model stays
usable on one device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from cpvlm.vision.split import Piece, SplitAttention, UnitOrder

SPLIT_ATTENTION = "cpvlm_vision_split"
"""The vision tower's attention implementation name under ``vision="split"``."""


@dataclass(frozen=True)
class VisionSplitContext:
    """What the tower's attention calls need: the split attention and its windowed blocks."""

    attention: SplitAttention
    windowed: frozenset[int]  # id() of the attention modules of windowed blocks


def split_vision_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    cpvlm_vision: VisionSplitContext | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    if cpvlm_vision is None:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    if dropout:
        raise ValueError(f"vision attention dropout {dropout} is not supported with vision='split'")
    windowed = id(module) in cpvlm_vision.windowed
    out = cpvlm_vision.attention.attend(query, key, value, windowed=windowed, scale=scaling)
    return out, None


AttentionInterface.register(SPLIT_ATTENTION, split_vision_attention)
AttentionMaskInterface.register(SPLIT_ATTENTION, sdpa_mask)


def local_rows(pieces: tuple[Piece, ...], per_unit) -> torch.Tensor:
    """The rows of ``per_unit(grid [1, 3])`` (a per-patch tensor of one unit) at each piece's
    patches, one piece after another; computed once per distinct grid."""
    cache: dict[tuple, torch.Tensor] = {}
    parts = []
    for p in pieces:
        if p.grid not in cache:
            cache[p.grid] = per_unit(torch.tensor([p.grid], dtype=torch.long))
        parts.append(cache[p.grid].index_select(0, p.patches.to(cache[p.grid].device)))
    return torch.cat(parts)


def single_call(n: int, device) -> torch.Tensor:
    """``cu_seqlens`` of one attention call over all n local patches."""
    return torch.tensor([0, n], dtype=torch.int32, device=device)


class SplitTower:
    """A family's tower as ``VisionDataParallel``'s split encoder (``unit_order``,
    ``encode_local``); selects ``SPLIT_ATTENTION`` for the tower's attention."""

    def __init__(self, adapter, model: nn.Module):
        self.adapter, self.model = adapter, model
        self.tower = adapter.vision_tower(model)
        self.tower.set_attn_implementation(SPLIT_ATTENTION)
        self._orders: dict[tuple, UnitOrder] = {}

    def unit_order(self, grid: tuple[int, int, int]) -> UnitOrder:
        if grid not in self._orders:
            self._orders[grid] = self.adapter.unit_order(grid)
        return self._orders[grid]

    def encode_local(self, pixel_rows: torch.Tensor, pieces, attention: SplitAttention):
        windowed = frozenset(id(m) for m in self.adapter.windowed_attention(self.tower))
        kwargs = self.adapter.split_tower_kwargs(self.tower, pieces, pixel_rows.shape[0])
        m = self.adapter.merge_size
        # The grid is not read: every per-patch input is precomputed in kwargs.
        grid = torch.tensor([[1, m, pixel_rows.shape[0] // m]], device=pixel_rows.device)
        context = VisionSplitContext(attention, windowed)
        return self.adapter.encode(self.model, pixel_rows, grid, cpvlm_vision=context, **kwargs)
