"""The vision tower under ``vision="split"``: its attention through AttentionInterface, its inputs
for exactly the local patches.

Legend: n local patches, m merge size, H heads, D head width.

The towers that split take precomputed per-patch inputs as keywords (transformers' ``vision_utils``:
``position_ids``, ``cu_seqlens``, ``window_index``, ``interp_indices``...): ``SplitTower`` computes
them with the functions the tower's own module calls (``tower_function``), on each whole unit's
grid, and takes the rows of the local patches (``local_rows``), so every float32 step inside them
(the bilinear weights of Qwen3-VL's position table) rounds as in the one-process tower: the rotary
angles and interpolated position embeddings are that tower's, bit for bit. A keyword the tower
does not take would leave it computing its own table from the placeholder grid; it reaches the
attention call instead, which raises. It passes
``cu_seqlens = [0, n]`` (and the same for windows, with the identity window order: the patches
arrive in window order already), so the tower's non-flash path makes one attention call per block
with all local patches, and ``SPLIT_ATTENTION``, selected for the tower only, replaces it with
``SplitAttention.attend`` (SDPA over whole units, ``cp_attention(causal=False)`` over sharded
ones). Without the ``cpvlm_vision`` keyword it is transformers' sdpa attention: the model stays
usable on one device.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch
from torch import nn
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from cpvlm.encoders.split import Piece, SplitAttention, UnitOrder

SPLIT_ATTENTION = "cpvlm_vision_split"
"""The vision tower's attention implementation name under ``vision="split"``."""


@dataclass(frozen=True)
class VisionSplitContext:
    """What the tower's attention calls need: the split attention and its windowed blocks."""

    attention: SplitAttention
    windowed: frozenset[int]  # id() of the attention modules of windowed blocks
    precomputed: frozenset[str] = frozenset()  # the keywords the tower must have taken


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
    untaken = sorted(cpvlm_vision.precomputed & kwargs.keys())
    if untaken:
        raise ValueError(
            f"vision='split': {type(module).__module__} did not take the precomputed {untaken}, "
            "so its tower computed them from the placeholder grid; this transformers version's "
            "tower is not supported with vision='split' (use vision='route')"
        )
    windowed = id(module) in cpvlm_vision.windowed
    out = cpvlm_vision.attention.attend(query, key, value, windowed=windowed, scale=scaling)
    return out, None


AttentionInterface.register(SPLIT_ATTENTION, split_vision_attention)
AttentionMaskInterface.register(SPLIT_ATTENTION, sdpa_mask)


def tower_function(tower: nn.Module, name: str):
    """The function ``name`` as the tower's own module calls it (transformers' ``vision_utils``
    helper that its forward uses), so that a piece's table is computed as the tower computes the
    whole unit's. The first class of the tower's MRO whose module has it: FSDP2's ``fully_shard``
    subclasses the tower in a torch module."""
    for cls in type(tower).__mro__:
        fn = getattr(sys.modules.get(cls.__module__), name, None)
        if callable(fn):
            return fn
    raise ValueError(
        f"vision='split': the module of {type(tower).__name__} has no {name}; this transformers "
        "version's tower is not supported with vision='split' (use vision='route')"
    )


def local_rows(pieces: tuple[Piece, ...], per_unit):
    """The rows of ``per_unit(grid [1, 3])`` (a per-patch tensor of one whole unit, or a tuple of
    them) at each piece's patches, one piece after another; computed once per distinct grid and
    call: each rank holding a piece pays, in parallel, what the one-process tower pays for the
    whole unit's table (O(its patches) host work, against O(patches x width x depth) tower work)."""
    cache: dict[tuple, tuple[torch.Tensor, ...]] = {}
    parts = []
    for p in pieces:
        if p.grid not in cache:
            table = per_unit(torch.tensor([p.grid], dtype=torch.long))
            cache[p.grid] = table if isinstance(table, tuple) else (table,)
        parts.append([t.index_select(0, p.patches.to(t.device)) for t in cache[p.grid]])
    out = tuple(torch.cat(column) for column in zip(*parts))
    return out if len(out) > 1 else out[0]


def single_call(n: int, device) -> torch.Tensor:
    """``cu_seqlens`` of one attention call over all n local patches."""
    return torch.tensor([0, n], dtype=torch.int32, device=device)


class SplitTower:
    """A family's tower as ``EncoderDataParallel``'s split encoder (``unit_order``,
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
        # Computed on the host from the grids, used on the pixels' device, as the one-process
        # tower uses its own (elementwise float32 steps, correctly rounded on either).
        kwargs = {k: v.to(pixel_rows.device) for k, v in kwargs.items()}
        m = self.adapter.merge_size
        # The grid is not read: every per-patch input is precomputed in kwargs.
        grid = torch.tensor([[1, m, pixel_rows.shape[0] // m]], device=pixel_rows.device)
        context = VisionSplitContext(attention, windowed, frozenset(kwargs))
        return self.adapter.encode(self.model, pixel_rows, grid, cpvlm_vision=context, **kwargs)
