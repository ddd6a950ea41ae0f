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


class _ReferenceSchedule:
    """The reference rows in the place of ``attention_schedule``'s: calls and computed pairs per
    step counted from its segments, as the cost model counted them before ``step_work``."""

    def __init__(self, plan: ShardPlan, mask: MaskSpec):
        self.rows = reference_steps(plan, mask)
        busy = [i for rows in self.rows for i, block in enumerate(rows) if block]
        self.last_step = max(busy, default=0)

    def step_work(self, r: int):
        computed = [
            sum(
                (s.q_stop - s.q_start) * (s.k_stop - s.k_start) if s.kind == MASKED else s.pairs
                for s in block
            )
            for block in self.rows[r]
        ]
        return [len(block) for block in self.rows[r]], computed


def test_cost_model_equals_its_value_on_the_reference_rows(monkeypatch):
    # impl="auto" reads calls and pairs per rank and step (step_work, from arrays, no segments);
    # on the reference rows every estimate and the choice must be the same, float for float.
    from cpvlm.attention import cost

    lens = [3] * 40 + [300, 5, 520, 2, 2]
    shapes = cost.Shapes(batch=1, q_heads=8, kv_heads=2, head_dim=64, dtype=torch.bfloat16)
    cases = []
    for layout in ("head_tail", "balanced"):
        plan = ShardPlan(sum(lens), 4, doc_lens=lens, layout=layout)
        for mask in (MaskSpec(), MaskSpec(window=150), MaskSpec(causal=False, window=40)):
            options = cost.candidates(plan.cp_size)
            got = [cost.estimate_seconds(i, plan, mask, shapes, u) for i, u in options]
            cases.append((plan, mask, options, got, cost.choose_impl(plan, mask, shapes)))
    # Segments made first: step_work then counts the rows instead (the other path).
    plan = ShardPlan(sum(lens), 4, doc_lens=lens)
    cost.estimate_seconds.cache_clear()
    rows = attention_schedule(plan, MaskSpec())
    rows.steps  # noqa: B018
    cases.append(
        (
            plan,
            MaskSpec(),
            [("ring", None)],
            [cost.estimate_seconds("ring", plan, True, shapes)],
            None,
        )
    )
    cost.estimate_seconds.cache_clear()
    monkeypatch.setattr(cost, "attention_schedule", lambda p, m: _ReferenceSchedule(p, m))
    for plan, mask, options, got, chosen in cases:
        want = [cost.estimate_seconds(i, plan, mask, shapes, u) for i, u in options]
        assert got == want, (plan, mask)
        if chosen is not None:
            assert chosen == cost.choose_impl(plan, mask, shapes), (plan, mask)
    cost.estimate_seconds.cache_clear()
