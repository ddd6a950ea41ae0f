"""Checkpoints with torch.distributed.checkpoint (DCP): model, optimizer, data position, RNG states.

Layout under ``--out DIR``:

    checkpoints/step_00000010/   a complete checkpoint: DCP files + meta.json (written last)
    checkpoints/.tmp-step_...    one being written; never read

Atomicity: every rank writes its DCP shards into the temporary directory; after a barrier rank 0
writes ``meta.json`` into it and renames the directory to its final name (an atomic rename on one
file system). Older checkpoints are deleted only after that rename, so a run killed at any moment
leaves the last complete checkpoint intact, and a directory without ``meta.json`` never counts.
Every rank must see the same ``--out`` (one machine, or a shared file system).

Model and optimizer states come from ``get_state_dict`` (sharded DTensors under FSDP2: every rank
writes its own shard). The data position (per DP rank) and the RNG states (per rank) are stored
under the key ``rank<r>``, so each rank reads back exactly its own.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

CHECKPOINTS = "checkpoints"
META = "meta.json"
KEEP = 2  # complete checkpoints kept; older ones are deleted after a new one is complete
_STEP_DIR = re.compile(r"^step_(\d+)$")


def step_dir(out: str | Path, step: int) -> Path:
    return Path(out) / CHECKPOINTS / f"step_{step:08d}"


def complete_checkpoints(out: str | Path) -> list[tuple[int, Path]]:
    """``(step, path)`` of every complete checkpoint under ``out``, oldest first."""
    root = Path(out) / CHECKPOINTS
    if not root.is_dir():
        return []
    found = []
    for path in root.iterdir():
        match = _STEP_DIR.match(path.name)
        if match and (path / META).is_file():
            found.append((int(match.group(1)), path))
    return sorted(found)


def latest_checkpoint(out: str | Path) -> Path | None:
    found = complete_checkpoints(out)
    return found[-1][1] if found else None


def read_meta(path: str | Path) -> dict:
    with open(Path(path) / META) as f:
        return json.load(f)


def rng_state(device: torch.device) -> dict:
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict, device: torch.device) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # not every platform can open a directory
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_checkpoint(
    out: str | Path,
    step: int,
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    rank_state: dict,
    meta: dict,
) -> Path:
    """Save step ``step``. Collective: every rank calls it with its own ``rank_state``."""
    rank = dist.get_rank()
    final = step_dir(out, step)
    tmp = final.with_name(".tmp-" + final.name)
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)  # left by a run killed while saving this step
        tmp.mkdir(parents=True)
    dist.barrier()
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd, f"rank{rank}": rank_state}
    dcp.save(state, checkpoint_id=str(tmp))
    dist.barrier()
    if rank == 0:
        with open(tmp / META, "w") as f:
            json.dump({**meta, "step": step}, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        _fsync_dir(tmp)
        if final.exists():
            shutil.rmtree(final)
        os.rename(tmp, final)
        _fsync_dir(final.parent)
        for _, old in complete_checkpoints(out)[:-KEEP]:
            shutil.rmtree(old, ignore_errors=True)
    dist.barrier()
    return final


def load_checkpoint(
    path: str | Path,
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    rank_state_template: dict,
) -> dict:
    """Load model and optimizer in place; return this rank's ``rank_state``. Collective."""
    rank = dist.get_rank()
    model_sd, optim_sd = get_state_dict(model, optimizer)
    key = f"rank{rank}"
    state = {"model": model_sd, "optim": optim_sd, key: rank_state_template}
    dcp.load(state, checkpoint_id=str(path))
    set_state_dict(
        model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"]
    )
    return state[key]
