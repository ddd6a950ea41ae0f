"""Expert parallelism (EP) under context parallelism: each rank holds 1/ep of every MoE layer's
experts, and the tokens travel to their experts' ranks and back.

Legend: P ranks in the EP group, E experts (E / P on each rank), K experts per token, n tokens on
this rank, m (token, expert) pairs this rank's experts receive, D hidden size.

Why tokens must move. Under CP every rank holds another shard of the sequence, so the ranks of an
EP group hold different tokens. An EP scheme that assumes the same batch on every EP rank (each
rank runs its experts on the whole batch and an all-reduce sums the partial outputs:
transformers' ``AllReduceEP``) would add the outputs of different tokens. Here each (token,
expert) pair is sent to the rank that holds the expert (``all_to_all_single`` with uneven
splits), the experts run there, and the outputs come back the same way (the transposed
exchange). Each pair has exactly one sender and one consumer, so both exchanges are
permutations: their backward is the transposed all-to-all, no sums.

Exactness. Rank k's experts compute E_e(x) for exactly the pairs routed to e from its EP group,
the pairs the one-process run computes; the sender weights and sums its pairs' outputs as
transformers' experts do (the same sum, in top-k slot order instead of expert order: the same
value for K = 2, round-off otherwise). The gradient of expert e on its rank is the sum over the
tokens of the EP group routed to e; the W / P ranks that hold the same experts (the *expert
replicas*, one per EP group) sum their gradients, which gives the sum over every token of the
step: cpvlm's summed-gradient convention (see ``data_parallel``). The router and its
load-balancing loss are untouched (``cpvlm.router_loss``).

The experts' weights are DTensors ``Shard(0)`` over the 1-d "ep" mesh: DCP saves each expert
once and loads it into another ep. Under ``parallelize(data_parallel="fsdp")`` each experts
module is then its own FSDP2 unit over the expert replicas (the "ep_replica" dim of the same 2-d
mesh; torchtitan's "dp_shard_mod_ep"): a rank holds 1/W of the expert parameters, as of every
other, and FSDP2's reduce-scatter sums the replicas' gradients. Otherwise (HSDP, "none", or
W = P: no replicas) they are replicated over the replicas and ``sync_expert_gradients`` sums
their gradients.

Why not transformers' ``AllToAllEP``: cpvlm/parallelize never imports transformers (it serves any
model whose experts module has the layout below), and transformers' EP is applied by
``from_pretrained`` on its own (tp, ep, fsdp) mesh; the exchange itself is the same idea. The
experts module contract (transformers' fused experts, e.g. Qwen3-VL-MoE, Qwen3.5-MoE): an
``int`` attribute ``num_experts``, its own parameters all ``[E, ...]``, and
``forward(hidden_nD, top_k_index_nK, top_k_weights_nK) -> [n, D]`` summing the weighted outputs.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, Shard

from cpvlm.distributed.collectives import ensure_requires_grad_for_cp_collective


def expert_modules(model: nn.Module) -> list[nn.Module]:
    """The fused-experts modules of ``model``: an ``int`` ``num_experts`` and own parameters that
    are all 3-d with ``num_experts`` rows (a router's 2-d weight does not count)."""
    found = []
    for module in model.modules():
        num = getattr(module, "num_experts", None)
        params = list(module.parameters(recurse=False))
        # sharded (DTensor), a parameter keeps its global shape and num_experts is the local count
        rows = all(p.dim() == 3 and (isinstance(p, DTensor) or p.shape[0] == num) for p in params)
        if isinstance(num, int) and params and rows:
            found.append(module)
    return found


def _is_sharded(module: nn.Module) -> bool:
    return any(isinstance(p, DTensor) for p in module.parameters(recurse=False))


def expert_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The parameters ``parallelize_experts`` sharded (DTensors of the experts modules)."""
    return [
        p
        for m in expert_modules(model)
        if _is_sharded(m)
        for p in m.parameters(recurse=False)
        if isinstance(p, DTensor)
    ]


def check_experts(ep: int, num_experts: int | None, name: str = "ep", flag: str = "") -> None:
    """``ep`` must divide the experts of a MoE model (``num_experts``; None: not a MoE model).
    The message names ``name`` (and the command-line ``flag``, if any) and the fix."""
    if ep == 1:
        return
    where = f"{name} = {ep}" + (f" ({flag})" if flag else "")
    if num_experts is None:
        raise ValueError(
            f"{where}: expert parallelism needs a MoE model (one with experts); this model has "
            "none: use ep 1"
        )
    if num_experts % ep:
        divisors = [d for d in range(1, num_experts + 1) if num_experts % d == 0]
        raise ValueError(
            f"{where}: must divide the model's {num_experts} experts (each rank holds "
            f"num_experts / ep of them); use one of {divisors}"
        )


def _all_to_all(x_mD: torch.Tensor, out_splits: list[int], in_splits: list[int], group):
    out = x_mD.new_empty(sum(out_splits), x_mD.shape[1])
    dist.all_to_all_single(out, x_mD.contiguous(), out_splits, in_splits, group=group)
    return out


class _Exchange(torch.autograd.Function):
    """Rows to other ranks (``in_splits[r]`` rows to rank r, ``out_splits[r]`` from it); the
    backward sends the gradients back the same way, transposed."""

    @staticmethod
    def forward(ctx, x_mD, out_splits, in_splits, group):
        ctx.splits, ctx.group = (out_splits, in_splits), group
        return _all_to_all(x_mD, out_splits, in_splits, group)

    @staticmethod
    def backward(ctx, grad_mD):
        out_splits, in_splits = ctx.splits
        return _all_to_all(grad_mD, in_splits, out_splits, ctx.group), None, None, None


def _exchange(x_mD, out_splits, in_splits, group) -> torch.Tensor:
    return _Exchange.apply(
        ensure_requires_grad_for_cp_collective(x_mD), out_splits, in_splits, group
    )


def _dispatch_and_combine(experts_fn, x_nD, index_nK, weights_nK, num_local: int, group):
    """The experts' output for this rank's tokens, each (token, expert) pair computed on the
    expert's rank. ``experts_fn(x_mD, local_index_m1, ones_m1)`` runs this rank's experts."""
    size = dist.get_world_size(group)
    num_top_k = index_nK.shape[-1]
    expert_ids = index_nK.reshape(-1)
    # Sorted by expert, the pairs are grouped by destination rank (each rank holds a contiguous
    # range of experts); the per-expert counts tell each receiver whose pairs it gets.
    order = torch.argsort(expert_ids, stable=True)
    send_counts_PE = torch.bincount(expert_ids, minlength=num_local * size).view(size, num_local)
    recv_counts_PE = torch.empty_like(send_counts_PE)
    dist.all_to_all_single(recv_counts_PE, send_counts_PE, group=group)
    send_splits = send_counts_PE.sum(1).tolist()
    recv_splits = recv_counts_PE.sum(1).tolist()
    recv_mD = _exchange(x_nD[order // num_top_k], recv_splits, send_splits, group)
    local_m = torch.arange(num_local, device=x_nD.device).repeat(size)
    local_m = local_m.repeat_interleave(recv_counts_PE.reshape(-1), output_size=sum(recv_splits))
    out_mD = experts_fn(recv_mD, local_m[:, None], recv_mD.new_ones(recv_mD.shape[0], 1))
    # Keeps the received rows in the graph where no expert here was hit (the output is then a
    # constant), so that the backward of the dispatch runs on every rank.
    out_mD = out_mD + recv_mD.sum(0) * 0
    back_pD = _exchange(out_mD.to(x_nD.dtype), send_splits, recv_splits, group)
    pairs_pD = torch.empty_like(back_pD).index_copy(0, order, back_pD)
    pairs_nKD = pairs_pD.view(*index_nK.shape, x_nD.shape[-1])
    return (pairs_nKD * weights_nK.to(pairs_nKD.dtype)[..., None]).sum(1)


def _ep_forward(module: nn.Module, forward, mesh: DeviceMesh):
    group = mesh.get_group()
    names = [n for n, p in module.named_parameters(recurse=False) if isinstance(p, DTensor)]

    def experts_fn(x_mD, local_m1, ones_m1):
        sharded = {n: module._parameters[n] for n in names}
        try:  # the experts' own forward, on this rank's experts (local ids)
            locals_ = []
            for n, p in sharded.items():
                local = p.to_local()
                locals_.append(local)
                module._parameters[n] = local if local.dtype == x_mD.dtype else local.to(x_mD.dtype)
            out_mD = forward(x_mD, local_m1, ones_m1)
        finally:
            module._parameters.update(sharded)
        # Every parameter in the graph, even where no pair reached this rank's experts (the
        # forward then skips them): each gets a gradient, zeros at worst, so that the expert
        # replicas' gradient reduction (FSDP2's reduce-scatter) runs on every rank.
        return out_mD + sum(t.reshape(-1)[:1].sum() for t in locals_).to(out_mD.dtype) * 0

    def ep_forward(hidden_states, top_k_index, top_k_weights):
        return _dispatch_and_combine(
            experts_fn, hidden_states, top_k_index, top_k_weights, module.num_experts, group
        )

    return ep_forward


def parallelize_experts(model: nn.Module, ep_mesh: DeviceMesh) -> list[nn.Parameter]:
    """Shard every experts module of ``model`` over the 1-d ``ep_mesh`` and route its tokens.

    Call it on every rank with identical weights (same seed or checkpoint), before FSDP2: each
    rank keeps its slice of each expert parameter as a ``DTensor`` ``Shard(0)`` (no
    communication) and ``num_experts`` becomes the local count. Returns the sharded parameters
    (FSDP2 over the dp x cp ranks must ignore them; ``parallelize`` shards them over their
    replicas or leaves their sum to ``sync_expert_gradients``).
    """
    size, rank = ep_mesh.size(), ep_mesh.get_local_rank()
    modules = expert_modules(model)
    if size > 1 and not modules:
        check_experts(size, None, "parallelize_experts: ep")
    sharded = []
    for module in modules:
        if _is_sharded(module):
            raise ValueError("parallelize_experts: the experts are sharded already")
        check_experts(size, module.num_experts, "parallelize_experts: ep")
        for name, p in list(module.named_parameters(recurse=False)):
            local = p.detach().chunk(size)[rank].clone()
            dt = DTensor.from_local(local, ep_mesh, [Shard(0)], run_check=False)
            module._parameters[name] = nn.Parameter(dt, requires_grad=p.requires_grad)
            sharded.append(module._parameters[name])
        module.num_experts //= size
        # per instance: the class's forward stays transformers' own, run on the local experts
        module.forward = _ep_forward(module, module.forward, ep_mesh)
    return sharded


def sync_expert_gradients(model: nn.Module, groups) -> None:
    """Sum the replicated experts' gradients over the ranks that hold the same experts (one per
    EP group; ``groups``: the ``MeshGroups`` of an ``ep > 1`` mesh); experts that FSDP2 shards
    over those ranks (``parallelize(data_parallel="fsdp")``) are left to its reduce-scatter.
    Call it once per step, after the last backward, on every rank; a missing gradient counts as
    zeros (a rank whose experts received no token still joins)."""
    params = [
        p
        for m in expert_modules(model)
        if _is_sharded(m) and not isinstance(m, FSDPModule)
        for p in m.parameters(recurse=False)
        if isinstance(p, DTensor) and p.requires_grad
    ]
    if not params or groups.ep_mesh is None:
        return
    replica_group = groups.ep_mesh.get_group("ep_replica")
    if dist.get_world_size(replica_group) == 1:
        return
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    locals_ = [p.grad.to_local() for p in params]
    flat = torch.cat([g.reshape(-1) for g in locals_])
    dist.all_reduce(flat, group=replica_group)
    for g, s in zip(locals_, flat.split([g.numel() for g in locals_])):
        g.copy_(s.view_as(g))
