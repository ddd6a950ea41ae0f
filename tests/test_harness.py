"""The multi-process harness itself: results, failures with tracebacks, hangs that time out."""

import os
import re
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


def _pid(rank, world_size):
    return os.getpid()


def _pid_after_new_groups(rank, world_size, count):
    for _ in range(count):
        dist.new_group(backend="gloo")
    return os.getpid()


def _hang_on_rank_0(rank, world_size):
    if rank == 0:
        time.sleep(3600)
    return rank


def _expected(world_size):
    return [(r, world_size, sum(range(world_size)) + 10 * world_size) for r in range(world_size)]


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_results_from_every_rank(world_size):
    assert run_distributed(_rank_and_sum, world_size, 10) == _expected(world_size)


def test_results_from_8_ranks_and_the_pooled_ranks_stay(monkeypatch):
    """8 ranks that do not fit beside the pooled worlds (a world of 4 among them): the first
    time they run on a pool of their own, and the pooled world keeps its processes (and what
    they imported)."""
    from cpvlm.verify import runner

    pids = run_distributed(_pid, 4)
    # 7 more pooled processes allowed than there are (in a full run: 1 + 2 + 3 + 4 of 12), and
    # no world known to be asked for twice.
    monkeypatch.setattr(runner, "_MAX_POOLED_PROCESSES", runner._pooled() + 7)
    monkeypatch.setattr(runner, "_oversized", set())
    assert run_distributed(_rank_and_sum, 8, 10) == _expected(8)
    assert run_distributed(_pid, 4) == pids
    assert 8 not in runner._pools


def test_a_pool_that_holds_too_many_process_groups_is_replaced(monkeypatch):
    """Groups a task leaves behind keep polling threads: once a worker holds more than the bound
    (the default group and 3 new ones > 3) its pool is closed after the call and the next call
    gets fresh processes; a pool under the bound keeps its processes."""
    from cpvlm.verify import runner

    monkeypatch.setattr(runner, "_MAX_GROUPS_PER_WORKER", 3)
    if 2 in runner._pools:  # its workers may hold the groups of earlier tests
        runner._pools.pop(2).close()
    first = run_distributed(_pid_after_new_groups, 2, 0)
    assert runner._pools[2].groups == 1
    assert run_distributed(_pid_after_new_groups, 2, 2) == first  # 3 groups: kept
    assert runner._pools[2].groups == 3
    assert run_distributed(_pid_after_new_groups, 2, 1) == first  # now 4, closed after the call
    assert 2 not in runner._pools
    fresh = run_distributed(_pid, 2)
    assert set(fresh).isdisjoint(first)
    assert runner._pools[2].groups == 1


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


def test_the_product_imports_no_test_harness_and_registers_nothing_at_exit():
    """What a training rank or ``cpvlm verify`` imports loads nothing of ``cpvlm.testing``, and
    the runner registers its pool shutdown with the first pool, not at import."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    sources = [p for p in (root / "cpvlm").rglob("*.py") if "testing" not in p.parts]
    importing = [
        str(p) for p in sources if re.search(r"(from|import) cpvlm\.testing", p.read_text())
    ]
    assert not importing, importing
    code = (
        "import atexit, sys\n"
        "import cpvlm.train.loop, cpvlm.train.synthetic, cpvlm.train.command, cpvlm.verify\n"
        "from cpvlm.verify.runner import shutdown_pools\n"
        "n = atexit._ncallbacks()\n"
        "atexit.unregister(shutdown_pools)\n"
        "assert atexit._ncallbacks() == n, 'shutdown_pools registered at import'\n"
        "loaded = [m for m in sys.modules if m.startswith('cpvlm.testing')]\n"
        "assert not loaded, loaded\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
