"""Ulysses CP attention (DeepSpeed-Ulysses style) for any head count: heads spread, sequence whole.

Legend: u = ranks of the Ulysses group (cp_size for ``impl="ulysses"``), i = this rank's index in
it; q/out [B,Hq,L,D] and k/v [B,Hkv,L,D] this rank's shard of L = S_loc positions; after the
all-to-all [B,Hq_i,uL,D] and [B,Hkv_i,uL,D]: this rank's heads over the group's uL positions, in
ascending global order (``plan.merge_ranks(u)``); G = Hq / Hkv; e = element size of the dtype.

Forward: one all-to-all sends every rank its query heads and the K/V heads they use, for all the
group's positions; local attention runs under the plan's mask (the schedule of the merged plan:
per document a fused causal or full call, small documents grouped into masked calls); one
all-to-all returns every rank its positions of all heads. Backward: the transposed all-to-alls
(dout out, then dq, dk, dv back; a K/V head that went to two ranks gets both gradients summed).

Heads (``head_split``): query heads are cut into u contiguous ranges of floor(Hq/u) or ceil(Hq/u)
heads, so no head count has to divide u; the slowest rank computes ceil(Hq/u) heads, so the price
of an uneven split is ceil(Hq/u) / (Hq/u) of the even work (``HeadSplit.imbalance``: 1.14 for
Hq=28 at u=8, 1.33 for Hq=12 at u=8; benchmarks/balance.py lists it). Rank i receives exactly the K/V heads
its query heads use: a K/V head goes to more than one rank only when its query heads are split
across ranks, and it is never expanded to Hq. Among the splits with those sizes it takes the one
with the fewest K/V heads on the busiest rank, then the fewest K/V heads in all, then the fewest
kernel groups (a rank's heads where each K/V head has the same number of query heads run as one
GQA call), then the earliest boundaries; found by a small dynamic program, identical everywhere.

Bytes on the wire per rank i per layer, forward + backward (what it sends to the other ranks;
N = B * L * D * e, Hq_i and Hkv_i its heads, sums over the other ranks m != i):
    forward   q, k, v out:   N * sum_m (Hq_m + 2 Hkv_m);      out back:  N * (u - 1) Hq_i
    backward  dout out:      N * sum_m Hq_m;                  dq, dk, dv back: N * (u-1)(Hq_i + 2 Hkv_i)
    total = N * [2 sum_m Hq_m + 2 sum_m Hkv_m + (u - 1)(2 Hq_i + 2 Hkv_i)]
(``cpvlm.attention.cost.wire_bytes`` computes it; a test counts it on real ranks.)
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch
import torch.distributed as dist
from torch.autograd.function import once_differentiable

from cpvlm.attention.block import acc_dtype, add_key_grads, attend_block, attend_block_backward
from cpvlm.attention.mask_spec import MaskSpec
from cpvlm.attention.schedule import Segment, attention_schedule
from cpvlm.distributed.shard_plan import ShardPlan

HeadGroup = tuple[int, int, int, int]
"""(q start, q stop, kv start, kv stop) of one uniform GQA kernel call, in a rank's local heads."""


@dataclass(frozen=True)
class HeadSplit:
    """Which query heads (and hence K/V heads) each of ``size`` ranks gets."""

    q_heads: int
    kv_heads: int
    bounds: tuple[int, ...]
    """``size + 1`` query-head boundaries: rank i gets heads ``bounds[i] .. bounds[i+1]-1``."""

    @property
    def size(self) -> int:
        return len(self.bounds) - 1

    @property
    def imbalance(self) -> float:
        """Query heads of the busiest rank over the mean Hq / size: what an uneven split costs
        the slowest rank (1.0 when size divides Hq)."""
        busiest = max(b - a for a, b in zip(self.bounds, self.bounds[1:]))
        return busiest * self.size / self.q_heads

    def q_range(self, i: int) -> tuple[int, int]:
        return self.bounds[i], self.bounds[i + 1]

    def kv_range(self, i: int) -> tuple[int, int]:
        a, b = self.q_range(i)
        return _kv_range(a, b, self.q_heads // self.kv_heads)

    def groups(self, i: int) -> tuple[HeadGroup, ...]:
        """Rank i's uniform GQA groups, in its local head indices."""
        a, b = self.q_range(i)
        c = self.kv_range(i)[0]
        return tuple(
            (qa - a, qb - a, ka - c, kb - c)
            for qa, qb, ka, kb in _groups(a, b, self.q_heads // self.kv_heads)
        )


def _kv_range(a: int, b: int, g: int) -> tuple[int, int]:
    return (a // g, (b - 1) // g + 1) if b > a else (0, 0)


def _groups(a: int, b: int, g: int) -> list[HeadGroup]:
    """Maximal runs of K/V heads that each serve the same number of query heads in [a, b)."""
    out: list[HeadGroup] = []
    lo, hi = _kv_range(a, b, g)
    for h in range(lo, hi):
        qa, qb = max(a, h * g), min(b, (h + 1) * g)
        if out and out[-1][1] - out[-1][0] == (out[-1][3] - out[-1][2]) * (qb - qa):
            out[-1] = (out[-1][0], qb, out[-1][2], h + 1)
        else:
            out.append((qa, qb, h, h + 1))
    return out


@lru_cache(maxsize=256)
def head_split(q_heads: int, kv_heads: int, size: int) -> HeadSplit:
    """The split of ``q_heads`` query heads (sharing ``kv_heads`` K/V heads) over ``size`` ranks
    (the rule is in the module docstring)."""
    g = q_heads // kv_heads
    lo, extra = divmod(q_heads, size)

    def cost(a: int, b: int) -> tuple[int, int]:
        kv = _kv_range(a, b, g)
        return kv[1] - kv[0], len(_groups(a, b, g))

    for max_kv in range(kv_heads + 1):
        # best[e]: (kv heads, groups, bounds) over the first i ranks, e of them with lo + 1 heads
        best: dict[int, tuple[int, int, tuple[int, ...]]] = {0: (0, 0, (0,))}
        for i in range(size):
            nxt: dict[int, tuple[int, int, tuple[int, ...]]] = {}
            for e, (kv, groups, bounds) in best.items():
                for bigger in (0, 1):
                    if e + bigger > extra or (i + 1) - (e + bigger) > size - extra:
                        continue
                    a = bounds[-1]
                    b = a + lo + bigger
                    n_kv, n_groups = cost(a, b)
                    if n_kv > max_kv:
                        continue
                    cand = (kv + n_kv, groups + n_groups, (*bounds, b))
                    if e + bigger not in nxt or cand < nxt[e + bigger]:
                        nxt[e + bigger] = cand
            best = nxt
        if extra in best:
            return HeadSplit(q_heads, kv_heads, best[extra][2])
    raise AssertionError("unreachable: max_kv = kv_heads always admits a split")


# ---- the all-to-all between sequence shards and head shards -----------------------------------


@dataclass(frozen=True)
class Relayout:
    """One rank's view of the all-to-all inside its Ulysses group of ``heads.size`` ranks."""

    heads: HeadSplit
    member: int
    order: torch.Tensor
    """[uL] the member-order concatenation of the group's shards -> ascending global order."""
    inverse: torch.Tensor


@lru_cache(maxsize=256)
def relayout(plan: ShardPlan, heads: HeadSplit, cp_rank: int) -> Relayout:
    """The all-to-all of ``cp_rank`` inside its group of ``heads.size`` consecutive ranks."""
    u = heads.size
    first = cp_rank - cp_rank % u
    concat = torch.cat([plan.indices(first + m) for m in range(u)])
    order = torch.argsort(concat)
    return Relayout(heads, cp_rank % u, order, torch.argsort(order))


def _ranges(lay: Relayout, kinds: tuple[str, ...]) -> list[list[tuple[int, int]]]:
    """Per tensor, per member, its head range (query heads for "q", K/V heads for "kv")."""
    pick = {"q": lay.heads.q_range, "kv": lay.heads.kv_range}
    return [[pick[kind](m) for m in range(lay.heads.size)] for kind in kinds]


def _all_to_all(send: torch.Tensor, out_splits, in_splits, group) -> torch.Tensor:
    if len(in_splits) == 1:
        return send
    recv = send.new_empty(sum(out_splits))
    dist.all_to_all_single(recv, send, out_splits, in_splits, group=group)
    return recv


def seq_to_heads(xs, kinds, lay: Relayout, group) -> list[torch.Tensor]:
    """[B,H,L,D] shards -> [B,H_i,uL,D] (this rank's heads, the group's positions, ascending)."""
    u, i = lay.heads.size, lay.member
    ranges = _ranges(lay, kinds)
    b, _, n, d = xs[0].shape
    send = torch.cat(
        [x[:, r[m][0] : r[m][1]].reshape(-1) for m in range(u) for x, r in zip(xs, ranges)]
    )
    in_splits = [sum(b * (r[m][1] - r[m][0]) * n * d for r in ranges) for m in range(u)]
    mine = [b * (r[i][1] - r[i][0]) * n * d for r in ranges]
    recv = _all_to_all(send, [sum(mine)] * u, in_splits, group).view(u, sum(mine))
    out = []
    for part, r in zip(recv.split(mine, dim=1), ranges):
        h = r[i][1] - r[i][0]
        x = part.reshape(u, b, h, n, d).permute(1, 2, 0, 3, 4).reshape(b, h, u * n, d)
        out.append(x.index_select(2, lay.order.to(x.device)))
    return out


def heads_to_seq(ys, kinds, totals, lay: Relayout, group) -> list[torch.Tensor]:
    """The adjoint of ``seq_to_heads``: [B,H_i,uL,D] -> [B,H,L,D], summing a head that several
    ranks hold (a K/V head whose query heads were split)."""
    u = lay.heads.size
    ranges = _ranges(lay, kinds)
    b, _, un, d = ys[0].shape
    n = un // u
    parts = [
        y.index_select(2, lay.inverse.to(y.device))
        .reshape(b, y.shape[1], u, n, d)
        .permute(2, 0, 1, 3, 4)
        .reshape(u, -1)
        for y in ys
    ]
    send = torch.cat(parts, dim=1).reshape(-1)
    sizes = [[b * (r[m][1] - r[m][0]) * n * d for r in ranges] for m in range(u)]
    recv = _all_to_all(send, [sum(s) for s in sizes], [send.numel() // u] * u, group)
    out = [ys[0].new_zeros(b, h, n, d) for h in totals]
    for m, chunk in enumerate(recv.split([sum(s) for s in sizes])):
        for x, r, piece in zip(out, ranges, chunk.split(sizes[m])):
            a, c = r[m]
            x[:, a:c] += piece.view(b, c - a, n, d)
    return out


class _SeqToHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, lay, group, q, k, v):
        ctx.args = (lay, group, (q.shape[1], k.shape[1], v.shape[1]))
        return tuple(seq_to_heads([q, k, v], ("q", "kv", "kv"), lay, group))

    @staticmethod
    @once_differentiable
    def backward(ctx, dq, dk, dv):
        lay, group, totals = ctx.args
        grads = heads_to_seq([dq, dk, dv], ("q", "kv", "kv"), totals, lay, group)
        return None, None, *grads


class _HeadsToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, lay, group, out_i):
        ctx.args = (lay, group)
        return heads_to_seq([out_i], ("q",), (lay.heads.q_heads,), lay, group)[0]

    @staticmethod
    @once_differentiable
    def backward(ctx, dout):
        lay, group = ctx.args
        return None, None, seq_to_heads([dout], ("q",), lay, group)[0]


def scatter_heads(q, k, v, lay: Relayout, group):
    """Differentiable ``seq_to_heads`` of q, k, v (backward: the transposed all-to-all)."""
    return _SeqToHeads.apply(lay, group, q, k, v)


def gather_heads(out_i, lay: Relayout, group):
    """Differentiable ``heads_to_seq`` of the attention output (backward: the transpose)."""
    return _HeadsToSeq.apply(lay, group, out_i)


# ---- local attention over the whole sequence on this rank's heads -----------------------------


def _local_forward(q, k, v, segments: tuple[Segment, ...], groups, scale, kernel=None):
    """(out, lse) of this rank's heads over the whole sequence: one block, the merged plan's
    segments, through the same block entry point as the ring (so the fused CUDA kernels serve it;
    ``kernel`` replaces the device's own, for tests)."""
    acc = acc_dtype(q.dtype)
    out_acc = torch.zeros(q.shape, dtype=acc, device=q.device)
    lse_acc = torch.full(q.shape[:3], float("-inf"), dtype=acc, device=q.device)
    for qa, qb, ka, kb in groups:
        attend_block(
            q[:, qa:qb],
            k[:, ka:kb],
            v[:, ka:kb],
            segments,
            out_acc[:, qa:qb],
            lse_acc[:, qa:qb],
            scale,
            kernel=kernel,
        )
    return out_acc.to(q.dtype), lse_acc


def _local_backward(dout, q, k, v, out, lse, segments, groups, scale, kernel=None):
    acc = acc_dtype(q.dtype)
    # Padding rows saw nothing (lse -inf); any finite lse gives them probability 0.
    lse = lse.masked_fill(lse == float("-inf"), 0)
    dq_acc = torch.zeros(q.shape, dtype=acc, device=q.device)
    dkv_acc = torch.zeros((2, *k.shape), dtype=acc, device=q.device)
    for qa, qb, ka, kb in groups:
        parts = attend_block_backward(
            dout[:, qa:qb],
            q[:, qa:qb],
            k[:, ka:kb],
            v[:, ka:kb],
            out[:, qa:qb],
            lse[:, qa:qb],
            segments,
            dq_acc[:, qa:qb],
            scale,
            kernel=kernel,
        )
        add_key_grads(dkv_acc[:, :, ka:kb], parts)
    return dq_acc.to(q.dtype), dkv_acc[0].to(k.dtype), dkv_acc[1].to(v.dtype)


class _LocalAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, segments, groups, scale):
        out, lse = _local_forward(q, k, v, segments, groups, scale)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (segments, groups, scale)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = _local_backward(dout.contiguous(), q, k, v, out, lse, *ctx.args)
        return dq, dk, dv, None, None, None


def ulysses_attention(
    q_BHSD: torch.Tensor,
    k_BHSD: torch.Tensor,
    v_BHSD: torch.Tensor,
    *,
    plan: ShardPlan,
    mask: MaskSpec,
    cp_rank: int,
    group: dist.ProcessGroup | None,
    scale: float,
) -> torch.Tensor:
    """Ulysses attention over the whole CP group (inputs checked by ``cp_attention``)."""
    heads = head_split(q_BHSD.shape[1], k_BHSD.shape[1], plan.cp_size)
    lay = relayout(plan, heads, cp_rank)
    q_i, k_i, v_i = scatter_heads(q_BHSD, k_BHSD, v_BHSD, lay, group)
    segments = attention_schedule(plan.merge_ranks(plan.cp_size), mask).segments(0, 0)
    out_i = _LocalAttention.apply(q_i, k_i, v_i, segments, heads.groups(lay.member), scale)
    return gather_heads(out_i, lay, group)
