"""gather_embeddings on real gloo ranks: values, per-rank gradients, empty ranks, dtypes."""

import re

import pytest
import torch
import torch.distributed as dist

from cpvlm.distributed.collectives import all_gather_dim0
from cpvlm.encoders import gather_embeddings
from cpvlm.testing import rel_err, run_distributed

WIDTHS = (5, 3, 2)  # main embeddings + two deepstack levels, gathered in one collective


def _rows(rank, count, dtype):
    g = torch.Generator().manual_seed(100 + rank)
    return [torch.randn(count, d, generator=g, dtype=torch.float64).to(dtype) for d in WIDTHS]


def _upstream(rank, total):
    """Rank-dependent upstream gradients: rank r's loss is sum_i <gathered_i, G_r,i>."""
    g = torch.Generator().manual_seed(7 + rank)
    return [torch.randn(total, d, generator=g, dtype=torch.float64) for d in WIDTHS]


def _gather_and_backward(rank, world_size, counts, dtype=torch.float64, gather=None):
    gather = gather or gather_embeddings
    xs = [x.requires_grad_() for x in _rows(rank, counts[rank], dtype)]
    out = gather(xs, counts, dist.group.WORLD)
    loss = sum((o.double() * g).sum() for o, g in zip(out, _upstream(rank, sum(counts))))
    loss.backward()
    return [o.detach() for o in out], [x.grad for x in xs]


def _expected(counts, dtype=torch.float64):
    rows = [_rows(r, n, dtype) for r, n in enumerate(counts)]
    full = [torch.cat([rows[r][i] for r in range(len(counts))]) for i in range(len(WIDTHS))]
    grad_sum = [sum(_upstream(r, sum(counts))[i] for r in range(len(counts))) for i in range(3)]
    starts = [sum(counts[:r]) for r in range(len(counts))]
    grads = [[g[s : s + n] for g in grad_sum] for s, n in zip(starts, counts)]
    return full, grads


COUNTS = [[3], [2, 4], [0, 3, 1], [2, 0, 0, 5], [0, 0, 0, 0], [0, 0, 6]]


@pytest.mark.parametrize("counts", COUNTS, ids=str)
def test_gather_values_and_per_rank_gradients(counts):
    results = run_distributed(_gather_and_backward, len(counts), counts)
    full, grads = _expected(counts)
    for rank, (out, grad) in enumerate(results):
        for o, f in zip(out, full):
            assert torch.equal(o, f)  # a gather moves values bit for bit
        # Each rank's gradient is the sum over ranks of the upstream gradients of its slice:
        # float64 sums of up to 4 terms in the same order differ only by round-off.
        for g, e in zip(grad, grads[rank]):
            assert g.shape == e.shape
            assert rel_err(g, e) <= 1e-12


class _LocalSliceBackward(torch.autograd.Function):
    """The bug of the field: all-gather forward, backward keeps only this rank's slice."""

    @staticmethod
    def forward(ctx, x, counts, rank):
        ctx.start, ctx.n = sum(counts[:rank]), counts[rank]
        m = max(counts)
        padded = torch.cat([x, x.new_zeros(m - x.shape[0], x.shape[1])])
        gathered = all_gather_dim0(padded, dist.group.WORLD).view(len(counts), m, -1)
        return torch.cat([gathered[r, :n] for r, n in enumerate(counts)])

    @staticmethod
    def backward(ctx, grad):
        return grad[ctx.start : ctx.start + ctx.n], None, None


def _local_slice_gather(xs, counts, group):
    rank = dist.get_rank(group)
    widths = [x.shape[1] for x in xs]
    out = _LocalSliceBackward.apply(torch.cat(xs, 1), counts, rank)
    return list(out.split(widths, 1))


def test_the_per_rank_gradient_check_catches_a_local_slice_backward():
    counts = [2, 3, 1]
    results = run_distributed(_gather_and_backward, 3, counts, gather=_local_slice_gather)
    full, grads = _expected(counts)
    for rank, (out, grad) in enumerate(results):
        assert all(torch.equal(o, f) for o, f in zip(out, full))  # forward is right...
        assert rel_err(grad[0], grads[rank][0]) > 0.1  # ...but the gradient is not.


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
def test_empty_rank_placeholders_in_every_dtype(dtype):
    counts = [0, 3, 0, 2]
    results = run_distributed(_gather_and_backward, 4, counts, dtype)
    full, grads = _expected(counts, dtype)
    for rank, (out, grad) in enumerate(results):
        assert all(o.dtype == dtype and torch.equal(o, f) for o, f in zip(out, full))
        # Gradients are reduce-scattered in `dtype`: 4 terms of |G| ~ 3, rounded to its epsilon.
        tol = {torch.float64: 1e-12, torch.float32: 1e-6}.get(dtype, 2e-2)
        for g, e in zip(grad, grads[rank]):
            assert g.dtype == dtype and rel_err(g, e) <= tol


def _gather_frozen_and_no_grad(rank, world_size, counts):
    xs = _rows(rank, counts[rank], torch.float64)  # nothing requires grad: a frozen tower
    out = gather_embeddings(xs, counts, dist.group.WORLD)
    # The output requires grad on every rank (grad mode decides), so every rank runs backward.
    assert all(o.requires_grad for o in out)
    sum(o.sum() for o in out).backward()
    with torch.no_grad():
        evaluated = gather_embeddings(xs, counts, dist.group.WORLD)
    assert not any(o.requires_grad for o in evaluated)
    return [o.detach() for o in out], evaluated


def test_frozen_inputs_and_no_grad():
    counts = [0, 2, 3]
    full, _ = _expected(counts)
    for out, evaluated in run_distributed(_gather_frozen_and_no_grad, 3, counts):
        assert all(torch.equal(o, f) for o, f in zip(out, full))
        assert all(torch.equal(o, f) for o, f in zip(evaluated, full))


def _gather_bad(rank, world_size, counts, rows):
    try:
        gather_embeddings(torch.zeros(rows, 2), counts, dist.group.WORLD)
    except ValueError as e:
        return str(e)
    return None


@pytest.mark.parametrize(
    "counts, rows, message",
    [
        ([1, 1, 1], 1, "got 3 counts for a group of 2 ranks"),
        ([2, -1], 2, r"counts\[1\] = -1"),
        ([3, 3], 2, "tensor 0 has 2 rows but counts says 3 for this rank"),
    ],
)
def test_bad_counts_raise_on_every_rank(counts, rows, message):
    messages = run_distributed(_gather_bad, 2, counts, rows)
    assert all(m is not None and re.search(message, m) for m in messages), messages


def _gather_mixed_dtypes(rank, world_size):
    try:
        gather_embeddings(
            [torch.zeros(1, 2), torch.zeros(1, 2, dtype=torch.float64)], [1, 1], dist.group.WORLD
        )
    except ValueError as e:
        return str(e)
    return None


def test_tensors_of_different_dtypes_are_rejected_on_every_rank():
    messages = run_distributed(_gather_mixed_dtypes, 2)
    assert all(m and "must share dtype and device" in m for m in messages), messages
