"""Data parallelism over dp x cp whose gradient sync SUMS: FSDP2, HSDP and DDP.

Why a sum. ``cpvlm.loss.token_mean_loss`` gives each rank its share of the step loss,
share_k = (sum of CE over the labels rank k holds) / N, with N the valid labels of the whole step.
The step loss is L = sum over ranks k (and microbatches m) of share_{k,m}, so

    dL/dtheta = sum_{k,m} g_{k,m},    g_{k,m} = dshare_{k,m}/dtheta.

Every CP rank holds a full copy of the parameters (CP splits the sequence, not the weights), so the
gradient sync runs over the flattened dp x cp group of W = R*S*C ranks, and must add, not average:
FSDP2 and DDP divide by W by default, which would give dL/dtheta / W. The loss itself is never
rescaled, so it keeps its meaning for logging.

FSDP2 / HSDP: the divide factor is set to 1 and every reduction is a plain SUM
(``set_gradient_divide_factor(1.0)`` + ``set_force_sum_reduction_for_comms(True)``; the latter also
avoids PreMulSum, which gloo lacks). FSDP2 reduces only the gradient of the backward that just ran
and adds the result to the sharded gradient, so syncing every microbatch, or only the last one
(``model.set_requires_gradient_sync(is_last)``), both give sum_{k,m} g_{k,m}.

DDP: a comm hook that sums would be wrong with gradient accumulation. DDP all-reduces the
*accumulated* ``.grad``: with a synced G already there, rank k holds G + g_k, and a sum gives
W*G + sum_k g_k. So cpvlm keeps DDP's mean and pre-multiplies each local gradient by W (a hook on
each parameter, before it is accumulated into ``.grad``). Proof, by induction over the syncs of a
step: if every rank holds the same G before a backward, rank k then holds G + W*g_k (or, under
``no_sync``, G + W*(g_k + g'_k + ...)), and DDP's mean gives (1/W) sum_k (G + W*g_k) = G + sum_k g_k.
Starting from G = 0, the step ends with sum_{k,m} g_{k,m} = dL/dtheta, whether every microbatch
syncs or only the last. (Multiplying and dividing by W is exact for W a power of two, else within
one rounding.)
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Shard
from torch.nn.parallel import DistributedDataParallel

from cpvlm.constants import DATA_PARALLEL
from cpvlm.parallelize.expert_parallel import (
    expert_modules,
    expert_parameters,
    parallelize_experts,
    sync_expert_gradients,
)
from cpvlm.parallelize.mesh import MeshGroups, mesh_groups, mesh_sizes
from cpvlm.parallelize.precision import Autocast, fsdp_policy, param_dtype_of

_FSDP_SUM_METHODS = ("set_gradient_divide_factor", "set_force_sum_reduction_for_comms")

FsdpUnits = Iterable[nn.Module] | nn.Module | Callable[[nn.Module], Iterable[nn.Module]]


def _scale_grad_hook(factor: int) -> Callable[[torch.Tensor], torch.Tensor]:
    def scale(grad: torch.Tensor) -> torch.Tensor:
        return grad * factor

    return scale


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
    compute_dtype: torch.dtype | None = None,
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
            "ddp": ``DistributedDataParallel`` over every rank; local gradients are pre-scaled by
            the number of ranks so that DDP's mean is the sum (the hooks stay on the parameters:
            train through the returned wrapper).
            "none": the model is returned as is; call ``sync_gradients(model, groups)`` once per
            step, after the last backward (nothing to do on a single rank).
        fsdp_units: submodules to shard as their own FSDP2 units before the root (e.g. the decoder
            layers): an ``nn.ModuleList``, an iterable of modules, a module, or a callable
            ``model -> modules``; children before parents. Ignored without FSDP2.
        groups: ``mesh_groups(mesh)`` if already built (it creates process groups); built with
            ``ep > 1`` (``mesh_groups(mesh, ep=...)``), the MoE experts are first sharded over
            its EP groups (``parallelize_experts``; FSDP2 or "none" only). "fsdp": each experts
            module is then its own FSDP2 unit over the ranks that hold the same experts (see
            ``_shard_expert_replicas``), which reduce-scatters their gradients. "hsdp" (and
            "fsdp" with ep = dp x cp: no replicas), the experts are left out of FSDP2 and
            replicated: call ``sync_expert_gradients(model, groups)`` after the step's last
            backward ("none": ``sync_gradients`` does).
        mp_policy: FSDP2 mixed precision, e.g. ``MixedPrecisionPolicy(param_dtype=torch.bfloat16,
            reduce_dtype=torch.float32)`` (compute in bf16, sum gradients in float32).
        compute_dtype: mixed precision for every mode (see ``cpvlm.parallelize.precision``):
            compute in this dtype, keep parameters, gradients and optimizer state in the model's.
            FSDP2: the policy above; DDP and "none": the forward under ``torch.autocast``.
        reshard_after_forward: passed to ``fully_shard``.
        ddp_kwargs: passed to ``DistributedDataParallel``.

    Returns:
        The model (FSDP2: the same object, now an ``FSDPModule``; DDP: the wrapper; with a
        ``compute_dtype`` under DDP or "none": an ``Autocast`` wrapper around it).
    """
    _check_mode(data_parallel, mesh)
    units = _resolve_units(model, fsdp_units)
    param_dtype = param_dtype_of(model)
    if compute_dtype == param_dtype:
        compute_dtype = None
    if compute_dtype is not None and mp_policy is not None:
        raise ValueError("parallelize: pass mp_policy or compute_dtype, not both")
    if groups is None:
        groups = mesh_groups(mesh)
    elif groups.mesh is not mesh:
        raise ValueError("parallelize: groups were built for another mesh; pass mesh_groups(mesh)")
    ignored: set[nn.Parameter] = set()
    expert_units: list[nn.Module] = []
    if groups.ep_mesh is not None:
        if data_parallel == "ddp":
            raise ValueError(
                f"parallelize: expert parallelism (ep={groups.ep}) runs with data_parallel='fsdp', "
                "'hsdp' or 'none', not 'ddp'"
            )
        sharded = parallelize_experts(model, groups.ep_mesh["ep"])
        if data_parallel == "fsdp" and groups.ep_mesh["ep_replica"].size() > 1:
            expert_units = expert_modules(model)
        else:
            ignored = set(sharded)
    if groups.tp_mesh is not None and data_parallel == "ddp":
        raise ValueError(
            f"parallelize: tensor parallelism (tp={groups.sizes.tp}) runs with data_parallel="
            "'fsdp', 'hsdp' or 'none', not 'ddp'"
        )

    if data_parallel in ("fsdp", "hsdp"):
        kwargs: dict[str, Any] = {
            "mesh": groups.dp_cp_mesh if data_parallel == "fsdp" else groups.hsdp_mesh,
            "reshard_after_forward": reshard_after_forward,
        }
        if ignored:
            kwargs["ignored_params"] = ignored
        if compute_dtype is not None:
            mp_policy = fsdp_policy(compute_dtype, param_dtype)
        if mp_policy is not None:
            kwargs["mp_policy"] = mp_policy
        for unit in expert_units:  # inside the units below: first
            _shard_expert_replicas(unit, groups.ep_mesh["ep_replica"], kwargs)
        for unit in units:
            fully_shard(unit, **kwargs)
        fully_shard(model, **kwargs)
        for module in model.modules():
            if isinstance(module, FSDPModule):  # per-unit settings: they do not recurse
                module.set_gradient_divide_factor(1.0)
                module.set_force_sum_reduction_for_comms(True)
        return model
    if data_parallel == "ddp":
        world = groups.sizes.world
        if world > 1:  # DDP divides by W; see the module docstring for why not a summing hook
            for p in model.parameters():
                if p.requires_grad:
                    p.register_hook(_scale_grad_hook(world))
        model = DistributedDataParallel(
            model, process_group=groups.grad_sync_group, **(ddp_kwargs or {})
        )
    return model if compute_dtype is None else Autocast(model, compute_dtype)


def _expert_rows_dim(param: nn.Parameter) -> Shard:
    return Shard(1)


def _shard_expert_replicas(experts: nn.Module, replicas: DeviceMesh, kwargs: dict) -> None:
    """Make ``experts`` (sharded by ``parallelize_experts``) an FSDP2 unit over ``replicas``,
    the ranks that hold the same experts (``ep_mesh["ep_replica"]``, a slice of the same 2-d
    mesh as the experts' "ep" mesh, as FSDP2 requires of DTensor parameters).

    A rank then keeps 1/ep of the experts, each sharded over the replicas: 1/(dp x cp) of the
    expert parameters, like every other parameter under FSDP2; the replicas' gradient sum is
    FSDP2's reduce-scatter. FSDP2 shards dim 1 (the experts' rows): dim 0, the expert index, is
    already split by EP, and sharding it again would need a strided placement (``_StridedShard``)
    where dim 1 gives a plain ``(Shard(1), Shard(0))`` DTensor that DCP reshards to any other
    ep. (torchtitan shards its experts over "dp_shard_mod_ep" too, on dim 1 where the local
    experts are fewer than the replicas.)
    """
    fully_shard(experts, **{**kwargs, "mesh": replicas}, shard_placement_fn=_expert_rows_dim)


def sync_gradients(model: nn.Module, groups: MeshGroups | dist.ProcessGroup) -> None:
    """Sum every parameter gradient over the dp x cp ranks (for ``data_parallel="none"``).

    Call it once per step, after the last backward: the gradients must hold only this rank's
    local sum (a second call would add the synced part W times). Sharded experts (``groups`` with
    ep > 1) are summed over their expert replicas instead (``sync_expert_gradients``). With TP the
    group is this tp slice's dp x cp ranks, and a TP shard's gradient is summed as it is (each
    rank of the group holds the same shard).
    Every rank sends every trainable parameter, in ``model.parameters()`` order, one flat buffer
    per dtype and device; a missing gradient counts as zeros (and becomes a zero tensor), so that
    ranks whose graph did not reach a parameter still join.
    """
    group = groups.grad_sync_group if isinstance(groups, MeshGroups) else groups
    experts = set()
    if isinstance(groups, MeshGroups) and groups.ep_mesh is not None:
        sync_expert_gradients(model, groups)
        experts = set(expert_parameters(model))
    params = [p for p in model.parameters() if p.requires_grad and p not in experts]
    all_reduce_gradients(params, group)


def all_reduce_gradients(params: Sequence[nn.Parameter], group) -> None:
    """Sum the gradients of ``params`` over ``group`` in place (a DTensor gradient's local
    shard as it is), one flat all-reduce per dtype and device, in ``params`` order; a missing
    gradient counts as zeros (and becomes a zero tensor), so that every rank joins."""
    buckets: dict[tuple[torch.dtype, torch.device], list[nn.Parameter]] = {}
    for p in params:
        buckets.setdefault((p.dtype, p.device), []).append(p)
    for bucket in buckets.values():
        for p in bucket:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        grads = [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad for p in bucket]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=group)
        for g, s in zip(grads, flat.split([g.numel() for g in grads])):
            g.copy_(s.view_as(g))
