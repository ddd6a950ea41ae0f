"""The training loop of one rank: model, data parallelism, data, steps, guards, checkpoints.

Legend: W world size = dp * cp * tp; a *row* is one packed sequence (one CP forward); a step trains
on ``rows_per_step`` rows of the global stream, R = rows_per_step / dp of them on each DP replica.

Per step every rank: takes its DP replica's rows (the same on all CP ranks), counts the valid
(shifted) labels of the whole step over DP, runs each row through ``ContextParallelVLM`` (its
loss is this rank's share of the step's token mean) and backward; the gradient sync sums over the
dp x cp ranks, so the summed gradients are the one-device gradients of the step (with ``--ep``,
the sharded experts are summed over the ranks that hold the same experts: FSDP2's reduce-scatter
over them, or ``sync_expert_gradients`` under ``--data-parallel none``). With
``--tp`` every TP rank of a (dp, cp) coordinate takes the same rows and computes the same loss;
the gradient sync runs per tp slice, and only the TP-partial replicated gradients (Qwen3's q/k
norms) are summed over TP (``sync_tp_gradients``); a step's statistics count tp rank 0. Then the
global gradient norm, one all-reduce of the step's statistics (its loss among them), the
non-finite guard, clipping and AdamW, and one small all-reduce (max) of memory and of a stop
request.

Every decision that ends or changes a step (a non-finite loss or gradient norm, SIGTERM/SIGINT
received by any rank) is taken from values every rank holds after those all-reduces, so all
ranks take it together: a run stops with the same ``RunStopped`` on every rank.

Every rank ends every backward with the same set of gradients: ContextParallelVLM runs the
vision tower on every rank, on a dummy frame (kept out of the result) where a rank or a whole row
has no image, so the tower gets zero gradients rather than none. FSDP2 and DDP need that when the
DP replicas' rows differ (one has images, another not).

Faults: each rank keeps its step and phase in the process group's store; when a collective times
out (``--dist-timeout``) the ranks that timed out name the one that did not (``RankStalled``).
With ``--async-save`` a checkpoint is written in the background, one at a time, and finished at
the first step boundary where every rank's write is done; a save that fails warns or stops
(``--on-save-error``), keeping the previous checkpoint.
"""

from __future__ import annotations

import json
import math
import random
import signal
import sys
import time
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.profiler import record_function

from cpvlm.data import ErrorLog, RankLoader
from cpvlm.data.balance import RowCost
from cpvlm.distributed import compat
from cpvlm.hf import ContextParallelVLM, adapter_for, build_model
from cpvlm.hf.registry import kit_for
from cpvlm.hf.tensor_plan import apply_tensor_parallel
from cpvlm.loss import count_valid_labels, shift_labels
from cpvlm.parallelize import MeshGroups, build_mesh, mesh_groups, parallelize
from cpvlm.parallelize.gradients import by_mesh, global_grad_norm, sync_step_gradients
from cpvlm.parallelize.row_groups import row_groups
from cpvlm.train import faults
from cpvlm.train.checkpoint import (
    PendingSave,
    SaveError,
    finish_save,
    load_checkpoint,
    read_meta,
    rng_state,
    set_rng_state,
    start_save,
    step_dir,
)
from cpvlm.train.config import TrainConfig
from cpvlm.train.dynamic_cp import plan_step, row_costs
from cpvlm.train.loader import (
    agree_on_decode_failures,
    build_loader,
    dynamic_cp_tokens,
    report_planning_errors,
)
from cpvlm.train.metrics import MetricsLog, Progress, StepMemory, summarize

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
"""How SLURM, Kubernetes and a terminal stop a job: finish the step, checkpoint, exit 128+sig."""

_STATS = (
    "loss",
    "tokens",
    "rows",
    "rows_text_only",
    "ranks_no_image",
    "ranks_no_visual_tokens",
    "rows_replaced",
)


class RunStopped(Exception):
    """The run ended early, on every rank alike: ``exit_code`` and a one-line reason."""

    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code


class RankStalled(RuntimeError):
    """A collective timed out (``--dist-timeout``) waiting for a rank: one line naming it."""


_PHASE_KEY = "cpvlm/phase/"
_TIMED_OUT_KEY = "cpvlm/timed-out/"
_AGREE_S = 2.0  # how long the ranks that timed out wait to hear of each other


class _Phases:
    """Each rank's step and phase (data, forward, backward, optimizer, checkpoint) in the process
    group's store, so that the ranks a collective timed out on can name the one they waited for:
    the ranks that did not time out too are not in the collective (stopped, hung, dead)."""

    def __init__(self, timeout_s: int):
        self.store = compat.default_store()
        self.rank, self.world, self.timeout_s = dist.get_rank(), dist.get_world_size(), timeout_s

    def enter(self, step: int, phase: str) -> None:
        self.store.set(f"{_PHASE_KEY}{self.rank}", json.dumps([step, phase]))

    def stalled(self, out: str) -> RankStalled:
        self.store.set(f"{_TIMED_OUT_KEY}{self.rank}", "1")
        deadline = time.monotonic() + _AGREE_S
        while True:
            waiting = [r for r in range(self.world) if self.store.check([f"{_TIMED_OUT_KEY}{r}"])]
            if len(waiting) == self.world or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        stalled = [r for r in range(self.world) if r not in waiting] or list(range(self.world))
        where = []
        for r in stalled:
            if not self.store.check([f"{_PHASE_KEY}{r}"]):
                where.append(f"rank {r} of {self.world} never started training")
                continue
            step, phase = json.loads(self.store.get(f"{_PHASE_KEY}{r}"))
            where.append(
                f"rank {r} of {self.world} made no progress for {self.timeout_s} s: in step "
                f"{step}, {phase} (last step done: {step - 1})"
            )
        return RankStalled(
            "; ".join(where) + f" (--dist-timeout {self.timeout_s}); every rank stops; the "
            f"newest intact checkpoint in {out} is kept"
        )


def freeze_vision_encoder(model: nn.Module) -> None:
    """``--freeze-vision``: the tower is frozen except its projector (the family's
    ``modules.projector`` prefixes: a merger inside the tower; one beside it stays trainable)."""
    adapter = adapter_for(model)
    for name, p in adapter.vision_tower(model).named_parameters():
        if not name.startswith(adapter.modules.projector):
            p.requires_grad_(False)


class _StopRequests:
    """SIGTERM / SIGINT set a flag instead of killing the rank mid-step (main thread only)."""

    def __init__(self):
        self.signum = 0
        self._previous = {}

    def __enter__(self):
        for sig in STOP_SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame):
        self.signum = self.signum or signum

    def __exit__(self, *exc):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


@dataclass
class _Run:
    """Everything one rank's loop works with, built once by ``_setup``."""

    config: TrainConfig
    device: torch.device
    groups: MeshGroups
    cp_model: ContextParallelVLM
    runner: nn.Module
    params: list[nn.Parameter]
    optimizer: torch.optim.Optimizer
    errors: ErrorLog | None
    loader: RankLoader | None = None
    start_step: int = 0
    records: list[dict] = field(default_factory=list)
    skipped: int = 0
    last_checkpoint: Path | None = None
    phases: _Phases | None = None
    save_group: dist.ProcessGroup | None = None  # --async-save: the background writes' group
    pending: PendingSave | None = None  # the checkpoint being written in the background
    tp_summed: list[nn.Module] = field(default_factory=list)  # gradients summed over TP
    row_cost: RowCost | None = None  # --dynamic-cp: the plan's cost model

    @property
    def lead(self) -> bool:
        return dist.get_rank() == 0


def _setup_model(config: TrainConfig, device: torch.device, groups, mesh):
    """``(model, cp_model, runner, tp_summed)``: the last, the modules whose gradients are summed
    over TP (``sync_tp_gradients``)."""
    m, p = config.model, config.parallel
    model = build_model(m.name, dtype=m.torch_master_dtype, seed=config.run.seed)
    if m.torch_master_dtype == torch.float64:
        # A float64 run is a check: the parts transformers computes in float32 whatever the dtype
        # (Gemma's RMSNorm) are computed in float64, as cpvlm verify does, so that CP matches
        # CP=1 to float64 round-off.
        kit_for(model).float64_islands(model)
    if m.lora is not None:  # the model frozen, LoRA layers in it (cpvlm.train.lora)
        from cpvlm.train.lora import apply_lora

        model = apply_lora(model, m.lora, config.run.seed)
    if m.freeze_vision:
        freeze_vision_encoder(model)
    if m.activation_checkpointing:
        # transformers recomputes its decoder layers and vision blocks in the backward, with
        # their module hooks (FSDP2's) outside the recomputed part.
        enable = getattr(model, "activation_checkpointing_enable", None)
        if enable is not None:
            enable({"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable({"use_reentrant": False})
    model.to(device)
    tp_summed = []
    if groups.tp_mesh is not None:  # before FSDP2, which shards the TP shards over dp x cp
        tp_summed = apply_tensor_parallel(model, groups.tp_mesh)
    blocks = None
    if p.dynamic_cp:  # every block group of the CP groups, made now on every rank alike
        blocks = row_groups(groups, timeout=timedelta(seconds=config.run.dist_timeout))
    cp_model = ContextParallelVLM(
        model,
        groups.cp_group,
        options=p.options,
        loss_chunk=m.loss_chunk or None,
        row_groups=blocks,
    )
    if p.dynamic_cp and cp_model.adapter.router_loss() is not None:
        raise ValueError(
            f"--dynamic-cp does not train {cp_model.family} yet: its router loss is a mean "
            "over forward batches, and a rank that idles in a round runs a blank row whose "
            "router loss would count; use static CP"
        )
    # FSDP2 units from the adapter: each decoder layer and the vision tower (the root keeps
    # embeddings, head, norm). The tower is a safe unit because ContextParallelVLM calls it exactly
    # once per forward on every rank, at the same point, with a dummy frame where there is nothing
    # to encode.
    units = adapter_for(model).fsdp_units(model)
    runner = parallelize(
        cp_model,
        mesh,
        data_parallel=p.data_parallel,
        groups=groups,
        fsdp_units=units,
        compute_dtype=m.torch_dtype if m.mixed_precision else None,
    )
    return model, cp_model, runner, tp_summed


def _setup(config: TrainConfig, device: torch.device, resume_from: str | None) -> _Run:
    # The global RNGs (nothing in a step draws from them) would otherwise hold the fork server's
    # random seeds: seeded, two runs save the same RNG states, so their checkpoints are identical.
    torch.manual_seed(config.run.seed + dist.get_rank())
    random.seed(config.run.seed + dist.get_rank())
    dp, cp, ep, tp = config.parallel.dp, config.parallel.cp, config.parallel.ep, config.parallel.tp
    mesh = build_mesh(dp_replicate=1, dp_shard=dp, cp=cp, ep=ep, tp=tp, device_type=device.type)
    groups = mesh_groups(mesh, ep=ep)
    model, cp_model, runner, tp_summed = _setup_model(config, device, groups, mesh)
    params = [p for p in cp_model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(
        params, lr=config.optim.lr, weight_decay=config.optim.weight_decay
    )
    if config.parallel.vision == "replicate":  # every rank encodes every unit
        config = config.replace(data={"decode": "all"})
    run = _Run(config, device, groups, cp_model, runner, params, optimizer, None)
    run.tp_summed = tp_summed
    if config.parallel.dynamic_cp:
        from cpvlm.hf.data.row_cost import row_cost

        run.row_cost = row_cost(model.config)
    run.phases = _Phases(config.run.dist_timeout)
    run.phases.enter(run.start_step + 1, "data")
    if config.run.async_save:
        timeout = timedelta(seconds=config.run.dist_timeout)
        run.save_group = dist.new_group(backend="gloo", timeout=timeout)
    data_state = None
    if resume_from is not None:
        data_state = _restore(run, Path(resume_from))
    out = config.run.out if dist.get_rank() == 0 else None
    run.errors = ErrorLog(out, strict=config.data.strict, start_step=run.start_step)
    run.loader = build_loader(
        config,
        model.config,
        groups,
        assign=cp_model.vision_assignment,
        pieces=cp_model.vision_pieces,
        state=data_state,
    )
    return run


def _restore(run: _Run, path: Path) -> dict:
    """Load the checkpoint at ``path`` into the run; returns its data state."""
    meta = read_meta(path)
    saved = TrainConfig.from_dict(meta["config"])
    # RNG states are per rank: restore them when every rank is the rank it was.
    before, now = saved.parallel, run.config.parallel
    same_layout = (before.dp, before.cp, before.tp) == (now.dp, now.cp, now.tp)
    template = {"rng": rng_state(run.device)} if same_layout else None
    restored = load_checkpoint(
        path,
        model=run.cp_model,
        optimizer=run.optimizer,
        rank_state_template=template,
        trainable_only=run.config.model.lora is not None,  # LoRA: the base is rebuilt
    )
    if restored is not None:
        set_rng_state(restored["rng"], run.device)
    run.start_step, run.last_checkpoint = meta["step"], path
    return meta["data"]


def _step_jobs(run: _Run, rows) -> tuple[list, dict | None]:
    """``([(row index, CP size), ...], dynamic_cp record)``: what this rank runs in the step, in
    order. Static CP: every row on the CP group (size None). ``--dynamic-cp``: a row or a blank
    (index None, size 1) per round (``cpvlm.train.dynamic_cp``; collective). Planned from the
    rows as the loader planned them (its pixels are those of these jobs), before failed rows
    are replaced by blanks."""
    if not run.config.parallel.dynamic_cp:
        return [(k, None) for k in range(len(rows))], None
    p = run.config.parallel
    rounds = plan_step(
        rows,
        row_costs(run.row_cost, rows),
        cp=p.cp,
        budget=dynamic_cp_tokens(run.config),
        dp=p.dp,
        dp_rank=run.groups.dp_rank,
        device=run.device,
    )
    jobs = [rounds.job(k, run.groups.cp_rank) or (None, 1) for k in range(rounds.rounds)]
    return jobs, rounds.record


def _forward_backward(
    run: _Run, step: int, rows, jobs
) -> tuple[torch.Tensor, int, int, int, set[str]]:
    """The ``jobs`` (``_step_jobs``) of step ``step`` (1-based) through the CP model: ``(loss
    sum, valid labels, units encoded, visual tokens held, the CP attention the rows ran)`` on this
    rank (``--attn auto`` picks per row). The ``record_function`` ranges name the phases in a
    torch.profiler trace (benchmarks/train.py --part profile); without a profiler they cost
    nothing measurable."""
    with record_function("cpvlm.labels"):
        shifted = [shift_labels(r.labels.view(1, -1), doc_lens=r.doc_lens) for r in rows]
        num_valid = count_valid_labels(shifted, run.groups.dp_group)
    loss_sum = torch.zeros((), dtype=torch.float64)
    units = visual_tokens = 0
    ran = set()
    for k, cp_size in jobs:
        row = rows[0].blank() if k is None else rows[k]
        run.phases.enter(step, "forward")
        with record_function("cpvlm.forward"):
            out = run.runner(
                **row.batch(run.device),
                doc_lens=row.doc_lens,
                num_valid=num_valid,
                num_batches=len(rows) * run.config.parallel.dp,  # per-row losses average
                **({} if cp_size is None else {"cp_size": cp_size}),
            )
        run.phases.enter(step, "backward")
        with record_function("cpvlm.backward"):
            out.loss.backward()
        loss_sum += out.loss.detach().double().cpu()
        units += out.encoded_units
        visual_tokens += out.local_visual_tokens
        ran.update(out.attn_impl.split(","))
    sync_step_gradients(run.cp_model, run.groups, run.config.parallel.data_parallel, run.tp_summed)
    return loss_sum, num_valid, units, visual_tokens, ran


def _step_stats(run: _Run, rows, loss_sum, units, visual_tokens, replaced) -> dict:
    """One all-reduce of the step's statistics; row facts counted once per DP replica, the loss
    once per (dp, cp) coordinate (its TP ranks hold the same)."""
    lead = run.groups.cp_rank == 0 and run.groups.tp_rank == 0
    with_vision = any(r.has_vision for r in rows)
    stats = torch.tensor(
        [
            float(loss_sum) if run.groups.tp_rank == 0 else 0.0,
            sum(r.num_tokens for r in rows) if lead else 0,
            len(rows) if lead else 0,
            sum(not r.has_vision for r in rows) if lead else 0,
            with_vision and units == 0,
            with_vision and visual_tokens == 0,
            replaced if lead else 0,
        ],
        dtype=torch.float64,
        device=run.device,
    )
    dist.all_reduce(stats)
    return dict(zip(_STATS, stats.cpu().tolist()))


def _nonfinite(loss: float, grad_norm: float) -> str | None:
    """What is not finite, in words, or None."""
    values = (("loss", loss), ("gradient norm", grad_norm))
    bad = [f"the {name} is {value}" for name, value in values if not math.isfinite(value)]
    return " and ".join(bad) or None


def _optimizer_step(run: _Run, step: int, grad_norm: torch.Tensor, num_valid: int) -> float:
    optim = run.config.optim
    if optim.max_grad_norm > 0:
        for group in by_mesh(run.params):
            torch.nn.utils.clip_grads_with_norm_(group, optim.max_grad_norm, grad_norm)
    lr = optim.lr_at(step)
    for group in run.optimizer.param_groups:
        group["lr"] = lr
    if num_valid > 0:  # a step without labels has zero gradients: AdamW would still move
        run.optimizer.step()
    return lr


def _train_step(
    run: _Run, step: int, memory: StepMemory, stops: _StopRequests
) -> tuple[dict, int, bool]:
    """Step ``step`` (0-based): its metrics record, the stop signal any rank received, and
    whether any rank is still writing a checkpoint in the background."""
    config = run.config
    mem_start = memory.start()
    t0 = time.perf_counter()
    run.phases.enter(step + 1, "data")
    with record_function("cpvlm.data"):
        rows = run.loader.next_step()
        bad = report_planning_errors(rows, run.errors, step + 1)
        jobs, dynamic = _step_jobs(run, rows)
        rows, replaced = agree_on_decode_failures(
            rows, run.groups, config.parallel.dp, run.device, run.errors, step + 1
        )
    data_s = time.perf_counter() - t0  # waiting for rows: what the loader did not hide
    run.phases.enter(step + 1, "forward")
    faults.inject(step + 1, dist.get_rank())
    loss_sum, num_valid, units, visual_tokens, ran = _forward_backward(run, step + 1, rows, jobs)
    run.phases.enter(step + 1, "optimizer")
    with record_function("cpvlm.optimizer"):
        grad_norm = global_grad_norm(run.params)
    with record_function("cpvlm.stats"):
        stats = _step_stats(run, rows, loss_sum, units, visual_tokens, replaced)
    problem = _nonfinite(stats["loss"], float(grad_norm))
    skipped = problem is not None
    if skipped:
        if run.skipped >= config.run.skip_nonfinite:
            raise RunStopped(_nonfinite_message(run, step, problem), 1)
        run.skipped += 1
        lr = config.optim.lr_at(step)
    else:
        with record_function("cpvlm.optimizer"):
            lr = _optimizer_step(run, step, grad_norm, num_valid)
    run.optimizer.zero_grad(set_to_none=True)
    seconds = time.perf_counter() - t0
    # Max over ranks of the memory figures, the stop request and a background write still
    # going: the same on every rank.
    writing = float(run.pending is not None and not run.pending.done())
    maxed = [mem_start, memory.peak(), float(stops.signum), writing]
    maxed = torch.tensor(maxed, dtype=torch.float64, device=run.device)
    dist.all_reduce(maxed, op=dist.ReduceOp.MAX)
    mem_start, mem_peak, signum, writing = maxed.cpu().tolist()
    record = {
        "step": step + 1,
        "loss": stats["loss"],
        "tokens_per_s": stats["tokens"] / seconds,
        "step_time_s": seconds,
        "data_time_s": data_s,
        "grad_norm": float(grad_norm),
        "lr": lr,
        "tokens": int(stats["tokens"]),
        "valid_labels": num_valid,
        "rows": int(stats["rows"]),
        "rows_text_only": int(stats["rows_text_only"]),
        "ranks": config.parallel.world_size,
        "ranks_no_image": int(stats["ranks_no_image"]),
        "ranks_no_visual_tokens": int(stats["ranks_no_visual_tokens"]),
        "bad_samples": bad,
        "rows_replaced": int(stats["rows_replaced"]),
        "truncated": sum(r.truncated for r in rows),
        "mem_start_mib": mem_start,
        "mem_peak_mib": mem_peak,
        "skipped_nonfinite": skipped,
        "attn_impl": ",".join(sorted(ran)),
    }
    if dynamic is not None:
        record["dynamic_cp"] = dynamic
    return record, int(signum), bool(writing)


def _nonfinite_message(run: _Run, step: int, problem: str) -> str:
    last = run.last_checkpoint
    kept = f"the last checkpoint is {last}" if last else "no checkpoint was written yet"
    skip = (
        f"{run.skipped} such steps were skipped already (--skip-nonfinite "
        f"{run.config.run.skip_nonfinite})"
        if run.skipped
        else "--skip-nonfinite N skips up to N such steps"
    )
    return (
        f"stopped at step {step + 1}: {problem}; nothing of this step was saved ({kept}); lower "
        f"--lr or check the data; {skip}"
    )


def _save(run: _Run, step: int, *, wait: bool) -> None:
    """Checkpoint after ``step`` steps (collective): in the background with --async-save (after
    the one in flight is finished), unless ``wait`` (the last checkpoint of the run)."""
    run.phases.enter(step, "checkpoint")
    if run.pending is not None:
        _finish(run, must=False)
    meta = {
        "config": run.config.to_dict(),
        "world_size": run.config.parallel.world_size,
        "data": run.loader.state_dict(),
    }
    run.pending = start_save(
        run.config.run.out,
        step,
        model=run.cp_model,
        optimizer=run.optimizer,
        rank_state={"rng": rng_state(run.device)},
        meta=meta,
        async_group=run.save_group,
        trainable_only=run.config.model.lora is not None,
    )
    if wait or run.save_group is None:
        _finish(run, must=wait)


def _finish(run: _Run, *, must: bool) -> None:
    """Finish the pending checkpoint (collective). If it failed: with --on-save-error continue a
    warning, and the next interval tries again; else (or when ``must``) ``RunStopped``."""
    pending, run.pending = run.pending, None
    try:
        run.last_checkpoint = finish_save(pending)
    except SaveError as err:
        last = run.last_checkpoint
        kept = f"the last checkpoint {last} is intact" if last else "no checkpoint was written"
        if must or run.config.run.on_save_error == "stop":
            raise RunStopped(
                f"stopped after step {pending.step}: {err}; {kept}; free space in --out and "
                f"continue with --resume --out {run.config.run.out}",
                1,
            ) from None
        if run.lead:
            print(
                f"cpvlm train: warning: {err}; {kept}; trying again at the next checkpoint "
                "(--on-save-error continue)",
                file=sys.stderr,
                flush=True,
            )


def train_rank(
    config: TrainConfig, device: torch.device, resume_from: str | None = None
) -> dict | None:
    """Train on this rank; returns the summary on rank 0. The process group must exist.

    ``resume_from``: the checkpoint directory to continue from (``cpvlm.train.launcher`` picks
    the newest intact one). Raises ``RunStopped`` on every rank for a non-finite step (exit 1,
    nothing of that step saved) or a stop signal (a checkpoint of the finished step, exit
    128 + signal number).
    """
    with _StopRequests() as stops:
        run = _setup(config, device, resume_from)
        log = MetricsLog(config.run.out, start_step=run.start_step) if run.lead else None
        progress = Progress(config.run.steps, run.start_step) if run.lead else None
        memory = StepMemory(device)
        try:
            for step in range(run.start_step, config.run.steps):
                with record_function("cpvlm.step"):
                    record, signum, writing = _train_step(run, step, memory, stops)
                run.records.append(record)
                if run.lead:
                    log.write(record)
                    progress.update(record)
                if run.pending is not None and not writing:  # every rank's write is done
                    _finish(run, must=False)
                last = step + 1 == config.run.steps
                every = config.run.ckpt_every
                if last or signum or (every and (step + 1) % every == 0):
                    _save(run, step + 1, wait=last or bool(signum))
                if signum and not last:
                    raise RunStopped(_stop_message(step + 1, config, signum), 128 + signum)
        except RuntimeError as err:
            if compat.is_collective_timeout(err):
                raise run.phases.stalled(config.run.out) from err
            raise
        finally:
            run.loader.close()
            if progress is not None:
                progress.close()
    if not run.lead:
        return None
    return summarize(config, run.records, run.start_step, log, run.errors)


def _stop_message(step: int, config: TrainConfig, signum: int) -> str:
    return (
        f"stopped by {signal.Signals(signum).name} after step {step} of {config.run.steps}: "
        f"checkpoint {step_dir(config.run.out, step)} written; continue with --resume "
        f"--out {config.run.out}"
    )
