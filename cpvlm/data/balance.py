"""What a row costs to train, and the deal of a step's rows to DP ranks by that cost.

Legend: L tokens of a document, (t, h, w) an item's grid in patches, R rows per DP rank per step,
MAC = one multiply-accumulate of the forward pass.

A DP replica waits at every gradient sync for the slowest one, and a VLM row's time is not its
token count: a row holding a long video costs its vision encoder work and attention that grows
with the square of its documents' lengths. ``RowCost`` models a row's forward MACs as

    token * sum L                      decoder matrices (and LM head) per token
  + pair * sum L (L + 1) / 2           causal attention pairs, per document (packed rows attend
                                       within their documents)
  + sum vision.unit_cost(grid)         the vision tower, per image and video (``EncoderCost``)

Backward is about twice the forward in every part, so forward MACs rank rows as step time does.
Costs are Python ints: every rank computes the same numbers from the same ``SampleMeta`` and so
the same deal, without communicating.

``dp_deal``: longest processing time first under the constraint of R rows per rank (each row, by
cost, to the least loaded rank with room; ties: the lower rank), then pairwise swaps between the
most loaded rank and another while a swap lowers the larger of the two loads. ``deal_bound`` is
what whole rows allow: of the dp (j - 1) + 1 costliest rows some rank holds j (for each j up to R),
so its load is at least the j cheapest of those plus the R - j cheapest rows left; the q ranks
that hold the k costliest rows hold q R - k others, at least the cheapest left, and one of them
at least their mean; and no deal beats the mean.

``plan_split``: who plans which samples of a packing window when planning is split over DP, by
an estimate of each sample's planning cost known before planning (``RowStream.plan_costs``):
longest first, each to the least loaded rank, any number a rank.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from cpvlm.data.meta import SampleMeta
from cpvlm.encoders.assign import lpt
from cpvlm.encoders.cost import EncoderCost


@dataclass(frozen=True)
class RowCost:
    """Forward MACs of a packed row (see the module docstring); build one with
    ``cpvlm.hf.data.row_cost(config)`` for a transformers VLM."""

    token: int  # decoder MACs per token
    pair: int  # decoder MACs per attended (query, key) pair, summed over the layers
    vision: EncoderCost | None = None

    def __post_init__(self):
        for name in ("token", "pair"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"RowCost.{name} must be an int >= 0, got {value!r}")
        if self.token == 0 and self.pair == 0:
            raise ValueError("RowCost: every row would cost 0; give token > 0 or pair > 0")

    def sample(self, meta: SampleMeta, tokens: int | None = None) -> int:
        """The cost of one document: ``meta``'s sample, cut to ``tokens`` if given."""
        n = meta.tokens if tokens is None else tokens
        cost = self.token * n + self.pair * (n * (n + 1) // 2)
        if self.vision is not None:
            cost += sum(self.vision.unit_cost(g) for g in meta.image_grids + meta.video_grids)
        return cost

    def row(self, doc_lens: Sequence[int], grids: Sequence[Sequence[int]]) -> int:
        """The cost of a packed row: its documents' lengths and its vision items' grids."""
        cost = sum(self.token * n + self.pair * (n * (n + 1) // 2) for n in doc_lens)
        if self.vision is not None:
            cost += sum(self.vision.unit_cost(g) for g in grids)
        return cost


def dp_deal(costs: Sequence[int], dp: int) -> list[list[int]]:
    """Indices (into ``costs``, one step's rows) for each of ``dp`` ranks, balanced by cost, the
    same number each, every rank's indices ascending (see the module docstring)."""
    if dp < 1 or len(costs) % dp:
        raise ValueError(f"dp_deal: {len(costs)} rows do not split over {dp} DP ranks")
    per_rank = len(costs) // dp
    shares: list[list[int]] = [[] for _ in range(dp)]
    load = [0] * dp
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        d = min((d for d in range(dp) if len(shares[d]) < per_rank), key=lambda d: (load[d], d))
        shares[d].append(i)
        load[d] += costs[i]
    for _ in range(len(costs) * dp):  # each swap lowers the top load, or the deal stops
        a = max(range(dp), key=lambda d: (load[d], -d))
        best = None  # (the larger new load, b, x, y): swap row x of a with row y of b
        for b in range(dp):
            for x in shares[a] if b != a else []:
                for y in shares[b]:
                    if costs[y] < costs[x]:
                        top = max(load[a] - costs[x] + costs[y], load[b] + costs[x] - costs[y])
                        if top < load[a] and (best is None or (top, b, x, y) < best):
                            best = (top, b, x, y)
        if best is None:
            break
        _, b, x, y = best
        shares[a][shares[a].index(x)], shares[b][shares[b].index(y)] = y, x
        load[a] += costs[y] - costs[x]
        load[b] += costs[x] - costs[y]
    return [sorted(s) for s in shares]


def plan_split(costs: Sequence[int], dp: int) -> list[list[int]]:
    """Indices into ``costs`` (a window's estimated planning costs) for each of ``dp`` ranks:
    costliest first, each to the least loaded rank (ties: the lower rank), every rank's indices
    ascending. Equal costs give the stripes d, d + dp, ... (see the module docstring)."""
    if dp < 1:
        raise ValueError(f"plan_split: dp must be >= 1, got {dp}")
    return [sorted(s) for s in lpt(costs, dp)]


def deal_bound(costs: Sequence[int], dp: int) -> float:
    """The lowest max/mean load over ``dp`` ranks that a deal of whole rows, R each, can reach
    by the argument of the module docstring (a bound: the best deal may lie above it)."""
    if dp < 1 or len(costs) % dp or not costs:
        raise ValueError(f"deal_bound: {len(costs)} rows do not split over {dp} DP ranks")
    per_rank = len(costs) // dp
    top = sorted(costs, reverse=True)
    mean = sum(costs) / dp
    heaviest = 0
    for j in range(1, per_rank + 1):
        m = dp * (j - 1) + 1  # of the m costliest rows some rank holds j (pigeonhole) ...
        rest = top[m:]
        load = sum(top[m - j : m]) + sum(rest[len(rest) - (per_rank - j) :] if per_rank > j else [])
        heaviest = max(heaviest, load)  # ... at least the j cheapest of them, and R - j others
    for k in range(1, dp + 1):  # the q ranks holding the k costliest rows: their mean load
        rest = top[k:][::-1]
        lowest = min(
            (sum(top[:k]) + sum(rest[: q * per_rank - k])) / q
            for q in range(-(-k // per_rank), k + 1)
        )
        heaviest = max(heaviest, lowest)
    return max(heaviest, mean) / mean if mean else 1.0


def max_over_mean(costs: Sequence[int], shares: Sequence[Sequence[int]]) -> float:
    """Max/mean load of a deal."""
    loads = [sum(costs[i] for i in s) for s in shares]
    mean = sum(loads) / len(loads)
    return max(loads) / mean if mean else 1.0
