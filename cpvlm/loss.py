"""Global token-mean loss: exact under context and data parallelism, with padding and empty ranks.

Legend: S = sequence length (full, before sharding), V = vocabulary size, N = global valid count.

The loss of a training step is the mean cross-entropy over every valid label of the global batch
(all data-parallel ranks, all gradient-accumulation microbatches):

    L = (1 / N) * sum over valid labels l of CE(l)

Split it by who holds each label: a CP rank of a DP replica holds some labels of one microbatch
(possibly none), and its *share* is the sum of CE over those labels divided by the same global N.
The shares of all (dp, cp) ranks and microbatches add up to L, so the gradient of L is the SUM over
ranks and microbatches of the gradients of the shares. That is why the gradient sync
(cpvlm.parallelize) sums over dp x cp instead of averaging, and why N must be counted on the whole
batch before any share is computed: a per-rank mean (divide by the local count) weights a label by
how many labels happen to sit on its rank, and is 0/0 on a rank that holds none.

A rank whose share has no valid label still returns a tensor connected to its logits (value 0,
gradient 0): the backward of the model's collectives (attention, vision routing) must run there too.

At a real vocabulary the logits dominate memory (S_loc x V: 4 GiB per rank at 4k local tokens and
V = 152k in float32, and as much again for their gradient). ``chunked_token_mean_loss`` takes the
hidden states and the output projection instead and never holds more than one chunk of rows'
logits: the forward keeps only each row's log-sum-exp, the backward recomputes a chunk's logits,
turns them into the gradient (softmax - one-hot) and folds it into the hidden states' and the
weight's gradients before the next chunk. The same loss and gradients as the unchunked loss.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F

from cpvlm.constants import IGNORE_INDEX


def _check_logits_and_labels(op: str, logits_loc, labels_loc, num_valid, ignore_index):
    """Validate the common arguments; returns ``(num_valid as int, valid-label mask)``."""
    if not isinstance(logits_loc, torch.Tensor) or not logits_loc.is_floating_point():
        raise ValueError(f"{op}: logits_loc must be a floating-point tensor")
    return _check_labels(op, tuple(logits_loc.shape), labels_loc, num_valid, ignore_index)


def _check_labels(op: str, logits_shape: tuple, labels_loc, num_valid, ignore_index):
    _check_int_labels(f"{op}: labels_loc", labels_loc)
    if len(logits_shape) < 1 or logits_shape[:-1] != tuple(labels_loc.shape):
        raise ValueError(
            f"{op}: logits of shape {logits_shape} need labels of shape {logits_shape[:-1]} "
            f"(every dim but the vocabulary), got {tuple(labels_loc.shape)}"
        )
    if isinstance(num_valid, torch.Tensor):
        num_valid = int(num_valid.item())
    if isinstance(num_valid, bool) or not isinstance(num_valid, int) or num_valid < 0:
        raise ValueError(
            f"{op}: num_valid must be an int >= 0 (from count_valid_labels), got {num_valid!r}"
        )
    valid = labels_loc != ignore_index
    if num_valid == 0 and bool(valid.any()):
        raise ValueError(
            f"{op}: num_valid is 0 but this rank holds {int(valid.sum())} valid labels; "
            "count_valid_labels must see the labels of every microbatch of the step, summed over "
            "the DP group"
        )
    return num_valid, valid


def _check_int_labels(name: str, labels: object) -> torch.Tensor:
    if not isinstance(labels, torch.Tensor):
        raise ValueError(f"{name} must be a tensor, got {type(labels).__name__}")
    if labels.is_floating_point() or labels.is_complex() or labels.dtype == torch.bool:
        raise ValueError(f"{name} must be an integer tensor of class ids, got {labels.dtype}")
    return labels


def shift_labels(
    labels: torch.Tensor,
    *,
    doc_lens: Sequence[int] | torch.Tensor | None = None,
    ignore_index: int = IGNORE_INDEX,
) -> torch.Tensor:
    """Next-token targets from labels aligned with the input ids, on the full sequence.

    ``labels[..., t]`` is the label of input token t (Hugging Face convention: the input ids with
    the tokens that must not be learned set to ``ignore_index``). The result holds at position t the
    label of token t+1, which the logits at position t predict. The last token of every packed
    document gets ``ignore_index``: it must not learn to predict the first token of the next
    document, and after sharding no rank could tell where a document ends.

    Shift before padding and sharding (``pad_and_shard``): the target of a rank's last position
    usually lives on another rank.

    Args:
        labels: ``[..., S]`` integer labels, sequence last.
        doc_lens: lengths of the packed documents of every row (summing to S), as for ``ShardPlan``;
            ``None`` means one document.
        ignore_index: the label value that is not learned.

    Returns:
        ``[..., S]`` shifted labels (a new tensor).
    """
    labels = _check_int_labels("shift_labels: labels", labels)
    if labels.dim() < 1 or labels.shape[-1] < 1:
        raise ValueError(f"shift_labels: labels of shape {tuple(labels.shape)} have no tokens")
    seq_len = labels.shape[-1]
    if isinstance(doc_lens, torch.Tensor):
        doc_lens = doc_lens.tolist()
    doc_lens = (seq_len,) if doc_lens is None else tuple(doc_lens)
    for i, n in enumerate(doc_lens):
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(
                f"shift_labels: doc_lens[{i}] = {n!r}; every document needs >= 1 token"
            )
    if sum(doc_lens) != seq_len:
        raise ValueError(
            f"shift_labels: doc_lens {list(doc_lens)} sum to {sum(doc_lens)} but labels have "
            f"{seq_len} tokens (shape {tuple(labels.shape)}, sequence last)"
        )
    shifted = torch.cat(
        [labels[..., 1:], labels.new_full((*labels.shape[:-1], 1), ignore_index)], -1
    )
    doc_ends = torch.tensor(doc_lens, device=labels.device).cumsum(0) - 1
    return shifted.index_fill(-1, doc_ends, ignore_index)


def count_valid_labels(
    labels: torch.Tensor | Sequence[torch.Tensor],
    dp_group: dist.ProcessGroup | None = None,
    *,
    ignore_index: int = IGNORE_INDEX,
) -> int:
    """N: the number of valid labels of the global batch of one optimizer step.

    Pass the labels of *every* gradient-accumulation microbatch of the step (a list), so that each
    microbatch's loss is normalised by the step's count. Every CP rank of a DP replica holds the
    same full labels, so the count is summed over the DP group only; ``dp_group=None`` means no
    data parallelism (this process's labels are the whole batch). The count is the same whether the
    labels are padded or not (padding is ``ignore_index``).

    Counting the *sharded* labels instead, summed over the flattened dp x cp group, gives the same
    number: a ShardPlan gives every padded position to exactly one CP rank, so the shards of a
    replica partition its labels.

    Every rank of ``dp_group`` must call this (one all-reduce of one int64), with labels on the
    group's device. Returns a Python int, identical on every rank.
    """
    if isinstance(labels, torch.Tensor):
        labels = [labels]
    labels = list(labels)
    if not labels:
        raise ValueError(
            "count_valid_labels: got no labels; pass the labels of every microbatch of the step "
            "(a rank without data passes a tensor of ignore_index)"
        )
    for i, lab in enumerate(labels):
        _check_int_labels(f"count_valid_labels: labels[{i}]", lab)
    device = labels[0].device
    count = torch.stack([(lab != ignore_index).sum().to(device) for lab in labels]).sum()
    if dp_group is not None:
        dist.all_reduce(count, group=dp_group)
    return int(count.item())


def token_mean_loss(
    logits_loc: torch.Tensor,
    labels_loc: torch.Tensor,
    num_valid: int,
    *,
    ignore_index: int = IGNORE_INDEX,
) -> torch.Tensor:
    """This rank's share of the global token-mean cross-entropy: sum of CE over its valid labels / N.

    Computed in float32 when the logits are in a lower precision (float64 stays float64). The
    shares of all dp x cp ranks and microbatches sum to the step loss, and their gradients, summed
    by the gradient sync (``cpvlm.parallelize``: sum, no division), to its gradient. For logging,
    the step loss is the sum of the detached shares over the dp x cp group and the microbatches.

    A rank without valid labels gets exactly 0, connected to ``logits_loc`` with a zero gradient,
    so its backward collectives still run. Rows whose label is ``ignore_index`` never reach the
    softmax, so a non-finite logit there (a padding row) cannot turn the loss or the gradient of the
    logits into NaN; ``logits.sum() * 0`` would (0 * inf).

    A step with no valid label anywhere (``num_valid == 0``) returns 0 on every rank and every
    gradient is exactly 0: no NaN, and every rank still runs its collectives. The optimizer may
    still change weights (weight decay, momentum); skip its step when ``num_valid == 0``, a fact
    every rank agrees on.

    Args:
        logits_loc: ``[..., V]`` logits of this rank's positions.
        labels_loc: ``[...]`` shifted labels of the same positions (``ignore_index`` = no loss).
        num_valid: N from ``count_valid_labels``, the same on every rank.

    Returns:
        A 0-d tensor in the compute dtype.
    """
    num_valid, valid = _check_logits_and_labels(
        "token_mean_loss", logits_loc, labels_loc, num_valid, ignore_index
    )
    dtype = torch.promote_types(logits_loc.dtype, torch.float32)
    # Only the valid rows reach the softmax: ignored rows (padding, image tokens) cost no copy,
    # and a non-finite logit there cannot turn into a NaN gradient. With no valid row this is a
    # sum over nothing: 0, still connected to logits_loc.
    ce_sum = F.cross_entropy(logits_loc[valid].to(dtype), labels_loc[valid].long(), reduction="sum")
    return ce_sum / max(num_valid, 1)


# ---- chunked: the logits of one chunk of rows at a time -----------------------------------------


class _ChunkedCrossEntropy(torch.autograd.Function):
    """Sum of CE over the rows of ``h_ND`` (all valid), ``chunk`` rows of logits at a time.

    The logits of a chunk are computed as ``F.linear`` computes them in the caller's context (in
    autocast: in its dtype) and the softmax in float32 at least; the backward recomputes them in
    the same context and runs its matmuls in the logits' dtype, as autograd would.
    """

    @staticmethod
    def forward(ctx, h_ND, weight_VD, bias_V, labels_N, chunk):
        acc = torch.promote_types(h_ND.dtype, torch.float32)
        device = h_ND.device.type
        ctx.autocast = torch.is_autocast_enabled(device), torch.get_autocast_dtype(device)
        lse_N = h_ND.new_empty(h_ND.shape[0], dtype=acc)
        total = torch.zeros((), dtype=acc, device=h_ND.device)
        for start in range(0, h_ND.shape[0], chunk):
            rows = slice(start, start + chunk)
            logits_CV = F.linear(h_ND[rows], weight_VD, bias_V).to(acc)
            lse_N[rows] = torch.logsumexp(logits_CV, dim=-1)
            picked = logits_CV.gather(1, labels_N[rows, None]).squeeze(1)
            total += (lse_N[rows] - picked).sum()
        ctx.save_for_backward(h_ND, weight_VD, bias_V, labels_N, lse_N)
        ctx.chunk = chunk
        return total

    @staticmethod
    def backward(ctx, grad_total):
        h_ND, weight_VD, bias_V, labels_N, lse_N = ctx.saved_tensors
        acc = lse_N.dtype
        grad_h = torch.empty_like(h_ND) if ctx.needs_input_grad[0] else None
        # Weight and bias gradients add up over chunks in the accumulation dtype, rounded once.
        grad_w = torch.zeros_like(weight_VD, dtype=acc) if ctx.needs_input_grad[1] else None
        need_b = bias_V is not None and ctx.needs_input_grad[2]
        grad_b = torch.zeros_like(bias_V, dtype=acc) if need_b else None
        enabled, autocast_dtype = ctx.autocast
        for start in range(0, h_ND.shape[0], ctx.chunk):
            rows = slice(start, start + ctx.chunk)
            h_CD = h_ND[rows]
            with torch.autocast(h_ND.device.type, dtype=autocast_dtype, enabled=enabled):
                logits_CV = F.linear(h_CD, weight_VD, bias_V)
            compute = logits_CV.dtype
            # d CE / d logits = softmax - one-hot, times the upstream gradient.
            d_CV = torch.exp(logits_CV.to(acc) - lse_N[rows, None])
            d_CV.scatter_add_(1, labels_N[rows, None], d_CV.new_full((h_CD.shape[0], 1), -1.0))
            d_CV = (d_CV * grad_total).to(compute)
            if grad_h is not None:
                grad_h[rows] = d_CV @ weight_VD.to(compute)
            if grad_w is not None:
                grad_w += (d_CV.t() @ h_CD.to(compute)).to(acc)
            if grad_b is not None:
                grad_b += d_CV.sum(0).to(acc)
        grad_w = None if grad_w is None else grad_w.to(weight_VD.dtype)
        grad_b = None if grad_b is None else grad_b.to(bias_V.dtype)
        return grad_h, grad_w, grad_b, None, None


def chunked_token_mean_loss(
    hidden_loc: torch.Tensor,
    weight: torch.Tensor,
    labels_loc: torch.Tensor,
    num_valid: int,
    *,
    bias: torch.Tensor | None = None,
    chunk_size: int = 1024,
    ignore_index: int = IGNORE_INDEX,
) -> torch.Tensor:
    """``token_mean_loss(hidden_loc @ weight.T + bias, labels_loc, num_valid)`` without the logits.

    Only the valid rows are projected, ``chunk_size`` at a time; no ``[rows, V]`` tensor outlives
    its chunk, in the forward or the backward (which recomputes the chunk's logits). The loss and
    the gradients of ``hidden_loc``, ``weight`` and ``bias`` are those of the unchunked loss (the
    same terms; only the order of the sums over rows differs). Logits are computed in the hidden
    states' dtype and the softmax in float32 at least, as ``token_mean_loss`` does.

    Args:
        hidden_loc: ``[..., D]`` final hidden states of this rank's positions.
        weight: ``[V, D]`` output projection (``lm_head.weight``); ``bias``: ``[V]`` or None.
        labels_loc, num_valid, ignore_index: as for ``token_mean_loss``.
        chunk_size: rows per chunk: the peak holds about 3 x chunk_size x V floats.
    """
    op = "chunked_token_mean_loss"
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"{op}: chunk_size must be an int >= 1, got {chunk_size!r}")
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        raise ValueError(f"{op}: weight must be a [V, D] tensor")
    if not isinstance(hidden_loc, torch.Tensor) or hidden_loc.shape[-1:] != weight.shape[1:]:
        raise ValueError(
            f"{op}: hidden states of shape {tuple(getattr(hidden_loc, 'shape', ()))} do not fit "
            f"a weight of shape {tuple(weight.shape)} (the last dims must agree)"
        )
    logits_shape = (*hidden_loc.shape[:-1], weight.shape[0])
    num_valid, valid = _check_labels(op, logits_shape, labels_loc, num_valid, ignore_index)
    h_ND = hidden_loc[valid]
    ce_sum = _ChunkedCrossEntropy.apply(h_ND, weight, bias, labels_loc[valid].long(), chunk_size)
    return ce_sum / max(num_valid, 1)
