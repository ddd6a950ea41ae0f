"""The block schedule under MaskSpec masks, against the dense rule (mask_cases.padded_rule_mask),
in one process: every visible pair computed exactly once, no hidden pair in a FULL or CAUSAL
rectangle, and a windowed layer skips what lies outside its window.
"""

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from mask_cases import padded_rule_mask, spans_of

from cpvlm import ShardPlan
from cpvlm.attention import MaskSpec, Shapes, attention_schedule, estimate_seconds
from cpvlm.attention.schedule import CAUSAL, FULL, MASKED


def _covered(plan: ShardPlan, mask: MaskSpec, rule: torch.Tensor) -> torch.Tensor:
    """[P, P] how often the schedule computes each visible pair; asserts on the way that FULL and
    CAUSAL rectangles hold only visible pairs, MASKED ones see only visible pairs, and each
    segment's ``pairs`` is what it sees."""
    schedule = attention_schedule(plan, mask)
    w = plan.cp_size
    count = torch.zeros(rule.shape, dtype=torch.long)
    for r in range(w):
        for i in range(w):
            rows_all, cols_all = plan.indices(r), plan.indices((r - i) % w)
            for seg in schedule.segments(r, i):
                rows, cols = rows_all[seg.rows], cols_all[seg.cols]
                want = rule[rows][:, cols]
                if seg.kind == FULL:
                    seen = torch.ones_like(want)
                elif seg.kind == CAUSAL:
                    seen = torch.ones_like(want).tril()
                else:
                    assert seg.kind == MASKED
                    seen = seg.visible
                assert not (seen & ~want).any(), f"hidden pair computed in {seg}"
                assert int(seen.sum()) == seg.pairs, seg
                count[rows[:, None].expand_as(seen)[seen], cols.expand_as(seen)[seen]] += 1
    return count


@st.composite
def _plans_and_masks(draw):
    cp = draw(st.integers(1, 4))
    docs = draw(st.lists(st.integers(1, 60), min_size=1, max_size=4))
    layout = draw(st.sampled_from(["head_tail", "balanced"]))
    plan = ShardPlan(sum(docs), cp, doc_lens=docs, layout=layout)
    causal = draw(st.booleans())
    window = draw(st.sampled_from([None, 1, 2, 3, 5, 17, 20, 40, 1000]))
    with_spans = draw(st.booleans())
    return plan, causal, window, with_spans


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_plans_and_masks())
def test_every_visible_pair_is_computed_exactly_once(case):
    plan, causal, window, with_spans = case
    cp = plan.cp_size
    spans = spans_of(plan, cp)[1] if with_spans else ()
    rule = padded_rule_mask(plan, cp, causal, window, with_spans)
    count = _covered(plan, MaskSpec(causal=causal, window=window, spans=spans), rule)
    assert torch.equal(count, rule.long()), (plan, causal, window, spans)


def _visible_per_rank(plan: ShardPlan, w: int) -> list[int]:
    """A single document: row i sees min(w, i + 1) keys under a causal window of w."""
    real = ~plan.is_padding
    return [
        int(torch.clamp(idx[real[idx]] + 1, max=w).sum())
        for idx in (plan.indices(r) for r in range(plan.cp_size))
    ]


def test_a_window_skips_what_lies_outside_it_at_cp4():
    """Single sequence, causal window w, cp = 4: per rank, the pairs the schedule's calls see
    (sum of Segment.pairs) equal the window's visible pairs of the rank's rows, counted from the
    rule above; the computed pairs (a MASKED call counted by its whole rectangle) exceed them by
    at most one h x h block per segment (h = schedule.block, the strip height), and in all by at
    most h / w of the visible work: an h-row strip computes its ~h*w visible pairs plus the
    hidden half of one h x h edge, h(h-1)/2, and grouping adds at most as much again (a grouped
    call may hold at most h^2 hidden pairs). So a rank computes at most (1 + h/w) (S/cp) w pairs,
    where without skipping it would compute ~S^2/8 (w = 1024: 4.2M of 33.5M)."""
    seq, cp = 16384, 4
    plan = ShardPlan(seq, cp)
    for w in (1024, 4096, 256):
        schedule = attention_schedule(plan, MaskSpec(window=w))
        h = schedule.block
        assert h is not None and h <= w
        for r, visible in enumerate(_visible_per_rank(plan, w)):
            segments = [seg for step in schedule.steps[r] for seg in step]
            assert sum(seg.pairs for seg in segments) == visible
            computed = schedule.computed_pairs(r)
            for seg in segments:
                area = (seg.q_stop - seg.q_start) * (seg.k_stop - seg.k_start)
                hidden = area - seg.pairs if seg.kind == MASKED else 0
                assert hidden <= h * h, (w, r, seg, hidden)
            assert visible <= computed <= visible + len(segments) * h * h
            assert computed <= visible * (1 + h / w), (w, r, computed, visible)
            # Work proportional to S x w: a rank's S/cp rows see at most w keys each.
            assert computed <= (1 + h / w) * (seq // cp) * w


def test_a_window_narrower_than_a_strip_is_still_bounded():
    """w < 16: strips of h = 16 rows, each one masked call of h x (h + w - 1); each call holds at
    most h^2 hidden pairs."""
    plan = ShardPlan(4000, 4)
    schedule = attention_schedule(plan, MaskSpec(window=5))
    h = schedule.block
    for r, visible in enumerate(_visible_per_rank(plan, 5)):
        segments = [seg for step in schedule.steps[r] for seg in step]
        assert sum(seg.pairs for seg in segments) == visible
        assert schedule.computed_pairs(r) <= visible + len(segments) * h * h
        assert schedule.computed_pairs(r) <= visible * (1 + h / 5)


def test_the_schedule_cache_tells_masks_apart():
    plan = ShardPlan(300, 2)
    a = attention_schedule(plan, MaskSpec(window=8))
    assert attention_schedule(plan, MaskSpec(window=8)) is a
    assert attention_schedule(plan, MaskSpec(window=9)) is not a
    assert attention_schedule(plan, True) is attention_schedule(plan, MaskSpec())
    assert attention_schedule(plan, MaskSpec(spans=((3, 9),))).mask.spans == ((3, 9),)


def test_the_cost_model_counts_windowed_work():
    plan = ShardPlan(16384, 4)
    shapes = Shapes(1, 8, 2, 64, torch.float32)
    full = estimate_seconds("ring", plan, MaskSpec(), shapes)
    windowed = estimate_seconds("ring", plan, MaskSpec(window=1024), shapes)
    # Compute is ~S*w / (S^2/2) = 1/8 of causal; fixed costs per call and message remain.
    assert windowed < full / 4
