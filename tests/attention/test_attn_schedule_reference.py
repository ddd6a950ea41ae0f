"""The vectorized schedule equals the loop-based one it replaced, rectangle for rectangle.

``cpvlm.testing.schedule_reference`` is the schedule as cpvlm computed it before (every rank's
rows, loops over runs, pieces and rectangles); the product computes one rank's rows with array
operations. On drawn plans (head-tail, balanced, contiguous) and masks (causal or not, windows,
spans) every segment must agree: bounds, kind, pairs, overwrite flag, mask and grouped parts; and
the ring's last step must be the last step at which the reference has any segment.
"""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cpvlm import ShardPlan
from cpvlm.attention import MaskSpec, attention_schedule
from cpvlm.attention.mask_spec import doc_starts
from cpvlm.attention.ring import ring_steps
from cpvlm.attention.schedule import MASKED
from cpvlm.testing.schedule_reference import reference_steps


def _fields(seg) -> tuple:
    return (seg.q_start, seg.q_stop, seg.k_start, seg.k_stop, seg.kind, seg.pairs, seg.overwrite)


def _assert_same(plan: ShardPlan, mask: MaskSpec) -> None:
    schedule, ref = attention_schedule(plan, mask), reference_steps(plan, mask)
    w = plan.cp_size
    for r in range(w):
        for i in range(w):
            new, old = schedule.segments(r, i), ref[r][i]
            where = f"{plan!r}, {mask}, rank {r}, step {i}"
            assert [_fields(s) for s in new] == [_fields(s) for s in old], where
            for a, b in zip(new, old):
                if a.kind == MASKED:
                    assert torch.equal(a.visible, b.visible), where
                    assert [_fields(p) for p in a.parts] == [_fields(p) for p in b.parts], where
    busy = [i for r in range(w) for i in range(w) if ref[r][i]]
    assert ring_steps(schedule) == 1 + max(busy, default=0)


@st.composite
def plans(draw):
    cp = draw(st.integers(1, 5))
    lens = draw(st.lists(st.integers(1, 60), min_size=1, max_size=6))
    layout = draw(st.sampled_from(["head_tail", "balanced", "contiguous"]))
    if layout != "contiguous":
        return ShardPlan(sum(lens), cp, doc_lens=lens, layout=layout)
    inner = draw(st.lists(st.integers(0, sum(lens)), min_size=cp - 1, max_size=cp - 1))
    return ShardPlan.contiguous(lens, [0, *sorted(inner), sum(lens)])


@st.composite
def masks(draw, plan: ShardPlan):
    causal = draw(st.booleans())
    window = draw(st.one_of(st.none(), st.integers(1, 80)))
    spans = []
    for start, n in zip(doc_starts(plan), plan.doc_lens):
        cuts = sorted(draw(st.sets(st.integers(start, start + n), max_size=4)))
        spans += [(a, b) for a, b in zip(cuts[::2], cuts[1::2]) if b > a]
    return MaskSpec(causal=causal, window=window, spans=tuple(spans))


@settings(max_examples=100, deadline=None)
@given(data=st.data())
def test_schedule_equals_the_loop_reference_rectangle_for_rectangle(data):
    plan = data.draw(plans())
    _assert_same(plan, data.draw(masks(plan)))


def test_schedule_equals_the_reference_on_many_documents_and_long_windows():
    # Grouped tiny documents, strips of a long window, a document split over every rank, and the
    # Ulysses / hybrid views of the same plan.
    lens = [3] * 40 + [300, 5, 520, 2, 2]
    for layout in ("head_tail", "balanced"):
        plan = ShardPlan(sum(lens), 4, doc_lens=lens, layout=layout)
        for mask in (MaskSpec(), MaskSpec(window=150), MaskSpec(causal=False, window=40)):
            for view in (plan, plan.merge_ranks(2), plan.merge_ranks(4)):
                _assert_same(view, mask)
