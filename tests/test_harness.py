"""The multi-process harness itself: results, failures with tracebacks, hangs that time out."""

import time

import pytest
import torch
import torch.distributed as dist

from cpvlm.testing import DistributedTestError, run_distributed


def _rank_and_sum(rank, world_size, offset):
    t = torch.tensor([rank + offset], dtype=torch.float64)
    dist.all_reduce(t)
    return rank, world_size, t.item()


def _raise_on_rank_1(rank, world_size):
    if rank == 1:
        raise RuntimeError("boom on purpose")
    dist.barrier()  # the other ranks would wait here forever


def _hang_on_rank_0(rank, world_size):
    if rank == 0:
        time.sleep(3600)
    return rank


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 8])
def test_results_from_every_rank(world_size):
    results = run_distributed(_rank_and_sum, world_size, 10)
    expected_sum = sum(range(world_size)) + 10 * world_size
    assert results == [(r, world_size, expected_sum) for r in range(world_size)]


def test_failing_rank_reports_its_traceback_and_pool_recovers():
    run_distributed(_rank_and_sum, 3, 0)  # start the pool first: the bound is on the failure path
    start = time.monotonic()
    with pytest.raises(DistributedTestError) as info:
        run_distributed(_raise_on_rank_1, 3, timeout=60)
    message = str(info.value)
    assert "rank(s) [1] raised" in message
    assert "boom on purpose" in message and "_raise_on_rank_1" in message
    assert "[0, 2] did not finish after another rank failed" in message
    assert time.monotonic() - start < 30
    assert run_distributed(_rank_and_sum, 3, 0)[2] == (2, 3, 3.0)  # a fresh pool after the kill


def test_hanging_rank_times_out_and_is_named():
    run_distributed(_rank_and_sum, 2, 0)
    start = time.monotonic()
    with pytest.raises(DistributedTestError, match=r"rank\(s\) \[0\] did not finish within 3s"):
        run_distributed(_hang_on_rank_0, 2, timeout=3)
    assert time.monotonic() - start < 20
    assert [r[0] for r in run_distributed(_rank_and_sum, 2, 0)] == [0, 1]
