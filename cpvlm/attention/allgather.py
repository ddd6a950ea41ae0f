"""All-gather CP attention (Llama 3 style): K/V of every rank gathered once, attention local.

Legend: W = cp_size, r = this rank; q/out/dout [B,Hq,S,D], k/v [B,Hkv,S,D] (gathered with Hkv
heads, never expanded), kv_all [W,2,B,Hkv,S,D] in rank order, lse [B,Hq,S] in the acc dtype.

One collective each way: an all-gather of K/V before any compute, and a reduce-scatter of the
dK/dV accumulators (float32 or float64) after the backward, since every rank's queries
contributed to every rank's keys. The mask and the skipped work are the ring's (same schedule,
same order), so the two implementations compute exactly the same calls. It suits many short
documents, where a ring step has little work to hide its transfer behind.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.autograd.function import once_differentiable
from torch.profiler import record_function

from cpvlm.attention.block import acc_dtype, add_key_grads, attend_block, attend_block_backward
from cpvlm.attention.schedule import AttentionSchedule
from cpvlm.distributed.collectives import all_gather_dim0, reduce_scatter_dim0


def _allgather_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    schedule: AttentionSchedule,
    rank: int,
    group: dist.ProcessGroup | None,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    world = schedule.plan.cp_size
    acc = acc_dtype(q.dtype)
    kv_all = all_gather_dim0(torch.stack([k, v]), group).view(world, 2, *k.shape)
    out_acc = torch.zeros(q.shape, dtype=acc, device=q.device)
    lse_acc = torch.full(q.shape[:3], float("-inf"), dtype=acc, device=q.device)
    for i in range(world):
        kv = kv_all[(rank - i) % world]
        attend_block(q, kv[0], kv[1], schedule.segments(rank, i), out_acc, lse_acc, scale)
    return out_acc.to(q.dtype), lse_acc, kv_all


def _allgather_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    kv_all: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    schedule: AttentionSchedule,
    rank: int,
    group: dist.ProcessGroup | None,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    world = schedule.plan.cp_size
    acc = acc_dtype(q.dtype)
    # Padding rows saw nothing (lse -inf); any finite lse gives them probability 0.
    lse = lse.masked_fill(lse == float("-inf"), 0)
    dq_acc = torch.zeros(q.shape, dtype=acc, device=q.device)
    dkv_all = torch.zeros(kv_all.shape, dtype=acc, device=q.device)
    for i in range(world):
        src = (rank - i) % world
        kv = kv_all[src]
        parts = attend_block_backward(
            dout, q, kv[0], kv[1], out, lse, schedule.segments(rank, i), dq_acc, scale
        )
        add_key_grads(dkv_all[src], parts)
    dkv = reduce_scatter_dim0(dkv_all.flatten(0, 1), group)
    return dq_acc.to(q.dtype), dkv[0].to(kv_all.dtype), dkv[1].to(kv_all.dtype)


class _AllGatherAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, schedule, rank, group, scale):
        out, lse, kv_all = _allgather_forward(q, k, v, schedule, rank, group, scale)
        ctx.save_for_backward(q, kv_all, out, lse)
        ctx.args = (schedule, rank, group, scale)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, dout):
        q, kv_all, out, lse = ctx.saved_tensors
        with record_function("cpvlm.attention.backward"):
            dq, dk, dv = _allgather_backward(dout, q, kv_all, out, lse, *ctx.args)
        return dq, dk, dv, None, None, None, None


def allgather_attention(
    q_BHSD: torch.Tensor,
    k_BHSD: torch.Tensor,
    v_BHSD: torch.Tensor,
    *,
    schedule: AttentionSchedule,
    cp_rank: int,
    group: dist.ProcessGroup | None,
    scale: float,
) -> torch.Tensor:
    """All-gather attention of this rank's queries over every rank's keys (inputs checked by
    ``cp_attention``)."""
    return _AllGatherAttention.apply(q_BHSD, k_BHSD, v_BHSD, schedule, cp_rank, group, scale)
