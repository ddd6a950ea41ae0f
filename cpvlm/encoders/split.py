"""Sequence parallelism inside the vision tower: the patches of sharded units spread over CP ranks.

Legend: m merge size, a group = m x m patches (one merged row), n a rank's local patches, H heads,
D head width, L the tower plan's local length.

Each rank runs the tower once on its local patches: the units it encodes whole, then its stretch
of the sharded units' line (``split_assignment``), each in the tower's own patch order (Qwen2.5-VL
reorders a unit's groups so that every window is contiguous; the others keep the pixel order).
Everything but attention is per patch (patch embedding, norms, MLPs) or per group (the merger),
so it runs on the local patches alone, given their own position embeddings. Attention
(``SplitAttention.attend``) is bidirectional within a unit (full-attention blocks) or within a
window (windowed blocks): over the whole units it is plain SDPA per unit or window; over the
line, ``cp_attention(causal=False)`` with a ``ShardPlan.contiguous`` whose documents are the
sharded units (or their windows) and whose cuts are the ranks' stretches. A merge group never
straddles ranks: cuts are group boundaries.

The output rows (one per local group) are then routed to the owners of their sequence positions
(``route_to_owners``), deepstack rows with them: what route mode does with whole units.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from cpvlm.attention import cp_attention
from cpvlm.distributed.collectives import StepAgreement
from cpvlm.distributed.shard_plan import ShardPlan
from cpvlm.encoders.split_assign import SplitAssignment
from cpvlm.encoders.units import EncoderUnits
from cpvlm.options import AttentionOptions


@dataclass(frozen=True)
class UnitOrder:
    """How a tower orders one unit's groups: ``groups[i]`` is the pixel-order group at tower
    position i, and ``windows`` the window lengths in groups along that order (None: the tower
    has no windowed blocks)."""

    groups: torch.Tensor
    windows: tuple[int, ...] | None = None


def pixel_order(num_groups: int) -> UnitOrder:
    return UnitOrder(torch.arange(num_groups))


@dataclass(frozen=True)
class Piece:
    """Patches of one unit that a rank encodes: ``patches`` index the unit's pixel rows (in the
    tower's order); ``grid`` is the unit's (t, h, w), from which the tower's position embeddings
    for those patches are taken."""

    unit: int
    grid: tuple[int, int, int]
    patches: torch.Tensor


@dataclass
class SplitAttention:
    """The attention of one tower call on a rank: local SDPA over whole units, ``cp_attention``
    over the line. Passed to the tower's attention function, which calls ``attend``."""

    whole_lens: tuple[int, ...]  # patches of each whole unit, in local order
    whole_windows: tuple[int, ...] | None  # patches of each window of the whole units
    plan: ShardPlan | None  # documents: the sharded units (None: nothing is sharded)
    window_plan: ShardPlan | None  # documents: their windows
    line_len: int  # this rank's patches of the line
    group: dist.ProcessGroup | None
    attention: AttentionOptions = AttentionOptions()  # cp_attention's, over the line
    step: StepAgreement | None = None

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        windowed: bool = False,
        scale: float | None = None,
    ) -> torch.Tensor:
        """``[1, n, H, D]`` from ``[1, H, n, D]`` q, k, v of the local patches."""
        if windowed and self.whole_windows is None:
            raise ValueError("SplitAttention: a windowed block, but the tower order has no windows")
        lens = self.whole_windows if windowed else self.whole_lens
        outs, start = [], 0
        for n in lens:
            part = slice(start, start + n)
            outs.append(
                F.scaled_dot_product_attention(
                    q[:, :, part], k[:, :, part], v[:, :, part], scale=scale
                )
            )
            start += n
        plan = self.window_plan if windowed else self.plan
        if plan is not None:
            outs.append(self._line(q[:, :, start:], k[:, :, start:], v[:, :, start:], plan, scale))
            start += self.line_len
        if start != q.shape[2]:
            raise ValueError(f"SplitAttention: {q.shape[2]} local patches, the plan has {start}")
        return torch.cat(outs, dim=2).transpose(1, 2)

    def _line(self, q, k, v, plan: ShardPlan, scale):
        pad = plan.local_len - q.shape[2]
        q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
        out = cp_attention(
            q,
            k,
            v,
            plan=plan,
            group=self.group,
            impl=self.attention.impl,
            ulysses_size=self.attention.ulysses_size,
            causal=False,
            scale=scale,
            step=self.step,
        )
        return out[:, :, : self.line_len]


@dataclass(frozen=True)
class LocalSplit:
    """What one rank encodes under a split assignment, and where every output row goes."""

    pieces: tuple[Piece, ...]  # whole units first (unit order), then the line's pieces
    pixel_index: torch.Tensor  # [n] the batch's pixel rows, in local tower order
    row_ids: torch.Tensor  # [n / m^2] global output row of each local output row
    row_ranks: torch.Tensor  # [R] the rank that encodes each global output row
    whole_lens: tuple[int, ...]
    whole_windows: tuple[int, ...] | None
    plan: ShardPlan | None
    window_plan: ShardPlan | None
    line_len: int


def local_split(
    units: EncoderUnits, orders: Sequence[UnitOrder], sa: SplitAssignment, rank: int
) -> LocalSplit:
    """Rank ``rank``'s share of ``sa`` (every rank computes every rank's row ranks alike)."""
    m2 = units.merge_size**2
    windowed = any(o.windows is not None for o in orders)
    row_ranks = torch.empty(units.row_offsets[-1], dtype=torch.long)
    for r, whole in enumerate(sa.whole):
        for u in whole:
            row_ranks[units.row_offsets[u] : units.row_offsets[u + 1]] = r
        for u, a, b in sa.pieces(r):
            row_ranks[units.row_offsets[u] + orders[u].groups[a:b]] = r

    def piece(u: int, a: int, b: int) -> tuple[Piece, torch.Tensor]:
        groups = orders[u].groups[a:b]
        patches = (groups.unsqueeze(1) * m2 + torch.arange(m2)).reshape(-1)
        return Piece(u, units.grids[u], patches), units.row_offsets[u] + groups

    parts = [piece(u, 0, units.row_counts[u]) for u in sa.whole[rank]]
    parts += [piece(u, a, b) for u, a, b in sa.pieces(rank)]
    pixel_index = [units.pixel_offsets[p.unit] + p.patches for p, _ in parts]
    whole = [units.pixel_counts[u] for u in sa.whole[rank]]
    whole_windows = None
    if windowed:
        whole_windows = tuple(g * m2 for u in sa.whole[rank] for g in orders[u].windows)
    plan = window_plan = None
    if sa.split:
        cuts = [c * m2 for c in sa.cuts]
        plan = ShardPlan.contiguous([units.pixel_counts[u] for u in sa.split], cuts)
        if windowed:
            windows = [g * m2 for u in sa.split for g in orders[u].windows]
            window_plan = ShardPlan.contiguous(windows, cuts)
    return LocalSplit(
        pieces=tuple(p for p, _ in parts),
        pixel_index=_cat(pixel_index),
        row_ids=_cat([rows for _, rows in parts]),
        row_ranks=row_ranks,
        whole_lens=tuple(whole),
        whole_windows=whole_windows,
        plan=plan,
        window_plan=window_plan,
        line_len=(sa.cuts[rank + 1] - sa.cuts[rank]) * m2,
    )


def _cat(parts: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat(parts) if parts else torch.empty(0, dtype=torch.long)


def check_orders(units: EncoderUnits, orders: Sequence[UnitOrder]) -> None:
    """Every unit order is a permutation of its groups; windows cover them."""
    for u, (order, rows) in enumerate(zip(orders, units.row_counts)):
        groups = order.groups
        if groups.numel() != rows or not torch.equal(torch.sort(groups).values, torch.arange(rows)):
            raise ValueError(
                f"EncoderDataParallel split: the tower's group order of unit {u} is not a "
                f"permutation of its {rows} groups"
            )
        if order.windows is not None and sum(order.windows) != rows:
            raise ValueError(
                f"EncoderDataParallel split: the windows of unit {u} cover {sum(order.windows)} "
                f"of its {rows} groups"
            )
