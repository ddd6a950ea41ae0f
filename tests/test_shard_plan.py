"""ShardPlan layout, padding, sharding and batch handling, in one process."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cpvlm import ShardPlan, pad_and_shard
from cpvlm.distributed import PAD_DOC, compat


def causal_pairs_per_rank_and_doc(plan):
    """[cp, docs] number of causal (q, k) pairs each rank attends within each document."""
    pairs = torch.zeros(plan.cp_size, len(plan.doc_lens), dtype=torch.long)
    for r in range(plan.cp_size):
        idx = plan.indices(r)
        doc = plan.doc_ids[idx]
        for d in range(len(plan.doc_lens)):
            q = idx[doc == d]
            keys = torch.nonzero(plan.doc_ids == d).squeeze(1)
            pairs[r, d] = (keys[None, :] <= q[:, None]).sum()
    return pairs


doc_mixes = st.integers(1, 8).flatmap(
    lambda cp: st.tuples(st.just(cp), st.lists(st.integers(1, 40), min_size=1, max_size=6))
)


@pytest.mark.parametrize("cp", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("seq_len", [16, 48, 96, 160])
def test_single_sequence_matches_torch_head_tail_balancer(cp, seq_len):
    plan = ShardPlan(seq_len, cp)
    expected = compat.torch_head_tail_indices(plan.padded_len, cp)
    if expected is None:
        pytest.skip("this torch has no private _HeadTailLoadBalancer to compare with")
    got = torch.stack([plan.indices(r) for r in range(cp)])
    assert torch.equal(got, expected)


def test_documents_are_padded_and_split_head_tail_each():
    plan = ShardPlan(10, 2, doc_lens=[3, 7])
    assert plan.padded_doc_lens == (4, 8) and plan.padded_len == 12 and plan.local_len == 6
    # doc 0 occupies [0, 4) (chunk size 1), doc 1 occupies [4, 12) (chunk size 2)
    assert plan.indices(0).tolist() == [0, 3, 4, 5, 10, 11]
    assert plan.indices(1).tolist() == [1, 2, 6, 7, 8, 9]
    assert plan.doc_ids.tolist() == [0, 0, 0, PAD_DOC, 1, 1, 1, 1, 1, 1, 1, PAD_DOC]
    assert plan.owners.tolist() == [0, 1, 1, 0, 0, 0, 1, 1, 1, 1, 0, 0]
    assert plan.source_index.tolist() == [0, 1, 2, -1, 3, 4, 5, 6, 7, 8, 9, -1]


@settings(max_examples=150, deadline=None)
@given(doc_mixes)
def test_indices_partition_and_causal_work_is_balanced_per_document(mix):
    cp, doc_lens = mix
    plan = ShardPlan(sum(doc_lens), cp, doc_lens=doc_lens)
    all_idx = torch.cat([plan.indices(r) for r in range(cp)])
    assert torch.equal(all_idx.sort().values, torch.arange(plan.padded_len))
    assert all(len(plan.indices(r)) == plan.local_len for r in range(cp))
    for r in range(cp):
        assert (plan.owners[plan.indices(r)] == r).all()
        assert torch.equal(plan.local_index[plan.indices(r)], torch.arange(plan.local_len))
    assert int((~plan.is_padding).sum()) == plan.seq_len
    for d, (n, p) in enumerate(zip(plan.doc_lens, plan.padded_doc_lens)):
        assert p % (2 * cp) == 0 and n <= p < n + 2 * cp
        assert int((plan.doc_ids == d).sum()) == n
    pairs = causal_pairs_per_rank_and_doc(plan)
    # Padding sits at the end of each document, so balance is exact on the padded documents;
    # on real tokens it is exact whenever a document needs no padding.
    for d, (n, p) in enumerate(zip(plan.doc_lens, plan.padded_doc_lens)):
        if n == p:
            assert (pairs[:, d] == pairs[0, d]).all(), (d, pairs[:, d])
    assert pairs.sum() == sum(n * (n + 1) // 2 for n in doc_lens)


@settings(max_examples=100, deadline=None)
@given(doc_mixes.map(lambda m: (m[0], [2 * m[0] * k for k in m[1]])))
def test_causal_work_equal_across_ranks_for_every_document(mix):
    cp, doc_lens = mix
    plan = ShardPlan(sum(doc_lens), cp, doc_lens=doc_lens)
    pairs = causal_pairs_per_rank_and_doc(plan)
    assert (pairs == pairs[0:1]).all()


@settings(max_examples=60, deadline=None)
@given(doc_mixes, st.sampled_from([0, 1, 2, -1, -2]))
def test_pad_shard_roundtrip_any_seq_dim(mix, seq_dim):
    cp, doc_lens = mix
    plan = ShardPlan(sum(doc_lens), cp, doc_lens=doc_lens)
    shape = [2, 3, 2]
    shape[seq_dim] = plan.seq_len
    x = torch.randn(shape)
    padded = plan.pad(x, seq_dim=seq_dim, value=7.0)
    assert padded.shape[seq_dim] == plan.padded_len
    assert torch.equal(plan.unpad(padded, seq_dim=seq_dim), x)
    pad_rows = padded.movedim(seq_dim, 0)[plan.is_padding]
    assert (pad_rows == 7.0).all()
    shards = [plan.shard(padded, r, seq_dim=seq_dim) for r in range(cp)]
    rebuilt = torch.empty_like(padded).movedim(seq_dim, 0)
    for r, s in enumerate(shards):
        rebuilt[plan.indices(r)] = s.movedim(seq_dim, 0)
    assert torch.equal(rebuilt.movedim(0, seq_dim), padded)


@pytest.mark.parametrize(
    "dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.bool]
)
def test_pad_and_shard_keep_dtype(dtype):
    plan = ShardPlan(9, 2, doc_lens=[4, 5])
    x = (torch.arange(18).reshape(2, 9) % 3).to(dtype)
    s = plan.shard(plan.pad(x, value=1), 1)
    assert s.dtype == dtype and s.shape == (2, plan.local_len)
    assert torch.equal(s, plan.pad(x, value=1)[:, plan.indices(1)])


def test_shard_backward_puts_gradient_at_the_rank_positions_only():
    plan = ShardPlan(11, 3, doc_lens=[5, 6])
    x = torch.randn(2, plan.seq_len, 4, dtype=torch.float64, requires_grad=True)
    padded = plan.pad(x)
    for r in range(3):
        g = torch.randn(2, plan.local_len, 4, dtype=torch.float64)
        (grad,) = torch.autograd.grad(plan.shard(padded, r), x, g, retain_graph=True)
        expected = torch.zeros(2, plan.padded_len, 4, dtype=torch.float64)
        expected[:, plan.indices(r)] = g
        assert torch.equal(grad, expected[:, ~plan.is_padding])


def test_sharded_embedding_gradients_sum_to_the_full_gradient():
    """The in-place failure mode cannot happen: sharding a grad-carrying embedding output."""
    emb = torch.nn.Embedding(50, 8, dtype=torch.float64)
    ids = torch.randint(0, 50, (2, 13))
    w = torch.randn(2, 13, 8, dtype=torch.float64)
    (emb(ids) * w).tanh().sum().backward()
    expected = emb.weight.grad.clone()
    emb.weight.grad = None
    plan = ShardPlan(13, 4)
    w_pad = plan.pad(w)
    for r in range(4):
        embeds = emb(ids)
        assert embeds.requires_grad
        loc = plan.shard(plan.pad(embeds), r)
        (loc * plan.shard(w_pad, r)).tanh().sum().backward()
    err = (emb.weight.grad - expected).abs().max() / expected.abs().max()
    assert err <= 1e-12


def test_pad_and_shard_batch():
    plan = ShardPlan(7, 2, doc_lens=[3, 4])
    ids = torch.arange(14).reshape(2, 7)
    batch = {
        "input_ids": ids,
        "labels": ids.clone(),
        "attention_mask": torch.ones(2, 7, dtype=torch.bool),
        "padding_mask": torch.zeros(2, 7, dtype=torch.bool),
        "position_ids": torch.arange(7).expand(3, 2, 7),
        "inputs_embeds": torch.randn(2, 7, 5),
        "pixel_values": torch.randn(7, 12),
        "image_grid_thw": torch.tensor([[1, 2, 2]]),
        "extra": torch.randn(2, 7, 3),
        "note": "kept",
    }
    out = pad_and_shard(batch, plan, 1, seq_dims={"extra": 1})
    idx = plan.indices(1)
    pad = plan.is_padding[idx]
    assert out["input_ids"].shape == (2, plan.local_len)
    assert (out["labels"][:, pad] == -100).all() and (out["input_ids"][:, pad] == 0).all()
    assert (out["padding_mask"][:, pad]).all() and not out["padding_mask"][:, ~pad].any()
    assert not out["attention_mask"][:, pad].any() and out["attention_mask"][:, ~pad].all()
    assert out["position_ids"].shape == (3, 2, plan.local_len)
    assert out["inputs_embeds"].shape == (2, plan.local_len, 5)
    assert out["extra"].shape == (2, plan.local_len, 3)
    assert out["pixel_values"] is batch["pixel_values"] and out["note"] == "kept"
    real = plan.source_index[idx][~pad]
    assert torch.equal(out["input_ids"][:, ~pad], ids[:, real])
    assert torch.equal(out["position_ids"][:, :, ~pad], batch["position_ids"][:, :, real])


def test_pad_and_shard_rejects_unknown_sequence_tensors():
    plan = ShardPlan(7, 2)
    with pytest.raises(ValueError, match=r"unknown key 'extra'.*seq_len=7.*seq_dims"):
        pad_and_shard({"extra": torch.zeros(2, 7)}, plan, 0)
    assert "extra" in pad_and_shard({"extra": torch.zeros(2, 7)}, plan, 0, seq_dims={"extra": None})
    with pytest.raises(ValueError, match="length 6 along seq_dim 1, expected the plan's seq_len 7"):
        pad_and_shard({"input_ids": torch.zeros(2, 6)}, plan, 0)


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: ShardPlan(8, 0), "cp_size must be a positive int"),
        (lambda: ShardPlan(0, 2), "seq_len must be a positive int"),
        (lambda: ShardPlan(8, 2, doc_lens=[3, 4]), "doc_lens sum to 7 but seq_len is 8"),
        (lambda: ShardPlan(8, 2, doc_lens=[8, 0]), r"doc_lens\[1\] = 0"),
        (lambda: ShardPlan(8, 2).shard(torch.zeros(1, 9), 0), "length 9 along seq_dim 1"),
        (lambda: ShardPlan(6, 2).shard(torch.zeros(1, 6), 0), "padded_len 8"),
        (lambda: ShardPlan(8, 2).indices(2), "cp_rank 2 is outside the CP group of 2 ranks"),
        (lambda: ShardPlan(8, 2).indices(-1), "cp_rank -1 is outside"),
        (lambda: ShardPlan(8, 2).pad(torch.zeros(8), seq_dim=1), "seq_dim 1 is out of range"),
    ],
)
def test_bad_input_names_the_problem(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_locate_gives_owner_and_flattened_local_index():
    plan = ShardPlan(23, 3, doc_lens=[5, 11, 7])
    batch = 2
    pos = torch.arange(batch * plan.padded_len)
    owner, local = plan.locate(pos)
    for flat in pos.tolist():
        b, p = divmod(flat, plan.padded_len)
        r = int(owner[flat])
        i = int(local[flat]) - b * plan.local_len
        assert 0 <= i < plan.local_len and int(plan.indices(r)[i]) == p
