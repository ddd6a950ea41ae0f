"""Process helpers: the default process group's store, collective timeouts, dying with the parent,
how many process groups a process holds.

Wraps ``distributed_c10d._get_default_store`` (private, in torch 2.11 to 2.15),
``distributed_c10d._world.pg_map`` (private; detected with ``getattr``, else ``None``) and
``torch.multiprocessing._prctl_pr_set_pdeathsig`` (private, Linux; detected with ``getattr``,
elsewhere nothing happens); a timeout is recognised by its message (gloo and NCCL).
"""

from __future__ import annotations


def default_store():
    """The key-value store the default process group was built on (a private torch API)."""
    from torch.distributed import distributed_c10d

    return distributed_c10d._get_default_store()


def process_group_count() -> int | None:
    """How many process groups this process holds, the default one included (``None`` where the
    private registry is not found). Each gloo group keeps threads that poll while idle, so a
    long-lived process that keeps creating groups slows the whole machine."""
    from torch.distributed import distributed_c10d

    pg_map = getattr(getattr(distributed_c10d, "_world", None), "pg_map", None)
    return None if pg_map is None else len(pg_map)


def is_collective_timeout(err: BaseException) -> bool:
    """A collective that waited longer than the process group's timeout (gloo: "Timed out
    waiting ... for recv"; NCCL's watchdog: "collective operation timeout")."""
    text = str(err)
    return "Timed out waiting" in text or "operation timeout" in text or "timed out" in text


def die_with_parent() -> None:
    """Have this process killed (SIGKILL) when its parent dies (Linux ``PR_SET_PDEATHSIG``,
    through torch's private helper; elsewhere nothing)."""
    import signal

    import torch.multiprocessing as tmp

    set_pdeathsig = getattr(tmp, "_prctl_pr_set_pdeathsig", None)
    if set_pdeathsig is not None:
        set_pdeathsig(signal.SIGKILL)
