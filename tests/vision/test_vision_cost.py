"""EncoderCost: the model-agnostic cost of a unit, checked by hand, by brute force over windows,
and against torch's FLOP counter on the toy tower."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.flop_counter import FlopCounterMode

from cpvlm.encoders import vision_units
from cpvlm.encoders.cost import EncoderCost, block_linear_macs
from cpvlm.testing.toy_tower import ToyVisionTower


def _window_pairs_brute_force(h: int, w: int, window: int) -> int:
    """Sum over the windows of a frame of (patches in the window)**2, window by window."""
    total = 0
    for r0 in range(0, h, window):
        for c0 in range(0, w, window):
            n = (min(r0 + window, h) - r0) * (min(c0 + window, w) - c0)
            total += n * n
    return total


def test_unit_cost_by_hand():
    cost = EncoderCost(linear_per_patch=100, pair=8, full_blocks=2, windowed_blocks=3, window=8)
    # A 20 x 12 frame: 240 patches; windows of 8: rows 8, 8, 4 and columns 8, 4, i.e. six
    # windows of 64, 32, 64, 32, 32, 16 patches.
    windows = 2 * 64**2 + 3 * 32**2 + 16**2
    frame = 100 * 240 + 8 * (2 * 240**2 + 3 * windows)
    assert cost.frame_pairs(20, 12) == 2 * 240**2 + 3 * windows
    assert cost.unit_cost((1, 20, 12)) == frame
    assert cost.unit_cost((5, 20, 12)) == 5 * frame  # frames are encoded independently
    assert EncoderCost.patches().unit_cost((3, 4, 6)) == 72


@settings(max_examples=200, deadline=None)
@given(h=st.integers(1, 60), w=st.integers(1, 60), window=st.integers(1, 20))
def test_windowed_pairs_equal_the_brute_force_sum_over_windows(h, w, window):
    cost = EncoderCost(linear_per_patch=0, pair=1, windowed_blocks=1, window=window)
    assert cost.frame_pairs(h, w) == _window_pairs_brute_force(h, w, window)


def test_attention_makes_one_large_image_cost_more_than_many_small_ones():
    cost = EncoderCost(linear_per_patch=1000, pair=10, full_blocks=1)
    assert cost.unit_cost((1, 32, 32)) > 4 * cost.unit_cost((1, 16, 16))
    units = vision_units(torch.tensor([[1, 32, 32], [4, 16, 16]]), 2)
    assert units.pixel_counts == [1024, 256, 256, 256, 256]
    assert cost.unit_costs(units) == [1024 * (1000 + 10 * 1024)] + [256 * (1000 + 10 * 256)] * 4


def test_part_cost_is_the_share_of_the_unit():
    cost = EncoderCost(linear_per_patch=7, pair=3, full_blocks=2)
    grid = (1, 6, 4)
    assert cost.part_cost(grid, 24) == cost.unit_cost(grid)
    assert cost.part_cost(grid, 0) == 0
    # Full attention: each query attends all 24 keys, so 6 queries do exactly a quarter.
    assert cost.part_cost(grid, 6) * 4 == cost.unit_cost(grid) == 24 * (7 + 3 * 2 * 24)
    parts = [cost.part_cost(grid, n) for n in (5, 7, 12)]
    assert sum(parts) <= cost.unit_cost(grid)
    with pytest.raises(ValueError, match=r"patches must be an int in \[0, 24\]"):
        cost.part_cost(grid, 25)


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"linear_per_patch": -1}, "linear_per_patch must be an int >= 0"),
        ({"linear_per_patch": 1.5}, "linear_per_patch must be an int"),
        ({"linear_per_patch": 1, "pair": True}, "pair must be an int"),
        ({"linear_per_patch": 1, "windowed_blocks": 2}, "needs window >= 1"),
        ({"linear_per_patch": 0, "pair": 4}, "every unit would cost 0"),
    ],
)
def test_bad_cost_models_are_rejected_naming_the_field(fields, message):
    with pytest.raises(ValueError, match=message):
        EncoderCost(**fields)


def test_toy_tower_cost_counts_exactly_its_matrix_products():
    # torch's FLOP counter sees every matmul, linear and convolution of the forward (2 FLOPs
    # per MAC) and nothing elementwise: the model must give exactly that, attention included.
    tower = ToyVisionTower(hidden=16, heads=2, depth=3, deepstack=(0, 2), out_dim=12).double()
    grids = torch.tensor([[1, 4, 6], [3, 2, 4], [1, 8, 8]])
    units = vision_units(grids, 2)
    pixels = torch.randn(units.pixel_offsets[-1], tower.pixel_dim, dtype=torch.float64)
    with FlopCounterMode(display=False) as counter:
        tower(pixels, grids)
    assert counter.get_total_flops() == 2 * sum(tower.vision_cost().unit_costs(units))
    assert block_linear_macs(16, 32, gated=False) == 4 * 16 * 16 + 2 * 16 * 32
