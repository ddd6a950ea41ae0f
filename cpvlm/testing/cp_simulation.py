"""Every rank's ring schedule of cp_attention in ONE process, without collectives.

Legend: W = cp_size, r = a rank, step i: rank r holds the K/V block of rank (r - i) mod W;
per-rank lists of local shards: q/out/dout [B,Hq,S_loc,D], k/v [B,Hkv,S_loc,D].

It runs what each rank of the ring runs (ring.py's ``forward_step`` / ``backward_step``: the same
schedule, block kernels, merges and dK/dV parts), for all ranks, with the messages replaced by
indexing: so one device checks the kernels inside the real segment/merge machinery at any cp,
which is how the CUDA kernels are checked on a machine with one GPU. The steps run in ring time
(step-major, ranks inside), so every accumulator receives its additions in the order the ring
gives them: on a deterministic kernel the results equal the gloo run's bit for bit.
"""

from __future__ import annotations

import torch

from cpvlm.attention import ring
from cpvlm.attention.block import add_key_grads
from cpvlm.attention.mask_spec import MaskSpec, as_mask
from cpvlm.attention.schedule import attention_schedule
from cpvlm.distributed import compat
from cpvlm.distributed.shard_plan import ShardPlan


def simulate_cp_attention(
    q: list[torch.Tensor],
    k: list[torch.Tensor],
    v: list[torch.Tensor],
    dout: list[torch.Tensor] | None = None,
    *,
    plan: ShardPlan,
    causal: bool | None = None,
    scale: float | None = None,
    kernel: compat.FusedAttentionKernel | None = None,
    mask: MaskSpec | None = None,
) -> tuple[list[torch.Tensor], ...]:
    """Ring cp_attention of every rank's shards -> per-rank (out,) or (out, dq, dk, dv).

    Args:
        q, k, v: rank r's local shards at index r (``plan.shard(x, r, seq_dim=2)``).
        dout: per-rank upstream gradients of out; None: forward only.
        plan, causal, scale, mask: as for ``cp_attention``.
        kernel: a fused kernel to run the blocks with (default: the device's own, as in
            cp_attention).
    """
    world = plan.cp_size
    for name, shards in (("q", q), ("k", k), ("v", v), ("dout", dout)):
        if shards is not None and len(shards) != world:
            raise ValueError(f"{name} must hold one shard per rank ({world}), got {len(shards)}")
    if scale is None:
        scale = q[0].shape[-1] ** -0.5
    mask = as_mask(mask, causal, where="simulate_cp_attention")
    mask.check(plan, where="simulate_cp_attention")
    schedule = attention_schedule(plan, mask)
    kv = [torch.stack([k[r], v[r]]) for r in range(world)]

    acc = [ring.forward_accumulators(q[r]) for r in range(world)]
    for i in range(world):
        for r in range(world):
            kv_i = kv[ring.source_rank(r, i, world)]
            ring.forward_step(q[r], kv_i, schedule, r, i, *acc[r], scale, kernel=kernel)
    out = [out_acc.to(q[r].dtype) for r, (out_acc, _) in enumerate(acc)]
    if dout is None:
        return (out,)

    state = [ring.backward_accumulators(q[r], kv[r], acc[r][1]) for r in range(world)]
    for i in range(world):
        for r in range(world):
            s = ring.source_rank(r, i, world)
            lse, dq_acc, _ = state[r]
            args = (dout[r], q[r], kv[s], out[r], lse, schedule, r, i, dq_acc, scale)
            add_key_grads(state[s][2], ring.backward_step(*args, kernel=kernel))
    dq = [dq_acc.to(q[r].dtype) for r, (_, dq_acc, _) in enumerate(state)]
    dk = [dkv[0].to(k[r].dtype) for r, (_, _, dkv) in enumerate(state)]
    dv = [dkv[1].to(v[r].dtype) for r, (_, _, dkv) in enumerate(state)]
    return out, dq, dk, dv
