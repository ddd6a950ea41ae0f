"""The rectangles (query piece, key run) pairs compute under a MaskSpec, with skipping, as arrays.

Legend: i, j = global padded positions of a query and a key; a *run* = consecutive real positions
of one document on one rank (schedule.py); [lo(i), hi(i)] = the keys row i sees, h = strip height
(``block``); every tensor below is 1-d over pairs or rectangles.

Every MaskSpec rule gives each real row an interval of keys of its own document (mask_spec.py):
    lo(i) = the document's start, or max(start, i - w + 1) with a window;
    hi(i) = i (causal; in a span: the span's last position), the document's last position (not
            causal), or min(last, i + w - 1) (not causal, with a window);
and lo, hi never decrease from one real row to the next (hi jumps up at a span's start). So a
query run is cut into *pieces* where hi jumps (span starts and stops) and, with a window, into
strips of h rows (h <= w); a piece [a, a2) then sees the key columns
    [lo(a), lo(a2-1))  left edge: some rows only               -> MASKED (at most h - 1 wide)
    [lo(a2-1), hi(a)]  every row                               -> FULL
    (hi(a), hi(a2-1)]  right edge: some rows only              -> MASKED, or, on a causal text
                       piece of the rank's own keys, the piece's diagonal square -> CAUSAL
each cut to the key run's columns. Columns outside [lo(a), hi(a2-1)] are never computed: a
windowed layer computes its w visible keys per row plus at most a left edge of h x h per strip
(half of it visible), i.e. work S x (w + h/2), not S^2 / 2. Since lo and hi are monotone, whether
a part is wholly, partly or not visible follows from lo and hi at its corners, in closed form:
no per-rectangle mask is built except for the MASKED rectangles themselves.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cpvlm.attention.mask_spec import MaskSpec
from cpvlm.distributed.shard_plan import ShardPlan

FULL = "full"
CAUSAL = "causal"
MASKED = "masked"
KINDS = (FULL, CAUSAL, MASKED)
"""Kind codes of the arrays below: index into KINDS."""
_FULL, _CAUSAL, _MASKED, _EDGE = 0, 1, 2, 3
"""_EDGE: a part whose visibility is still to be decided (FULL, MASKED or nothing)."""

Rect = tuple[int, int, int, int, str, torch.Tensor | None]
"""(local q start, q stop, local k start, k stop, kind, visible [rows, cols] bool for MASKED)."""


def strip_height(window: int) -> int:
    """Rows per strip under a window: the left edge computes up to h(h-1)/2 hidden pairs per
    strip ((h-1)/2w of the work), while each strip costs about three kernel calls. Under 16 rows
    the calls cost more than the pairs: a window narrower than h makes each strip one masked
    call of h x (h + w - 1), h(h-1) of it hidden."""
    return max(16, min(128, window // 16))


@dataclass(frozen=True, eq=False)
class Bands:
    """lo(i) and hi(i) of ``mask`` on ``plan`` in closed form, per position and its document."""

    doc_start: torch.Tensor
    """[D] each document's first padded position."""
    doc_last: torch.Tensor
    """[D] each document's last real position."""
    causal: bool
    window: int | None
    span_start: torch.Tensor
    span_stop: torch.Tensor
    cuts: torch.Tensor
    """Sorted positions where hi jumps (span starts and stops): a piece never crosses one."""
    block: int | None
    """Strip height under a window; None: pieces are whole runs."""

    def lo(self, pos: torch.Tensor, doc: torch.Tensor) -> torch.Tensor:
        start = take(self.doc_start, doc)
        return start if self.window is None else torch.maximum(start, pos - self.window + 1)

    def hi(self, pos: torch.Tensor, doc: torch.Tensor) -> torch.Tensor:
        if not self.causal:
            last = take(self.doc_last, doc)
            return last if self.window is None else torch.minimum(last, pos + self.window - 1)
        if not self.span_start.numel():
            return pos
        k, inside = self._span_of(pos)
        return torch.where(inside, take(self.span_stop, k) - 1, pos)

    def _span_of(self, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        k = (torch.searchsorted(self.span_start, pos, right=True) - 1).clamp(min=0)
        return k, (take(self.span_start, k) <= pos) & (pos < take(self.span_stop, k))

    def first_row_reaching(self, a: torch.Tensor, doc: torch.Tensor, c0: torch.Tensor):
        """The first row i >= a with hi(i) >= c0 (hi is monotone; may lie past the piece)."""
        if not self.causal:
            if self.window is None:
                return a  # hi is the document's last position: a row reaches c0 or none does
            return torch.maximum(a, c0 - self.window + 1)
        if not self.span_start.numel():
            return torch.maximum(a, c0)
        k, inside = self._span_of(c0)
        return torch.maximum(a, torch.where(inside, take(self.span_start, k), c0))


def bands(plan: ShardPlan, mask: MaskSpec) -> Bands:
    padded = torch.tensor(plan.padded_doc_lens)
    start = torch.cumsum(padded, 0) - padded
    spans = torch.tensor(mask.spans, dtype=torch.long).reshape(-1, 2)
    if not mask.causal:
        spans = spans[:0]  # a span adds nothing without causality
    cuts = torch.unique(spans.flatten())
    return Bands(
        doc_start=start,
        doc_last=start + torch.tensor(plan.doc_lens) - 1,
        causal=mask.causal,
        window=mask.window,
        span_start=spans[:, 0].contiguous(),
        span_stop=spans[:, 1].contiguous(),
        cuts=cuts,
        block=None if mask.window is None else strip_height(mask.window),
    )


def take(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``x[index]`` for a 1-d long ``index`` (index_select: a few times faster than indexing)."""
    return x.index_select(0, index)


def _expand(counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(owner, rank within owner) of ``counts.sum()`` items, ``counts[o]`` of them per owner."""
    owner = torch.repeat_interleave(torch.arange(counts.numel()), counts)
    first = torch.cumsum(counts, 0) - counts
    return owner, torch.arange(owner.numel()) - take(first, owner)


def pieces(b: Bands, start: torch.Tensor, stop: torch.Tensor):
    """(run, a, a2): the global [a, a2) pieces of the runs [start, stop), run by run, in order."""
    first = torch.searchsorted(b.cuts, start, right=True)
    last = torch.searchsorted(b.cuts, stop, right=False)
    run, k = _expand(last - first + 1)
    nsub = take(last - first + 1, run)
    top = max(b.cuts.numel() - 1, 0)
    cut = take(b.cuts, (take(first, run) + k - 1).clamp(0, top)) if b.cuts.numel() else k
    sub_a = torch.where(k == 0, take(start, run), cut)
    cut = take(b.cuts, (take(first, run) + k).clamp(0, top)) if b.cuts.numel() else k
    sub_b = torch.where(k == nsub - 1, take(stop, run), cut)
    if b.block is None:
        return run, sub_a, sub_b
    sub, j = _expand(-(-(sub_b - sub_a) // b.block))
    a = take(sub_a, sub) + j * b.block
    return take(run, sub), a, torch.minimum(a + b.block, take(sub_b, sub))


def pair_parts(b: Bands, doc, a, a2, kg, kend):
    """The parts of query pieces [a, a2) against key runs [kg, kend] (global, kend inclusive),
    three slots per pair in the order the module docstring lists them: (pair, c0, c1, kind),
    non-empty parts only, with kind _FULL, _CAUSAL or _EDGE (still to classify)."""
    l0, l1 = b.lo(a, doc), b.lo(a2 - 1, doc)
    h0, h1 = b.hi(a, doc), b.hi(a2 - 1, doc)
    seen = torch.maximum(l0, kg) <= torch.minimum(h1, kend)
    diag = (h0 == a) & (h1 == a2 - 1) & (kg <= a) & (a2 - 1 <= kend) if b.causal else seen & False
    case_a = diag & (l1 <= a)
    case_b = ~case_a & (l1 > h0 + 1)  # a strip taller than the window: one masked call
    edge = torch.full_like(a, _EDGE)
    slot0 = (l0, torch.where(case_b, h1, l1 - 1), edge)
    slot1 = (l1, torch.where(case_a, a - 1, h0), torch.full_like(a, _FULL))
    slot2 = (torch.where(case_a, a, h0 + 1), h1, torch.where(case_a, _CAUSAL, _EDGE))
    c0 = torch.stack([slot0[0], slot1[0], slot2[0]], 1)
    c1 = torch.stack([slot0[1], slot1[1], slot2[1]], 1)
    kind = torch.stack([slot0[2], slot1[2], slot2[2]], 1)
    c0, c1 = torch.maximum(c0, kg[:, None]), torch.minimum(c1, kend[:, None])
    keep = (c0 <= c1) & seen[:, None]
    keep[:, 1:] &= ~case_b[:, None]
    at = torch.nonzero(keep.view(-1)).squeeze(1)
    return at // 3, take(c0.view(-1), at), take(c1.view(-1), at), take(kind.view(-1), at)


def classify_edges(b: Bands, doc, a, a2, c0, c1, kind):
    """Kinds with every _EDGE part decided: _FULL where every row sees every column, _MASKED
    where some do, -1 where none does (lo, hi monotone: the corners decide)."""
    edge = kind == _EDGE
    every = (b.lo(a2 - 1, doc) <= c0) & (b.hi(a, doc) >= c1)
    first = b.first_row_reaching(a, doc, c0)
    some = (first < a2) & (b.lo(first.clamp(max=a2 - 1), doc) <= c1)
    decided = torch.where(every, _FULL, torch.where(some, _MASKED, -1))
    return torch.where(edge, decided, kind)


def visible(b: Bands, doc: int, a: int, a2: int, c0: int, c1: int) -> torch.Tensor:
    """[a2 - a, c1 - c0 + 1] bool: which keys c0..c1 rows a..a2-1 see (global positions)."""
    rows = torch.arange(a, a2)
    d = torch.full_like(rows, doc)
    j = torch.arange(c0, c1 + 1)
    return (j >= b.lo(rows, d)[:, None]) & (j <= b.hi(rows, d)[:, None])
