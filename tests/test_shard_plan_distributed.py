"""ShardPlan.shard / unshard on real gloo ranks against one-process references."""

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

from cpvlm import ShardPlan
from cpvlm.testing import run_distributed


def _roundtrip(rank, world_size, doc_lens, seq_dim, dtype):
    plan = ShardPlan(sum(doc_lens), world_size, doc_lens=doc_lens)
    g = torch.Generator().manual_seed(1)
    shape = [2, 3, 2]
    shape[seq_dim] = plan.seq_len
    x = (torch.randn(shape, generator=g) * 4).to(dtype)
    padded = plan.pad(x, seq_dim=seq_dim)
    full = plan.unshard(
        plan.shard(padded, rank, seq_dim=seq_dim), dist.group.WORLD, seq_dim=seq_dim
    )
    return torch.equal(full, padded) and full.dtype == dtype


@settings(max_examples=25, deadline=None)
@given(
    cp=st.integers(1, 4),
    doc_lens=st.lists(st.integers(1, 30), min_size=1, max_size=4),
    seq_dim=st.sampled_from([0, 1, -1]),
)
def test_shard_then_unshard_returns_the_input(cp, doc_lens, seq_dim):
    assert all(run_distributed(_roundtrip, cp, doc_lens, seq_dim, torch.float64))


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int32, torch.bool]
)
def test_unshard_any_dtype(dtype):
    assert all(run_distributed(_roundtrip, 3, [5, 9, 2], 1, dtype))


def _embedding_grad_through_shard_and_unshard(rank, world_size, doc_lens):
    """Each rank: embed the full ids, shard, unshard, weight by a rank-dependent tensor."""
    torch.manual_seed(0)
    emb = torch.nn.Embedding(40, 6, dtype=torch.float64)
    seq_len = sum(doc_lens)
    ids = torch.randint(0, 40, (2, seq_len))
    plan = ShardPlan(seq_len, world_size, doc_lens=doc_lens)
    weights = [torch.randn(2, plan.padded_len, 6, dtype=torch.float64) for _ in range(world_size)]
    local = plan.shard(plan.pad(emb(ids)), rank)
    full = plan.unshard(local.sin(), dist.group.WORLD)
    # Rank r's loss term depends on every rank's shard through the gather.
    (full * weights[rank]).sum().backward()
    grad = emb.weight.grad.clone()
    dist.all_reduce(grad)
    return grad, [w.clone() for w in weights], ids


@pytest.mark.parametrize("world_size, doc_lens", [(1, [7]), (2, [9]), (3, [4, 11]), (4, [1, 6, 2])])
def test_gradients_through_unshard_match_one_process(world_size, doc_lens):
    results = run_distributed(_embedding_grad_through_shard_and_unshard, world_size, doc_lens)
    _, weights, ids = results[0]
    torch.manual_seed(0)
    emb = torch.nn.Embedding(40, 6, dtype=torch.float64)
    plan = ShardPlan(sum(doc_lens), world_size, doc_lens=doc_lens)
    # Reference: the sum over ranks of every rank's loss, on one process.
    padded = plan.pad(emb(ids)).sin()
    sum((padded * w).sum() for w in weights).backward()
    expected = emb.weight.grad
    for grad, _, _ in results:
        assert ((grad - expected).abs().max() / expected.abs().max()).item() <= 1e-12


def _unshard_with_wrong_group_size(rank, world_size):
    plan = ShardPlan(8, world_size + 1)
    plan.unshard(torch.zeros(1, plan.local_len), dist.group.WORLD)


def test_unshard_rejects_a_group_that_does_not_match_the_plan():
    from cpvlm.testing import DistributedTestError

    with pytest.raises(DistributedTestError, match="the group has 2 ranks but the plan has 3"):
        run_distributed(_unshard_with_wrong_group_size, 2)
