"""Route encoder rows from the rank that encoded them to the rank that owns their position.

Legend: W ranks, R rows of all units (unit order = the unwrapped tower's output order),
n rows encoded on this rank, k visual positions owned by this rank, P padded sequence length,
L = P // W local length, D packed feature width.

A row's *position* is its place in the padded batch, flattened: ``b * P + p`` for sequence b and
padded position p. Its owner is ``plan.owners[p]``; its *local index* on the owner is
``b * L + i`` where ``plan.indices(owner)[i] == p``, i.e. its place in the owner's flattened
``[B, L]`` shard. The rows a rank receives come back sorted by local index: the order in which
its visual positions appear in its shard, the order ``masked_scatter`` fills them.

Each row crosses the network at most once (rows whose owner encoded them never leave), so a rank
sends and receives about R/W rows instead of the (W-1)/W * R an all-gather moves. Every row has
exactly one consumer, so the backward is the transposed all-to-all: a permutation, no sums.
gloo's all_to_all_single takes uneven split sizes, so nothing is padded.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from cpvlm.distributed.collectives import (
    StepAgreement,
    agree,
    ensure_requires_grad_for_cp_collective,
    fingerprint,
    to_wire,
)
from cpvlm.distributed.shard_plan import ShardPlan
from cpvlm.encoders._pack import as_tensor_list, check_rows, pack_features, unpack_features


@dataclass(frozen=True)
class RoutePlan:
    """Who sends which row where; identical on every rank up to ``cp_rank``'s own view."""

    cp_rank: int
    send_index: torch.Tensor  # [n] rows of x_loc in send order (by destination, then local index)
    send_counts: list[int]  # [W] rows this rank sends to each rank
    recv_counts: list[int]  # [W] rows this rank receives from each rank
    out_from_arrival: torch.Tensor  # [k] arrival slot of each output row
    local_positions: torch.Tensor  # [k] local index of each output row, ascending
    inputs: int = 0  # fingerprint of (row_ranks, row_positions, plan): equal on every rank

    @property
    def num_local_rows(self) -> int:
        return int(self.local_positions.numel())


def _check_positions(row_positions: torch.Tensor, num_rows: int, plan: ShardPlan) -> torch.Tensor:
    if not isinstance(row_positions, torch.Tensor) or row_positions.dim() != 1:
        raise ValueError("route: row_positions must be a 1-d integer tensor, one entry per row")
    if row_positions.is_floating_point() or row_positions.dtype == torch.bool:
        raise ValueError(f"route: row_positions must be integers, got {row_positions.dtype}")
    if row_positions.numel() != num_rows:
        raise ValueError(
            f"route: {row_positions.numel()} row_positions for {num_rows} encoder rows "
            f"(t*h*w/merge**2 summed over the grids)"
        )
    pos = row_positions.detach().to("cpu", torch.long)
    if num_rows == 0:
        return pos
    if int(pos.min()) < 0:
        raise ValueError(f"route: row_positions has a negative entry {int(pos.min())}")
    padding = plan.is_padding[pos % plan.padded_len]
    if bool(padding.any()):
        bad = int(pos[padding][0])
        raise ValueError(
            f"route: row position {bad} is a padding position of {plan!r}; positions index the "
            f"padded batch as b * padded_len + p with p = plan.padded_index[token position]"
        )
    if torch.unique(pos).numel() != num_rows:
        raise ValueError("route: two encoder rows share a sequence position")
    return pos


def route_plan(
    row_ranks: torch.Tensor, row_positions: torch.Tensor, plan: ShardPlan, cp_rank: int
) -> RoutePlan:
    """The routing of R rows: ``row_ranks[g]`` encoded row g, ``row_positions[g]`` is its position.

    Rank s holds the rows with ``row_ranks == s`` in ascending g. A pure function of replicated
    integers: every rank computes its part without communicating. Raises ValueError for positions
    that are out of range, padding, or repeated.
    """
    plan._check_rank(cp_rank)
    w = plan.cp_size
    row_ranks = row_ranks.to("cpu", torch.long)
    if row_ranks.numel() and not 0 <= int(row_ranks.min()) <= int(row_ranks.max()) < w:
        raise ValueError(
            f"route: row_ranks must lie in [0, {w}), got {row_ranks.unique().tolist()}"
        )
    pos = _check_positions(row_positions, row_ranks.numel(), plan)
    owner, local = plan.locate(pos)
    stride = int(local.max()) + 1 if local.numel() else 1

    mine = torch.nonzero(row_ranks == cp_rank).squeeze(1)
    dest = owner[mine]
    send_index = torch.argsort(dest * stride + local[mine])

    owned = torch.nonzero(owner == cp_rank).squeeze(1)
    src = row_ranks[owned]
    arrival = owned[torch.argsort(src * stride + local[owned])]
    out_from_arrival = torch.argsort(local[arrival])
    return RoutePlan(
        cp_rank=cp_rank,
        send_index=send_index,
        send_counts=torch.bincount(dest, minlength=w).tolist(),
        recv_counts=torch.bincount(src, minlength=w).tolist(),
        out_from_arrival=out_from_arrival,
        local_positions=local[arrival][out_from_arrival],
        inputs=fingerprint(row_ranks, pos, plan.cp_size, plan.doc_lens),
    )


def _all_to_all(x_nD, out_rows, out_splits, in_splits, group) -> torch.Tensor:
    send = to_wire(x_nD)
    recv = send.new_empty(out_rows, x_nD.shape[1])
    dist.all_to_all_single(recv, send, out_splits, in_splits, group=group)
    return recv.to(x_nD.dtype)


def _forward(x_nD: torch.Tensor, rp: RoutePlan, group: dist.ProcessGroup | None) -> torch.Tensor:
    send_nD = x_nD.index_select(0, rp.send_index.to(x_nD.device))
    arrived_kD = _all_to_all(send_nD, sum(rp.recv_counts), rp.recv_counts, rp.send_counts, group)
    return arrived_kD.index_select(0, rp.out_from_arrival.to(x_nD.device))


def _backward(grad_kD: torch.Tensor, rp: RoutePlan, group: dist.ProcessGroup | None):
    arrived_kD = torch.zeros_like(grad_kD).index_copy_(
        0, rp.out_from_arrival.to(grad_kD.device), grad_kD
    )
    back_nD = _all_to_all(arrived_kD, sum(rp.send_counts), rp.send_counts, rp.recv_counts, group)
    return torch.zeros_like(back_nD).index_copy_(0, rp.send_index.to(grad_kD.device), back_nD)


class _RouteRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_nD, rp, group):
        ctx.rp, ctx.group = rp, group
        return _forward(x_nD, rp, group)

    @staticmethod
    def backward(ctx, grad_kD):
        return _backward(grad_kD.contiguous(), ctx.rp, ctx.group), None, None


def route_to_owners(
    x_loc: torch.Tensor | Sequence[torch.Tensor],
    rp: RoutePlan,
    group: dist.ProcessGroup | None,
    *,
    step: StepAgreement | None = None,
) -> torch.Tensor | list[torch.Tensor]:
    """Send each row of ``x_loc`` to the owner of its position; return this rank's rows.

    Args:
        x_loc: rows this rank encoded, ``[n, D]`` in the order of ``route_plan`` (ascending global
            row), or a list of such tensors with the same rows and dtype (one collective).
        rp: ``route_plan(...)`` for this rank.
        group: the CP group.
        step: the CP step this routing belongs to (see ``StepAgreement``), if any.

    Returns ``[k, D]`` (a list if ``x_loc`` was a list): the rows of this rank's visual positions
    sorted by local index (``rp.local_positions``). In grad mode the transposed all-to-all runs in
    the backward on every rank, whether or not ``x_loc`` requires grad here. Before any row moves,
    the ranks agree (one small all-reduce) that their plans come from the same inputs and that
    widths and dtype match; a rank whose rows do not match its plan makes every rank raise.
    """
    op = "route_to_owners"
    facts, error = {}, None
    try:
        tensors, single = as_tensor_list(x_loc, op)
        if dist.get_rank(group) != rp.cp_rank:
            raise ValueError(
                f"{op}: the plan is for cp_rank {rp.cp_rank}, this is group rank "
                f"{dist.get_rank(group)}"
            )
        if len(rp.send_counts) != dist.get_world_size(group):
            raise ValueError(
                f"{op}: the plan is for {len(rp.send_counts)} ranks, the group has "
                f"{dist.get_world_size(group)}"
            )
        check_rows(tensors, int(rp.send_index.numel()), op, "the route plan")
        facts = {
            "route inputs (row ranks, row positions, plan)": rp.inputs,
            "widths": tuple(t.shape[1] for t in tensors),
        }
        facts["dtype"] = tensors[0].dtype
    except ValueError as err:
        error = str(err)
    agree(op, group, facts, error=error, step=step)
    packed_nD, dims = pack_features(tensors)
    if torch.is_grad_enabled() and packed_nD.is_floating_point():
        packed_nD = ensure_requires_grad_for_cp_collective(packed_nD)
        out_kD = _RouteRows.apply(packed_nD, rp, group)
    else:
        out_kD = _forward(packed_nD, rp, group)
    parts = unpack_features(out_kD, dims)
    return parts[0] if single else parts
