"""assign_units and vision_units: pure functions of the grids, checked by hand, by property,
on the benchmark's mixes with the published towers' cost models, and on real gloo ranks."""

import functools

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

from cpvlm.encoders import (
    EncoderDataParallel,
    assign_units,
    contiguous_assignment,
    vision_units,
)
from cpvlm.encoders.cost import EncoderCost
from cpvlm.testing import run_distributed
from cpvlm.testing.toy_tower import ToyVisionTower
from cpvlm.testing.vision_cases import MIXES, PUBLISHED_TOWERS


def _loads(counts, per_rank):
    return [sum(counts[u] for u in units) for units in per_rank]


def _balance(costs, per_rank):
    loads = _loads(costs, per_rank)
    return max(loads) / (sum(loads) / len(loads))


@functools.cache
def cost_models() -> dict[str, EncoderCost]:
    """The published towers' cost models (read from their configs by the HF integration), the
    toy tower's and plain patch counts. Built here, not at import: gloo workers import this
    module to run ``_assign_on_rank`` and need neither transformers nor the configs."""
    transformers = pytest.importorskip("transformers")
    from cpvlm.hf.vision_cost import vision_cost

    published = {
        name: vision_cost(transformers.AutoConfig.for_model(model_type, vision_config=vc))
        for name, (model_type, vc) in PUBLISHED_TOWERS.items()
    }
    toy = ToyVisionTower(hidden=16, depth=2).vision_cost()
    return {**published, "toy tower": toy, "patches": EncoderCost.patches()}


@settings(max_examples=200, deadline=None)
@given(
    counts=st.lists(st.integers(0, 5000), max_size=40),
    cp=st.integers(1, 8),
)
def test_assignment_is_a_balanced_partition_in_ascending_order(counts, cp):
    per_rank = assign_units(counts, cp)
    assert len(per_rank) == cp
    assert sorted(u for units in per_rank for u in units) == list(range(len(counts)))
    assert all(units == sorted(units) for units in per_rank)
    assert per_rank == assign_units(list(counts), cp)  # deterministic
    # Greedy longest-first guarantees max load <= mean + the largest unit (Graham's bound).
    if counts:
        assert max(_loads(counts, per_rank)) <= sum(counts) / cp + max(counts)


@settings(max_examples=100, deadline=None)
@given(
    sides=st.lists(
        st.tuples(st.integers(1, 4), st.integers(1, 40), st.integers(1, 40)), max_size=30
    ),
    cp=st.integers(1, 8),
)
def test_cost_balance_on_large_integer_costs(sides, cp):
    # Modelled costs reach 1e13 and beyond: the arithmetic must stay exact, the bounds hold.
    cost = cost_models()["Qwen3-VL-8B"]
    costs = [cost.unit_cost((t, 2 * h, 2 * w)) for t, h, w in sides]
    per_rank = assign_units(costs, cp)
    assert sorted(u for units in per_rank for u in units) == list(range(len(costs)))
    if costs:
        assert max(_loads(costs, per_rank)) <= sum(costs) / cp + max(costs)


def test_refinement_beats_plain_longest_first():
    # Longest-first gives {3, 2, 2} = 7 and {3, 2} = 5; one swap reaches 6 / 6.
    per_rank = assign_units([3, 3, 2, 2, 2], 2)
    assert _loads([3, 3, 2, 2, 2], per_rank) == [6, 6]


def test_refinement_looks_past_a_lightest_rank_it_cannot_improve():
    # Longest-first: {8} = 8, {5, 3} = 8, {4, 3, 3} = 10. The lightest rank {8} admits no
    # exchange with the heaviest (every move or swap overshoots), the next one does: swapping
    # 4 and 3 gives 8 / 9 / 9, the optimum (the 8 stands alone, 26 - 8 = 18 over two ranks).
    counts = [3, 4, 5, 3, 3, 8]
    assert sorted(_loads(counts, assign_units(counts, 3))) == [8, 9, 9]


def test_patch_balance_beats_count_balance_on_mixed_sizes():
    counts = [4096, 256, 256, 256, 1024, 1024, 256, 4096]
    by_patch = max(_loads(counts, assign_units(counts, 2)))
    by_count = max(_loads(counts, contiguous_assignment(len(counts), 2)))
    assert by_patch == sum(counts) // 2 and by_count > by_patch


def test_more_ranks_than_units_and_no_units():
    assert assign_units([5, 9], 4) == [[1], [0], [], []]
    assert assign_units([], 3) == [[], [], []]
    assert assign_units(torch.tensor([4, 4, 4]), 1) == [[0, 1, 2]]


@pytest.mark.parametrize(
    "counts, cp, message",
    [
        ([1, -2], 2, r"costs\[1\] = -2"),
        ([1.5], 2, "ints >= 0"),
        (torch.tensor([1.0]), 2, "integer tensor"),
        ([1], 0, "cp_size"),
    ],
)
def test_assignment_rejects_bad_input(counts, cp, message):
    with pytest.raises(ValueError, match=message):
        assign_units(counts, cp)


@pytest.mark.parametrize("cp", [2, 4, 8])
@pytest.mark.parametrize("mix", list(MIXES))
@pytest.mark.parametrize("model", [*PUBLISHED_TOWERS, "toy tower"])
def test_cost_balance_within_5_percent_where_the_largest_unit_allows(model, mix, cp):
    units = vision_units(torch.tensor(MIXES[mix]), 2)
    costs = cost_models()[model].unit_costs(units)
    per_rank = assign_units(costs, cp)
    assert sorted(u for units_r in per_rank for u in units_r) == list(range(units.num_units))
    # No assignment of whole units beats max(unit cost) / mean; below 1.05 the goal is 1.05.
    # (Plain patch counts are not a cost model here: on the 12-image + video mix at cp 8 the
    # best any assignment reaches is 4480 patches for a mean of 4256, 1.053, by exhaustive
    # search over the units' multiples of 64 patches; longest-first + exchange gets 1.083.)
    bound = max(costs) / (sum(costs) / cp)
    assert _balance(costs, per_rank) <= max(1.05, bound)


def test_cost_balance_fixes_what_patch_balance_misses():
    # The 12-image + video mix at cp 4 under Qwen3-VL-8B: equal patches leave the rank with the
    # 4096-patch image 8% above the mean (measured 1.088), cost balance reaches 1.005.
    units = vision_units(torch.tensor(MIXES["current"]), 2)
    costs = cost_models()["Qwen3-VL-8B"].unit_costs(units)
    assert _balance(costs, assign_units(units.pixel_counts, 4)) > 1.08
    assert _balance(costs, assign_units(costs, 4)) < 1.01


def _assign_on_rank(rank, world_size, cost_models):
    """Every mix's assignment under every cost model, from this rank's own arithmetic; and the
    assignment EncoderDataParallel makes for the toy tower by default and with ``cost=``."""
    out = {}
    for name, cost in cost_models.items():
        for mix, grids in MIXES.items():
            units = vision_units(torch.tensor(grids), 2)
            for cp in (2, 4, 8):
                out[name, mix, cp] = assign_units(cost.unit_costs(units), cp)
    tower = ToyVisionTower(hidden=16, depth=2)
    units = vision_units(torch.tensor(MIXES["current"]), 2)
    out["vdp default"] = EncoderDataParallel(tower, dist.group.WORLD).assignment(units)
    out["vdp patches"] = EncoderDataParallel(
        tower, dist.group.WORLD, cost=EncoderCost.patches()
    ).assignment(units)
    out["vdp plain tower"] = EncoderDataParallel(torch.nn.Identity(), None).assignment(units)
    return out


def test_assignment_is_identical_on_every_gloo_rank():
    # Spawned ranks have their own hash seeds and interpreters: the same costs must give the
    # same assignment everywhere, equal to this process's, with no communication.
    results = run_distributed(_assign_on_rank, 4, cost_models())
    assert all(r == results[0] for r in results[1:])
    units = vision_units(torch.tensor(MIXES["current"]), 2)
    for name, cost in cost_models().items():
        for mix, grids in MIXES.items():
            mix_units = vision_units(torch.tensor(grids), 2)
            for cp in (2, 4, 8):
                expected = assign_units(cost.unit_costs(mix_units), cp)
                assert results[0][name, mix, cp] == expected
    # EncoderDataParallel balances by the tower's vision_cost(); cost= and plain towers (no
    # vision_cost method: patch counts) override it.
    toy_costs = cost_models()["toy tower"].unit_costs(units)
    assert results[0]["vdp default"] == assign_units(toy_costs, 4)
    assert results[0]["vdp patches"] == assign_units(units.pixel_counts, 4)
    assert results[0]["vdp plain tower"] == results[0]["vdp patches"]
    assert results[0]["vdp default"] != results[0]["vdp patches"]


def test_vision_data_parallel_rejects_a_cost_that_is_not_a_vision_cost():
    with pytest.raises(ValueError, match="cost must be an EncoderCost"):
        EncoderDataParallel(torch.nn.Identity(), None, cost=[1, 2, 3])


def test_videos_split_into_contiguous_frame_units():
    units = vision_units(torch.tensor([[1, 4, 6], [3, 2, 4], [1, 2, 2]]), 2)
    assert units.grids == ((1, 4, 6), (1, 2, 4), (1, 2, 4), (1, 2, 4), (1, 2, 2))
    assert units.items == (0, 1, 1, 1, 2)
    assert units.pixel_counts == [24, 8, 8, 8, 4]
    assert units.row_counts == [6, 2, 2, 2, 1]
    # A video's frame units are consecutive ranges of its pixel rows and output rows.
    assert units.pixel_index([1, 2, 3]).tolist() == list(range(24, 48))
    assert units.row_index([3, 0]).tolist() == [10, 11, 0, 1, 2, 3, 4, 5]
    assert [t.shape[0] for t in units.split_by_item(torch.zeros(13, 1))] == [6, 6, 1]
    whole = vision_units(torch.tensor([[3, 2, 4]]), 2, split_frames=False)
    assert whole.grids == ((3, 2, 4),) and whole.row_counts == [6]


@pytest.mark.parametrize(
    "grid, message",
    [
        ([[1, 3, 4]], "divisible by the merge size 2"),
        ([[0, 2, 2]], "must be >= 1"),
        ([[1, 2]], r"shape \[N, 3\]"),
    ],
)
def test_bad_grids_are_rejected(grid, message):
    with pytest.raises(ValueError, match=message):
        vision_units(torch.tensor(grid), 2)
    with pytest.raises(ValueError, match="integer"):
        vision_units(torch.tensor([[1.0, 2.0, 2.0]]), 2)


def test_units_balance_around_base_loads():
    """Units of one encoder balance around the work another encoder already gave each rank:
    the heaviest clip goes to the rank with the least vision work, and the totals end even."""
    assert assign_units([5, 5], 2, base_loads=[10, 0]) == [[], [0, 1]]
    per_rank = assign_units([7, 4, 3, 2], 3, base_loads=[0, 6, 3])
    loads = [b + sum([7, 4, 3, 2][u] for u in mine) for b, mine in zip([0, 6, 3], per_rank)]
    assert 0 in per_rank[0] and max(loads) == 9  # 25 over 3 ranks: 9 is the best
    with pytest.raises(ValueError, match="one load per rank"):
        assign_units([1], 2, base_loads=[0])
