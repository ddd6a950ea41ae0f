"""split_assignment and ShardPlan.contiguous: which units are sharded, where the cuts go (no
processes). The exactness of running the tower on the pieces is tests/vision/test_vision_split.py.
"""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cpvlm import ShardPlan
from cpvlm.encoders import assign_units, vision_units
from cpvlm.encoders.split_assign import split_assignment
from cpvlm.testing.vision_cases import PUBLISHED_TOWERS, SPLIT_MIX


def _qwen3_8b_cost():
    transformers = pytest.importorskip("transformers")
    from cpvlm.hf.vision_cost import vision_cost

    model_type, vc = PUBLISHED_TOWERS["Qwen3-VL-8B"]
    return vision_cost(transformers.AutoConfig.for_model(model_type, vision_config=vc))


def test_three_large_images_among_small_ones_balance_within_5_percent_at_cp8():
    units = vision_units(torch.tensor(SPLIT_MIX), 2)
    costs = _qwen3_8b_cost().unit_costs(units)
    mean = sum(costs) / 8
    whole = assign_units(costs, 8)
    whole_max = max(sum(costs[u] for u in us) for us in whole)
    sa = split_assignment(costs, units.row_counts, 8)
    loads = sa.rank_costs(costs)
    # Whole units are bounded by the largest one (1.67x the mean); sharded, the mix is not.
    assert max(costs) / mean > 1.6 and whole_max / mean > 1.6
    assert max(loads) / mean <= 1.05
    assert sa.split == (0, 1, 2)  # exactly the three 1600-patch images
    # The modelled loads account for every unit once (pieces rounded down, at most 1 per piece).
    pieces = sum(len(sa.pieces(r)) for r in range(8))
    assert sum(costs) - pieces <= sum(loads) <= sum(costs)


def test_small_units_stay_whole_and_the_mixed_test_batch_shards_its_largest():
    # Balanced whole: nothing is cut (route mode's assignment).
    sa = split_assignment([5, 5, 5, 5], [2, 2, 2, 2], 2)
    assert sa.split == () and sa.cuts == (0, 0, 0)
    assert sa.whole == tuple(tuple(us) for us in assign_units([5, 5, 5, 5], 2))
    # The HF tests' mixed batch (tests/hf/hf_families.py): 4x4, 8x4 images and a 2-frame 4x4
    # video; the 8x4 image (8 groups) is sharded at cp 2 and 4, by patches as by a tower's cost.
    grids = [(1, 4, 4), (1, 8, 4), (1, 4, 4), (1, 4, 4)]
    units = vision_units(torch.tensor(grids), 2)
    for cp, cuts in ((2, (0, 2, 8)), (4, (0, 1, 2, 3, 8))):
        sa = split_assignment(units.pixel_counts, units.row_counts, cp)
        assert sa.split == (1,) and sa.cuts == cuts


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.tuples(st.integers(1, 400), st.integers(1, 40)), min_size=1, max_size=12),
    st.integers(1, 8),
)
def test_every_group_is_on_exactly_one_rank_and_sharded_units_are_contiguous(units, cp):
    costs = [c for c, _ in units]
    groups = [g for _, g in units]
    sa = split_assignment(costs, groups, cp)
    assert list(sa.cuts) == sorted(sa.cuts) and sa.cuts[-1] == sum(sa.groups)
    seen = {u: [] for u in sa.split}
    for r in range(cp):
        for u, a, b in sa.pieces(r):
            seen[u].append((r, a, b))
    whole = [u for us in sa.whole for u in us]
    assert sorted(whole + list(sa.split)) == list(range(len(units)))
    for u, parts in seen.items():
        # A sharded unit's groups, once each, in order on ascending ranks; the ranks between
        # them (rounded to an empty range) hold nothing of the line: one range per rank.
        assert [a for _, a, _ in parts] == [0, *[b for _, _, b in parts[:-1]]]
        assert parts[-1][2] == groups[u]
        ranks = [r for r, _, _ in parts]
        assert ranks == sorted(set(ranks))
        for r in range(ranks[0] + 1, ranks[-1]):
            assert r in ranks or sa.cuts[r] == sa.cuts[r + 1]
    # No rank above its whole units or its fair share by more than half a group at either end.
    share = -(-sum(costs) // cp)
    half_group = max((costs[u] / g / 2 + 1 for u, g in zip(sa.split, sa.groups)), default=0)
    for r, load in enumerate(sa.rank_costs(costs)):
        whole_cost = sum(costs[u] for u in sa.whole[r])
        assert load <= max(whole_cost, share) + 2 * half_group


def test_contiguous_plan_cuts_inside_documents_and_pads_at_the_tail():
    plan = ShardPlan.contiguous([5, 3, 8], [0, 4, 4, 16])
    assert plan.local_len == 12 and plan.padded_len == 36
    assert plan.indices(0).tolist() == [0, 1, 2, 3, *range(16, 24)]
    assert plan.indices(1).tolist() == list(range(24, 36))  # only padding
    assert plan.indices(2).tolist() == list(range(4, 16))
    assert plan.whole_on == (-1, 2, 2)
    assert plan.doc_ids[:16].tolist() == [0] * 5 + [1] * 3 + [2] * 8
    assert plan != ShardPlan.contiguous([5, 3, 8], [0, 5, 8, 16])  # the cuts are in the key
    with pytest.raises(ValueError, match="cuts must run from 0 to the total length 16"):
        ShardPlan.contiguous([5, 3, 8], [0, 4, 15])
    with pytest.raises(ValueError, match="ascending ints"):
        ShardPlan.contiguous([5, 3, 8], [0, 9, 4, 16])
