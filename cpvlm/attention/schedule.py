"""Block schedule of CP attention: which rectangles of each (query rank, key rank) block to compute.

Legend: W = cp_size, r = query rank, s = key/value rank, local coordinates = positions in a rank's
shard (0..S_loc), "real" = not padding, a *run* = a maximal stretch of a rank's shard that holds
consecutive real positions of one document.

Everything is derived from the plan's positions, whatever its layout: every rank's positions are
ascending, so a rank's positions of one document are in document order and the mask between the
runs of two ranks is a staircase. Document by document, block (r, s) is, under the plain masks
(``MaskSpec(causal)``, no window, no span):
  - not causal:      every real row of the document x every real column, FULL;
  - causal, s == r:  the document's rows x the same columns, top-left CAUSAL (one square when its
                     runs on the rank are contiguous, which both layouts guarantee);
  - causal, s != r:  each query run x the key runs that lie wholly before it, FULL (runs of two
                     ranks never interleave inside a run); later key runs are hidden.
Adjacent rectangles with the same rows or the same columns are joined. Under head-tail (rank r
holds chunks r and t = 2W-1-r of a document) this gives at most one rectangle per document and
block: for s < r both query chunks x chunk s; for s > r chunk t x both key chunks. Padding never
enters a rectangle, so it stays out of every real row's softmax and padding rows receive nothing.
Everything else in the block (other documents, the hidden halves) is never computed.

Under a sliding window or bidirectional spans (mask_spec.py) each query row sees an interval of
keys, and bands.py turns each (query run, key run) pair into FULL, CAUSAL and MASKED rectangles
from those intervals (with a window: strips of h rows, skipping every key outside the window);
the plain masks give the rectangles above through the same path.

Many tiny documents would mean many tiny kernel calls; consecutive small rectangles are grouped
into one masked rectangle with an explicit mask when that is cheaper (see _group); under a
window a grouped call holds at most one strip's h x h hidden pairs, so grouping keeps the skipping.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import lru_cache

import torch

from cpvlm.attention.bands import (
    CAUSAL,
    FULL,
    MASKED,
    RowIntervals,
    pair_rects,
    pieces,
    row_intervals,
)
from cpvlm.attention.mask_spec import MaskSpec
from cpvlm.distributed import compat
from cpvlm.distributed.shard_plan import ShardPlan

# Cost model for grouping, in units of one (query, key) pair of fused-kernel work. A fused CPU
# kernel call costs about as much as a 32x32 block in fixed overhead (measured: ~20 us per call,
# ~25 ns per pair at Hq=8, D=64); a masked call also reads its mask.
_CALL_COST = 1024
_MASKED_PAIR_COST = 1.25
_MAX_MASK_ELEMENTS = 1 << 18


@dataclass(frozen=True, eq=False)
class Segment:
    """One kernel call: rows [q_start, q_stop) of the local queries against columns
    [k_start, k_stop) of one rank's keys, with a kind: FULL, CAUSAL (top-left) or MASKED."""

    q_start: int
    q_stop: int
    k_start: int
    k_stop: int
    kind: str
    pairs: int
    """Visible (query, key) pairs: the work this call must do."""
    overwrite: bool = False
    """No earlier call in this rank's order wrote these rows: store instead of merging."""
    visible: torch.Tensor | None = field(default=None, repr=False)
    """[q_stop - q_start, k_stop - k_start] bool, MASKED only."""
    parts: tuple[Segment, ...] = field(default=(), repr=False)
    """MASKED only: the FULL/CAUSAL rectangles it groups, for kernels that take them in one call."""
    _cache: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def rows(self) -> slice:
        return slice(self.q_start, self.q_stop)

    @property
    def cols(self) -> slice:
        return slice(self.k_start, self.k_stop)

    def additive_mask(self, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """0 where visible, -inf elsewhere; built once per dtype and device."""
        key = ("mask", dtype, device)
        if key not in self._cache:
            mask = torch.zeros(self.visible.shape, dtype=dtype, device=device)
            self._cache[key] = mask.masked_fill_(~self.visible.to(device), float("-inf"))
        return self._cache[key]

    def empty_rows(self, device: torch.device) -> torch.Tensor:
        """[q_stop - q_start] bool: rows that see no key in this call (their lse is -inf)."""
        key = ("empty", device)
        if key not in self._cache:
            self._cache[key] = ~self.visible.any(dim=1).to(device)
        return self._cache[key]


@dataclass(frozen=True, eq=False)
class AttentionSchedule:
    """Per query rank, per ring step i, the segments of block (r, (r - i) mod W)."""

    plan: ShardPlan
    mask: MaskSpec
    steps: tuple[tuple[tuple[Segment, ...], ...], ...]
    block: int | None = None
    """Rows per strip under a window (bands.py); None without one."""

    @property
    def causal(self) -> bool:
        return self.mask.causal

    def segments(self, cp_rank: int, step: int) -> tuple[Segment, ...]:
        return self.steps[cp_rank][step]

    def kernel_calls(self, cp_rank: int) -> int:
        return sum(len(block) for block in self.steps[cp_rank])

    def computed_pairs(self, cp_rank: int) -> int:
        """(query, key) pairs rank ``cp_rank`` computes, counting a MASKED call in full."""
        return sum(_area(seg) if seg.kind == MASKED else seg.pairs for seg in self._all(cp_rank))

    def _all(self, cp_rank: int):
        return (seg for block in self.steps[cp_rank] for seg in block)


def attention_schedule(plan: ShardPlan, mask: MaskSpec | bool) -> AttentionSchedule:
    """The schedule of ``plan`` under ``mask`` (a bool: ``MaskSpec(causal=mask)``), cached: every
    layer of a step with the same mask, and every step with the same document lengths and
    spans, reuses it."""
    with compat.real_tensors():  # host integers: computed even in a dry run on fake tensors
        return _schedule(plan, mask if isinstance(mask, MaskSpec) else MaskSpec(causal=mask))


@lru_cache(maxsize=64)
def _schedule(plan: ShardPlan, mask: MaskSpec) -> AttentionSchedule:
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
    return AttentionSchedule(plan, mask, tuple(steps), iv.block)


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
            out.append(replace(seg, overwrite=first))
        marked.append(tuple(out))
    return tuple(marked)
