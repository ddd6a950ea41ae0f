"""The block schedule: exact coverage of the mask, and the work the head-tail layout predicts."""

import torch
import torch.distributed as dist
from attn_cases import dense_mask
from hypothesis import given, settings
from hypothesis import strategies as st

from cpvlm import ShardPlan
from cpvlm.attention import attention_schedule, cp_attention
from cpvlm.attention.schedule import CAUSAL, FULL, MASKED
from cpvlm.distributed import compat
from cpvlm.testing import run_distributed


def _coverage(plan, causal):
    """[P, P] count of how many calls compute each (query, key) pair as visible."""
    schedule = attention_schedule(plan, causal)
    w = plan.cp_size
    count = torch.zeros(plan.padded_len, plan.padded_len, dtype=torch.long)
    for r in range(w):
        for i in range(w):
            s = (r - i) % w
            for seg in schedule.segments(r, i):
                rows, cols = plan.indices(r)[seg.rows], plan.indices(s)[seg.cols]
                shape = (len(rows), len(cols))
                if seg.kind == FULL:
                    seen = torch.ones(shape, dtype=torch.long)
                elif seg.kind == CAUSAL:
                    seen = torch.ones(shape, dtype=torch.long).tril()
                else:
                    seen = seg.visible.long()
                count[rows[:, None], cols[None, :]] += seen
    return count


@settings(max_examples=60, deadline=None)
@given(
    cp=st.integers(1, 4),
    doc_lens=st.lists(st.integers(1, 70), min_size=1, max_size=5),
    causal=st.booleans(),
)
def test_schedule_computes_every_visible_pair_exactly_once_and_nothing_else(cp, doc_lens, causal):
    plan = ShardPlan(sum(doc_lens), cp, doc_lens=doc_lens)
    assert torch.equal(_coverage(plan, causal), dense_mask(plan, causal).long())


def test_schedule_uses_fused_calls_for_long_documents_and_groups_tiny_ones():
    long_docs = attention_schedule(ShardPlan(700, 2, doc_lens=[300, 400]), True)
    kinds = {seg.kind for r in range(2) for block in long_docs.steps[r] for seg in block}
    assert kinds == {FULL, CAUSAL}
    # 128 documents of 3 tokens: one call per document and block would be 128 calls per block.
    tiny = attention_schedule(ShardPlan(384, 2, doc_lens=[3] * 128), True)
    for r in range(2):
        assert tiny.kernel_calls(r) <= 4
        assert all(seg.kind == MASKED for block in tiny.steps[r] for seg in block)


def _count_kernel_calls(rank, world_size, seq_len):
    """Run cp_attention forward and backward, recording every fused kernel call's shape."""
    return {impl: _count_impl(rank, seq_len, impl, world_size) for impl in ("ring", "allgather")}


def _count_impl(rank, seq_len, impl, world_size):
    calls = {"fwd": [], "bwd": []}
    forward, backward = compat.cpu_flash_forward, compat.cpu_flash_backward

    def counting_forward(q, k, v, *, causal, scale, mask=None):
        calls["fwd"].append((q.shape[2], k.shape[2], causal, mask is not None))
        return forward(q, k, v, causal=causal, scale=scale, mask=mask)

    def counting_backward(dout, q, k, v, out, lse, *, causal, scale, mask=None):
        calls["bwd"].append((q.shape[2], k.shape[2], causal, mask is not None))
        return backward(dout, q, k, v, out, lse, causal=causal, scale=scale, mask=mask)

    compat.cpu_flash_forward, compat.cpu_flash_backward = counting_forward, counting_backward
    try:
        plan = ShardPlan(seq_len, world_size)
        q, k, v = (torch.randn(1, 2, plan.local_len, 8, requires_grad=True) for _ in range(3))
        out = cp_attention(q, k, v, plan=plan, cp_rank=rank, group=dist.group.WORLD, impl=impl)
        out.sum().backward()
    finally:
        compat.cpu_flash_forward, compat.cpu_flash_backward = forward, backward
    return calls


def test_causal_single_sequence_at_cp4_computes_what_head_tail_predicts():
    w, seq_len = 4, 128
    c = seq_len // (2 * w)
    results = run_distributed(_count_kernel_calls, w, seq_len)
    plan = ShardPlan(seq_len, w)
    mask = dense_mask(plan, True)
    for r, calls in ((r, res[impl]) for r, res in enumerate(results) for impl in res):
        # Head-tail prediction for rank r, one fused call per ring step:
        #   own block: chunks (r, t) x (r, t), one top-left causal 2c x 2c square;
        #   a block of rank s < r: both query chunks x chunk s only (2c x c), full;
        #   a block of rank s > r: query chunk t only x both chunks of s (c x 2c), full.
        predicted = sorted(
            [(2 * c, 2 * c, True, False)]
            + [(2 * c, c, False, False)] * r
            + [(c, 2 * c, False, False)] * (w - 1 - r)
        )
        assert sorted(calls["fwd"]) == predicted
        assert sorted(calls["bwd"]) == predicted
        # The pairs those calls compute are exactly the visible pairs of the rank's queries:
        # 2*w*c^2 + c, half of the 4*w*c^2 a ring without skipping would compute.
        computed = sum(
            lq * (lq + 1) // 2 if causal else lq * lk for lq, lk, causal, _ in calls["fwd"]
        )
        visible = int(mask[plan.indices(r)].sum())
        assert computed == visible == 2 * w * c * c + c
