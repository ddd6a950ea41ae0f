"""All-gather of encoder rows with uneven per-rank counts; backward is a reduce-scatter.

Legend: W ranks, n_r rows on rank r (``counts[r]``, known on every rank), M = max n_r,
N = sum n_r, D packed feature width.

Every rank uses every gathered row, so the gradient of rank r's rows is the sum over ranks of the
gradient of those rows: a reduce-scatter. Keeping only the local slice of the gradient (what some
public frameworks shipped) silently drops the other ranks' contributions to the encoder.
gloo has no uneven all-gather, so each rank pads to M rows and the padding is trimmed.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from cpvlm.distributed.collectives import (
    StepAgreement,
    agree,
    all_gather_dim0,
    ensure_requires_grad_for_cp_collective,
    reduce_scatter_dim0,
)
from cpvlm.encoders._pack import (
    as_tensor_list,
    check_counts,
    check_rows,
    pack_features,
    unpack_features,
)


def _real_rows(counts: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """Positions of the real rows in the padded ``[W*M]`` gather, in rank order."""
    m = max(counts, default=0)
    parts = [torch.arange(r * m, r * m + n) for r, n in enumerate(counts)]
    return torch.cat(parts).to(device)


def _forward(
    x_nD: torch.Tensor, counts: tuple[int, ...], group: dist.ProcessGroup | None
) -> torch.Tensor:
    m = max(counts)
    padded_MD = torch.cat([x_nD, x_nD.new_zeros(m - x_nD.shape[0], x_nD.shape[1])])
    gathered_WMD = all_gather_dim0(padded_MD, group)
    return gathered_WMD.index_select(0, _real_rows(counts, x_nD.device))


def _backward(
    grad_ND: torch.Tensor, counts: tuple[int, ...], rank: int, group: dist.ProcessGroup | None
) -> torch.Tensor:
    m = max(counts)
    padded_WMD = grad_ND.new_zeros(len(counts) * m, grad_ND.shape[1])
    padded_WMD.index_copy_(0, _real_rows(counts, grad_ND.device), grad_ND)
    return reduce_scatter_dim0(padded_WMD, group)[: counts[rank]]


class _GatherRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_nD, counts, rank, group):
        ctx.counts, ctx.rank, ctx.group = counts, rank, group
        return _forward(x_nD, counts, group)

    @staticmethod
    def backward(ctx, grad_ND):
        return _backward(grad_ND.contiguous(), ctx.counts, ctx.rank, ctx.group), None, None, None


def gather_embeddings(
    x_loc: torch.Tensor | Sequence[torch.Tensor],
    counts: Sequence[int] | torch.Tensor,
    group: dist.ProcessGroup | None,
    *,
    step: StepAgreement | None = None,
) -> torch.Tensor | list[torch.Tensor]:
    """Rows of every rank in rank order, on every rank.

    Args:
        x_loc: this rank's rows ``[counts[rank], D]`` (``[0, D]`` of the real dtype on a rank
            without rows), or a list of such tensors (main embeddings, deepstack levels) with the
            same rows and dtype: they travel packed in one collective.
        counts: rows of every rank, identical on every rank.
        group: the CP group.
        step: the CP step this gather belongs to (see ``StepAgreement``), if any.

    Returns a tensor ``[sum(counts), D]`` (a list if ``x_loc`` was a list). In grad mode the
    backward reduce-scatter runs on every rank, whether or not ``x_loc`` requires grad here.
    Before any row moves, the ranks agree (one small all-reduce) on the counts, widths and dtype;
    a rank whose rows do not match ``counts`` makes every rank raise the same error.
    """
    op = "gather_embeddings"
    rank, facts, error = dist.get_rank(group), {}, None
    try:
        tensors, single = as_tensor_list(x_loc, op)
        counts = check_counts(counts, dist.get_world_size(group), op)
        check_rows(tensors, counts[rank], op, "counts")
        facts = {"counts": counts, "widths": tuple(t.shape[1] for t in tensors)}
        facts["dtype"] = tensors[0].dtype
    except ValueError as err:
        error = str(err)
    agree(op, group, facts, error=error, step=step)
    packed_nD, dims = pack_features(tensors)
    if torch.is_grad_enabled() and packed_nD.is_floating_point():
        packed_nD = ensure_requires_grad_for_cp_collective(packed_nD)
        out_ND = _GatherRows.apply(packed_nD, counts, rank, group)
    else:
        out_ND = _forward(packed_nD, counts, group)
    parts = unpack_features(out_ND, dims)
    return parts[0] if single else parts
