"""The pixel rows a rank reads under ``vision="split"``: its whole units, and of a sharded unit only
the merge groups of its piece.

Legend: m merge size, a group = m x m patches (one merged row of the tower's output), w the
unit's width in patches, wm = w / m its width in groups, p the patch size in pixels.

A unit's pixel rows are its groups in pixel order (rows (h/m, w/m, m, m) of one frame), so a
piece's rows are ``m^2`` consecutive rows per group. Its tower order may differ (Qwen2.5-VL's
windows): a rank reads its piece's groups sorted by pixel order, and ``local_split`` picks them
out. What a rank reads is thus ``pixel_rows_read``: for every unit of ``units_of(rank)``,
ascending, all its rows or only its piece's groups' rows; every unit's rows come after the
previous unit's, so the index is ascending.

Decoding only a piece is exact where the processor's steps after the resize are per pixel
(rescale, normalise) or a permutation (patchify): a decoder resizes the whole frame (a resize
reads its neighbours, so a band resized alone would differ), keeps the band of merged rows
``group_band`` gives, and runs the rest on the band only (``band_rows`` then picks the piece's
rows out of the band's).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from cpvlm.encoders.split import UnitOrder
from cpvlm.encoders.split_assign import SplitAssignment
from cpvlm.encoders.units import EncoderUnits

Groups = tuple[int, ...]
"""A piece's groups, in pixel order, ascending."""


def piece_groups(orders: Sequence[UnitOrder], sa: SplitAssignment, rank: int) -> dict[int, Groups]:
    """``{unit: groups}`` of the sharded units ``rank`` holds a piece of (see the module
    docstring)."""
    return {
        u: tuple(int(g) for g in torch.sort(orders[u].groups[a:b]).values)
        for u, a, b in sa.pieces(rank)
    }


def pixel_rows_read(
    units: EncoderUnits, mine: Sequence[int], groups: Mapping[int, Groups]
) -> torch.Tensor:
    """``[n]`` the batch's pixel rows that a rank reads, ascending: the units ``mine``, whole
    or, for a unit in ``groups``, only those groups' rows."""
    m2 = units.merge_size**2
    parts = []
    for u in mine:
        start = units.pixel_offsets[u]
        if u in groups:
            g = torch.tensor(groups[u], dtype=torch.long)
            parts.append((start + g.unsqueeze(1) * m2 + torch.arange(m2)).reshape(-1))
        else:
            parts.append(torch.arange(start, start + units.pixel_counts[u]))
    return torch.cat(parts) if parts else torch.empty(0, dtype=torch.long)


def group_band(groups: Groups, width_groups: int) -> tuple[int, int]:
    """``(first, stop)`` merged rows of a frame that hold ``groups`` (a frame ``width_groups``
    groups wide): the band a decoder processes after the whole frame's resize."""
    if not groups:
        raise ValueError("group_band: no groups")
    return groups[0] // width_groups, groups[-1] // width_groups + 1


def band_rows(groups: Groups, width_groups: int, merge: int) -> torch.Tensor:
    """Indices of ``groups``' pixel rows among the rows of their band (``group_band``)."""
    first, _ = group_band(groups, width_groups)
    m2 = merge * merge
    g = torch.tensor(groups, dtype=torch.long) - first * width_groups
    return (g.unsqueeze(1) * m2 + torch.arange(m2)).reshape(-1)
