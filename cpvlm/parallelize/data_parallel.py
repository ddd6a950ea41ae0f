"""Data parallelism over dp x cp whose gradient sync SUMS: FSDP2, HSDP and DDP.

Why a sum. ``cpvlm.loss.token_mean_loss`` gives each rank its share of the step loss,
share_k = (sum of CE over the labels rank k holds) / N, with N the valid labels of the whole step.
The step loss is L = sum_k share_k over all R*S*C ranks (and microbatches), so

    dL/dtheta = sum_k dshare_k/dtheta.

Every CP rank holds a full copy of the parameters (CP splits the sequence, not the weights), so the
gradient sync runs over the flattened dp x cp group, and it must be a plain sum. FSDP2 and DDP
average by default (divide by the group size), which would give dL/dtheta / (R*S*C). So the
divide factor is set to 1 and only SUM reductions are issued (FSDP2:
``set_gradient_divide_factor(1.0)`` + ``set_force_sum_reduction_for_comms(True)``, which also
avoids the PreMulSum op that gloo lacks; DDP: a comm hook that all-reduces without dividing).
The loss is not rescaled, so it keeps its meaning for logging and the proof has no hidden factor.

Gradient accumulation: the sum is linear, so syncing every microbatch (the default) and syncing
only the last one (FSDP2 ``model.set_requires_gradient_sync(is_last)``, DDP ``model.no_sync()``)
give the same gradient; both are tested.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel

from cpvlm.parallelize.mesh import MeshGroups, mesh_groups, mesh_sizes

DATA_PARALLEL = ("fsdp", "hsdp", "ddp", "none")

_FSDP_SUM_METHODS = ("set_gradient_divide_factor", "set_force_sum_reduction_for_comms")

FsdpUnits = Iterable[nn.Module] | nn.Module | Callable[[nn.Module], Iterable[nn.Module]]


def _allreduce_sum_hook(group, bucket):
    """DDP comm hook: sum the bucket over the group (DDP's own hook divides by the group size).

    (group: ProcessGroup, bucket: dist.GradBucket) -> Future[Tensor]. Not annotated: DDP checks
    the annotations by identity, and postponed annotations are strings.
    """
    work = dist.all_reduce(bucket.buffer(), group=group, async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])


def _resolve_units(model: nn.Module, fsdp_units: FsdpUnits | None) -> list[nn.Module]:
    if fsdp_units is None:
        return []
    if isinstance(fsdp_units, nn.ModuleList):
        units = list(fsdp_units)
    elif isinstance(fsdp_units, nn.Module):
        units = [fsdp_units]
    elif callable(fsdp_units):
        units = list(fsdp_units(model))
    else:
        units = list(fsdp_units)
    in_model = {id(m) for m in model.modules()}
    for i, unit in enumerate(units):
        if not isinstance(unit, nn.Module):
            raise ValueError(
                f"parallelize: fsdp_units[{i}] is a {type(unit).__name__}, not a module"
            )
        if unit is model:
            raise ValueError(
                f"parallelize: fsdp_units[{i}] is the model itself; list submodules only (the "
                "root is always wrapped last)"
            )
        if id(unit) not in in_model:
            raise ValueError(
                f"parallelize: fsdp_units[{i}] ({type(unit).__name__}) is not a submodule of the model"
            )
    for i, outer in enumerate(units):
        for j in range(i + 1, len(units)):
            if units[j] is outer:
                raise ValueError(f"parallelize: fsdp_units[{i}] and fsdp_units[{j}] are the same")
            if any(m is units[j] for m in outer.modules()):
                raise ValueError(
                    f"parallelize: fsdp_units[{i}] ({type(outer).__name__}) contains "
                    f"fsdp_units[{j}] ({type(units[j]).__name__}); FSDP wraps bottom-up, so list "
                    "children before their parents"
                )
    return units


def _check_mode(data_parallel: str, mesh: DeviceMesh) -> None:
    if data_parallel not in DATA_PARALLEL:
        raise ValueError(
            f"parallelize: data_parallel={data_parallel!r}; choose one of {list(DATA_PARALLEL)}"
        )
    sizes = mesh_sizes(mesh)
    if data_parallel == "fsdp" and sizes.dp_replicate > 1:
        raise ValueError(
            f"parallelize: data_parallel='fsdp' shards over dp_shard x cp, but the mesh has "
            f"dp_replicate={sizes.dp_replicate}; use data_parallel='hsdp' to replicate over it, or "
            f"build the mesh with dp_replicate=1, dp_shard={sizes.dp}"
        )
    if data_parallel in ("fsdp", "hsdp"):
        missing = [m for m in _FSDP_SUM_METHODS if not hasattr(FSDPModule, m)]
        if missing:
            raise ValueError(
                f"parallelize: FSDP2 in torch {torch.__version__} lacks {missing}, needed to sum "
                "gradients exactly (older releases had divide-factor bugs); use torch >= 2.8 or "
                "data_parallel='ddp'"
            )


def parallelize(
    model: nn.Module,
    mesh: DeviceMesh,
    *,
    data_parallel: str = "fsdp",
    fsdp_units: FsdpUnits | None = None,
    groups: MeshGroups | None = None,
    mp_policy: MixedPrecisionPolicy | None = None,
    reshard_after_forward: bool | int | None = None,
    ddp_kwargs: dict[str, Any] | None = None,
) -> nn.Module:
    """Apply data parallelism over the dp x cp ranks of ``mesh``, with a summed gradient sync.

    With ``cpvlm.loss.token_mean_loss`` the synced gradient is exactly the gradient of the global
    token mean (see the module docstring). Call on every rank, with identical parameters (same
    seed or checkpoint): FSDP2 keeps each rank's shard of its own copy.

    Args:
        model: the model; attention must already run as ``cp_attention`` over ``groups.cp_group``.
        mesh: named ``("dp_replicate", "dp_shard", "cp")`` (or a subset, in that order), over
            every rank; see ``build_mesh``.
        data_parallel:
            "fsdp": FSDP2 ``fully_shard`` over the flattened dp_shard x cp ranks (dp_replicate=1).
            "hsdp": FSDP2 on the 2-d mesh (dp_replicate, dp_shard x cp): replicate x shard.
            "ddp": ``DistributedDataParallel`` over every rank, with a summing comm hook.
            "none": the model is returned as is; call ``sync_gradients(model, groups)`` after the
            last backward of a step (nothing to do on a single rank).
        fsdp_units: submodules to shard as their own FSDP2 units before the root (e.g. the decoder
            layers): an ``nn.ModuleList``, an iterable of modules, a module, or a callable
            ``model -> modules``; children before parents. Ignored without FSDP2.
        groups: ``mesh_groups(mesh)`` if already built (it creates process groups).
        mp_policy: FSDP2 mixed precision, e.g. ``MixedPrecisionPolicy(param_dtype=torch.bfloat16,
            reduce_dtype=torch.float32)`` (compute in bf16, sum gradients in float32).
        reshard_after_forward: passed to ``fully_shard``.
        ddp_kwargs: passed to ``DistributedDataParallel``.

    Returns:
        The model (FSDP2: the same object, now an ``FSDPModule``; DDP: the wrapper).
    """
    _check_mode(data_parallel, mesh)
    units = _resolve_units(model, fsdp_units)
    if groups is None:
        groups = mesh_groups(mesh)
    elif groups.mesh is not mesh:
        raise ValueError("parallelize: groups were built for another mesh; pass mesh_groups(mesh)")

    if data_parallel in ("fsdp", "hsdp"):
        kwargs: dict[str, Any] = {
            "mesh": groups.dp_cp_mesh if data_parallel == "fsdp" else groups.hsdp_mesh,
            "reshard_after_forward": reshard_after_forward,
        }
        if mp_policy is not None:
            kwargs["mp_policy"] = mp_policy
        for unit in units:
            fully_shard(unit, **kwargs)
        fully_shard(model, **kwargs)
        for module in model.modules():
            if isinstance(module, FSDPModule):  # per-unit settings: they do not recurse
                module.set_gradient_divide_factor(1.0)
                module.set_force_sum_reduction_for_comms(True)
        return model
    if data_parallel == "ddp":
        group = groups.grad_sync_group
        ddp = DistributedDataParallel(model, process_group=group, **(ddp_kwargs or {}))
        ddp.register_comm_hook(group, _allreduce_sum_hook)
        return ddp
    return model


def sync_gradients(model: nn.Module, groups: MeshGroups | dist.ProcessGroup) -> None:
    """Sum every parameter gradient over the dp x cp ranks (for ``data_parallel="none"``).

    Every rank sends every trainable parameter, in ``model.parameters()`` order, one flat buffer
    per dtype and device; a missing gradient counts as zeros (and becomes a zero tensor), so that
    ranks whose graph did not reach a parameter still join.
    """
    group = groups.grad_sync_group if isinstance(groups, MeshGroups) else groups
    buckets: dict[tuple[torch.dtype, torch.device], list[nn.Parameter]] = {}
    for p in model.parameters():
        if p.requires_grad:
            buckets.setdefault((p.dtype, p.device), []).append(p)
    for params in buckets.values():
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        flat = torch.cat([p.grad.reshape(-1) for p in params])
        dist.all_reduce(flat, group=group)
        for p, g in zip(params, flat.split([p.numel() for p in params])):
            p.grad.copy_(g.view_as(p))
