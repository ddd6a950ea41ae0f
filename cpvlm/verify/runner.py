"""Run a function on N real gloo processes, return every rank's result, never hang.

``cpvlm verify`` runs its CP side with it, and the tests their distributed checks. A pool of N
spawned workers per world size is started once and reused, so that a distributed test costs
milliseconds after the first one. Each worker has a default gloo process group.

    results = run_distributed(fn, world_size, *args, timeout=60)

calls ``fn(rank, world_size, *args)`` on every rank. ``fn`` must be importable (a module-level
function). If a rank raises, the others usually wait forever in their next collective; so on the
first failure the pool waits a short grace period, kills every worker and raises
``DistributedTestError`` with the failing rank's traceback. On a timeout it kills every worker
and names the ranks that did not finish. A killed pool is rebuilt on the next call. At most
``_MAX_POOLED_PROCESSES`` workers stay pooled, the least recently used pools closed first; a
world that does not fit beside the pooled ones runs the first time on a pool of its own. The first
pool registers ``shutdown_pools`` to run at exit; importing this module registers nothing.

Tasks may create process groups (DeviceMesh dims, subgroups) that nothing destroys, and each gloo
group keeps threads that poll while idle (150 groups cost a worker about 16% of a core). A pool
whose workers hold more than ``_MAX_GROUPS_PER_WORKER`` groups after a task is closed, and the next
call starts a fresh one: a long test run keeps its speed instead of filling the machine with idle
threads.
"""

from __future__ import annotations

import atexit
import multiprocessing as mp
import os
import pickle
import queue
import sys
import tempfile
import time
import traceback
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

_FAILURE_GRACE_S = 3.0
_START_TIMEOUT_S = 300.0
_MAX_POOLED_PROCESSES = 12
_MAX_GROUPS_PER_WORKER = 24


class DistributedTestError(AssertionError):
    """A rank raised, or ranks did not finish in time. ``errors``: the traceback of each rank
    that raised (empty when ranks only timed out)."""

    def __init__(self, message: str, errors: dict[int, str] | None = None):
        super().__init__(message)
        self.errors = dict(errors or {})


def _worker_main(rank: int, world_size: int, init_file: str, tasks, results) -> None:
    import torch
    import torch.distributed as dist

    from cpvlm.distributed.compat import die_with_parent, process_group_count

    # A worker is not a daemon (a task may start processes of its own, as a training rank's
    # DataLoader does), so nothing else would end it if the process that started it were killed.
    die_with_parent()
    torch.set_num_threads(1)
    try:
        store = dist.FileStore(init_file, world_size)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
    except BaseException:
        results.put((rank, "start-failed", traceback.format_exc()))
        return
    results.put((rank, "ready", None))
    while True:
        message = tasks.get()
        if message is None:
            break
        task_id, sys_path, payload = message
        for entry in sys_path:
            if entry not in sys.path:
                sys.path.append(entry)
        try:
            fn, args, kwargs = pickle.loads(payload)
            value = fn(rank, world_size, *args, **kwargs)
            results.put((rank, task_id, ("ok", pickle.dumps(value), process_group_count())))
        except BaseException:
            results.put((rank, task_id, ("error", traceback.format_exc(), None)))
    dist.destroy_process_group()


class _Pool:
    """World-size workers sharing one gloo process group."""

    def __init__(self, world_size: int):
        self.world_size = world_size
        ctx = mp.get_context("spawn")
        self._tmpdir = tempfile.TemporaryDirectory(prefix="cpvlm-pool-")
        init_file = os.path.join(self._tmpdir.name, "store")
        self.results = ctx.Queue()
        self.tasks = [ctx.Queue() for _ in range(world_size)]
        self.procs = [
            ctx.Process(
                target=_worker_main,
                args=(rank, world_size, init_file, self.tasks[rank], self.results),
                daemon=False,  # a task may start processes (DataLoader workers)
            )
            for rank in range(world_size)
        ]
        for proc in self.procs:
            proc.start()
        self._next_task = 0
        self.groups = 0  # the most process groups a worker held after a task
        ready, errors = set(), {}
        deadline = time.monotonic() + _START_TIMEOUT_S
        while len(ready) + len(errors) < world_size:
            try:
                rank, status, detail = self.results.get(
                    timeout=max(0.0, deadline - time.monotonic())
                )
            except queue.Empty:
                break
            (ready.add(rank) if status == "ready" else errors.__setitem__(rank, detail))
        if len(ready) < world_size:
            self.kill()
            missing = sorted(set(range(world_size)) - ready - set(errors))
            detail = "".join(f"\n--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items()))
            raise DistributedTestError(
                f"could not start {world_size} gloo workers (ranks not ready: {missing}){detail}"
            )

    def alive(self) -> bool:
        return all(proc.is_alive() for proc in self.procs)

    def run(self, fn: Callable, args: tuple, kwargs: dict, timeout: float) -> list[Any]:
        task_id = self._next_task
        self._next_task += 1
        payload = pickle.dumps((fn, args, kwargs))
        for q in self.tasks:
            q.put((task_id, list(sys.path), payload))
        values: dict[int, Any] = {}
        errors: dict[int, str] = {}
        deadline = time.monotonic() + timeout
        first_error_at = 0.0
        while len(values) + len(errors) < self.world_size:
            if errors:
                deadline = min(deadline, first_error_at + _FAILURE_GRACE_S)
            remaining = deadline - time.monotonic()
            try:
                rank, tid, (status, body, groups) = self.results.get(timeout=max(0.01, remaining))
            except queue.Empty:
                if time.monotonic() >= deadline:
                    break
                continue
            if tid != task_id:
                continue
            if status == "ok":
                values[rank] = pickle.loads(body)
                self.groups = max(self.groups, groups or 0)
            else:
                if not errors:
                    first_error_at = time.monotonic()
                errors[rank] = body
            dead = [r for r, p in enumerate(self.procs) if not p.is_alive()]
            if dead and not errors:
                errors.update(
                    {r: f"worker process died (exit code {self.procs[r].exitcode})" for r in dead}
                )
                first_error_at = time.monotonic()
        if errors or len(values) < self.world_size:
            self.kill()
            unfinished = sorted(set(range(self.world_size)) - set(values) - set(errors))
            name = getattr(fn, "__qualname__", repr(fn))
            lines = [f"{name} on {self.world_size} ranks:"]
            if errors:
                lines.append(f"rank(s) {sorted(errors)} raised")
            if unfinished:
                why = "after another rank failed" if errors else f"within {timeout:.0f}s"
                lines.append(f"rank(s) {unfinished} did not finish {why}")
            for rank, tb in sorted(errors.items()):
                lines.append(f"\n--- rank {rank} ---\n{tb}")
            raise DistributedTestError("\n".join(lines), errors)
        return [values[r] for r in range(self.world_size)]

    def kill(self) -> None:
        for proc in self.procs:
            if proc.is_alive():
                proc.kill()
        for proc in self.procs:
            proc.join(timeout=5)
        self._tmpdir.cleanup()

    def close(self) -> None:
        for q in self.tasks:
            q.put(None)
        for proc in self.procs:
            proc.join(timeout=5)
        self.kill()


_pools: OrderedDict[int, _Pool] = OrderedDict()
_exit_hook: list[bool] = []  # whether shutdown_pools is registered with atexit
_oversized: set[int] = set()  # world sizes that have run once without fitting beside the pooled


def run_distributed(
    fn: Callable, world_size: int, *args: Any, timeout: float = 120.0, **kwargs: Any
) -> list[Any]:
    """Run ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` gloo ranks.

    Returns the list of per-rank return values (pickled by value). Raises DistributedTestError
    with the failing rank's traceback, or with the ranks that did not finish within ``timeout``.
    """
    if not 1 <= world_size <= 64:
        raise ValueError(f"world_size must be in [1, 64], got {world_size}")
    pool = _pools.pop(world_size, None)
    if pool is not None and not pool.alive():
        pool.kill()
        pool = None
    keep = True
    if pool is None:
        if _pools and _pooled() + world_size > _MAX_POOLED_PROCESSES:
            # The first time, a world that does not fit beside the pooled ones runs on a pool of
            # its own, closed after the call: evicting them for a world used once would cost each
            # of them its warm processes (what their tasks imported, seconds a process).
            keep = world_size in _oversized
            _oversized.add(world_size)
        while keep and _pools and _pooled() + world_size > _MAX_POOLED_PROCESSES:
            _pools.popitem(last=False)[1].close()
        if not _exit_hook:
            atexit.register(shutdown_pools)
            _exit_hook.append(True)
        pool = _Pool(world_size)
    try:
        result = pool.run(fn, args, kwargs, timeout)
    except DistributedTestError:
        raise  # the pool has killed its workers
    except BaseException:
        pool.kill()  # e.g. an unpicklable fn: the workers' state is unknown
        raise
    if keep and pool.groups <= _MAX_GROUPS_PER_WORKER:
        _pools[world_size] = pool
    else:
        pool.close()
    return result


def _pooled() -> int:
    return sum(p.world_size for p in _pools.values())


def shutdown_pools() -> None:
    """Stop every pooled worker."""
    while _pools:
        _pools.popitem()[1].close()
