"""cpvlm.distributed.compat: both branches of the version-dependent tensor collectives, on gloo.

torch 2.11/2.12 have only all_gather_into_tensor / reduce_scatter_tensor; 2.13+ add the *_single
names. ``legacy_collectives()`` forces the older branch on the installed torch, so both are checked
here whatever torch CI runs. The expected values are written out from the rank formula.
"""

import pytest
import torch
import torch.distributed as dist

from cpvlm.distributed import compat, differentiable_all_gather_dim0
from cpvlm.distributed.collectives import all_gather_dim0, reduce_scatter_dim0
from cpvlm.testing import run_distributed


def _rank_rows(rank, dtype):
    return (torch.arange(6, dtype=torch.float64).view(3, 2) + 10 * rank).to(dtype)


def _collectives(rank, world_size, legacy, dtype):
    def run():
        gathered = all_gather_dim0(_rank_rows(rank, dtype), dist.group.WORLD)
        flags = all_gather_dim0(torch.tensor([rank % 2 == 0]), dist.group.WORLD)
        reduced = reduce_scatter_dim0(
            torch.arange(2.0 * world_size, dtype=torch.float64).view(world_size, 2) * (rank + 1),
            dist.group.WORLD,
        )
        x = _rank_rows(rank, torch.float64).requires_grad_()
        (differentiable_all_gather_dim0(x, dist.group.WORLD) * (rank + 1)).sum().backward()
        return gathered, flags, reduced, x.grad, compat.uses_single_collectives()

    if legacy:
        with compat.legacy_collectives():
            return run()
    return run()


@pytest.mark.parametrize("legacy", [False, True], ids=["single", "legacy"])
@pytest.mark.parametrize("world_size", [1, 3])
def test_both_collective_branches_give_the_rank_formula(world_size, legacy):
    w = world_size
    for dtype in (torch.float64, torch.bfloat16):
        results = run_distributed(_collectives, w, legacy, dtype, timeout=60)
        for rank, (gathered, flags, reduced, grad, single) in enumerate(results):
            expected = torch.cat([_rank_rows(r, dtype) for r in range(w)])
            assert gathered.dtype == dtype and torch.equal(gathered, expected)
            assert flags.dtype == torch.bool and flags.tolist() == [r % 2 == 0 for r in range(w)]
            # sum over ranks of (r+1) * row = w(w+1)/2 * row; this rank keeps row `rank`.
            row = torch.arange(2.0 * w, dtype=torch.float64).view(w, 2)[rank]
            assert torch.equal(reduced, row.view(1, 2) * (w * (w + 1) // 2))
            # every rank r weighs the gathered copy by r+1: the gradient is sum_r (r+1).
            assert torch.equal(grad, torch.full((3, 2), w * (w + 1) / 2, dtype=torch.float64))
            assert single == (not legacy and hasattr(dist, "all_gather_single"))
