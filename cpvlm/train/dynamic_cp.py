"""``cpvlm train --dynamic-cp``: a step's rows as rounds of jobs on blocks of the CP group.

Legend: C the CP size, c a row's CP size (a divisor of C), R rows per DP replica per step.

Every rank of a DP replica holds all of the replica's R rows (ids and labels; the valid labels
are counted over DP as in a static step, so the loss stays the step's global token mean). Each
rank computes the same plan from them (``cpvlm.data.dynamic_cp.plan_dynamic_cp``: a row's CP
size from its token count and the per-rank budget, rounds packed by the modelled cost
``RowCost``), and in round k runs its job's row on its block's group (``ContextParallelVLM``'s
``forward(cp_size=c)``), forward and backward. A rank no job of the round covers, and every rank
of a replica that has fewer rounds than the longest replica's, runs a row that trains nothing
(``LocalRow.blank``) on its group of one: FSDP2 all-gathers each unit once per forward over the
whole mesh, so every rank makes one forward and one backward per round, the same number of rounds
(``plan_step``'s one all-reduce agrees on it).

That all-reduce also checks the rows: a fingerprint of each row (ids, labels, documents, grids) on
every CP rank of its replica. Every collective a row's forward makes, and the plan itself, depend
on them; a rank handed another row would run other jobs, and the other ranks would wait in a
collective it never joins. A mismatch is the same ``ValueError`` on every rank of the world,
before any row runs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from cpvlm.data import LocalRow
from cpvlm.data.balance import RowCost
from cpvlm.data.dynamic_cp import DynamicPlan, divisors, plan_dynamic_cp
from cpvlm.distributed.collectives import fingerprint

_NONE = torch.iinfo(torch.int64).min  # a slot another replica fills (all-reduce MAX)


def row_costs(cost: RowCost, rows: list[LocalRow]) -> list[int]:
    """Each row's modelled forward MACs: its documents' decoder work and its vision units'
    (``RowCost``, as the DP deal counts them)."""
    return [cost.row(r.doc_lens or [r.num_tokens], r.grid_thw.tolist()) for r in rows]


@dataclass(frozen=True)
class StepRounds:
    """A step's rounds on this rank: its replica's plan and the rounds every rank runs."""

    plan: DynamicPlan
    rounds: int  # the most of any replica: rounds past this replica's plan are blank
    record: dict  # metrics.jsonl's ``dynamic_cp``: the whole step's sizes, rounds, balance

    def job(self, round_index: int, cp_rank: int) -> tuple[int, int] | None:
        """``(row, CP size)`` this rank runs in round ``round_index``, or None (a blank)."""
        if round_index >= len(self.plan.rounds):
            return None
        job = self.plan.job(round_index, cp_rank)
        return None if job is None else (job.row, job.size)


def _row_fingerprint(row: LocalRow) -> int:
    return fingerprint(row.input_ids, row.labels, tuple(row.doc_lens), row.grid_thw)


def plan_step(
    rows: list[LocalRow],
    costs: list[int],
    *,
    cp: int,
    budget: int,
    dp: int,
    dp_rank: int,
    device: torch.device,
) -> StepRounds:
    """The plan of this replica's ``rows`` and the step's agreed rounds (collective over the
    world: one all-reduce). Raises the same ``ValueError`` on every rank when a row differs
    between the CP ranks of its replica (see the module docstring)."""
    plan = plan_dynamic_cp([r.num_tokens for r in rows], costs, cp, budget)
    sizes = divisors(cp)
    counts = plan.sizes()
    prints = [_row_fingerprint(r) for r in rows]
    mine = [
        *prints,
        *(-f for f in prints),
        len(plan.rounds),
        round(plan.modelled_time(costs)),
        sum(costs),
        *(counts.get(c, 0) for c in sizes),
    ]
    facts = torch.full((dp, len(mine)), _NONE, dtype=torch.int64)
    facts[dp_rank] = torch.tensor(mine, dtype=torch.int64)
    facts = facts.to(device)
    dist.all_reduce(facts, op=dist.ReduceOp.MAX)
    facts = facts.cpu()
    n = len(rows)
    differ = (facts[:, :n] != -facts[:, n : 2 * n]).nonzero().tolist()
    if differ:
        d, k = differ[0]
        raise ValueError(
            f"cpvlm train --dynamic-cp: row {k} of DP replica {d} differs between the replica's "
            "CP ranks (ids, labels, documents or grids); every CP rank of a replica must be "
            "handed the same rows (the plan and every collective of a row depend on them)"
        )
    stats = facts[:, 2 * n :].tolist()
    ideal = sum(s[2] for s in stats) / (dp * cp)  # a step split evenly over every rank
    record = {
        "sizes": {str(c): sum(s[3 + i] for s in stats) for i, c in enumerate(sizes)},
        "rounds": max(s[0] for s in stats),
        "modelled_balance": max(s[1] for s in stats) / ideal if ideal else 1.0,
    }
    return StepRounds(plan, record["rounds"], record)
