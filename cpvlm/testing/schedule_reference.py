"""The block schedule as cpvlm computed it before it was vectorized (loops over runs, pieces and
rectangles, every rank's rows), kept as the reference that the tests and benchmarks/host.py compare
the product's ``attention_schedule`` with, rectangle for rectangle. Not a product path.

Legend as in ``cpvlm/attention/schedule.py`` and ``cpvlm/attention/bands.py``.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import torch

from cpvlm.attention.bands import CAUSAL, FULL, MASKED, Rect, strip_height
from cpvlm.attention.mask_spec import MaskSpec, doc_starts
from cpvlm.attention.schedule import (
    _CALL_COST,
    _MASKED_PAIR_COST,
    _MAX_MASK_ELEMENTS,
    Segment,
)
from cpvlm.distributed.shard_plan import ShardPlan


@dataclass(frozen=True, eq=False)
class RowIntervals:
    """[lo(i), hi(i)] of every padded position (meaningless at padding), and where to cut."""

    lo: list[int]
    hi: list[int]
    cuts: list[int]
    """Sorted positions where hi jumps (span starts and stops): a piece never crosses one."""
    block: int | None
    """Strip height under a window; None: pieces are whole runs."""
    causal: bool


def row_intervals(plan: ShardPlan, mask: MaskSpec) -> RowIntervals:
    doc = plan.doc_ids.clamp(min=0)
    starts = torch.tensor(doc_starts(plan))[doc]
    last = starts + torch.tensor(plan.doc_lens)[doc] - 1
    pos = torch.arange(plan.padded_len)
    lo, hi = starts, pos.clone() if mask.causal else last
    cuts: list[int] = []
    if mask.window is not None:
        lo = torch.maximum(lo, pos - mask.window + 1)
        if not mask.causal:
            hi = torch.minimum(hi, pos + mask.window - 1)
    if mask.causal and mask.spans:
        for a, b in mask.spans:
            hi[a:b] = b - 1
            cuts += [a, b]
    block = None if mask.window is None else strip_height(mask.window)
    return RowIntervals(lo.tolist(), hi.tolist(), sorted(set(cuts)), block, mask.causal)


def pieces(iv: RowIntervals, start: int, stop: int) -> list[tuple[int, int]]:
    """Global [a, a2) pieces of the query rows [start, stop)."""
    first = bisect.bisect_right(iv.cuts, start)
    last = bisect.bisect_left(iv.cuts, stop)
    bounds = [start, *iv.cuts[first:last], stop]
    out = []
    for a, b in zip(bounds[:-1], bounds[1:]):
        step = iv.block or b - a
        out.extend((x, min(x + step, b)) for x in range(a, b, step))
    return out


def pair_rects(iv: RowIntervals, q_run, k_run, q_pieces) -> list[Rect]:
    """The rectangles of query run ``q_run`` (cut into ``q_pieces``) against key run ``k_run``,
    in query order; local coordinates."""
    (q0, _, qg), (k0, k1, kg) = q_run, k_run
    kend = kg + (k1 - k0) - 1
    rects: list[Rect] = []
    for a, a2 in q_pieces:
        l0, l1, h0, h1 = iv.lo[a], iv.lo[a2 - 1], iv.hi[a], iv.hi[a2 - 1]
        if max(l0, kg) > min(h1, kend):
            continue
        rows = (q0 + a - qg, q0 + a2 - qg)
        diag = iv.causal and h0 == a and h1 == a2 - 1 and kg <= a and a2 - 1 <= kend
        if diag and l1 <= a:
            parts = [(l0, l1 - 1, None), (l1, a - 1, FULL), (a, a2 - 1, CAUSAL)]
        elif l1 > h0 + 1:  # a strip taller than the window: its edges overlap, one masked call
            parts = [(l0, h1, None)]
        else:
            parts = [(l0, l1 - 1, None), (l1, h0, FULL), (h0 + 1, h1, None)]
        for c0, c1, kind in parts:
            c0, c1 = max(c0, kg), min(c1, kend)
            if c0 <= c1:
                rect = _rect(iv, rows, (a, a2), (c0, c1), (k0 - kg, kind))
                if rect is not None:
                    rects.append(rect)
    return rects


def _rect(iv: RowIntervals, rows, glob_rows, glob_cols, shift_kind) -> Rect | None:
    (a, a2), (c0, c1), (shift, kind) = glob_rows, glob_cols, shift_kind
    cols = (c0 + shift, c1 + 1 + shift)
    if kind is not None:
        return (*rows, *cols, kind, None)
    j = torch.arange(c0, c1 + 1)
    lo, hi = torch.tensor(iv.lo[a:a2]), torch.tensor(iv.hi[a:a2])
    visible = (j >= lo[:, None]) & (j <= hi[:, None])
    if bool(visible.all()):
        return (*rows, *cols, FULL, None)
    if not bool(visible.any()):
        return None
    return (*rows, *cols, MASKED, visible)


def reference_steps(
    plan: ShardPlan, mask: MaskSpec | bool
) -> tuple[tuple[tuple[Segment, ...], ...], ...]:
    """Per query rank, per ring step, the segments (``AttentionSchedule.steps``), computed as
    cpvlm did before it was vectorized: every rank's rows, loops over runs and pieces."""
    mask = mask if isinstance(mask, MaskSpec) else MaskSpec(causal=mask)
    mask.check(plan, where="attention_schedule")
    w = plan.cp_size
    iv, plain = row_intervals(plan, mask), _plain_docs(plan, mask)
    runs = [_runs(plan, r) for r in range(w)]
    steps = []
    for r in range(w):
        blocks = [
            _group(_rects(iv, runs[r], runs[(r - i) % w], i == 0, plain), _max_hidden(iv))
            for i in range(w)
        ]
        steps.append(_mark_overwrites(blocks, plan.local_len))
    return tuple(steps)


_Run = tuple[int, int, int]
"""(local start, local stop, global start) of a run."""


def _runs(plan: ShardPlan, rank: int) -> dict[int, list[_Run]]:
    """The runs of ``rank``'s shard, per document, in local (= global) order."""
    idx = plan.indices(rank)
    if idx.numel() == 0:
        return {}
    doc = plan.doc_ids[idx]
    starts = torch.ones(idx.numel(), dtype=torch.bool)
    starts[1:] = (idx[1:] != idx[:-1] + 1) | (doc[1:] != doc[:-1])
    bounds = [*torch.nonzero(starts).squeeze(1).tolist(), idx.numel()]
    runs: dict[int, list[_Run]] = {}
    for a, b in zip(bounds[:-1], bounds[1:]):
        d = int(doc[a])
        if d >= 0:
            runs.setdefault(d, []).append((a, b, int(idx[a])))
    return runs


def _rects(
    iv: RowIntervals,
    q_runs: dict[int, list[_Run]],
    k_runs: dict[int, list[_Run]],
    same_rank: bool,
    plain_docs: set[int],
) -> list[Segment]:
    rects = []
    for d in sorted(q_runs.keys() & k_runs.keys()):
        qs, ks = q_runs[d], k_runs[d]
        if same_rank and iv.causal and d in plain_docs and _contiguous(qs):
            # Local order is document order: the rank's part of the document is one causal square.
            rects.append((qs[0][0], qs[-1][1], qs[0][0], qs[-1][1], CAUSAL, None))
            continue
        doc_rects = []
        for q_run in qs:
            q_pieces = pieces(iv, q_run[2], q_run[2] + q_run[1] - q_run[0])
            for k_run in ks:
                doc_rects.extend(pair_rects(iv, q_run, k_run, q_pieces))
        rects.extend(_join(doc_rects))
    segments = []
    for q0, q1, k0, k1, kind, visible in rects:
        if kind == CAUSAL:
            pairs = (q1 - q0) * (q1 - q0 + 1) // 2
        elif kind == MASKED:
            pairs = int(visible.sum())
        else:
            pairs = (q1 - q0) * (k1 - k0)
        segments.append(Segment(q0, q1, k0, k1, kind, pairs, visible=visible))
    return segments


def _plain_docs(plan: ShardPlan, mask: MaskSpec) -> set[int]:
    """Documents whose mask is the plain causal/bidirectional one (no window, no span)."""
    if mask.window is not None:
        return set()
    with_spans = {int(plan.doc_ids[a]) for a, _ in mask.spans} if mask.causal else set()
    return set(range(len(plan.doc_lens))) - with_spans


def _contiguous(runs: list[_Run]) -> bool:
    return all(a[1] == b[0] for a, b in zip(runs[:-1], runs[1:]))


def _join(rects: list[tuple]) -> list[tuple]:
    """Join FULL rectangles with the same rows and adjacent columns, then those with the same
    columns and adjacent rows (rectangles come query run by query run, columns ascending)."""
    return _join_along(_join_along(rects, cols=True), cols=False)


def _join_along(rects: list[tuple], cols: bool) -> list[tuple]:
    out: list[tuple] = []
    for rect in rects:
        if out and out[-1][4] == FULL == rect[4]:
            q0, q1, k0, k1 = out[-1][:4]
            if cols and (q0, q1) == rect[:2] and k1 == rect[2]:
                out[-1] = (q0, q1, k0, rect[3], FULL, None)
                continue
            if not cols and (k0, k1) == rect[2:4] and q1 == rect[0]:
                out[-1] = (q0, rect[1], k0, k1, FULL, None)
                continue
        out.append(rect)
    return out


def _area(seg: Segment) -> int:
    return (seg.q_stop - seg.q_start) * (seg.k_stop - seg.k_start)


def _cost(group: list[Segment]) -> float:
    if len(group) == 1:
        seg = group[0]
        if seg.kind == MASKED:
            return _CALL_COST + _MASKED_PAIR_COST * _area(seg)
        return _CALL_COST + (seg.pairs if seg.kind == CAUSAL else _area(seg))
    return _CALL_COST + _MASKED_PAIR_COST * _bbox_area(group)


def _bbox_area(group: list[Segment]) -> int:
    rows = max(s.q_stop for s in group) - min(s.q_start for s in group)
    cols = max(s.k_stop for s in group) - min(s.k_start for s in group)
    return rows * cols


def _max_hidden(iv: RowIntervals) -> float:
    """Hidden pairs a grouped call may compute: under a window one strip's h x h, so that
    grouping never undoes the skipping (a band's strips would group into their bounding box)."""
    return float("inf") if iv.block is None else iv.block * iv.block


def _group(rects: list[Segment], max_hidden: float) -> tuple[Segment, ...]:
    """Greedily merge consecutive rectangles into masked calls when that is cheaper and the
    call computes at most ``max_hidden`` hidden pairs."""
    groups: list[list[Segment]] = []
    for rect in rects:
        if groups:
            merged = [*groups[-1], rect]
            area = _bbox_area(merged)
            cheaper = _CALL_COST + _MASKED_PAIR_COST * area <= _cost(groups[-1]) + _cost([rect])
            hidden = area - sum(s.pairs for s in merged)
            if area <= _MAX_MASK_ELEMENTS and cheaper and hidden <= max_hidden:
                groups[-1] = merged
                continue
        groups.append([rect])
    return tuple(g[0] if len(g) == 1 else _masked(g) for g in groups)


def _masked(group: list[Segment]) -> Segment:
    q0, q1 = min(s.q_start for s in group), max(s.q_stop for s in group)
    k0, k1 = min(s.k_start for s in group), max(s.k_stop for s in group)
    visible = torch.zeros(q1 - q0, k1 - k0, dtype=torch.bool)
    for s in group:
        block = visible[s.q_start - q0 : s.q_stop - q0, s.k_start - k0 : s.k_stop - k0]
        if s.kind == CAUSAL:
            rows, cols = block.shape
            block |= torch.arange(rows)[:, None] >= torch.arange(cols)  # tril: slow for bool on CPU
        elif s.kind == MASKED:
            block |= s.visible
        else:
            block.fill_(True)
    pairs = sum(s.pairs for s in group)
    # A fused kernel runs the rectangles of the group; an edge's mask is no rectangle, so a group
    # that holds one runs as one dense masked call there too.
    rects = [p for s in group for p in (s.parts if s.kind == MASKED else (s,))]
    dense = any(s.kind == MASKED and not s.parts for s in group)
    return Segment(
        q0, q1, k0, k1, MASKED, pairs, visible=visible, parts=() if dense else tuple(rects)
    )


def _mark_overwrites(
    blocks: list[tuple[Segment, ...]], local_len: int
) -> tuple[tuple[Segment, ...], ...]:
    written = torch.zeros(local_len, dtype=torch.bool)
    marked = []
    for block in blocks:
        out = []
        for seg in block:
            first = not bool(written[seg.rows].any())
            written[seg.rows] = True
            out.append(
                Segment(
                    seg.q_start,
                    seg.q_stop,
                    seg.k_start,
                    seg.k_stop,
                    seg.kind,
                    seg.pairs,
                    overwrite=first,
                    visible=seg.visible,
                    parts=seg.parts,
                )
            )
        marked.append(tuple(out))
    return tuple(marked)
