"""Dynamic CP: each packed row of a step split over as few ranks of its CP group as it needs.

Legend: C the CP size; c a row's CP size, a divisor of C; a *block* of size c is one of the C / c
aligned runs of CP ranks ``b * c .. b * c + c - 1``; a *job* is one row on one block.

With a fixed CP size every row is cut over all C ranks: a short conversation pays C - 1 ring
exchanges per layer for blocks too small to keep a device busy. Here a row gets the smallest c
whose share of it fits a rank's token budget (``rank_tokens``, by default what a full row leaves
each rank at CP C, so no rank holds more of a row than under static CP), and a step becomes a
sequence of *rounds*: in each round the C ranks are cut into aligned blocks, each block runs one
job, and a rank no block covers runs nothing (the trainer gives it a row that trains nothing, so
FSDP2's collectives, made once per forward on every rank, still line up). Blocks are aligned so
that every block is one of the process groups made once at start-up (``C / c`` groups for each c).

Rounds are packed first-fit decreasing by modelled time (a job's cost / c; cost in forward MACs,
``RowCost``): jobs in order of size, then time, each into the first round with a free aligned
block of its size (the lowest such block), else into a new round. A round lasts as long as its
slowest job, so jobs of like time share rounds. Everything is a function of the step's rows:
every rank computes the same plan without communicating.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class RowJob:
    """Row ``row`` (an index into the step's rows of one DP replica) on the ``size`` CP ranks of
    block ``block``: CP ranks ``block * size`` to ``block * size + size - 1``."""

    row: int
    size: int
    block: int

    @property
    def ranks(self) -> range:
        return range(self.block * self.size, (self.block + 1) * self.size)


@dataclass(frozen=True)
class DynamicPlan:
    """A step's rounds for one CP group of ``cp`` ranks; each round's jobs cover disjoint blocks."""

    cp: int
    rounds: tuple[tuple[RowJob, ...], ...]

    def job(self, round_index: int, cp_rank: int) -> RowJob | None:
        """The job CP rank ``cp_rank`` runs in round ``round_index``, or None (it idles)."""
        for job in self.rounds[round_index]:
            if cp_rank in job.ranks:
                return job
        return None

    def sizes(self) -> Counter:
        """Rows per CP size, ``{c: rows}``."""
        return Counter(job.size for r in self.rounds for job in r)

    def modelled_time(self, costs: Sequence[int]) -> float:
        """The sum over rounds of the slowest job's cost per rank (see the module docstring)."""
        return sum(max(costs[j.row] / j.size for j in r) for r in self.rounds)


def divisors(cp: int) -> list[int]:
    """The CP sizes a row can take in a group of ``cp`` ranks, ascending."""
    return [c for c in range(1, cp + 1) if cp % c == 0]


def row_size(tokens: int, cp: int, rank_tokens: int) -> int:
    """The smallest divisor c of ``cp`` with ``ceil(tokens / c) <= rank_tokens``, else ``cp``."""
    return next((c for c in divisors(cp) if -(-tokens // c) <= rank_tokens), cp)


def plan_rounds(costs: Sequence[int], sizes: Sequence[int], cp: int) -> DynamicPlan:
    """Pack jobs (row i at CP size ``sizes[i]``) into rounds, first-fit decreasing by
    ``costs[i] / sizes[i]`` (see the module docstring)."""
    if len(costs) != len(sizes):
        raise ValueError(f"plan_rounds: {len(costs)} costs but {len(sizes)} sizes")
    bad = [c for c in sizes if isinstance(c, bool) or not isinstance(c, int) or c < 1 or cp % c]
    if bad:
        raise ValueError(f"plan_rounds: CP sizes {sorted(set(bad))} do not divide cp={cp}")
    order = sorted(range(len(costs)), key=lambda i: (-sizes[i], -costs[i] / sizes[i], i))
    rounds: list[list[RowJob]] = []
    used: list[set[int]] = []  # CP ranks taken, per round
    for i in order:
        c = sizes[i]
        for r, taken in enumerate(used + [set()]):
            block = next(
                (b for b in range(cp // c) if not taken & set(range(b * c, b * c + c))), None
            )
            if block is not None:
                if r == len(rounds):
                    rounds.append([])
                    used.append(set())
                rounds[r].append(RowJob(i, c, block))
                used[r].update(range(block * c, block * c + c))
                break
    ordered = tuple(tuple(sorted(r, key=lambda j: j.block * j.size)) for r in rounds)
    return DynamicPlan(cp, ordered)


def plan_dynamic_cp(
    tokens: Sequence[int], costs: Sequence[int], cp: int, rank_tokens: int
) -> DynamicPlan:
    """The rounds of a step's rows (one DP replica's): each row at ``row_size`` by its token
    count, packed by ``plan_rounds``."""
    if cp < 1:
        raise ValueError(f"plan_dynamic_cp: cp must be >= 1, got {cp}")
    if rank_tokens < 1:
        raise ValueError(f"plan_dynamic_cp: rank_tokens must be >= 1, got {rank_tokens}")
    return plan_rounds(costs, [row_size(n, cp, rank_tokens) for n in tokens], cp)
