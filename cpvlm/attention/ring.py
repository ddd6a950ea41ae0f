"""Ring CP attention: K/V blocks travel around the CP group, one neighbour step at a time.

Legend: W = cp_size, r = this rank, step i holds the K/V block of rank (r - i) mod W;
q/out/dout [B,Hq,S,D], k/v [B,Hkv,S,D] (never expanded to Hq, so a message carries Hkv heads),
kv [2,B,Hkv,S,D] (K and V in one message), lse [B,Hq,S] in the acc dtype.

Forward: while block i is computed, block i+1 is already on its way (batch_isend_irecv to the
next rank, from the previous one), so communication hides behind compute. Each block's output
merges into float32 (float64 for float64) accumulators through the log-sum-exp.
Backward: the same ring again; each block's dK/dV accumulator (float32 or float64) travels with
it, each rank adding its share, and arrives back at the block's owner after W hops.
Every rank sends and receives at every step, whatever its share of the mask, so no rank waits
for a message that is never sent; the steps after the last one at which any rank has work are
skipped by every rank alike (``ring_steps``: the schedule is the same on every rank). With the
balanced layout's whole documents that can be all but the first: no K/V moves at all. A rank's work at one step is a function of its own
(``forward_step`` / ``backward_step``), which the tests' ``simulate_cp_attention`` runs for
every rank in one process, without the messages.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.autograd.function import once_differentiable
from torch.profiler import record_function

from cpvlm.attention.block import acc_dtype, add_key_grads, attend_block, attend_block_backward
from cpvlm.attention.schedule import AttentionSchedule

_KV_TAG, _DKV_TAG = 0, 1


def _shift(
    send: torch.Tensor, recv: torch.Tensor, rank: int, world: int, group, tag: int
) -> list[dist.Work]:
    """Start sending ``send`` to the next rank and receiving ``recv`` from the previous one."""
    ops = [
        dist.P2POp(dist.isend, send, group=group, group_peer=(rank + 1) % world, tag=tag),
        dist.P2POp(dist.irecv, recv, group=group, group_peer=(rank - 1) % world, tag=tag),
    ]
    return dist.batch_isend_irecv(ops)


def _return_to_owner(
    dkv: torch.Tensor, rank: int, hops: int, world: int, group
) -> tuple[torch.Tensor, list[dist.Work]]:
    """Send the dK/dV accumulator that arrived ``hops`` steps after its block's owner back to it
    (for a full ring, ``hops = W - 1``, this is one more neighbour step)."""
    recv = torch.empty_like(dkv)
    ops = [
        dist.P2POp(dist.isend, dkv, group=group, group_peer=(rank - hops) % world, tag=_DKV_TAG),
        dist.P2POp(dist.irecv, recv, group=group, group_peer=(rank + hops) % world, tag=_DKV_TAG),
    ]
    return recv, dist.batch_isend_irecv(ops)


def _wait(works: list[dist.Work]) -> None:
    with record_function("cpvlm.attention.wait"):  # what the ring did not hide behind compute
        for work in works:
            work.wait()


# ---- one rank's work at one ring step (the real ring and the tests' simulate_cp_attention) ----


def source_rank(rank: int, step: int, world: int) -> int:
    """The rank whose K/V block rank ``rank`` holds at ring step ``step``."""
    return (rank - step) % world


def ring_steps(schedule: AttentionSchedule) -> int:
    """The ring steps that must run: up to the last step at which any rank computes something."""
    return 1 + schedule.last_step


def forward_accumulators(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(out_acc, lse_acc) of a rank before its first block: nothing seen yet."""
    acc = acc_dtype(q.dtype)
    out_acc = torch.zeros(q.shape, dtype=acc, device=q.device)
    return out_acc, torch.full(q.shape[:3], float("-inf"), dtype=acc, device=q.device)


def forward_step(q, kv, schedule, rank, step, out_acc, lse_acc, scale, kernel=None) -> None:
    """Merge rank ``rank``'s queries against the K/V block ``kv`` of step ``step`` into its
    accumulators."""
    segments = schedule.segments(rank, step)
    attend_block(q, kv[0], kv[1], segments, out_acc, lse_acc, scale, kernel=kernel)


def backward_accumulators(q, kv, lse) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(the finite lse the backward uses, dq_acc, this rank's block's dkv_acc)."""
    acc = acc_dtype(q.dtype)
    # Padding rows saw nothing (lse -inf); every key is masked for them, so any finite lse
    # gives them probability 0 and keeps exp(-inf - -inf) = nan out of the kernels.
    lse = lse.masked_fill(lse == float("-inf"), 0)
    dq_acc = torch.zeros(q.shape, dtype=acc, device=q.device)
    return lse, dq_acc, torch.zeros(kv.shape, dtype=acc, device=q.device)


def backward_step(dout, q, kv, out, lse, schedule, rank, step, dq_acc, scale, kernel=None):
    """Add rank ``rank``'s dq of step ``step`` into ``dq_acc``; return the block's dK/dV parts,
    which belong to the accumulator of the block's owner (``add_key_grads``)."""
    segments = schedule.segments(rank, step)
    return attend_block_backward(
        dout, q, kv[0], kv[1], out, lse, segments, dq_acc, scale, kernel=kernel
    )


# ---- the ring ----------------------------------------------------------------------------------


def _ring_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    schedule: AttentionSchedule,
    rank: int,
    group: dist.ProcessGroup | None,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    world, steps = schedule.plan.cp_size, ring_steps(schedule)
    out_acc, lse_acc = forward_accumulators(q)
    kv = torch.stack([k, v])
    spare = torch.empty_like(kv)
    for i in range(steps):
        works = _shift(kv, spare, rank, world, group, _KV_TAG) if i + 1 < steps else []
        forward_step(q, kv, schedule, rank, i, out_acc, lse_acc, scale)
        _wait(works)
        kv, spare = spare, kv
    return out_acc.to(q.dtype), lse_acc


def _ring_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    schedule: AttentionSchedule,
    rank: int,
    group: dist.ProcessGroup | None,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    world, steps = schedule.plan.cp_size, ring_steps(schedule)
    kv = torch.stack([k, v])
    spare = torch.empty_like(kv)
    lse, dq_acc, dkv = backward_accumulators(q, kv, lse)
    dkv_spare = torch.empty_like(dkv)
    dkv_works: list[dist.Work] = []
    for i in range(steps):
        kv_works = _shift(kv, spare, rank, world, group, _KV_TAG) if i + 1 < steps else []
        parts = backward_step(dout, q, kv, out, lse, schedule, rank, i, dq_acc, scale)
        # The running dK/dV of this block's owner, from the previous rank (which held it last).
        _wait(dkv_works)
        if i > 0:
            dkv, dkv_spare = dkv_spare, dkv
        add_key_grads(dkv, parts)
        if i + 1 < steps:
            dkv_works = _shift(dkv, dkv_spare, rank, world, group, _DKV_TAG)
        _wait(kv_works)
        kv, spare = spare, kv
    if steps > 1:
        # No rank adds to this block's accumulator after the last step: it is complete; it goes
        # back to its owner, which receives its own block's.
        dkv, works = _return_to_owner(dkv, rank, steps - 1, world, group)
        _wait(works)
    return dq_acc.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, schedule, rank, group, scale):
        out, lse = _ring_forward(q, k, v, schedule, rank, group, scale)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (schedule, rank, group, scale)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        with record_function("cpvlm.attention.backward"):
            dq, dk, dv = _ring_backward(dout, q, k, v, out, lse, *ctx.args)
        return dq, dk, dv, None, None, None, None


def ring_attention(
    q_BHSD: torch.Tensor,
    k_BHSD: torch.Tensor,
    v_BHSD: torch.Tensor,
    *,
    schedule: AttentionSchedule,
    cp_rank: int,
    group: dist.ProcessGroup | None,
    scale: float,
) -> torch.Tensor:
    """Ring attention of this rank's queries over every rank's keys (inputs checked by
    ``cp_attention``)."""
    return _RingAttention.apply(q_BHSD, k_BHSD, v_BHSD, schedule, cp_rank, group, scale)
