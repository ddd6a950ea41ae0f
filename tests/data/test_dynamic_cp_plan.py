"""The dynamic-CP planner: every row once, on an aligned block of a divisor size, blocks of a
round disjoint, sizes from the token budget, deterministic."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cpvlm.data.dynamic_cp import plan_dynamic_cp, plan_rounds, row_size


@settings(max_examples=200, deadline=None)
@given(
    cp=st.sampled_from([1, 2, 3, 4, 6, 8]),
    tokens=st.lists(st.integers(1, 5000), min_size=0, max_size=24),
    rank_tokens=st.integers(1, 2000),
)
def test_plan_covers_every_row_once_on_disjoint_aligned_blocks(cp, tokens, rank_tokens):
    costs = [n * 7 + n * n for n in tokens]
    plan = plan_dynamic_cp(tokens, costs, cp, rank_tokens)
    rows = sorted(job.row for r in plan.rounds for job in r)
    assert rows == list(range(len(tokens)))
    for r in plan.rounds:
        assert r, "no empty round"
        taken = [rank for job in r for rank in job.ranks]
        assert len(taken) == len(set(taken)) and all(0 <= k < cp for k in taken)
        for job in r:
            assert cp % job.size == 0
            assert job.size == row_size(tokens[job.row], cp, rank_tokens)
    assert plan == plan_dynamic_cp(list(tokens), list(costs), cp, rank_tokens)


def test_row_size_is_the_smallest_divisor_within_budget():
    assert [row_size(n, 4, 150) for n in (16, 150, 151, 300, 301, 600, 601)] == [
        1,
        1,
        2,
        2,
        4,
        4,
        4,
    ]
    assert row_size(100, 6, 40) == 3  # divisors of 6: 1, 2, 3, 6


def test_mixed_rows_share_rounds_by_size():
    # one long row over 4 ranks, two medium over 2 each, four short ones alone
    tokens = [600, 300, 280, 100, 90, 80, 70]
    plan = plan_dynamic_cp(tokens, tokens, 4, 150)
    assert plan.sizes() == {4: 1, 2: 2, 1: 4}
    assert [sorted((j.row, j.size, j.block) for j in r) for r in plan.rounds] == [
        [(0, 4, 0)],
        [(1, 2, 0), (2, 2, 1)],
        [(3, 1, 0), (4, 1, 1), (5, 1, 2), (6, 1, 3)],
    ]
    assert plan.job(1, 3).row == 2 and plan.job(0, 2).row == 0
    assert plan.modelled_time(tokens) == 150 + 150 + 100


def test_bad_sizes_are_refused():
    with pytest.raises(ValueError, match="do not divide"):
        plan_rounds([1, 2], [1, 3], 4)
    with pytest.raises(ValueError, match="2 costs but 1 sizes"):
        plan_rounds([1, 2], [1], 4)
