"""Which CP rank encodes which unit: balanced by modelled cost, identical on every rank.

A unit's encoder cost grows with its patches, and faster than linearly: attention within a frame
grows with patches**2 (see cost.py). Balancing by the number of images, as contiguous splitting
does, leaves one rank with the big images while the others wait at the next collective; so does
balancing by patches when one image is large. The assignment balances the per-unit costs it is
given (``EncoderCost.unit_costs``, or plain patch counts) and is a pure function of them: integer
costs, fixed tie-breaks, so every rank computes the same assignment without communicating.
A unit is never split: the caller decides what a unit is (an image, or one frame of a video).
"""

from __future__ import annotations

import heapq
from bisect import bisect_left
from collections.abc import Sequence

import torch

_MAX_REFINE_STEPS_PER_UNIT = 4


def _check_costs(costs: Sequence[int] | torch.Tensor) -> list[int]:
    if isinstance(costs, torch.Tensor):
        if costs.dim() != 1 or costs.is_floating_point() or costs.is_complex():
            raise ValueError(
                f"costs must be a 1-d integer tensor, got {costs.dtype} of shape "
                f"{tuple(costs.shape)}"
            )
        costs = costs.tolist()
    counts = list(costs)
    for u, n in enumerate(counts):
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(
                f"costs[{u}] = {n!r}; unit costs must be ints >= 0 (patch counts or "
                "EncoderCost.unit_costs), so that every rank's arithmetic is exact and identical"
            )
    return counts


def lpt(counts: Sequence[int], cp_size: int, base: Sequence[int] | None = None) -> list[list[int]]:
    """Longest processing time first: biggest unit to the least loaded rank (ties: lower rank),
    each rank starting at its ``base`` load (default 0); each rank's units in the order dealt.
    (Also ``cpvlm.data.plan_split``'s deal.)"""
    heap = [(0 if base is None else base[r], r) for r in range(cp_size)]
    heapq.heapify(heap)
    per_rank: list[list[int]] = [[] for _ in range(cp_size)]
    for u in sorted(range(len(counts)), key=lambda u: (-counts[u], u)):
        load, r = heapq.heappop(heap)
        per_rank[r].append(u)
        heapq.heappush(heap, (load + counts[u], r))
    return per_rank


def _best_exchange(
    heavy: list[int], light: list[int], counts: list[int], gap: int
) -> tuple[int, int | None] | None:
    """The move (u, None) or swap (u, v) from heavy to light that best halves ``gap``.

    Moving a cost d with 0 < d < gap lowers the heavier of the two ranks and strictly lowers the
    sum of squared loads, so refinement always terminates.
    """
    best, best_key = None, None
    light_sorted = sorted(light, key=lambda v: (counts[v], v))
    light_doubled = [2 * counts[v] for v in light_sorted]
    for u in sorted(heavy):
        candidates = [(u, None, counts[u])]
        # Swap partner: light unit v with counts[u] - counts[v] closest to gap / 2 (doubled, so
        # that the arithmetic stays in exact ints).
        i = bisect_left(light_doubled, 2 * counts[u] - gap)
        for j in (i - 1, i):
            if 0 <= j < len(light_sorted):
                v = light_sorted[j]
                candidates.append((u, v, counts[u] - counts[v]))
        for cu, cv, d in candidates:
            if 0 < d < gap:
                key = (abs(gap - 2 * d), cu, -1 if cv is None else cv)
                if best_key is None or key < best_key:
                    best, best_key = (cu, cv), key
    return best


def assign_units(
    costs: Sequence[int] | torch.Tensor, cp_size: int, base_loads: Sequence[int] | None = None
) -> list[list[int]]:
    """One list of unit indices per rank, balanced by unit cost, each list ascending.

    ``costs[u]`` is unit u's cost: ``EncoderCost.unit_costs(units)`` (modelled encoder work), or
    patch counts (``units.pixel_counts``) to balance patches. Greedy longest-first, then moves
    and swaps from the most loaded rank to the least loaded rank that one improves, while any
    does. No rank can end below max(costs), so max/mean is bounded by max(costs)/mean.
    Deterministic; every rank gets the same answer. A rank may get no units (more ranks than
    units); it must still join the collectives. ``base_loads``: each rank's work already given
    (another encoder's units, in the same cost unit), which these units balance around.
    """
    if isinstance(cp_size, bool) or not isinstance(cp_size, int) or cp_size < 1:
        raise ValueError(f"cp_size must be a positive int, got {cp_size!r}")
    counts = _check_costs(costs)
    base = [0] * cp_size if base_loads is None else _check_costs(list(base_loads))
    if len(base) != cp_size:
        raise ValueError(f"base_loads must have one load per rank ({cp_size}), got {len(base)}")
    per_rank = lpt(counts, cp_size, base)
    loads = [b + sum(counts[u] for u in units) for b, units in zip(base, per_rank)]
    for _ in range(_MAX_REFINE_STEPS_PER_UNIT * len(counts)):
        hi = max(range(cp_size), key=lambda r: (loads[r], -r))
        exchange = None
        # The lightest partner first; a heavier one only when the lightest admits no exchange
        # (its units are all too large to swap), so refinement does not stop at that pair.
        for lo in sorted(range(cp_size), key=lambda r: (loads[r], r)):
            if loads[lo] >= loads[hi]:
                break
            exchange = _best_exchange(per_rank[hi], per_rank[lo], counts, loads[hi] - loads[lo])
            if exchange is not None:
                break
        if exchange is None:
            break
        u, v = exchange
        per_rank[hi].remove(u)
        per_rank[lo].append(u)
        moved = counts[u]
        if v is not None:
            per_rank[lo].remove(v)
            per_rank[hi].append(v)
            moved -= counts[v]
        loads[hi] -= moved
        loads[lo] += moved
    return [sorted(units) for units in per_rank]


def contiguous_assignment(num_units: int, cp_size: int) -> list[list[int]]:
    """Equal unit counts in contiguous blocks (what balancing by count does); for comparison."""
    base, extra = divmod(num_units, cp_size)
    out, start = [], 0
    for r in range(cp_size):
        n = base + (r < extra)
        out.append(list(range(start, start + n)))
        start += n
    return out
