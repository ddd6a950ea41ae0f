"""Dynamic CP: each packed row of a step split over as few ranks of its CP group as it needs.

Legend: C the CP size; c a row's CP size, a divisor of C; a *block* of size c is one of the C / c
aligned runs of CP ranks ``b * c .. b * c + c - 1``; a *job* is one row on one block; n a row's
tokens, M its forward MACs (``RowCost``).

With a fixed CP size every row is cut over all C ranks: a short conversation pays C - 1 ring
exchanges per layer for blocks too small to keep a device busy. Here a row gets at least the
smallest c whose share of it fits a rank's token budget (``rank_tokens``, by default what a full
row leaves each rank at CP C, so no rank holds more of a row than under static CP: the memory
rule), and a step becomes a sequence of *rounds*: in each round the C ranks are cut into aligned
blocks, each block runs one job, and a rank no block covers runs nothing (the trainer gives it a
row that trains nothing, so FSDP2's collectives, made once per forward on every rank, still line
up). Blocks are aligned so that every block is one of the process groups made once at start-up
(``C / c`` groups for each c).

Rounds are packed first-fit decreasing: jobs in order of size, then time, each into the first
round with a free aligned block of its size (the lowest such block), else into a new round. A
round lasts as long as its slowest job, so jobs of like time share rounds.

Without a time model a job's time is M / c and every row keeps the memory rule's c. With one
(``JobTimes``, seconds) a job of row (n, M) at size c takes

    (1 + backward) M / c * mac_s                       its rank's share of the compute
  + 2 layers c call_s                                  one attention call per ring step, fwd + bwd
  + max(0, exchange - attention)                       the ring's transfers that its own
      exchange  = layers [2 (c-1) hop(kv) + c hop(acc)] attention kernels do not hide
      hop(b)    = message_s + b ceil(n / c) / link_bytes_per_s
      attention = (1 + backward) min(M - token n, pair n (n + 1) / 2) / c * mac_s

(the ring of ``cpvlm.attention.cost``: K/V go c - 1 hops forward and again backward, the dK/dV
accumulators c hops; an all-gather sends as many bytes in c - 1 messages), and a round takes
``max(slowest job, gather_s) + round_s``: FSDP2 gathers the parameters again for every forward
and backward (hidden behind the round's compute when there is enough of it) and each round pays
its fixed launch and synchronisation costs. So a larger c divides the compute but pays latency
and bytes per layer that grow with c, and every round pays its fixed costs: short rows win on
few ranks, and a long row wins on many. The planner then chooses, never below the memory rule
(a larger c only lowers a rank's share): from the memory rule's sizes, one pass over the slowest
job of each round, slowest first, raising its c a divisor at a time while that shortens the step;
then each of C's divisors as a floor on every row's c, where one is faster still (the floor C is
static CP, so the plan is never slower than static CP in the model).

Everything is a function of the step's rows: every rank computes the same plan without
communicating. Planning costs O(rows x rounds) integer mask tests per packing, about a few
dozen packings per step.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache


@dataclass(frozen=True)
class JobTimes:
    """The time model of a job (see the module docstring); build one for a transformers VLM with
    ``cpvlm.simulate.dynamic_cp.job_times``. Seconds, bytes, forward MACs."""

    mac_s: float  # forward seconds per MAC at the achieved throughput
    backward_factor: float  # backward time over forward time
    token: int  # MACs per token of the matrices (``RowCost.token``): nothing hides a hop there
    pair: int  # MACs per attended pair over the layers (``RowCost.pair``)
    layers: int  # layers whose attention exchanges K/V over a row's ranks
    kv_bytes: int  # K and V bytes per token and layer
    acc_bytes: int  # dK and dV accumulator bytes per token and layer
    call_s: float  # fixed cost of one attention kernel call
    message_s: float  # fixed cost of one message
    link_bytes_per_s: float  # what one rank sends per second
    round_s: float = 0.0  # fixed cost of a round (a forward and backward on every rank)
    gather_s: float = 0.0  # FSDP2's parameter gathers of a round, hidden behind its compute

    def job(self, tokens: int, cost: int, c: int) -> float:
        """Seconds of a row of ``tokens`` tokens and ``cost`` MACs on ``c`` ranks."""
        train = (1 + self.backward_factor) * self.mac_s
        seconds = train * cost / c + 2 * self.layers * c * self.call_s
        if c == 1:
            return seconds
        local = -(-tokens // c)
        hop = self.message_s + self.kv_bytes * local / self.link_bytes_per_s
        acc = self.message_s + self.acc_bytes * local / self.link_bytes_per_s
        exchange = self.layers * (2 * (c - 1) * hop + c * acc)
        attention = min(max(cost - self.token * tokens, 0), self.pair * tokens * (tokens + 1) // 2)
        return seconds + max(0.0, exchange - train * attention / c)

    def round(self, slowest_job: float) -> float:
        """Seconds of a round whose slowest job takes ``slowest_job``."""
        return max(slowest_job, self.gather_s) + self.round_s


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

    def modelled_seconds(self, tokens: Sequence[int], costs: Sequence[int], times: JobTimes):
        """The step's seconds under ``times``: its rounds' (see the module docstring)."""
        return sum(
            times.round(max(times.job(tokens[j.row], costs[j.row], j.size) for j in r))
            for r in self.rounds
        )

    def balance(self, costs: Sequence[int]) -> float:
        """Busy rank-time over the group's: the sum of every job's cost over C times the sum of
        each round's slowest job's cost per rank (1.0: no rank ever waits)."""
        busy = sum(costs[j.row] for r in self.rounds for j in r)
        span = self.cp * self.modelled_time(costs)
        return busy / span if span else 1.0


def divisors(cp: int) -> list[int]:
    """The CP sizes a row can take in a group of ``cp`` ranks, ascending."""
    return [c for c in range(1, cp + 1) if cp % c == 0]


def row_size(tokens: int, cp: int, rank_tokens: int) -> int:
    """The smallest divisor c of ``cp`` with ``ceil(tokens / c) <= rank_tokens``, else ``cp``."""
    return next((c for c in divisors(cp) if -(-tokens // c) <= rank_tokens), cp)


def _free_block(idle: int, c: int, cp: int) -> int | None:
    """The lowest aligned block of size ``c`` whose ranks are all in the mask ``idle``: bit k of
    ``runs`` says ranks k .. k + c - 1 are idle (doubling shifts), kept at multiples of c."""
    runs, covered = idle, 1
    while covered < c:
        step = min(covered, c - covered)
        runs &= runs >> step
        covered += step
    runs &= _aligned(c, cp)
    return None if not runs else ((runs & -runs).bit_length() - 1) // c


@lru_cache(maxsize=1024)
def _aligned(c: int, cp: int) -> int:
    """The mask of the first ranks of the blocks of size ``c``."""
    return sum(1 << (b * c) for b in range(cp // c))


def plan_rounds(
    costs: Sequence[int], sizes: Sequence[int], cp: int, times: Sequence[float] | None = None
) -> DynamicPlan:
    """Pack jobs (row i at CP size ``sizes[i]``) into rounds, first-fit decreasing by size, then
    by ``times[i]`` (default ``costs[i] / sizes[i]``; see the module docstring)."""
    if len(costs) != len(sizes):
        raise ValueError(f"plan_rounds: {len(costs)} costs but {len(sizes)} sizes")
    bad = [c for c in sizes if isinstance(c, bool) or not isinstance(c, int) or c < 1 or cp % c]
    if bad:
        raise ValueError(f"plan_rounds: CP sizes {sorted(set(bad))} do not divide cp={cp}")
    if times is None:
        times = [costs[i] / sizes[i] for i in range(len(costs))]
    return _plan(_pack(sizes, times, cp), sizes, cp)


def _pack(sizes: Sequence[int], times: Sequence[float], cp: int) -> list[list[tuple[int, int]]]:
    """``plan_rounds``' rounds as (row, block) pairs, without checks or objects (the planner
    packs a step a few dozen times)."""
    order = sorted(range(len(sizes)), key=lambda i: (-sizes[i], -times[i], i))
    rounds: list[list[tuple[int, int]]] = []
    idle: list[int] = []  # per round, a mask of the CP ranks no job holds yet
    start, size = 0, None  # rounds before ``start`` have no free block of ``size`` (they only fill)
    for i in order:
        c = sizes[i]
        if c != size:
            start, size = 0, c
        for r in range(start, len(rounds)):
            block = _free_block(idle[r], c, cp)
            if block is not None:
                break
            start = r + 1
        else:
            r, block = len(rounds), 0
            rounds.append([])
            idle.append((1 << cp) - 1)
        rounds[r].append((i, block))
        idle[r] &= ~(((1 << c) - 1) << (block * c))
    return rounds


def _plan(rounds: list[list[tuple[int, int]]], sizes: Sequence[int], cp: int) -> DynamicPlan:
    """The plan of ``_pack``'s rounds, each round's jobs in the order of their ranks."""
    ordered = (sorted(r, key=lambda job: job[1] * sizes[job[0]]) for r in rounds)
    return DynamicPlan(cp, tuple(tuple(RowJob(i, sizes[i], b) for i, b in r) for r in ordered))


def plan_dynamic_cp(
    tokens: Sequence[int],
    costs: Sequence[int],
    cp: int,
    rank_tokens: int,
    *,
    times: JobTimes | None = None,
) -> DynamicPlan:
    """The rounds of a step's rows (one DP replica's): without ``times`` each row at
    ``row_size`` by its token count, packed by ``plan_rounds``; with ``times`` the sizes that
    model fastest from those upward (see the module docstring)."""
    if cp < 1:
        raise ValueError(f"plan_dynamic_cp: cp must be >= 1, got {cp}")
    if rank_tokens < 1:
        raise ValueError(f"plan_dynamic_cp: rank_tokens must be >= 1, got {rank_tokens}")
    if len(tokens) != len(costs):
        raise ValueError(f"plan_dynamic_cp: {len(tokens)} token counts but {len(costs)} costs")
    least = [row_size(n, cp, rank_tokens) for n in tokens]
    if times is None:
        return plan_rounds(costs, least, cp)
    sizes_of = divisors(cp)
    seconds_at = [  # per row, its job's seconds at each size the memory rule allows
        {c: times.job(n, m, c) for c in sizes_of if c >= least_c}
        for n, m, least_c in zip(tokens, costs, least)
    ]

    def pack(sizes: list[int]) -> tuple[float, list[list[tuple[int, int]]]]:
        rounds = _pack(sizes, [seconds_at[i][c] for i, c in enumerate(sizes)], cp)
        slowest = [max(seconds_at[i][sizes[i]] for i, _ in r) for r in rounds]
        return sum(times.round(t) for t in slowest), rounds

    # from the memory rule's sizes, the slowest job of each round, slowest first: one divisor
    # up while the step gets shorter
    best_s, best = pack(least)
    best_sizes = least
    critical = [max(r, key=lambda j: (seconds_at[j[0]][least[j[0]]], -j[0]))[0] for r in best]
    for row in sorted(critical, key=lambda i: (-seconds_at[i][least[i]], i)):
        c = best_sizes[row]
        while c < cp:
            larger = next(d for d in sizes_of if d > c)
            sizes = best_sizes[:row] + [larger] + best_sizes[row + 1 :]
            seconds, rounds = pack(sizes)
            if seconds >= best_s:
                break
            best_s, best, best_sizes, c = seconds, rounds, sizes, larger
    # a floor on every row's c (the floor cp is static CP), where one beats that
    for floor in sizes_of[1:]:
        sizes = [max(c, floor) for c in least]
        seconds, rounds = pack(sizes)
        if seconds < best_s:
            best_s, best, best_sizes = seconds, rounds, sizes
    return _plan(best, best_sizes, cp)
