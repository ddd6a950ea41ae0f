"""The dynamic-CP planner: every row once, on an aligned block of a divisor size, blocks of a
round disjoint, sizes from the token budget, deterministic."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cpvlm.data.dynamic_cp import JobTimes, divisors, plan_dynamic_cp, plan_rounds, row_size


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


# ---- with a time model ------------------------------------------------------------------------

# H100-like figures (cpvlm.attention.cost.CUDA_NCCL) on a small decoder: latency-bound short rows
H100ISH = JobTimes(
    mac_s=5.5e-15,
    backward_factor=2.5,
    token=10**9,
    pair=64 * 1024,
    layers=16,
    kv_bytes=2 * 8 * 128 * 2,
    acc_bytes=2 * 8 * 128 * 4,
    call_s=10e-6,
    message_s=20e-6,
    link_bytes_per_s=200e9,
    round_s=1e-3,
    gather_s=5e-3,
)


def _row_costs(tokens, vision):
    return [H100ISH.token * n + H100ISH.pair * n * (n + 1) // 2 + v for n, v in zip(tokens, vision)]


def _static(tokens, costs, cp, times):
    return plan_rounds(costs, [cp] * len(tokens), cp).modelled_seconds(tokens, costs, times)


times_strategy = st.builds(
    JobTimes,
    mac_s=st.sampled_from([0.0, 5.5e-15, 6.5e-11]),
    backward_factor=st.sampled_from([2.0, 2.5]),
    token=st.sampled_from([0, 10**6, 10**9]),
    pair=st.sampled_from([0, 1000, 64 * 1024]),
    layers=st.integers(0, 40),
    kv_bytes=st.sampled_from([0, 4096]),
    acc_bytes=st.sampled_from([0, 8192]),
    call_s=st.sampled_from([0.0, 10e-6, 100e-6]),
    message_s=st.sampled_from([0.0, 20e-6, 1e-3]),
    link_bytes_per_s=st.sampled_from([0.5e9, 200e9]),
    round_s=st.sampled_from([0.0, 1e-3]),
    gather_s=st.sampled_from([0.0, 5e-3, 0.3]),
)


@settings(max_examples=200, deadline=None)
@given(
    cp=st.sampled_from([1, 2, 3, 4, 6, 8, 12, 16]),
    tokens=st.lists(st.integers(1, 20000), min_size=0, max_size=40),
    rank_tokens=st.integers(1, 4000),
    vision=st.lists(st.sampled_from([0, 10**12, 10**14]), min_size=40, max_size=40),
    times=times_strategy,
)
def test_timed_plan_keeps_the_invariants_and_never_loses_to_static_cp(
    cp, tokens, rank_tokens, vision, times
):
    costs = _row_costs(tokens, vision)
    plan = plan_dynamic_cp(tokens, costs, cp, rank_tokens, times=times)
    rows = sorted(job.row for r in plan.rounds for job in r)
    assert rows == list(range(len(tokens)))
    for r in plan.rounds:
        assert r, "no empty round"
        taken = [rank for job in r for rank in job.ranks]
        assert len(taken) == len(set(taken)) and all(0 <= k < cp for k in taken)
        for job in r:
            assert cp % job.size == 0 and job.ranks.start % job.size == 0
            # never below the memory rule: no rank holds more of a row than its budget allows
            assert job.size >= row_size(tokens[job.row], cp, rank_tokens)
    seconds = plan.modelled_seconds(tokens, costs, times)
    assert seconds <= _static(tokens, costs, cp, times) * (1 + 1e-12)
    least = plan_dynamic_cp(tokens, costs, cp, rank_tokens)  # the memory rule's sizes
    assert seconds <= least.modelled_seconds(tokens, costs, times) * (1 + 1e-12)
    assert plan == plan_dynamic_cp(list(tokens), list(costs), cp, rank_tokens, times=times)


@settings(max_examples=100, deadline=None)
@given(
    tokens=st.integers(1, 10**6),
    cost=st.integers(0, 10**15),
    times=times_strategy,
    cp=st.sampled_from([2, 4, 8, 16, 64]),
)
def test_job_time_is_compute_over_c_plus_what_grows_with_c(tokens, cost, times, cp):
    from dataclasses import replace

    # with nothing but compute, a job's time is its cost shared by c ranks
    compute = replace(times, layers=0)
    train = (1 + times.backward_factor) * times.mac_s * cost
    for c in divisors(cp):
        assert compute.job(tokens, cost, c) == pytest.approx(train / c, rel=1e-12, abs=1e-300)
    # with nothing to compute, what a job pays grows with c
    idle = replace(times, mac_s=0.0)
    paid = [idle.job(tokens, cost, c) for c in divisors(cp)]
    assert paid == sorted(paid)
    if times.layers and (times.message_s or times.call_s):
        assert paid[-1] > paid[0]


def test_a_costly_short_row_gets_more_ranks_than_memory_needs():
    # one 2k-token row with a huge vision tower beside three tiny rows, cp 4, a budget of 4k
    # tokens a rank: memory puts all four on one rank each, one round as long as the costly row
    tokens = [2048, 64, 64, 64]
    costs = _row_costs(tokens, [10**15, 0, 0, 0])
    plan = plan_dynamic_cp(tokens, costs, 4, 4096, times=H100ISH)
    least = plan_dynamic_cp(tokens, costs, 4, 4096)
    assert least.sizes() == {1: 4}
    assert plan.sizes() == {4: 1, 1: 3}
    faster = plan.modelled_seconds(tokens, costs, H100ISH)
    assert faster < 0.5 * least.modelled_seconds(tokens, costs, H100ISH)


def test_short_rows_on_one_rank_beat_static_cp_on_h100_figures():
    # 1 long row (must take all 8 ranks) and 31 short conversations: static CP runs 32 rounds
    tokens = [65536] + [1024] * 31
    costs = _row_costs(tokens, [0] * 32)
    plan = plan_dynamic_cp(tokens, costs, 8, 8192, times=H100ISH)
    assert plan.sizes()[8] == 1 and len(plan.rounds) < 32
    dynamic = plan.modelled_seconds(tokens, costs, H100ISH)
    assert dynamic < 0.7 * _static(tokens, costs, 8, H100ISH)  # 0.62: the long row dominates


def test_plan_checks_its_lengths():
    with pytest.raises(ValueError, match="2 token counts but 1 costs"):
        plan_dynamic_cp([1, 2], [1], 4, 10)
