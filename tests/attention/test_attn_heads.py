"""Ulysses head splits (any head count, GQA heads sent only where used), the ulysses_size check and
what impl="auto" may pick."""

import itertools

import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

from cpvlm import ShardPlan
from cpvlm.attention import Shapes, choose_impl, cp_attention, estimate_seconds, head_split
from cpvlm.attention.cost import candidates
from cpvlm.testing import run_distributed

head_cases = st.tuples(st.integers(1, 16), st.integers(1, 6), st.integers(1, 9)).map(
    lambda t: (t[0] * t[1], t[0], t[2])  # (Hq, Hkv, ranks) with Hkv | Hq
)


def _kv_needed(a, b, g):
    return {h // g for h in range(a, b)}


@settings(max_examples=100, deadline=None)
@given(head_cases)
def test_head_split_covers_every_head_once_and_sends_kv_heads_only_where_used(case):
    hq, hkv, size = case
    g = hq // hkv
    split = head_split(hq, hkv, size)
    assert split.bounds[0] == 0 and split.bounds[-1] == hq and split.size == size
    sizes = [split.q_range(i)[1] - split.q_range(i)[0] for i in range(size)]
    assert set(sizes) <= {hq // size, -(-hq // size)} and sum(sizes) == hq
    receivers = {h: 0 for h in range(hkv)}
    for i in range(size):
        a, b = split.q_range(i)
        lo, hi = split.kv_range(i)
        assert set(range(lo, hi)) == _kv_needed(a, b, g)  # exactly the K/V heads it uses
        for h in range(lo, hi):
            receivers[h] += 1
        # Uniform GQA groups tile the rank's heads: query j of a group uses its K/V head j // n.
        covered = []
        for qa, qb, ka, kb in split.groups(i):
            n = (qb - qa) // (kb - ka)
            assert (qb - qa) == n * (kb - ka)
            for j in range(qa, qb):
                assert (a + j) // g == lo + ka + (j - qa) // n
            covered += range(qa, qb)
        assert covered == list(range(b - a))
    for h, count in receivers.items():
        owners = {
            i
            for i in range(size)
            for q in range(h * g, (h + 1) * g)
            if split.bounds[i] <= q < split.bounds[i + 1]
        }
        assert count == len(owners)  # more than one rank only when its query heads are split


def test_head_split_is_the_best_split_with_balanced_sizes():
    """Brute force over every order of floor/ceil sizes: no split has fewer K/V heads on the
    busiest rank, then fewer in all, then fewer kernel groups."""
    for hq, hkv, size in [(8, 2, 3), (6, 2, 4), (12, 4, 3), (12, 4, 5), (14, 2, 4), (9, 3, 4)]:
        g, lo, extra = hq // hkv, hq // size, hq % size
        best = None
        for bigger in itertools.combinations(range(size), extra):
            bounds = [0]
            for i in range(size):
                bounds.append(bounds[-1] + lo + (i in bigger))
            kv = [len(_kv_needed(a, b, g)) for a, b in zip(bounds[:-1], bounds[1:])]
            key = (max(kv), sum(kv))
            best = key if best is None else min(best, key)
        split = head_split(hq, hkv, size)
        kv = [split.kv_range(i)[1] - split.kv_range(i)[0] for i in range(size)]
        assert (max(kv), sum(kv)) == best, (hq, hkv, size)
    assert head_split(6, 2, 4).bounds == (0, 1, 3, 4, 6)  # one K/V head per rank, not two
    assert head_split(2, 1, 4).bounds == (0, 0, 0, 1, 2)  # two ranks without query heads
    # The price of an uneven split: the busiest rank's heads over the mean.
    assert head_split(28, 4, 8).imbalance == 4 / 3.5 and head_split(32, 8, 8).imbalance == 1.0


def _bad_ulysses_size(rank, world_size):
    plan = ShardPlan(16, world_size)
    q, kv = torch.randn(1, 4, plan.local_len, 8), torch.randn(1, 2, plan.local_len, 8)
    messages = []
    for impl, u in (("hybrid", None), ("hybrid", 3), ("hybrid", True), ("ring", 2)):
        try:
            cp_attention(q, kv, kv, plan=plan, group=dist.group.WORLD, impl=impl, ulysses_size=u)
            messages.append(None)
        except ValueError as e:
            messages.append(str(e))
    return messages


def test_ulysses_size_is_checked_with_a_message_naming_the_fix():
    for messages in run_distributed(_bad_ulysses_size, 4):
        for m in messages[:3]:
            assert m.startswith("cp_attention: ulysses_size="), m
            assert "impl='hybrid' splits the CP ranks into Ulysses groups" in m, m
            assert "a divisor of the CP size 4: one of [1, 2, 4]" in m, m
        assert "ulysses_size=2 (--ulysses-size): applies to impl='hybrid' only" in messages[3]


def test_auto_picks_the_smallest_estimate_among_the_candidates():
    shapes = Shapes(1, 8, 2, 64, torch.bfloat16)
    assert choose_impl(ShardPlan(4096, 1), True, shapes) == ("ring", None)
    for cp, docs, device in ((4, [4096], "cpu"), (8, [64] * 64, "cuda"), (4, [8192], "cuda")):
        plan = ShardPlan(sum(docs), cp, doc_lens=docs)
        options = candidates(cp)
        assert ("hybrid", 2) in options and ("ulysses", None) in options
        times = {o: estimate_seconds(o[0], plan, True, shapes, o[1], device) for o in options}
        assert all(t > 0 for t in times.values())
        chosen = choose_impl(plan, True, shapes, device)
        assert times[chosen] == min(times.values())
