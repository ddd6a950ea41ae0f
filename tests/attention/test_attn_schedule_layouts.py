"""The block schedule of the balanced layout and of merged plans covers the mask exactly."""

import torch
from attn_cases import real_mask
from hypothesis import given, settings
from hypothesis import strategies as st
from test_attn_schedule import _coverage

from cpvlm import ShardPlan


@settings(max_examples=30, deadline=None)
@given(
    cp=st.sampled_from([1, 2, 3, 4, 6, 8]),
    doc_lens=st.lists(st.integers(1, 70), min_size=1, max_size=8),
    causal=st.booleans(),
    layout=st.sampled_from(["head_tail", "balanced"]),
    data=st.data(),
)
def test_schedule_of_any_layout_and_merged_view_computes_every_visible_pair_once(
    cp, doc_lens, causal, layout, data
):
    plan = ShardPlan(sum(doc_lens), cp, doc_lens=doc_lens, layout=layout)
    u = data.draw(st.sampled_from([u for u in range(1, cp + 1) if cp % u == 0]))
    real = plan.padded_index
    expected = torch.zeros(plan.padded_len, plan.padded_len, dtype=torch.long)
    expected[real[:, None], real[None, :]] = real_mask(doc_lens, causal).long()
    for p in (plan, plan.merge_ranks(u)):
        assert torch.equal(_coverage(p, causal), expected), (p, u)
