"""The rectangles one (query run, key run) pair computes under a MaskSpec, with skipping.

Legend: i, j = global padded positions of a query and a key; a *run* = (local start, local stop,
global start) of consecutive real positions of one document on one rank (schedule.py);
[lo(i), hi(i)] = the keys row i sees, h = strip height (``block``).

Every MaskSpec rule gives each real row an interval of keys of its own document (mask_spec.py):
    lo(i) = the document's start, or max(start, i - w + 1) with a window;
    hi(i) = i (causal; in a span: the span's last position), the document's last position (not
            causal), or min(last, i + w - 1) (not causal, with a window);
and lo, hi never decrease from one row to the next, except that hi jumps at a span's start.
So a query run is cut into *pieces* where hi jumps (span starts and stops) and, with a window,
into strips of h rows (h <= w); a piece [a, a2) then sees the key columns
    [lo(a), lo(a2-1))  left edge: some rows only               -> MASKED (at most h - 1 wide)
    [lo(a2-1), hi(a)]  every row                               -> FULL
    (hi(a), hi(a2-1)]  right edge: some rows only              -> MASKED, or, on a causal text
                       piece of the rank's own keys, the piece's diagonal square -> CAUSAL
each cut to the key run's columns. Columns outside [lo(a), hi(a2-1)] are never computed: a
windowed layer computes its w visible keys per row plus at most a left edge of h x h per strip
(half of it visible), i.e. work S x (w + h/2), not S^2 / 2.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import torch

from cpvlm.attention.mask_spec import MaskSpec, doc_starts
from cpvlm.distributed.shard_plan import ShardPlan

FULL = "full"
CAUSAL = "causal"
MASKED = "masked"

Rect = tuple[int, int, int, int, str, torch.Tensor | None]
"""(local q start, q stop, local k start, k stop, kind, visible [rows, cols] bool for MASKED)."""


def strip_height(window: int) -> int:
    """Rows per strip under a window: the left edge computes up to h(h-1)/2 hidden pairs per
    strip ((h-1)/2w of the work), while each strip costs about three kernel calls. Under 16 rows
    the calls cost more than the pairs: a window narrower than h makes each strip one masked
    call of h x (h + w - 1), h(h-1) of it hidden."""
    return max(16, min(128, window // 16))


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
