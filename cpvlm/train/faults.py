"""Faults injected on purpose, for the fault tests only: ``CPVLM_FAULT=KIND@STEP[:RANK]``.

Read here and nowhere else (``cpvlm train`` calls ``fires``). KIND is one of

    crash    the rank raises at the start of step STEP (1-based)
    stop     the rank stops itself with SIGSTOP at the start of step STEP (a stalled rank)
    kill     the rank kills itself with SIGKILL at the start of step STEP (a rank the OOM killer
             or a failing node takes)
    enospc   the rank's files of the checkpoint of step STEP are cut short and the write fails
             with ENOSPC (a disk that fills up during a save)

RANK defaults to 0. A fault fires once per job: not again after a torchrun restart
(``TORCHELASTIC_RESTART_COUNT`` > 0), so that an elastic restart can be tested.
"""

from __future__ import annotations

import errno
import os
import signal

ENV = "CPVLM_FAULT"
KINDS = ("crash", "stop", "kill", "enospc")


def _parse(spec: str) -> tuple[str, int, int]:
    kind, _, rest = spec.partition("@")
    step, _, rank = rest.partition(":")
    if kind not in KINDS or not step.isdigit() or (rank and not rank.isdigit()):
        raise ValueError(
            f"{ENV}={spec!r}: expected KIND@STEP[:RANK] with KIND one of {', '.join(KINDS)}"
        )
    return kind, int(step), int(rank or 0)


def fires(kind: str, step: int, rank: int) -> bool:
    """Whether ``CPVLM_FAULT`` asks for fault ``kind`` at ``step`` on ``rank``."""
    spec = os.environ.get(ENV)
    if not spec or int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0:
        return False
    return _parse(spec) == (kind, step, rank)


def inject(step: int, rank: int) -> None:
    """The crash, stop or kill asked for at the start of ``step`` on ``rank``, if any."""
    if fires("crash", step, rank):
        raise RuntimeError(f"{ENV}: injected crash at step {step} on rank {rank}")
    if fires("stop", step, rank):
        os.kill(os.getpid(), signal.SIGSTOP)
    if fires("kill", step, rank):
        os.kill(os.getpid(), signal.SIGKILL)


def full_disk_writer(path: str, rank: int):
    """A DCP writer whose files come out short, failing with ENOSPC, as on a full disk."""
    from torch.distributed.checkpoint import FileSystemWriter

    class FullDisk(FileSystemWriter):
        def write_data(self, plan, planner):
            done = super().write_data(plan, planner)
            done.wait()
            for name in sorted(os.listdir(path)):
                if name.startswith(f"__{rank}_"):
                    file = os.path.join(path, name)
                    os.truncate(file, os.path.getsize(file) // 2)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)

    return FullDisk(path)
