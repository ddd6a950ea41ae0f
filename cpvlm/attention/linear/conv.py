"""Causal depthwise conv1d under CP: each chunk gets the ``K-1`` rows that precede it (its halo).

Legend: B batch, L = S_loc local length, C channels, K kernel width, W = cp_size, n halo rows.

Output t of a causal conv reads inputs t-K+1 .. t of the same document (zeros before its start).
Under head-tail sharding the rows before a chunk usually live on another rank: the tail of chunk
j-1, which for a short document may span several chunks and ranks. Every rank computes, from the
plan alone, which positions every rank needs; one all-to-all then moves exactly those rows (at
most K-1 per chunk, none at a document start, none that the rank holds itself). Each chunk is
convolved with its halo in front; the backward is the transposed all-to-all, the halo rows'
gradients summed into the rows they came from (a row can be in the halo of two chunks).

Bytes per rank and layer, each way (forward rows, backward their gradients): at most
``2 * n_docs * (K - 1) * B * C`` elements, independent of the sequence length.
Padding positions (a document's tail up to a multiple of 2W) output 0 and pass no gradient.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch
import torch.distributed as dist
import torch.nn.functional as F

from cpvlm.attention.linear.layout import local_chunks
from cpvlm.distributed.collectives import ensure_requires_grad_for_cp_collective, to_wire
from cpvlm.distributed.shard_plan import ShardPlan

ACTIVATIONS = {None: None, "silu": F.silu, "swish": F.silu}
"""Activations applied after the conv (transformers' causal_conv1d_fn accepts these names)."""


@dataclass(frozen=True)
class HaloPlan:
    """Which rows this rank sends and where its halo rows come from; a pure function of the plan."""

    send_index: torch.Tensor  # [n_send] local rows to send, grouped by destination rank
    send_counts: list[int]  # [W]
    recv_counts: list[int]  # [W]
    ext_index: torch.Tensor  # [E] rows of [x_loc | received | zero] that make the extended input
    out_index: torch.Tensor  # [L] conv output index of each local row
    real: torch.Tensor  # [L] bool, False at padding positions


def _needed_positions(plan: ShardPlan, rank: int, halo: int) -> list[list[int]]:
    """Per local chunk, the global positions of its halo (in order; -1 before a document start)."""
    doc_starts = [s for s, _ in plan._doc_starts]
    out = []
    for ch in local_chunks(plan, rank):
        first = ch.global_start - halo
        out.append([p if p >= doc_starts[ch.doc] else -1 for p in range(first, ch.global_start)])
    return out


@lru_cache(maxsize=64)
def halo_plan(plan: ShardPlan, cp_rank: int, kernel_size: int) -> HaloPlan:
    """The halo exchange of a width-``kernel_size`` causal conv for ``cp_rank``."""
    w, halo, owners, local_of = plan.cp_size, kernel_size - 1, plan.owners, plan.local_index

    def remote_needs(dest: int) -> dict[int, list[int]]:
        """Unique positions ``dest`` needs from each other rank, ascending."""
        pos = {p for needs in _needed_positions(plan, dest, halo) for p in needs if p >= 0}
        by_src: dict[int, list[int]] = {s: [] for s in range(w)}
        for p in sorted(pos):
            if int(owners[p]) != dest:
                by_src[int(owners[p])].append(p)
        return by_src

    mine = remote_needs(cp_rank)
    send = [remote_needs(d)[cp_rank] if d != cp_rank else [] for d in range(w)]
    send_index = [int(local_of[p]) for rows in send for p in rows]

    # Extended input: per chunk, its halo rows then its own rows. Table rows: [0, L) local,
    # [L, L + n_recv) received in source-rank order, L + n_recv the zero row.
    n_recv = sum(len(rows) for rows in mine.values())
    slot, offset = {}, plan.local_len
    for s in range(w):
        for p in mine[s]:
            slot[p] = offset
            offset += 1
    zero = plan.local_len + n_recv
    ext, out_index = [], torch.empty(plan.local_len, dtype=torch.long)
    for ch, needs in zip(local_chunks(plan, cp_rank), _needed_positions(plan, cp_rank, halo)):
        for p in needs:
            if p < 0:
                ext.append(zero)
            elif int(owners[p]) == cp_rank:
                ext.append(int(local_of[p]))
            else:
                ext.append(slot[p])
        # Output i of a padding-free conv reads ext[i .. i + K - 1]: the chunk's row t is output
        # (start of the chunk's block in ext) + t.
        block = len(ext) - halo
        out_index[ch.local_start : ch.local_start + ch.length] = block + torch.arange(ch.length)
        ext.extend(range(ch.local_start, ch.local_start + ch.length))
    return HaloPlan(
        send_index=torch.tensor(send_index, dtype=torch.long),
        send_counts=[len(rows) for rows in send],
        recv_counts=[len(mine[s]) for s in range(w)],
        ext_index=torch.tensor(ext, dtype=torch.long),
        out_index=out_index,
        real=~plan.is_padding[plan.indices(cp_rank)],
    )


def _all_to_all(x_nBC: torch.Tensor, out_rows: int, out_splits, in_splits, group) -> torch.Tensor:
    send = to_wire(x_nBC.flatten(1))
    recv = send.new_empty(out_rows, send.shape[1])
    dist.all_to_all_single(recv, send, out_splits, in_splits, group=group)
    return recv.to(x_nBC.dtype).view(out_rows, *x_nBC.shape[1:])


def _exchange(x_LBC: torch.Tensor, hp: HaloPlan, group) -> torch.Tensor:
    """Rows ``x_LBC[send_index]`` to the ranks that need them; returns the received rows."""
    send = x_LBC.index_select(0, hp.send_index.to(x_LBC.device))
    return _all_to_all(send, sum(hp.recv_counts), hp.recv_counts, hp.send_counts, group)


class _HaloExchange(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_LBC, hp: HaloPlan, group):
        ctx.hp, ctx.group, ctx.rows = hp, group, x_LBC.shape[0]
        return _exchange(x_LBC, hp, group)

    @staticmethod
    def backward(ctx, grad_nBC):
        hp = ctx.hp
        back = _all_to_all(
            grad_nBC.contiguous(), sum(hp.send_counts), hp.send_counts, hp.recv_counts, ctx.group
        )
        # A row sent to two ranks (tiny chunks) gets both gradients: a sum, not a copy.
        grad = back.new_zeros((ctx.rows, *back.shape[1:]))
        return grad.index_add_(0, hp.send_index.to(back.device), back), None, None


def cp_causal_conv1d(
    x_BLC: torch.Tensor,
    weight_CK: torch.Tensor,
    bias_C: torch.Tensor | None = None,
    *,
    plan: ShardPlan,
    group: dist.ProcessGroup | None,
    activation: str | None = None,
) -> torch.Tensor:
    """Causal depthwise conv of this rank's shard, exactly as on the whole (per-document) sequence.

    Args:
        x_BLC: ``[B, L, C]`` this rank's shard (``plan.shard`` of the padded ``[B, P, C]``).
        weight_CK: ``[C, K]`` depthwise weights (a ``Conv1d(groups=C)`` weight squeezed at dim 1);
            output t is ``sum_i weight[:, i] * x[t - K + 1 + i]``, as in transformers'
            ``causal_conv1d_fn``, computed in the weight's dtype.
        bias_C: ``[C]`` or None.
        plan: the layout every rank of ``group`` shares; each document starts from zeros.
        group: the CP group (``None``: the default group).
        activation: ``None``, ``"silu"`` or ``"swish"``.

    Returns ``[B, L, C]`` in ``x_BLC``'s dtype; 0 at padding positions. Every rank of the group
    must call this with the same plan, kernel width, shapes and dtype.
    """
    _check(x_BLC, weight_CK, bias_C, plan, group, activation)
    k = weight_CK.shape[1]
    hp = halo_plan(plan, dist.get_rank(group), k)
    x = x_BLC.to(weight_CK.dtype).transpose(0, 1)  # [L, B, C]: rows on dim 0 for the exchange
    if torch.is_grad_enabled():
        x = ensure_requires_grad_for_cp_collective(x)
        received = _HaloExchange.apply(x, hp, group)
    else:
        received = _exchange(x, hp, group)
    table = torch.cat([x, received, x.new_zeros(1, *x.shape[1:])])
    ext_BCE = table.index_select(0, hp.ext_index.to(x.device)).permute(1, 2, 0)
    out = F.conv1d(ext_BCE, weight_CK.unsqueeze(1), bias_C, groups=weight_CK.shape[0])
    act = ACTIVATIONS[activation]
    if act is not None:
        out = act(out)
    out_BLC = out.index_select(2, hp.out_index.to(out.device)).transpose(1, 2)
    out_BLC = out_BLC * hp.real.to(out.device).view(1, -1, 1)
    return out_BLC.to(x_BLC.dtype)


def _check(x, weight, bias, plan, group, activation) -> None:
    op = "cp_causal_conv1d"
    if not isinstance(plan, ShardPlan):
        raise ValueError(f"{op}: plan must be a ShardPlan, got {type(plan).__name__}")
    if dist.get_world_size(group) != plan.cp_size:
        raise ValueError(
            f"{op}: the group has {dist.get_world_size(group)} ranks but the plan has "
            f"cp_size={plan.cp_size}"
        )
    if activation not in ACTIVATIONS:
        raise ValueError(f"{op}: activation must be one of {list(ACTIVATIONS)}, got {activation!r}")
    if not isinstance(x, torch.Tensor) or x.dim() != 3 or x.shape[1] != plan.local_len:
        shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(
            f"{op}: x must be [B, local_len={plan.local_len}, C] (a shard of {plan!r}), got {shape}"
        )
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or weight.shape[0] != x.shape[2]:
        shape = tuple(weight.shape) if isinstance(weight, torch.Tensor) else type(weight).__name__
        raise ValueError(f"{op}: weight must be [C={x.shape[2]}, K], got {shape}")
    if weight.shape[1] < 1:
        raise ValueError(f"{op}: the kernel width must be >= 1, got weight {tuple(weight.shape)}")
    if bias is not None and tuple(bias.shape) != (x.shape[2],):
        raise ValueError(f"{op}: bias must be [C={x.shape[2]}], got {tuple(bias.shape)}")
    if not x.is_floating_point() or not weight.is_floating_point():
        raise ValueError(
            f"{op}: x and weight must be floating point, got {x.dtype}, {weight.dtype}"
        )
