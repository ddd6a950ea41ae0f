"""Start the ranks of ``cpvlm train``: the launcher's (torchrun), or dp * cp local processes.

Under torchrun (``RANK`` and ``WORLD_SIZE`` set) every process validates the config against the
launcher's world, joins the process group from the environment (NCCL on CUDA devices, gloo on
CPU) and trains; torchrun supervises the ranks.

Without a launcher, ``launch`` validates everything it can first (flags, world, model config,
whether the data fits the sequence length, the output directory), then starts dp * cp processes
on this machine, joined by a file store (gloo on CPU). If any rank fails, the others are stopped
(SIGTERM after a 1 s grace period, then SIGKILL) and ``TrainingFailed`` carries that rank's
traceback; if the launcher itself dies, its ranks notice within a second and exit.
"""

from __future__ import annotations

import multiprocessing
import os
import tempfile
import threading
import time
from pathlib import Path

from cpvlm.train.config import TrainConfig, resolve_world

GRACE_S = 1.0
_PRELOAD = ["cpvlm.train.loop"]  # imported once by the fork server, not once per rank


class ConfigError(ValueError):
    """The configuration cannot run; raised before any rank starts work."""


class TrainingFailed(RuntimeError):
    """A rank failed; ``rank`` and the message (its traceback) say which and why."""

    def __init__(self, rank: int, message: str):
        super().__init__(message)
        self.rank = rank


def under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def model_config(name: str):
    """The HF config of ``--model`` (a tiny name or a local checkpoint directory)."""
    from cpvlm.integrations.hf import TINY_MODELS, adapter_for

    if name in TINY_MODELS:
        return TINY_MODELS[name]()
    path = Path(name)
    if not (path / "config.json").is_file():
        raise ValueError(
            f"model.name = {name!r} (--model): neither a tiny model ({', '.join(TINY_MODELS)}) "
            "nor a local checkpoint directory with a config.json (hub downloads are not supported)"
        )
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path, local_files_only=True)
    adapter_for(config)
    return config


def _check_out(config: TrainConfig) -> None:
    from cpvlm.train.checkpoint import latest_checkpoint, read_meta

    out = config.run.out
    latest = latest_checkpoint(out) if out else None
    if not config.run.resume:
        if latest is not None:
            raise ValueError(
                f"run.out = {out!r} (--out) already holds a run (checkpoint {latest.name}); pass "
                "--resume to continue it, or choose another --out"
            )
        return
    if latest is None:
        raise ValueError(
            f"run.resume (--resume): no complete checkpoint in {Path(out) / 'checkpoints'}; "
            "check --out, or start without --resume"
        )
    meta = read_meta(latest)
    saved = TrainConfig.from_dict(meta["config"])
    diffs = saved.differences(config)
    if diffs:
        raise ValueError(
            f"run.resume (--resume): the run in {out} was trained with other settings; resume "
            f"with the same flags (only --steps, --ckpt-every, --device may change): "
            + "; ".join(diffs)
        )
    if meta["step"] >= config.run.steps:
        raise ValueError(
            f"run.steps = {config.run.steps} (--steps): the checkpoint in {out} is already at "
            f"step {meta['step']}; pass a larger --steps to continue"
        )


def _check_data(config: TrainConfig, mc) -> None:
    import importlib
    import sys

    from cpvlm.data import source_kind
    from cpvlm.train.data import check_data_fits, load_source
    from cpvlm.train.loader import has_processor

    spec = config.data.source
    if spec == "synthetic":
        check_data_fits(load_source("synthetic", mc, config.run.seed), config.data.seq_len)
        return
    try:
        kind = source_kind(spec)
    except ValueError as err:
        raise ValueError(f"data.source {str(err).removeprefix('--data ')} (--data)") from None
    if kind == "function":
        module_name, _, func_name = spec.partition(":")
        if os.getcwd() not in sys.path:
            sys.path.insert(0, os.getcwd())  # as `python -m` does; the ranks do the same
        try:
            module = importlib.import_module(module_name)
        except ImportError as err:
            raise ValueError(
                f"data.source (--data): cannot import {module_name!r}: {err}"
            ) from None
        if not callable(getattr(module, func_name, None)):
            raise ValueError(f"data.source (--data): {module_name} has no function {func_name!r}")
    elif not has_processor(config.model.name):
        raise ValueError(
            f"data.source = {spec!r} (--data): conversations are tokenized by the model's own "
            f"processor, but --model {config.model.name} is not a checkpoint directory with one "
            "(tokenizer, chat template, image processor); pass --model DIR"
        )


def prepare(config: TrainConfig, world_size: int | None = None) -> TrainConfig:
    """Every check that needs no process group; returns the config with dp (and out) filled."""
    import torch

    config = resolve_world(config, world_size)
    if world_size is None:
        config = config.with_default_out()
    device = config.run.device
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("run.device = 'cuda' (--device): no CUDA device is available")
    if (
        device == "cuda"
        and world_size is None
        and torch.cuda.device_count() < config.parallel.world_size
    ):
        raise ValueError(
            f"run.device = 'cuda' (--device): {config.parallel.world_size} ranks need as many "
            f"GPUs, this machine has {torch.cuda.device_count()}"
        )
    mc = model_config(config.model.name)
    _check_data(config, mc)
    if config.run.out:
        _check_out(config)
    return config


def _device(config: TrainConfig, local_rank: int, launched: bool):
    import torch

    want = config.run.device
    if want == "cuda" or (want == "auto" and launched and torch.cuda.is_available()):
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a dead launcher whose parent has not reaped it yet is a zombie
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return True


def _exit_when_orphaned(launcher_pid: int) -> None:
    """If the launcher dies, exit, even in the middle of a collective.

    Watched by pid: the ranks are children of the fork server, which itself stays up while they
    run (they hold its liveness pipe), so neither the parent pid nor PR_SET_PDEATHSIG would tell.
    """

    def watch():
        while _alive(launcher_pid):
            time.sleep(0.5)
        for child in multiprocessing.active_children():  # DataLoader workers go with the rank
            child.kill()
        os._exit(1)

    threading.Thread(target=watch, daemon=True, name="cpvlm-launcher-watch").start()


def _local_worker(
    index: int, config: TrainConfig, store_path: str, threads: int, launcher_pid: int
) -> None:
    import torch
    import torch.distributed as dist

    from cpvlm.train.loop import train_rank

    _exit_when_orphaned(launcher_pid)
    torch.set_num_threads(threads)
    world = config.parallel.world_size
    device = _device(config, index, launched=False)
    backend = "nccl" if device.type == "cuda" else "gloo"
    store = dist.FileStore(store_path, world)
    dist.init_process_group(backend, store=store, rank=index, world_size=world)
    train_rank(config, device)
    dist.destroy_process_group()


def _cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def launch_local(config: TrainConfig) -> None:
    """Run ``config`` (already ``prepare``d) on dp * cp processes of this machine."""
    import torch.multiprocessing as tmp

    world = config.parallel.world_size
    threads = max(1, _cpu_count() // world)
    method = "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"
    if method == "forkserver":
        multiprocessing.get_context("forkserver").set_forkserver_preload(_PRELOAD)
    with tempfile.TemporaryDirectory(prefix="cpvlm-train-") as tmpdir:
        context = tmp.start_processes(
            _local_worker,
            args=(config, os.path.join(tmpdir, "store"), threads, os.getpid()),
            nprocs=world,
            join=False,
            start_method=method,
        )
        try:
            while not context.join(grace_period=GRACE_S):
                pass
        except tmp.ProcessRaisedException as err:
            raise TrainingFailed(err.error_index, _trim(err.msg, err.error_index, world)) from None
        except tmp.ProcessExitedException as err:
            raise TrainingFailed(
                err.error_index, f"rank {err.error_index} of {world} died: {err.msg}"
            ) from None
        except BaseException:
            for proc in context.processes:
                if proc.is_alive():
                    proc.kill()
            raise


_DATA_ERROR = "cpvlm.data.errors.DataError: "


def _trim(msg: str, rank: int, world: int) -> str:
    body = msg.split("terminated with the following error:\n", 1)[-1].rstrip()
    last = body.rsplit("\n", 1)[-1]
    if last.startswith(_DATA_ERROR):  # bad data under --strict: its one line says it all
        return f"bad data (--strict): {last.removeprefix(_DATA_ERROR)}"
    return f"rank {rank} of {world} failed:\n{body}"


def launch(config: TrainConfig) -> None:
    """Train: under torchrun on this process's rank, else on dp * cp local processes.

    Raises ``ConfigError`` for a bad config (before any rank starts work) and ``TrainingFailed``
    when a local rank fails.
    """
    world = int(os.environ["WORLD_SIZE"]) if under_torchrun() else None
    try:
        config = prepare(config, world)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    if world is None:
        launch_local(config)
        return
    import torch.distributed as dist

    from cpvlm.train.loop import train_rank

    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = _device(config, local_rank, launched=True)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    try:
        if not config.run.out:  # one default directory for all ranks, chosen by rank 0
            chosen = [config.with_default_out().run.out]
            dist.broadcast_object_list(chosen, src=0)
            config = config.replace(run={"out": chosen[0]})
        train_rank(config, device)
    finally:
        dist.destroy_process_group()
