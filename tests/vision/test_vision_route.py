"""route_to_owners on real gloo ranks: each row reaches the owner of its position, exactly once."""

import re

import pytest
import torch
import torch.distributed as dist

from cpvlm import ShardPlan
from cpvlm.encoders import route_plan, route_to_owners
from cpvlm.testing import rel_err, run_distributed

WIDTHS = (4, 3)  # main rows + one deepstack level, one all-to-all


def _case(world_size, doc_lens, batch, num_rows, seed, layout="head_tail"):
    """Random row -> (encoding rank, padded-batch position) for `num_rows` rows."""
    plan = ShardPlan(sum(doc_lens), world_size, doc_lens=doc_lens, layout=layout)
    g = torch.Generator().manual_seed(seed)
    real = torch.cat([b * plan.padded_len + plan.padded_index for b in range(batch)])
    positions = real[torch.randperm(real.numel(), generator=g)[:num_rows]]
    row_ranks = torch.randint(0, world_size, (num_rows,), generator=g)
    rows = [torch.randn(num_rows, d, generator=g, dtype=torch.float64) for d in WIDTHS]
    upstream = [
        torch.randn(batch * plan.padded_len, d, generator=g, dtype=torch.float64) for d in WIDTHS
    ]
    return plan, positions, row_ranks, rows, upstream


def _route_and_backward(rank, world_size, doc_lens, batch, num_rows, seed, layout):
    plan, positions, row_ranks, rows, upstream = _case(
        world_size, doc_lens, batch, num_rows, seed, layout
    )
    rp = route_plan(row_ranks, positions, plan, rank)
    mine = row_ranks == rank
    xs = [r[mine].clone().requires_grad_() for r in rows]
    out = route_to_owners(xs, rp, dist.group.WORLD)
    # Rank-dependent upstream: the gradient at the local slots this rank owns.
    owner_slot = _local_to_padded(plan, batch, rank)[rp.local_positions]
    sum((o * u[owner_slot]).sum() for o, u in zip(out, upstream)).backward()
    return [o.detach() for o in out], [x.grad for x in xs], rp.local_positions, rp.recv_counts


def _local_to_padded(plan, batch, rank):
    """Padded-batch position of every slot of this rank's flattened [B, S_loc] shard."""
    idx = plan.indices(rank)
    return torch.cat([b * plan.padded_len + idx for b in range(batch)])


CASES = [
    (1, [9], 1, 6),
    (2, [13], 1, 10),
    (3, [5, 11], 2, 20),
    (4, [7, 3, 9], 2, 30),
    (4, [16], 1, 2),  # most ranks encode nothing and own nothing
    (3, [12], 1, 0),  # no vision rows at all
]


@pytest.mark.parametrize("layout", ["head_tail", "balanced"])
@pytest.mark.parametrize("world_size, doc_lens, batch, num_rows", CASES, ids=str)
def test_rows_reach_their_owners_in_local_order_and_gradients_come_back(
    world_size, doc_lens, batch, num_rows, layout
):
    results = run_distributed(_route_and_backward, world_size, doc_lens, batch, num_rows, 3, layout)
    plan, positions, row_ranks, rows, upstream = _case(
        world_size, doc_lens, batch, num_rows, 3, layout
    )
    seen = []
    for rank, (out, grads, local_positions, recv_counts) in enumerate(results):
        slots = _local_to_padded(plan, batch, rank)
        # Reference: the rows whose positions fall in this rank's shard, in shard order.
        wanted = [i for i, p in enumerate(slots.tolist()) if p in set(positions.tolist())]
        assert local_positions.tolist() == wanted
        row_of = {p: g for g, p in enumerate(positions.tolist())}
        expected_rows = [row_of[slots[i].item()] for i in wanted]
        seen += expected_rows
        for o, r in zip(out, rows):
            assert torch.equal(o, r[expected_rows])
        # Rows arrive only from their encoders, and none from elsewhere.
        assert sum(recv_counts) == len(expected_rows)
        # Each row has one consumer: its gradient is exactly the upstream at its position.
        mine = (row_ranks == rank).nonzero().squeeze(1)
        for g, u in zip(grads, upstream):
            assert torch.equal(g, u[positions[mine]])
    assert sorted(seen) == list(range(num_rows))


def _route_no_grad_and_frozen(rank, world_size):
    plan, positions, row_ranks, rows, _ = _case(world_size, [10], 1, 8, 5)
    rp = route_plan(row_ranks, positions, plan, rank)
    x = rows[0][row_ranks == rank]  # does not require grad: a frozen tower
    out = route_to_owners(x, rp, dist.group.WORLD)
    assert out.requires_grad  # grad mode decides, so every rank joins the backward
    out.sum().backward()
    with torch.no_grad():
        evaluated = route_to_owners(x, rp, dist.group.WORLD)
    return out.detach(), evaluated


def test_frozen_rows_and_no_grad_route_identically():
    for out, evaluated in run_distributed(_route_no_grad_and_frozen, 3):
        assert not evaluated.requires_grad and rel_err(evaluated, out) == 0


def _route_bad(rank, world_size, positions):
    plan = ShardPlan(10, world_size)
    try:
        route_plan(
            torch.zeros(len(positions), dtype=torch.long), torch.tensor(positions), plan, rank
        )
    except ValueError as e:
        return str(e)
    return None


@pytest.mark.parametrize(
    "positions, message",
    [
        ([0, 10], "is a padding position"),
        ([3, 3], "share a sequence position"),
        ([-1], "negative"),
    ],
)
def test_bad_positions_raise_on_every_rank(positions, message):
    messages = run_distributed(_route_bad, 2, positions)
    assert all(m and re.search(message, m) for m in messages), messages


def test_row_positions_must_match_the_rows():
    plan = ShardPlan(8, 2)
    with pytest.raises(ValueError, match="3 row_positions for 2 encoder rows"):
        route_plan(torch.zeros(2, dtype=torch.long), torch.arange(3), plan, 0)
    with pytest.raises(ValueError, match="row_ranks must lie in"):
        route_plan(torch.tensor([0, 2]), torch.arange(2), plan, 0)
