"""The router load-balancing loss from CP-summed statistics: the shares of real gloo ranks add up to
the one-process loss of the whole batch, and so do their gradients, with uneven shards, a rank
holding no token, padding, and a batch without a valid token.

The reference is an independent float64 transcription of transformers' load_balancing_loss_func
(cpvlm.verify.reference). float64: the ranks sum the same terms in another order, so 1e-12.
"""

import pytest
import torch
import torch.distributed as dist

from cpvlm.router_loss import load_balancing_loss, load_balancing_loss_share
from cpvlm.testing import rel_err, run_distributed
from cpvlm.verify.moe_reference import switch_load_balancing_loss

E, K, LAYERS = 6, 2, 3


def _batch(n_tokens: int, masked_out: float):
    g = torch.Generator().manual_seed(7)
    logits = [torch.randn(n_tokens, E, generator=g, dtype=torch.float64) * 2 for _ in range(LAYERS)]
    keep = torch.rand(n_tokens, generator=g) >= masked_out
    return logits, keep


def _shares(rank, world_size, splits, masked_out):
    logits, keep = _batch(sum(splits), masked_out)
    start = sum(splits[:rank])
    mine = slice(start, start + splits[rank])
    local = [t[mine].clone().requires_grad_(True) for t in logits]
    share = load_balancing_loss_share(local, keep[mine], top_k=K, group=dist.group.WORLD)
    share.backward()
    total = share.detach().clone()
    dist.all_reduce(total)
    return total, [t.grad for t in local]


@pytest.mark.parametrize(
    "splits, masked_out",
    [([37], 0.2), ([20, 17], 0.2), ([9, 0, 15], 0.3), ([5, 11, 0, 8], 0.0), ([4, 3], 1.0)],
)
def test_shares_sum_to_the_one_process_loss_and_gradients(splits, masked_out):
    logits, keep = _batch(sum(splits), masked_out)
    full = [t.clone().requires_grad_(True) for t in logits]
    if keep.any():
        expected = switch_load_balancing_loss(full, keep, E, K)
    else:  # transformers divides 0 by 0 here; the CP loss is 0 with a zero gradient
        expected = sum(t.sum() for t in full) * 0
    expected.backward()
    assert rel_err(load_balancing_loss(logits, keep, top_k=K), expected) <= 1e-12
    per_rank = run_distributed(_shares, len(splits), splits, masked_out)
    total = per_rank[0][0]
    assert rel_err(total, expected.detach()) <= 1e-12
    for layer in range(LAYERS):
        grads = torch.cat([r[1][layer] for r in per_rank])
        assert rel_err(grads, full[layer].grad) <= 1e-12
        assert torch.isfinite(grads).all()
    if masked_out == 1.0:
        assert total == 0 and all(g.abs().max() == 0 for r in per_rank for g in r[1])


def test_the_per_shard_loss_is_another_number():
    """What the model's own loss function gives on each shard, averaged: not the batch's loss."""
    logits, keep = _batch(40, 0.1)
    whole = load_balancing_loss(logits, keep, top_k=K)
    halves = [slice(0, 13), slice(13, 40)]
    per_shard = sum(load_balancing_loss([t[h] for t in logits], keep[h], top_k=K) for h in halves)
    assert rel_err(per_shard / 2, whole) > 1e-3


def test_bad_router_logits_are_named():
    logits, keep = _batch(10, 0.0)
    with pytest.raises(ValueError, match="returned no router logits"):
        load_balancing_loss([], keep, top_k=K)
    with pytest.raises(ValueError, match=r"MoE layer 1 have shape \(9, 6\); expected \[10, 6\]"):
        load_balancing_loss([logits[0], logits[1][:9]], keep, top_k=K)
