"""The training loop of one rank: model, data parallelism, data, steps, metrics, checkpoints.

Legend: W world size = dp * cp; a *row* is one packed sequence (one CP forward); a step runs
batch_size * grad_accum rows per DP rank.

Per step every rank: takes its DP replica's rows (the same on all CP ranks), counts the valid
(shifted) labels of the whole step over DP, runs each row through ``ContextParallelVLM`` (its
loss is this rank's share of the step's token mean) and backward; the gradient sync sums over the
dp x cp ranks, so the summed gradients are the one-device gradients of the step. Then the global
gradient norm, clipping, AdamW, and one all-reduce of the step's statistics.

Every rank ends every backward with the same set of gradients: ContextParallelVLM runs the
vision tower on every rank, on a dummy frame (kept out of the result) where a rank or a whole row
has no image, so the tower gets zero gradients rather than none. FSDP2 and DDP need that when the
DP replicas' rows differ (one has images, another not).
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
from torch import nn
from torch.profiler import record_function

from cpvlm.data import ErrorLog
from cpvlm.integrations.hf import ContextParallelVLM, adapter_for, build_model
from cpvlm.loss import count_valid_labels, shift_labels
from cpvlm.parallelize import build_mesh, mesh_groups, parallelize, sync_gradients
from cpvlm.train.checkpoint import (
    latest_checkpoint,
    load_checkpoint,
    read_meta,
    rng_state,
    save_checkpoint,
    set_rng_state,
)
from cpvlm.train.config import TrainConfig
from cpvlm.train.loader import agree_on_decode_failures, build_loader, report_planning_errors
from cpvlm.train.metrics import MetricsLog, Progress, StepMemory, summarize

_STATS = (
    "loss",
    "tokens",
    "rows",
    "rows_text_only",
    "ranks_no_image",
    "ranks_no_visual_tokens",
    "rows_replaced",
)


def freeze_vision_encoder(model: nn.Module) -> None:
    """``--freeze-vision``: the tower is frozen except its projector (the family's adapter says
    which modules those are: Qwen's mergers, GLM's downsample and merger)."""
    adapter_for(model).freeze_vision_encoder(model)


def global_grad_norm(params: list[nn.Parameter]) -> torch.Tensor:
    """The 2-norm of all gradients of the model, whole (FSDP2 shards: a DTensor reduction)."""
    grads = [p.grad for p in params if p.grad is not None]
    norm = torch.nn.utils.get_total_norm(grads, norm_type=2.0)
    if hasattr(norm, "full_tensor"):
        norm = norm.full_tensor()
    return norm


def _setup_model(config: TrainConfig, device: torch.device, groups, mesh):
    model = build_model(config.model.name, dtype=config.model.torch_dtype, seed=config.run.seed)
    if config.model.freeze_vision:
        freeze_vision_encoder(model)
    model.to(device)
    p = config.parallel
    cp_model = ContextParallelVLM(
        model,
        groups.cp_group,
        attn=p.attn,
        vision=p.vision,
        flow=p.flow,
        ulysses_size=p.ulysses_size,
        layout=p.layout,
    )
    # FSDP2 units from the adapter: each decoder layer and the vision tower (the root keeps
    # embeddings, head, norm). The tower is a safe unit because ContextParallelVLM calls it exactly
    # once per forward on every rank, at the same point, with a dummy frame where there is nothing
    # to encode.
    units = adapter_for(model).fsdp_units(model)
    runner = parallelize(
        cp_model, mesh, data_parallel=p.data_parallel, groups=groups, fsdp_units=units
    )
    return model, cp_model, runner


def _restore(config: TrainConfig, cp_model, optimizer, device):
    """``(data state, first step)``: from the latest checkpoint under ``--resume``, else fresh."""
    if not config.run.resume:
        return None, 0
    path = latest_checkpoint(config.run.out)
    template = {"data": {"window": 0, "row": 0}, "rng": rng_state(device)}
    restored = load_checkpoint(
        path, model=cp_model, optimizer=optimizer, rank_state_template=template
    )
    set_rng_state(restored["rng"], device)
    return restored["data"], read_meta(path)["step"]


def _forward_backward(runner, rows, device, num_valid: int, num_batches: int):
    """Forward and backward of this rank's rows: ``(loss sum, units encoded, visual tokens, the
    CP attention the rows ran)`` (``--attn auto`` picks per row)."""
    loss_sum = torch.zeros((), dtype=torch.float64)
    units = visual_tokens = 0
    ran = set()
    for row in rows:
        with record_function("cpvlm.forward"):
            out = runner(
                **row.batch(device),
                doc_lens=row.doc_lens,
                num_valid=num_valid,
                num_batches=num_batches,  # per-row losses (MoE router) average over the rows
            )
        with record_function("cpvlm.backward"):
            out.loss.backward()
        loss_sum += out.loss.detach().double().cpu()
        units += out.encoded_units
        visual_tokens += out.local_visual_tokens
        ran.update(out.attn_impl.split(","))
    return loss_sum, units, visual_tokens, ran


def _optimizer_step(config: TrainConfig, cp_model, groups, params, optimizer, step, num_valid):
    """Gradient sync (without FSDP/DDP), norm, clipping, AdamW; ``(grad norm, lr)``."""
    if config.parallel.data_parallel == "none":
        sync_gradients(cp_model, groups)
    grad_norm = global_grad_norm(params)
    if config.optim.max_grad_norm > 0:
        torch.nn.utils.clip_grads_with_norm_(params, config.optim.max_grad_norm, grad_norm)
    lr = config.optim.lr_at(step)
    for group in optimizer.param_groups:
        group["lr"] = lr
    if num_valid > 0:  # a step without labels has zero gradients: AdamW would still move
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return grad_norm, lr


def _step_stats(rows, groups, device, loss_sum, units, visual_tokens, replaced) -> dict:
    """One all-reduce of this step's statistics; row facts counted once per DP replica."""
    lead = groups.cp_rank == 0
    with_vision = any(r.has_vision for r in rows)
    stats = torch.tensor(
        [
            float(loss_sum),
            sum(r.num_tokens for r in rows) if lead else 0,
            len(rows) if lead else 0,
            sum(not r.has_vision for r in rows) if lead else 0,
            with_vision and units == 0,
            with_vision and visual_tokens == 0,
            replaced if lead else 0,
        ],
        dtype=torch.float64,
        device=device,
    )
    dist.all_reduce(stats)
    return dict(zip(_STATS, stats.cpu().tolist()))


def _record(step, stats, times, grad_norm, lr, num_valid, world, bad, rows, mem) -> dict:
    seconds, data_s = times
    return {
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
        "ranks": world,
        "ranks_no_image": int(stats["ranks_no_image"]),
        "ranks_no_visual_tokens": int(stats["ranks_no_visual_tokens"]),
        "bad_samples": bad,
        "rows_replaced": int(stats["rows_replaced"]),
        "truncated": sum(r.truncated for r in rows),
        "mem_start_mib": mem[0],
        "mem_peak_mib": mem[1],
    }


def train_rank(config: TrainConfig, device: torch.device) -> dict | None:
    """Train on this rank; returns the summary on rank 0. The process group must exist.

    The ``record_function`` ranges ("cpvlm.step", ".data", ".forward", ...) name the phases of a
    step in a torch.profiler trace (benchmarks/train_profile.py); without a profiler they cost
    nothing measurable."""
    rank, world = dist.get_rank(), dist.get_world_size()
    dp, cp = config.parallel.dp, config.parallel.cp
    mesh = build_mesh(dp_replicate=1, dp_shard=dp, cp=cp, device_type=device.type)
    groups = mesh_groups(mesh)
    model, cp_model, runner = _setup_model(config, device, groups, mesh)
    params = [p for p in cp_model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(
        params, lr=config.optim.lr, weight_decay=config.optim.weight_decay
    )
    data_state, start_step = _restore(config, cp_model, optimizer, device)
    if config.parallel.vision == "replicate":  # every rank encodes every unit
        config = config.replace(data={"decode": "all"})
    loader = build_loader(
        config, model.config, groups, assign=cp_model.vision_assignment, state=data_state
    )
    errors = ErrorLog(config.run.out if rank == 0 else None, strict=config.data.strict)

    log = MetricsLog(config.run.out, start_step=start_step) if rank == 0 else None
    progress = Progress(config.run.steps, start_step) if rank == 0 else None
    meta = {"config": config.to_dict(), "world_size": world}
    records = []
    memory = StepMemory(device)
    for step in range(start_step, config.run.steps):
        mem_start = memory.start()
        t0 = time.perf_counter()
        with record_function("cpvlm.step"):
            with record_function("cpvlm.data"):
                rows = loader.next_step()
                bad = report_planning_errors(rows, errors, step + 1)
                rows, replaced = agree_on_decode_failures(
                    rows, groups, dp, device, errors, step + 1
                )
            data_s = time.perf_counter() - t0  # waiting for rows: what the loader did not hide
            with record_function("cpvlm.labels"):
                shifted = [shift_labels(r.labels.view(1, -1), doc_lens=r.doc_lens) for r in rows]
                num_valid = count_valid_labels(shifted, groups.dp_group)
            loss_sum, units, visual_tokens, ran = _forward_backward(
                runner, rows, device, num_valid, dp * loader.rows_per_step
            )
            with record_function("cpvlm.optimizer"):
                grad_norm, lr = _optimizer_step(
                    config, cp_model, groups, params, optimizer, step, num_valid
                )
            with record_function("cpvlm.stats"):
                stats = _step_stats(rows, groups, device, loss_sum, units, visual_tokens, replaced)
                seconds = time.perf_counter() - t0
                mem = torch.tensor([mem_start, memory.peak()], dtype=torch.float64, device=device)
                dist.all_reduce(mem, op=dist.ReduceOp.MAX)
        record = _record(
            step, stats, (seconds, data_s), grad_norm, lr, num_valid, world, bad, rows,
            mem.cpu().tolist(),
        )  # fmt: skip
        record["attn_impl"] = ",".join(sorted(ran))
        records.append(record)
        if rank == 0:
            log.write(record)
            progress.update(record)
        every = config.run.ckpt_every
        if (every and (step + 1) % every == 0) or step + 1 == config.run.steps:
            rank_state = {"data": loader.state_dict(), "rng": rng_state(device)}
            save_checkpoint(
                config.run.out,
                step + 1,
                model=cp_model,
                optimizer=optimizer,
                rank_state=rank_state,
                meta=meta,
            )
    loader.close()
    if rank != 0:
        return None
    progress.close()
    return summarize(config, records, start_step, log, errors)
