"""Which units are sharded across CP ranks, and where the cuts go: balance beyond the largest unit.

Legend: W ranks, U units, c_u a unit's cost, G_u its merge groups (m x m patches each, the
tower's merger input), C the total cost, T = ceil(C / W) a rank's fair share.

Whole-unit assignment cannot beat max(c_u) / mean: one 4K image at cp 8 is a rank's work alone.
``split_assignment`` shards the units that stand in the way, at merge-group granularity:

1. S = the units with c_u > T (no rank can hold them whole within its share). The others (R) are
   assigned whole (``assign_units``: longest first, then exchanges).
2. While the heaviest rank's whole units cost more than T * (1 + 1/_SLACK), the largest unit of
   R (ties: lower index) moves to S and R is assigned again: the largest unit is what keeps the
   exchanges from balancing. R may end empty (then every unit is sharded).
3. The units of S, in unit order, form one line of groups (a unit's groups in the tower's order:
   see ``cpvlm.encoders.split``). Each rank's room, T minus its whole units' cost (0 if over), is
   a stretch of that line in rank order (McNaughton's wrap-around rule): rank r takes the groups
   between the cumulative rooms of ranks < r and <= r, each cut rounded to the nearest group
   boundary, with the cost of a group c_u / G_u (queries attend their whole unit or window, so a
   group costs its share of the unit; ``EncoderCost.part_cost``). A sharded unit thus lies on
   consecutive ranks, each holding one contiguous range of the line, as ``ShardPlan.contiguous``
   needs; rank loads end within half a group of T, or at their whole units' cost when that is
   above T.

Every step is integer arithmetic on the costs and group counts: every rank computes the same
assignment without communicating.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from cpvlm.encoders.assign import _check_costs, assign_units

_SLACK = 50
"""Whole units may leave a rank at most T / _SLACK above the fair share before one more is cut."""


@dataclass(frozen=True)
class SplitAssignment:
    """Whole units per rank, and the sharded units' line of groups cut into rank ranges."""

    whole: tuple[tuple[int, ...], ...]
    """Per rank, the units it encodes whole (ascending)."""
    split: tuple[int, ...]
    """The sharded units, ascending: the line is their groups one unit after another."""
    cuts: tuple[int, ...]
    """W + 1 group boundaries on the line: rank r holds groups ``[cuts[r], cuts[r+1])``."""
    groups: tuple[int, ...]
    """Groups of each sharded unit (in ``split`` order)."""

    @property
    def cp_size(self) -> int:
        return len(self.whole)

    def pieces(self, rank: int) -> list[tuple[int, int, int]]:
        """``(unit, first group, stop group)`` of every sharded unit that ``rank`` holds part of,
        groups counted within the unit, in line order."""
        lo, hi = self.cuts[rank], self.cuts[rank + 1]
        out, start = [], 0
        for u, g in zip(self.split, self.groups):
            a, b = max(lo, start), min(hi, start + g)
            if a < b:
                out.append((u, a - start, b - start))
            start += g
        return out

    def units_of(self, rank: int) -> list[int]:
        """The units ``rank`` encodes whole or holds pieces of, ascending: those whose pixels it
        reads."""
        return sorted({*self.whole[rank], *(u for u, _, _ in self.pieces(rank))})

    def rank_costs(self, costs: Sequence[int]) -> list[int]:
        """Modelled cost per rank: whole units plus each piece's share of its unit (rounded
        down, as ``EncoderCost.part_cost``)."""
        out = []
        for r, units in enumerate(self.whole):
            cost = sum(costs[u] for u in units)
            g_of = dict(zip(self.split, self.groups))
            cost += sum(costs[u] * (b - a) // g_of[u] for u, a, b in self.pieces(r))
            out.append(cost)
        return out


def split_assignment(costs: Sequence[int], groups: Sequence[int], cp_size: int) -> SplitAssignment:
    """Assign units ``costs`` (ints) of ``groups`` merge groups each to ``cp_size`` ranks, whole
    or sharded (the rule in the module docstring). Deterministic."""
    if isinstance(cp_size, bool) or not isinstance(cp_size, int) or cp_size < 1:
        raise ValueError(f"cp_size must be a positive int, got {cp_size!r}")
    costs = _check_costs(costs)
    groups = [int(g) for g in groups]
    if len(groups) != len(costs) or any(g < 1 for g in groups):
        raise ValueError(
            f"split_assignment: need one group count >= 1 per unit, got {groups} for "
            f"{len(costs)} units"
        )
    share = -(-sum(costs) // cp_size)
    split = {u for u, c in enumerate(costs) if c > share}
    while True:
        rest = [u for u in range(len(costs)) if u not in split]
        per_rank = [
            [rest[i] for i in units] for units in assign_units([costs[u] for u in rest], cp_size)
        ]
        loads = [sum(costs[u] for u in units) for units in per_rank]
        if not rest or _SLACK * max(loads) <= (_SLACK + 1) * share:
            break
        split.add(min(rest, key=lambda u: (-costs[u], u)))
    order = sorted(split)
    cuts = _cuts([costs[u] for u in order], [groups[u] for u in order], loads, share)
    return SplitAssignment(
        whole=tuple(tuple(sorted(units)) for units in per_rank),
        split=tuple(order),
        cuts=tuple(cuts),
        groups=tuple(groups[u] for u in order),
    )


def _cuts(line_costs: list[int], line_groups: list[int], loads: list[int], share: int):
    """Group boundaries of each rank's stretch of the line (step 3 of the module docstring)."""
    total_cost, total_groups = sum(line_costs), sum(line_groups)
    cuts, room = [0], 0
    for load in loads[:-1]:
        room = min(room + max(0, share - load), total_cost)
        cuts.append(max(cuts[-1], _group_at(room, line_costs, line_groups)))
    cuts.append(total_groups)
    return cuts


def _group_at(x: int, line_costs: list[int], line_groups: list[int]) -> int:
    """The group boundary nearest to cost ``x`` along the line (within the unit holding it)."""
    cost_before, groups_before = 0, 0
    for c, g in zip(line_costs, line_groups):
        if x < cost_before + c:
            # nearest of the unit's g + 1 boundaries, at costs (x - before) * g / c, rounded
            return groups_before + (2 * (x - cost_before) * g + c) // (2 * c)
        cost_before, groups_before = cost_before + c, groups_before + g
    return groups_before
