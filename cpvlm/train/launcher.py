"""Start the ranks of ``cpvlm train``: the launcher's (torchrun), or dp * cp local processes.

Under torchrun (``RANK`` and ``WORLD_SIZE`` set) every process validates the config against the
launcher's world, joins the process group from the environment (NCCL on CUDA devices, gloo on
CPU) and trains; torchrun supervises the ranks (and forwards SIGTERM to them).

Without a launcher, ``launch`` validates everything it can first (flags, world, model directory,
whether the data fits the sequence length, the output directory, which checkpoint to resume),
prints the output directory, then starts dp * cp processes on this machine, joined by a file
store (gloo on CPU). SIGTERM or SIGINT to this process is passed on to the ranks, which finish
their step, checkpoint and stop (a second signal kills them); sent to the whole process group
(Slurm, a terminal's Ctrl-C), the fork server and the DataLoader workers ignore it and the ranks
count it once. If any rank fails, the others are stopped (SIGTERM after a 1 s grace period, then
SIGKILL) and ``TrainingFailed`` carries that rank's traceback, or the signal that killed it, or
the one line of a rank that timed out waiting for a stalled one (``--dist-timeout``); if the
launcher itself dies, its ranks notice within a second and exit.

Under torchrun, a restarted job (``--max-restarts``, ``TORCHELASTIC_RESTART_COUNT`` > 0) with an
``--out`` resumes as ``--resume auto`` does: from the newest intact checkpoint, if any.

A run that stops early on every rank (a non-finite step, a stop signal) ends in ``RunStopped``
with its exit code and one line; the local ranks hand it to the launcher through a file.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from datetime import timedelta
from pathlib import Path

from cpvlm.train.config import TrainConfig, resolve_batch, resolve_world

GRACE_S = 1.0
_PRELOAD = ["cpvlm.train.loop"]  # imported once by the fork server, not once per rank
_STATUS = "status.json"
_STALLED = "stalled-rank"  # + the rank that found a stalled rank: its one line
RUN_FILES = ("metrics.jsonl", "summary.json", "data_errors.jsonl", "checkpoints")
"""What makes a directory a run's (``--overwrite`` removes exactly these)."""
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin")


class ConfigError(ValueError):
    """The configuration cannot run; raised before any rank starts work."""


class TrainingFailed(RuntimeError):
    """A rank failed; ``rank`` and the message (its traceback) say which and why."""

    def __init__(self, rank: int, message: str):
        super().__init__(message)
        self.rank = rank


def under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def restart_count() -> int:
    """How often torchrun (``--max-restarts``) restarted this job; 0 outside torchrun."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def _lead() -> bool:
    return os.environ.get("RANK", "0") == "0"


def model_config(name: str):
    """The HF config of ``--model`` (a tiny name or a local checkpoint directory with weights)."""
    from cpvlm.hf import TINY_MODELS, adapter_for

    if name in TINY_MODELS:
        return TINY_MODELS[name]()
    path = Path(name)
    where = f"model.name = {name!r} (--model)"
    if not (path / "config.json").is_file():
        raise ValueError(
            f"{where}: neither a tiny model ({', '.join(TINY_MODELS)}) nor a local checkpoint "
            "directory with a config.json (hub downloads are not supported)"
        )
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError, KeyError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ValueError(f"{where}: its config.json cannot be read: {first}") from None
    adapter_for(config)
    if not any((path / f).is_file() for f in WEIGHT_FILES) and not any(
        path.glob("model-*.safetensors")
    ):
        raise ValueError(
            f"{where}: the directory has a config.json but no weights ({', '.join(WEIGHT_FILES)});"
            " point --model at a save_pretrained directory (cpvlm export writes one)"
        )
    return config


def _check_new_run(config: TrainConfig) -> None:
    out = Path(config.run.out)
    present = [f for f in RUN_FILES if (out / f).exists()]
    if not present:
        return
    if not config.run.overwrite:
        raise ValueError(
            f"run.out = {str(out)!r} (--out) already holds a run ({', '.join(present)}); pass "
            "--resume to continue it, --overwrite to replace it, or choose another --out"
        )
    if _lead():
        for name in present:
            target = out / name
            if target.is_dir():
                shutil.rmtree(target)
            else:
                target.unlink()


def _resume_point(config: TrainConfig) -> tuple[TrainConfig, str, list[str]]:
    """``(config with grad_accum resolved, checkpoint to load, lines to show)`` for --resume."""
    from cpvlm.train.checkpoint import newest_intact, read_meta

    out = config.run.out
    path, skipped = newest_intact(out)
    if path is None and config.run.resume == "auto":  # a requeued job that saved nothing yet
        config = resolve_batch(config.replace(run={"resume": False, "overwrite": True}), None)
        _check_new_run(config)
        return config, None, [*skipped, "--resume auto: no intact checkpoint yet, starting anew"]
    if path is None:
        detail = "; ".join(skipped) if skipped else "none"
        raise ValueError(
            f"run.resume (--resume): no intact checkpoint in {Path(out) / 'checkpoints'} "
            f"({detail}); check --out, or start without --resume"
        )
    meta = read_meta(path)
    saved = TrainConfig.from_dict(meta["config"])
    config = resolve_batch(config, saved)
    diffs = saved.differences(config)
    if diffs:
        raise ValueError(
            f"run.resume (--resume): the run in {out} was trained with other settings; resume "
            "with the same flags (only --steps, --ckpt-every, --device, --cp, --dp, --tp, --ep, "
            "--attn, --vision, --flow and the memory flags may change): " + "; ".join(diffs)
        )
    if meta["step"] >= config.run.steps:
        raise ValueError(
            f"run.steps = {config.run.steps} (--steps): the checkpoint in {out} is already at "
            f"step {meta['step']}; pass a larger --steps to continue"
        )
    lines = [*skipped, f"resuming from checkpoint {path.name} (step {meta['step']})"]
    before, now = saved.parallel, config.parallel
    if (before.dp, before.cp, before.tp) != (now.dp, now.cp, now.tp):
        with_tp = before.tp > 1 or now.tp > 1

        def layout(p):
            return f"dp {p.dp} x cp {p.cp}" + (f" x tp {p.tp}" if with_tp else "")

        lines.append(
            f"resharded: {layout(before)} -> {layout(now)}; "
            f"grad-accum {saved.data.grad_accum} -> {config.data.grad_accum} keeps the global "
            f"batch of {config.rows_per_step} rows per step"
        )
    return config, str(path), lines


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
    if kind == "prepared":
        from cpvlm.hf.data.prepared_key import check_prepared_spec

        check_prepared_spec(config, mc)


def prepare(
    config: TrainConfig, world_size: int | None = None
) -> tuple[TrainConfig, str | None, list[str]]:
    """Every check that needs no process group.

    Returns the config with dp, grad_accum (and out) filled, the checkpoint to resume from (or
    None), and the lines to show before training (checkpoints skipped, resharding).
    """
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
    from cpvlm.hf.experts import num_experts
    from cpvlm.hf.tensor_plan import check_tp
    from cpvlm.parallelize.expert_parallel import check_experts

    mc = model_config(config.model.name)
    check_experts(config.parallel.ep, num_experts(mc), "parallel.ep", "--ep")
    check_tp(config.parallel.tp, mc, "parallel.tp (--tp)")
    _check_data(config, mc)
    if restart_count() and config.run.out:  # torchrun restarted the job: continue it
        config = config.replace(run={"resume": "auto", "overwrite": False})
    if config.run.resume:
        return _resume_point(config)
    config = resolve_batch(config, None)
    if config.run.out:
        _check_new_run(config)
    return config, None, []


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


def _exit_now() -> None:
    """Exit 1 at once, with the DataLoader workers: no teardown that could wait for a rank."""
    for child in multiprocessing.active_children():
        child.kill()
    os._exit(1)


def _exit_when_orphaned(launcher_pid: int) -> None:
    """If the launcher dies, exit, even in the middle of a collective.

    Watched by pid: the ranks are children of the fork server, which itself stays up while they
    run (they hold its liveness pipe), so neither the parent pid nor PR_SET_PDEATHSIG would tell.
    """

    def watch():
        while _alive(launcher_pid):
            time.sleep(0.5)
        _exit_now()  # DataLoader workers go with the rank

    threading.Thread(target=watch, daemon=True, name="cpvlm-launcher-watch").start()


def _local_worker(
    index: int,
    config: TrainConfig,
    tmpdir: str,
    threads: int,
    launcher_pid: int,
    resume_from: str | None,
) -> None:
    import torch
    import torch.distributed as dist

    from cpvlm.train.loop import RankStalled, RunStopped, train_rank

    _exit_when_orphaned(launcher_pid)
    torch.set_num_threads(threads)
    world = config.parallel.world_size
    device = _device(config, index, launched=False)
    backend = "nccl" if device.type == "cuda" else "gloo"
    store = dist.FileStore(os.path.join(tmpdir, "store"), world)
    timeout = timedelta(seconds=config.run.dist_timeout)
    dist.init_process_group(backend, store=store, rank=index, world_size=world, timeout=timeout)
    try:
        train_rank(config, device, resume_from)
    except RunStopped as stop:  # raised alike on every rank; rank 0 tells the launcher
        if index == 0:
            status = {"message": str(stop), "exit_code": stop.exit_code}
            Path(tmpdir, _STATUS).write_text(json.dumps(status))
    except RankStalled as stalled:  # the stalled rank never joins again: leave at once
        Path(tmpdir, f"{_STALLED}{index}").write_text(str(stalled))
        print(f"cpvlm train: rank {index}: {stalled}", file=sys.stderr, flush=True)
        _exit_now()
    _destroy_process_group()


def _destroy_process_group() -> None:
    """Destroy every process group before the interpreter exits.

    Left to the interpreter's shutdown, a gloo process group may outlive Python's objects, and
    its worker threads are then destroyed unjoined: the process aborts at exit with "terminate
    called without an active exception" (now and then, not always). Only after a run that ended
    alike on every rank (done, or ``RunStopped``): after an error, other ranks may still be in a
    collective, and tearing the group down could wait for them; the launcher stops them instead.
    """
    import torch.distributed as dist

    dist.destroy_process_group()


def _cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


class _PassOnSignals:
    """While the ranks run: SIGTERM / SIGINT go on to them; a second one kills them.

    The ranks may have had the signal already (sent to the whole process group, as Slurm and a
    terminal do); a rank counts it once either way.
    """

    def __init__(self, processes):
        self.processes, self.count, self.signum = processes, 0, 0

    def __enter__(self):
        self._previous = {
            s: signal.signal(s, self._handle) for s in (signal.SIGTERM, signal.SIGINT)
        }
        return self

    def _handle(self, signum, frame):
        self.count += 1
        self.signum = self.signum or signum
        for proc in self.processes:
            if not proc.is_alive():
                continue
            if self.count == 1:
                os.kill(proc.pid, signum)  # finish the step, checkpoint, stop
            else:
                proc.kill()

    def __exit__(self, *exc):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def _start_forkserver() -> None:
    """Start the fork server that starts the ranks, with SIGTERM and SIGINT ignored.

    A stop signal to the whole process group would kill it otherwise, and multiprocessing then
    reads every rank it started as exited with code 255 while the ranks still run (the launcher
    stopped them, or read their half-written error files): the "exit 255, no traceback" deaths.
    Ignored signals survive its exec; the ranks set their own handlers (cpvlm.train.loop).
    """
    from multiprocessing import forkserver

    multiprocessing.get_context("forkserver").set_forkserver_preload(_PRELOAD)
    previous = {s: signal.signal(s, signal.SIG_IGN) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        forkserver.ensure_running()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def launch_local(config: TrainConfig, resume_from: str | None = None) -> None:
    """Run ``config`` (already ``prepare``d) on dp * cp processes of this machine."""
    import torch.multiprocessing as tmp

    from cpvlm.train.loop import RunStopped

    world = config.parallel.world_size
    threads = max(1, _cpu_count() // world)
    method = "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"
    if method == "forkserver":
        _start_forkserver()
    with tempfile.TemporaryDirectory(prefix="cpvlm-train-") as tmpdir:
        context = tmp.start_processes(
            _local_worker,
            args=(config, tmpdir, threads, os.getpid(), resume_from),
            nprocs=world,
            join=False,
            start_method=method,
        )
        signals = _PassOnSignals(context.processes)
        try:
            with signals:
                while not context.join(grace_period=GRACE_S):
                    pass
        except (tmp.ProcessRaisedException, tmp.ProcessExitedException) as err:
            if signals.count > 1:
                name = signal.Signals(signals.signum).name
                raise RunStopped(
                    f"killed by a second {name}: the ranks did not finish their step; the "
                    f"newest intact checkpoint in {config.run.out} is kept",
                    128 + signals.signum,
                ) from None
            stalled = sorted(Path(tmpdir).glob(_STALLED + "*"))
            if stalled:
                raise TrainingFailed(err.error_index, stalled[0].read_text()) from None
            if isinstance(err, tmp.ProcessRaisedException):
                message = _trim(err.msg, err.error_index, world)
            else:
                message = f"rank {err.error_index} of {world} died: {err.msg}"
                if err.exit_code == 255 and method == "forkserver":  # not the rank's own code
                    message += " (multiprocessing's code when the fork server died: killed?)"
            raise TrainingFailed(err.error_index, message) from None
        except BaseException:
            for proc in context.processes:
                if proc.is_alive():
                    proc.kill()
            raise
        status = Path(tmpdir, _STATUS)
        if status.exists():
            stop = json.loads(status.read_text())
            raise RunStopped(stop["message"], stop["exit_code"])


_DATA_ERROR = "cpvlm.data.errors.DataError: "


def _trim(msg: str, rank: int, world: int) -> str:
    body = msg.split("terminated with the following error:\n", 1)[-1].rstrip()
    last = body.rsplit("\n", 1)[-1]
    if last.startswith(_DATA_ERROR):  # bad data under --strict: its one line says it all
        return f"bad data (--strict): {last.removeprefix(_DATA_ERROR)}"
    return f"rank {rank} of {world} failed:\n{body}"


def _announce(config: TrainConfig, lines: list[str]) -> None:
    out = Path(config.run.out)
    print(f"cpvlm train: output in {out} (metrics.jsonl, summary.json, checkpoints/)", flush=True)
    for line in lines:
        print(f"cpvlm train: {line}", flush=True)


def torchrun_store(timeout: timedelta):
    """``(store, rank, world size)`` of torchrun's environment, the store's keys this attempt's.

    torchrun's default (static) rendezvous keeps one store for the whole job, its agent's, and
    the ranks of a restarted job (``--max-restarts``) find in it every key the ranks before them
    wrote: gloo's addresses among them, under the same names. A restarted rank that reads a peer's
    address before the peer has written its new one connects to a dead process's port ("Gloo
    connectFullMesh failed ... Connection refused"; NCCL's unique id alike). Under a prefix of
    the restart count each attempt sees only its own keys (and so do the stall reports'
    phases, ``cpvlm.train.loop``).
    """
    import torch.distributed as dist

    store, rank, world = next(dist.rendezvous("env://", timeout=timeout))
    return dist.PrefixStore(f"cpvlm/attempt_{restart_count()}/", store), rank, world


def launch(config: TrainConfig) -> None:
    """Train: under torchrun on this process's rank, else on dp * cp local processes.

    Raises ``ConfigError`` for a bad config (before any rank starts work), ``TrainingFailed``
    when a local rank fails, and ``RunStopped`` when the run stopped early on every rank.
    """
    world = int(os.environ["WORLD_SIZE"]) if under_torchrun() else None
    try:
        config, resume_from, lines = prepare(config, world)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    if world is None:
        _announce(config, lines)
        launch_local(config, resume_from)
        return
    import torch.distributed as dist

    from cpvlm.train.loop import RankStalled, RunStopped, train_rank

    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = _device(config, local_rank, launched=True)
    timeout = timedelta(seconds=config.run.dist_timeout)
    backend = "nccl" if device.type == "cuda" else "gloo"
    store, rank, world = torchrun_store(timeout)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)
    if not config.run.out:  # one default directory for all ranks, chosen by rank 0
        chosen = [config.with_default_out().run.out]
        dist.broadcast_object_list(chosen, src=0)
        config = config.replace(run={"out": chosen[0]})
    if dist.get_rank() == 0:
        _announce(config, lines)
    try:
        train_rank(config, device, resume_from)
    except RunStopped:
        _destroy_process_group()
        raise
    except RankStalled as stalled:  # the stalled rank never joins again: leave at once
        print(f"cpvlm train: rank {dist.get_rank()}: {stalled}", file=sys.stderr, flush=True)
        _exit_now()
    _destroy_process_group()
