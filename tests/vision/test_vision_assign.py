"""assign_vision_units and vision_units: pure functions of the grids, checked by hand and by property."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cpvlm.vision import assign_vision_units, contiguous_assignment, vision_units


def _loads(counts, per_rank):
    return [sum(counts[u] for u in units) for units in per_rank]


@settings(max_examples=200, deadline=None)
@given(
    counts=st.lists(st.integers(0, 5000), max_size=40),
    cp=st.integers(1, 8),
)
def test_assignment_is_a_balanced_partition_in_ascending_order(counts, cp):
    per_rank = assign_vision_units(counts, cp)
    assert len(per_rank) == cp
    assert sorted(u for units in per_rank for u in units) == list(range(len(counts)))
    assert all(units == sorted(units) for units in per_rank)
    assert per_rank == assign_vision_units(list(counts), cp)  # deterministic
    # Greedy longest-first guarantees max load <= mean + the largest unit (Graham's bound).
    if counts:
        assert max(_loads(counts, per_rank)) <= sum(counts) / cp + max(counts)


def test_refinement_beats_plain_longest_first():
    # Longest-first gives {3, 2, 2} = 7 and {3, 2} = 5; one swap reaches 6 / 6.
    per_rank = assign_vision_units([3, 3, 2, 2, 2], 2)
    assert _loads([3, 3, 2, 2, 2], per_rank) == [6, 6]


def test_patch_balance_beats_count_balance_on_mixed_sizes():
    counts = [4096, 256, 256, 256, 1024, 1024, 256, 4096]
    by_patch = max(_loads(counts, assign_vision_units(counts, 2)))
    by_count = max(_loads(counts, contiguous_assignment(len(counts), 2)))
    assert by_patch == sum(counts) // 2 and by_count > by_patch


def test_more_ranks_than_units_and_no_units():
    assert assign_vision_units([5, 9], 4) == [[1], [0], [], []]
    assert assign_vision_units([], 3) == [[], [], []]
    assert assign_vision_units(torch.tensor([4, 4, 4]), 1) == [[0, 1, 2]]


@pytest.mark.parametrize(
    "counts, cp, message",
    [([1, -2], 2, r"patch_counts\[1\] = -2"), ([1.5], 2, "ints"), ([1], 0, "cp_size")],
)
def test_assignment_rejects_bad_input(counts, cp, message):
    with pytest.raises(ValueError, match=message):
        assign_vision_units(counts, cp)


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
