"""Hybrid CP attention (USP style): Ulysses inside groups of u consecutive ranks, a ring across them.

Legend: W = cp_size = u * r; CP rank g = j * u + i is member i of Ulysses group j (ranks
j*u .. j*u+u-1, consecutive, so a group can sit inside one node) and rank j of ring i (ranks
i, u + i, 2u + i, ...); L = S_loc; e = element size of the dtype; Hq_i / Hkv_i the heads of
member i (``head_split(Hq, Hkv, u)``, the same for every ring, so a ring's ranks share their heads).

Steps: (1) the Ulysses all-to-all inside group j gives member i its heads over the group's uL
positions; (2) ring attention over ring i on those heads, with the K/V blocks of the other groups
travelling around the ring; (3) the inverse all-to-all. Backward: the ring's backward inside the
transposed all-to-alls. Each uniform GQA group of a member's heads runs its own ring (most splits
have one), so K/V are never expanded.

Layout of the ring dimension. ``ShardPlan`` stays the one sequence layout: under head-tail, rank g
holds chunks g and 2W-1-g of every document (2W chunks of c). After step (1), group j holds
    {j*u + i : i < u}  =  chunks ju .. ju+u-1                = super-chunk j,
    {2W-1-j*u-i : i < u} = chunks (2r-1-j)u .. (2r-j)u - 1    = super-chunk 2r-1-j,
where super-chunk = u consecutive chunks (2r super-chunks of u*c per document). That is head-tail
over the r ring ranks with chunks u times longer: every ring rank has the same causal work of every
document, at every ring step, as in a plain ring over r ranks. ``plan.merge_ranks(u)`` is that view
(positions of a group in ascending order), and the ring's block schedule is derived from it like
any other plan's, whatever the layout (under ``layout="balanced"`` a group holds its members'
whole documents plus the super-chunks of the split ones).

Bytes on the wire per rank per layer, forward + backward (what it sends; N = B * L * D * e):
    Ulysses over u: N * [2 sum_{m != i} Hq_m + 2 sum_{m != i} Hkv_m + (u - 1)(2 Hq_i + 2 Hkv_i)]
    ring over r on uL positions with Hkv_i heads (a = element size of the accumulator dtype:
    8 for float64, else 4):  (r - 1) * 2 * (2 u N Hkv_i)  +  r * 2 u N Hkv_i * a / e   (r > 1)
(``cpvlm.attention.cost.wire_bytes`` computes it; a test counts it on real ranks.)
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from cpvlm.attention.mask_spec import MaskSpec
from cpvlm.attention.ring import ring_attention
from cpvlm.attention.schedule import attention_schedule
from cpvlm.attention.ulysses import gather_heads, head_split, relayout, scatter_heads
from cpvlm.distributed.shard_plan import ShardPlan

_groups: dict[tuple, tuple] = {}


def hybrid_groups(
    group: dist.ProcessGroup | None, ulysses_size: int
) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """(Ulysses group, ring group) of this rank for a CP ``group`` split as ulysses_size x r.

    Created on first use (every rank of the CP group calls this at the same point: the first hybrid
    attention call, or ahead of it) and kept for the life of the process. Only the ranks of each new
    group take part in creating it (``use_local_synchronization``); every rank creates its Ulysses
    group, then its ring group, so no creation waits on one that is not under way.
    """
    group = dist.group.WORLD if group is None else group
    ranks = tuple(dist.get_process_group_ranks(group))
    key = (id(group), ranks, ulysses_size)
    if key not in _groups:
        u = ulysses_size
        j, i = divmod(dist.get_rank(group), u)
        backend = dist.get_backend(group)

        def new(members):
            if list(members) == list(ranks):
                return group
            return dist.new_group(list(members), backend=backend, use_local_synchronization=True)

        # The group is kept in the value so that its id cannot be reused while cached.
        _groups[key] = (group, new(ranks[j * u : (j + 1) * u]), new(ranks[i::u]))
    return _groups[key][1:]


def hybrid_attention(
    q_BHSD: torch.Tensor,
    k_BHSD: torch.Tensor,
    v_BHSD: torch.Tensor,
    *,
    plan: ShardPlan,
    mask: MaskSpec,
    cp_rank: int,
    group: dist.ProcessGroup | None,
    scale: float,
    ulysses_size: int,
) -> torch.Tensor:
    """Ulysses over ``ulysses_size`` consecutive ranks x ring across (inputs checked by
    ``cp_attention``)."""
    u = ulysses_size
    ulysses_group, ring_group = hybrid_groups(group, u)
    heads = head_split(q_BHSD.shape[1], k_BHSD.shape[1], u)
    lay = relayout(plan, heads, cp_rank)
    q_i, k_i, v_i = scatter_heads(q_BHSD, k_BHSD, v_BHSD, lay, ulysses_group)
    schedule = attention_schedule(plan.merge_ranks(u), mask)
    outs = [
        ring_attention(
            q_i[:, qa:qb],
            k_i[:, ka:kb],
            v_i[:, ka:kb],
            schedule=schedule,
            cp_rank=cp_rank // u,
            group=ring_group,
            scale=scale,
        )
        for qa, qb, ka, kb in heads.groups(lay.member)
    ]
    # A member without query heads (Hq < u) still joins both all-to-alls, forward and backward:
    # its empty q_i carries the graph through (and so does every member of its ring, alike).
    out_i = torch.cat(outs, dim=1) if outs else q_i
    return gather_heads(out_i, lay, ulysses_group)
