"""``cpvlm train``'s loop on the pooled gloo ranks of ``run_distributed``, for the tests.

``launch_pooled(config, resume_from)`` stands in for ``cpvlm.train.launcher.launch_local``: the
same ``train_rank`` on the same world size, with the same threads per rank and the same
``CPVLM_*`` environment, but on warm pooled processes instead of dp * cp new ones (each new one
imports transformers: about 12 s of CPU before its first step). What it gives the caller is what
``launch_local`` gives: ``RunStopped`` when the run stopped early on every rank, ``TrainingFailed``
with the failing rank's trimmed traceback when a rank raised, and every rank's printed lines on
file descriptors 1 and 2 (rank order), where a local launcher's ranks print theirs.

The test suite puts it in place of ``launch_local`` for every test not marked ``launch``
(``tests/conftest.py``): the tests that check numerics, checkpoints or data run on pooled ranks,
and only those whose subject is the launch itself (signals, killed or stopped ranks, torchrun,
restarts) start processes.
"""

from __future__ import annotations

import contextlib
import io
import os
import sys
import tempfile
from pathlib import Path

from cpvlm.verify.runner import DistributedTestError, run_distributed

# A pooled run's limit: longer than any test's own (pytest-timeout), so that the test's timeout
# names the test; the pool still kills every rank of a run that hangs.
_TIMEOUT_S = 1200.0
_ENV_PREFIX = "CPVLM_"


def _threads(world: int) -> int:
    from cpvlm.train.launcher import _cpu_count

    return max(1, _cpu_count() // world)  # as launch_local gives each rank


@contextlib.contextmanager
def _environment(env: dict[str, str]):
    """``CPVLM_*`` variables exactly as the caller has them, for the task only."""
    before = {k: v for k, v in os.environ.items() if k.startswith(_ENV_PREFIX)}
    for key in before:
        del os.environ[key]
    os.environ.update(env)
    try:
        yield
    finally:
        for key in env:
            os.environ.pop(key, None)
        os.environ.update(before)


def _rank(rank, world, config, resume_from, env, threads, out_dir):
    import torch

    from cpvlm.train.loop import RunStopped, train_rank

    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    out, err = io.StringIO(), io.StringIO()
    try:
        with _environment(env), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            train_rank(config, torch.device("cpu"), resume_from)
    except RunStopped as stop:  # raised alike on every rank
        return ("stopped", str(stop), stop.exit_code)
    finally:
        torch.set_num_threads(previous)
        # Written even when the rank raises: the caller shows what it printed before it failed.
        Path(out_dir, f"{rank}.out").write_text(out.getvalue())
        Path(out_dir, f"{rank}.err").write_text(err.getvalue())
    return ("done", None, 0)


def _show(out_dir: str, world: int) -> None:
    """Every rank's lines on this process's file descriptors 1 and 2, where a local launcher's
    ranks write theirs (not on ``sys.stdout``: what the command itself prints stays apart, as
    with real ranks; pytest's ``capfd`` sees both, ``capsys`` the command's alone)."""
    sys.stdout.flush()
    sys.stderr.flush()
    for rank in range(world):
        for suffix, fd in (("out", 1), ("err", 2)):
            path = Path(out_dir, f"{rank}.{suffix}")
            if path.exists() and path.stat().st_size:
                os.write(fd, path.read_bytes())


def launch_pooled(config, resume_from: str | None = None) -> None:
    """Run ``config`` (already ``prepare``d) on ``run_distributed``'s pooled ranks, with what
    ``launch_local`` raises and prints."""
    from cpvlm.train.launcher import TrainingFailed, _trim
    from cpvlm.train.loop import RunStopped

    if config.run.device == "cuda":
        raise ValueError("launch_pooled runs on CPU gloo ranks; a CUDA run needs launch_local")
    world = config.parallel.world_size
    env = {k: v for k, v in os.environ.items() if k.startswith(_ENV_PREFIX)}
    with tempfile.TemporaryDirectory(prefix="cpvlm-pooled-train-") as out_dir:
        args = (config, resume_from, env, _threads(world), out_dir)
        try:
            results = run_distributed(_rank, world, *args, timeout=_TIMEOUT_S)
        except DistributedTestError as err:
            _show(out_dir, world)
            if not err.errors:  # ranks that did not finish in time: the pool's own message
                raise
            rank = min(err.errors)
            raise TrainingFailed(rank, _trim(err.errors[rank], rank, world)) from None
        _show(out_dir, world)
    if any(kind == "stopped" for kind, _, _ in results):
        ((kind, message, code),) = set(results)  # RunStopped is raised alike on every rank
        assert kind == "stopped", results
        raise RunStopped(message, code)
