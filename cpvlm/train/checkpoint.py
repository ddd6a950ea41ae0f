"""Checkpoints with torch.distributed.checkpoint (DCP): model, optimizer, data position, RNG states.

Layout under ``--out DIR``:

    checkpoints/step_00000010/   a complete checkpoint: DCP files, manifest.json, meta.json (last)
    checkpoints/.tmp-step_...    one being written; never read

Atomicity: every rank writes its DCP shards into the temporary directory; after a barrier rank 0
checks what DCP says it wrote (every item of its metadata lies within a file on disk), writes
``manifest.json`` (every file and its size) and ``meta.json``, and renames the directory to its
final name (an atomic rename on one file system). An asynchronous save (``--async-save``) stages
the state to host memory, writes in the background (one at a time) and is finished the same way
once every rank's write is done. A save that fails (a full disk, any write error) removes its
temporary directory and raises ``SaveError`` on every rank. Older checkpoints are deleted only after that
rename, so a run killed at any moment leaves the last complete checkpoint intact. A checkpoint
counts only if it is *intact*: its meta.json and manifest.json parse, and every file of the
manifest is there with its size (a truncated or lost file shows). Every rank must see the same
``--out`` (one machine, or a shared file system).

Model and optimizer states come from ``get_state_dict`` (sharded DTensors under FSDP2: every rank
writes its own shard); DCP stores each tensor whole, in the file layout of the ranks that wrote
it, and loads it into whatever sharding the loading ranks have, so a run may resume with another
dp and cp. The data position is the same on every rank (one global stream) and lives in
meta.json; the RNG states are per rank (key ``rank<r>``) and are restored when the ranks are laid
out as when they were saved.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)

from cpvlm.distributed import compat
from cpvlm.train import faults

CHECKPOINTS = "checkpoints"
META = "meta.json"
MANIFEST = "manifest.json"
KEEP = 2  # complete checkpoints kept; older ones are deleted after a new one is complete
_STEP_DIR = re.compile(r"^step_(\d+)$")


def step_dir(out: str | Path, step: int) -> Path:
    return Path(out) / CHECKPOINTS / f"step_{step:08d}"


def complete_checkpoints(out: str | Path) -> list[tuple[int, Path]]:
    """``(step, path)`` of every checkpoint directory with a meta.json under ``out``, oldest first."""
    root = Path(out) / CHECKPOINTS
    if not root.is_dir():
        return []
    found = []
    for path in root.iterdir():
        match = _STEP_DIR.match(path.name)
        if match and (path / META).is_file():
            found.append((int(match.group(1)), path))
    return sorted(found)


def problem(path: str | Path) -> str | None:
    """Why the checkpoint at ``path`` cannot be used, or None when it is intact."""
    path = Path(path)
    try:
        meta = read_meta(path)
        if not isinstance(meta.get("step"), int) or "config" not in meta:
            return f"{META} lacks its step or config"
    except (OSError, ValueError) as err:
        return f"{META} is unreadable ({err})"
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except (OSError, ValueError) as err:
        return f"{MANIFEST} is missing or unreadable ({err})"
    for name, size in manifest["files"].items():
        file = path / name
        if not file.is_file():
            return f"{name} is missing"
        if file.stat().st_size != size:
            return f"{name} has {file.stat().st_size} bytes, the manifest says {size} (truncated?)"
    return None


def newest_intact(out: str | Path) -> tuple[Path | None, list[str]]:
    """The newest intact checkpoint (or None) and one line per newer one skipped, saying why."""
    skipped = []
    for _, path in reversed(complete_checkpoints(out)):
        why = problem(path)
        if why is None:
            return path, skipped
        skipped.append(f"skipping checkpoint {path.name}: {why}")
    return None, skipped


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


def _write_json(path: Path, value: dict) -> None:
    with open(path, "w") as f:
        json.dump(value, f, indent=1)
        f.flush()
        os.fsync(f.fileno())


def _verify_and_describe(tmp: Path) -> dict:
    """Check the files DCP wrote against its own metadata; the manifest of the directory."""
    files = {p.name: p.stat().st_size for p in sorted(tmp.iterdir()) if p.is_file()}
    for name, needed in compat.dcp_file_extents(tmp).items():
        if files.get(name, -1) < needed:
            raise OSError(
                f"checkpoint {tmp.name}: {name} holds {files.get(name, 0)} bytes but DCP wrote "
                f"{needed} into it (disk full, or another process writing to --out?)"
            )
    return {"files": files}


class SaveError(OSError):
    """A checkpoint could not be written; the previous one is intact. Raised alike on every rank."""


@dataclass
class PendingSave:
    """A checkpoint being written: DCP's save (``future`` when asynchronous), then what rank 0
    writes once every rank's files are on disk (``finish_save``)."""

    out: Path
    step: int
    tmp: Path
    meta: dict
    future: Future | None = None
    error: str | None = None  # the synchronous save failed

    def done(self) -> bool:
        return self.future is None or self.future.done()


def _writer(tmp: Path, step: int, rank: int):
    if faults.fires("enospc", step, rank):
        return faults.full_disk_writer(str(tmp), rank)
    return dcp.FileSystemWriter(str(tmp))


def start_save(
    out: str | Path,
    step: int,
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    rank_state: dict,
    meta: dict,
    async_group=None,
    trainable_only: bool = False,
) -> PendingSave:
    """Start saving step ``step``. Collective: every rank calls it with its own ``rank_state``.

    With ``async_group`` (a gloo group of every rank, used by nothing else) the state is staged
    to host memory and written in the background; else written before this returns.
    ``trainable_only``: leave the frozen parameters out (LoRA: the base model is rebuilt).
    """
    rank = dist.get_rank()
    tmp = step_dir(out, step).with_name(".tmp-" + step_dir(out, step).name)
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)  # left by a run killed while saving this step
        tmp.mkdir(parents=True)
    dist.barrier()
    options = StateDictOptions(ignore_frozen_params=trainable_only)
    model_sd, optim_sd = get_state_dict(model, optimizer, options=options)
    state = {"model": model_sd, "optim": optim_sd, f"rank{rank}": rank_state}
    pending = PendingSave(Path(out), step, tmp, meta)
    writer = _writer(tmp, step, rank)
    try:
        if async_group is None:
            dcp.save(state, storage_writer=writer)
        else:
            pending.future = compat.async_save(state, writer, async_group)
    except compat.checkpoint_error_types() as err:  # DCP raises alike on every rank
        pending.error = compat.checkpoint_failure(err)
    return pending


def finish_save(pending: PendingSave) -> Path:
    """Wait for ``pending``; rank 0 checks the files, writes the manifest and meta.json and
    renames the directory. Collective. Returns the checkpoint; raises ``SaveError`` on every
    rank when any rank's write failed or the files do not hold what DCP wrote (the temporary
    directory is then removed, the previous checkpoint kept)."""
    error = pending.error
    if pending.future is not None:
        try:
            pending.future.result()
        except compat.checkpoint_error_types() as err:
            error = compat.checkpoint_failure(err)
    dist.barrier()
    final = step_dir(pending.out, pending.step)
    errors = [error]
    if dist.get_rank() == 0:
        errors = [error or _publish(pending, final)]
        if errors[0] is not None:
            shutil.rmtree(pending.tmp, ignore_errors=True)
    dist.broadcast_object_list(errors, src=0)
    if errors[0] is not None:
        raise SaveError(f"checkpoint {final.name} was not written: {errors[0]}")
    return final


def _publish(pending: PendingSave, final: Path) -> str | None:
    """Rank 0: manifest, meta.json, rename, delete old checkpoints; the error, or None."""
    tmp = pending.tmp
    try:
        _write_json(tmp / MANIFEST, _verify_and_describe(tmp))
        _write_json(tmp / META, {**pending.meta, "step": pending.step})
        _fsync_dir(tmp)
        if final.exists():
            shutil.rmtree(final)
        os.rename(tmp, final)
        _fsync_dir(final.parent)
        for _, old in complete_checkpoints(pending.out)[:-KEEP]:
            shutil.rmtree(old, ignore_errors=True)
    except OSError as err:
        return str(err)
    return None


def save_checkpoint(out: str | Path, step: int, **state) -> Path:
    """Save step ``step`` and wait for it (``start_save`` then ``finish_save``). Collective."""
    return finish_save(start_save(out, step, **state))


def load_checkpoint(
    path: str | Path,
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    rank_state_template: dict | None,
    trainable_only: bool = False,
) -> dict | None:
    """Load model and optimizer in place (resharded to this run's layout). Collective.

    Returns this rank's ``rank_state`` when ``rank_state_template`` is given (the ranks are laid
    out as when the checkpoint was saved), else None.
    """
    # trainable_only: dcp.load fails on a trainable tensor the checkpoint lacks; the frozen ones
    # stay as built (strict=False lets set_state_dict leave them out).
    options = StateDictOptions(ignore_frozen_params=trainable_only, strict=not trainable_only)
    model_sd, optim_sd = get_state_dict(model, optimizer, options=options)
    state = {"model": model_sd, "optim": optim_sd}
    key = f"rank{dist.get_rank()}"
    if rank_state_template is not None:
        state[key] = rank_state_template
    dcp.load(state, checkpoint_id=str(path))
    set_state_dict(
        model,
        optimizer,
        model_state_dict=state["model"],
        optim_state_dict=state["optim"],
        options=options,
    )
    return state.get(key)
