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

import contextlib
import gc
from functools import cached_property, lru_cache, partial
from itertools import repeat
from operator import itemgetter

import torch

from cpvlm.attention import bands as bd
from cpvlm.attention.bands import CAUSAL, FULL, KINDS, MASKED, take  # noqa: F401 (FULL: re-exported)
from cpvlm.attention.mask_spec import MaskSpec
from cpvlm.distributed import compat
from cpvlm.distributed.shard_plan import ShardPlan

# Cost model for grouping, in units of one (query, key) pair of fused-kernel work. A fused CPU
# kernel call costs about as much as a 32x32 block in fixed overhead (measured: ~20 us per call,
# ~25 ns per pair at Hq=8, D=64); a masked call also reads its mask.
_CALL_COST = 1024
_MASKED_PAIR_COST = 1.25
_MAX_MASK_ELEMENTS = 1 << 18


class Segment(tuple):
    """One kernel call: rows [q_start, q_stop) of the local queries against columns
    [k_start, k_stop) of one rank's keys, with a kind: FULL, CAUSAL (top-left) or MASKED.

    A tuple (q_start, q_stop, k_start, k_stop, kind, pairs) with named fields: a schedule holds
    up to documents x ranks of them, made every step, so ``_blocks`` builds them without a
    Python call each (``tuple.__new__``). The rest (overwrite, parts, the mask) are class
    defaults until set. Equality and hashing are by identity, as for any call object.
    """

    overwrite = False
    """No earlier call in this rank's order wrote these rows: store instead of merging."""
    parts: tuple[Segment, ...] = ()
    """MASKED only: the FULL/CAUSAL rectangles it groups, for kernels that take them in one
    call; () for a call that holds an edge's mask (no rectangle)."""
    _visible = None
    _cache = None

    q_start = property(itemgetter(0))
    q_stop = property(itemgetter(1))
    k_start = property(itemgetter(2))
    k_stop = property(itemgetter(3))
    kind = property(itemgetter(4))
    pairs = property(itemgetter(5), doc="Visible (query, key) pairs: the work this call must do.")
    __eq__ = object.__eq__
    __ne__ = object.__ne__
    __hash__ = object.__hash__

    def __new__(
        cls,
        q_start: int,
        q_stop: int,
        k_start: int,
        k_stop: int,
        kind: str,
        pairs: int,
        overwrite: bool = False,
        visible: torch.Tensor | None = None,
        parts: tuple[Segment, ...] = (),
    ):
        seg = tuple.__new__(cls, (q_start, q_stop, k_start, k_stop, kind, pairs))
        if overwrite:
            seg.overwrite = overwrite
        if visible is not None:
            seg._visible = visible
        if parts:
            seg.parts = parts
        return seg

    def __repr__(self) -> str:
        return (
            f"Segment({self.q_start}, {self.q_stop}, {self.k_start}, {self.k_stop}, "
            f"{self.kind!r}, pairs={self.pairs}, overwrite={self.overwrite})"
        )

    @property
    def rows(self) -> slice:
        return slice(self.q_start, self.q_stop)

    @property
    def cols(self) -> slice:
        return slice(self.k_start, self.k_stop)

    @property
    def visible(self) -> torch.Tensor | None:
        """[q_stop - q_start, k_stop - k_start] bool, MASKED only; built on first use (a fused
        kernel that runs ``parts`` never needs it)."""
        if callable(self._visible):
            self._visible = self._visible()
        return self._visible

    def _cached(self, key, make):
        if self._cache is None:
            self._cache = {}
        if key not in self._cache:
            self._cache[key] = make()
        return self._cache[key]

    def additive_mask(self, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """0 where visible, -inf elsewhere; built once per dtype and device."""

        def make():
            mask = torch.zeros(self.visible.shape, dtype=dtype, device=device)
            return mask.masked_fill_(~self.visible.to(device), float("-inf"))

        return self._cached(("mask", dtype, device), make)

    def empty_rows(self, device: torch.device) -> torch.Tensor:
        """[q_stop - q_start] bool: rows that see no key in this call (their lse is -inf)."""
        return self._cached(("empty", device), lambda: ~self.visible.any(dim=1).to(device))


class AttentionSchedule:
    """Per query rank, per ring step i, the segments of block (r, (r - i) mod W).

    A rank's rows are computed when it first asks for them (``segments``), from arrays over its
    runs and pieces; what every rank must agree on (``last_step``) is computed from all ranks'
    runs without their rectangles."""

    def __init__(self, plan: ShardPlan, mask: MaskSpec):
        self.plan, self.mask = plan, mask
        self._rows: dict[int, tuple[tuple[Segment, ...], ...]] = {}
        self._work: dict[int, tuple[list[int], list[int]]] = {}

    @property
    def causal(self) -> bool:
        return self.mask.causal

    @property
    def block(self) -> int | None:
        """Rows per strip under a window (bands.py); None without one."""
        return self._bands.block

    @cached_property
    def _bands(self) -> bd.Bands:
        return bd.bands(self.plan, self.mask)

    @cached_property
    def _runs(self) -> _Runs:
        return _runs(self.plan)

    @property
    def steps(self) -> tuple[tuple[tuple[Segment, ...], ...], ...]:
        """Every rank's rows (tests, offline tools): a step needs only ``segments``."""
        return tuple(self.rank_steps(r) for r in range(self.plan.cp_size))

    def rank_steps(self, cp_rank: int) -> tuple[tuple[Segment, ...], ...]:
        """Rank ``cp_rank``'s segments of every ring step."""
        if cp_rank not in self._rows:
            self.plan._check_rank(cp_rank)
            with compat.real_tensors(), _gc_paused():
                self._rows[cp_rank] = _blocks(self, cp_rank, _rank_rects(self, cp_rank))
        return self._rows[cp_rank]

    def segments(self, cp_rank: int, step: int) -> tuple[Segment, ...]:
        return self.rank_steps(cp_rank)[step]

    @cached_property
    def last_step(self) -> int:
        """The last ring step at which any rank computes something (0 when none does)."""
        with compat.real_tensors():
            return _last_step(self)

    def step_work(self, cp_rank: int) -> tuple[list[int], list[int]]:
        """Per ring step, rank ``cp_rank``'s kernel calls and computed (query, key) pairs (a
        MASKED call counted in full): what the cost model reads, counted from the rectangles'
        arrays without making their segments when the rank's rows are not made yet."""
        if cp_rank in self._rows:
            rows = self._rows[cp_rank]
            return [len(b) for b in rows], [sum(map(_computed, b)) for b in rows]
        if cp_rank not in self._work:
            self.plan._check_rank(cp_rank)
            with compat.real_tensors():
                rect = _rank_rects(self, cp_rank)
                self._work[cp_rank] = _step_work(self, rect, self.plan.cp_size)
        return self._work[cp_rank]

    def kernel_calls(self, cp_rank: int) -> int:
        return sum(len(block) for block in self.rank_steps(cp_rank))

    def computed_pairs(self, cp_rank: int) -> int:
        """(query, key) pairs rank ``cp_rank`` computes, counting a MASKED call in full."""
        return sum(map(_computed, self._all(cp_rank)))

    def _all(self, cp_rank: int):
        return (seg for block in self.rank_steps(cp_rank) for seg in block)


@contextlib.contextmanager
def _gc_paused():
    """No cyclic garbage collection while a rank's segments are made: they are thousands of
    new objects, each allocation counting towards a collection that, in a training process,
    walks every live object (they hold no cycles; collection resumes after)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def attention_schedule(plan: ShardPlan, mask: MaskSpec | bool) -> AttentionSchedule:
    """The schedule of ``plan`` under ``mask`` (a bool: ``MaskSpec(causal=mask)``), cached: every
    layer of a step with the same mask, and every step with the same document lengths and
    spans, reuses it (and each rank's rows, once computed)."""
    return _schedule(plan, mask if isinstance(mask, MaskSpec) else MaskSpec(causal=mask))


@lru_cache(maxsize=64)
def _schedule(plan: ShardPlan, mask: MaskSpec) -> AttentionSchedule:
    with compat.real_tensors():  # host integers: computed even in a dry run on fake tensors
        mask.check(plan, where="attention_schedule")
    return AttentionSchedule(plan, mask)


# ---- runs -------------------------------------------------------------------------------------


class _Runs:
    """Every rank's runs as arrays, in rank then local order: rank, doc, local start and stop,
    global start; and the same runs in global order (``by_pos``), with each document's first."""

    def __init__(self, rank, doc, lstart, lstop, gstart, num_docs: int, cp_size: int):
        self.rank, self.doc, self.lstart, self.lstop, self.gstart = rank, doc, lstart, lstop, gstart
        self.gend = gstart + lstop - lstart - 1
        self.rank_first = torch.searchsorted(rank, torch.arange(cp_size + 1))
        self.by_pos = torch.argsort(gstart)
        self.doc_first = torch.searchsorted(take(doc, self.by_pos), torch.arange(num_docs + 1))
        self.sorted_gstart = take(gstart, self.by_pos)
        self.sorted_gend = take(self.gend, self.by_pos)


@lru_cache(maxsize=8)
def _runs(plan: ShardPlan) -> _Runs:
    """Every rank's runs, cached per plan: the schedules of its masks (a step's causal and
    windowed layers) share them."""
    table = plan.range_table
    rank, a, b = (table[:, j].contiguous() for j in range(3))
    local = torch.cumsum(b - a, 0) - (b - a) - rank * plan.local_len
    padded = torch.tensor(plan.padded_doc_lens)
    ds = torch.cumsum(padded, 0) - padded
    de = ds + torch.tensor(plan.doc_lens)
    d0 = torch.searchsorted(ds, a, right=True) - 1
    d1 = torch.searchsorted(ds, b - 1, right=True) - 1
    item, k = bd._expand(d1 - d0 + 1)  # a contiguous range may hold several documents
    doc = take(d0, item) + k
    g0, g1 = (
        torch.maximum(take(a, item), take(ds, doc)),
        torch.minimum(take(b, item), take(de, doc)),
    )
    item, doc, g0, g1 = _select(g1 > g0, item, doc, g0, g1)
    rank, l0 = take(rank, item), take(local, item) + g0 - take(a, item)
    l1 = l0 + g1 - g0
    # Ranges that meet (a rank's two middle chunks) make one run.
    new = torch.ones(doc.numel(), dtype=torch.bool)
    new[1:] = (rank[1:] != rank[:-1]) | (doc[1:] != doc[:-1]) | (g0[1:] != g1[:-1])
    first = torch.nonzero(new).squeeze(1)
    last = torch.cat([first[1:], first.new_tensor([doc.numel()])]) - 1
    rank, doc, l0, g0 = (take(x, first) for x in (rank, doc, l0, g0))
    return _Runs(rank, doc, l0, take(l1, last), g0, len(plan.doc_lens), plan.cp_size)


# ---- one rank's rows --------------------------------------------------------------------------


def _plain_docs(plan: ShardPlan, mask: MaskSpec) -> torch.Tensor:
    """[D] bool: documents whose mask is the plain causal/bidirectional one (no window, span)."""
    plain = torch.full((len(plan.doc_lens),), mask.window is None)
    if mask.causal and mask.spans and mask.window is None:
        starts = torch.tensor([a for a, _ in mask.spans])
        plain[plan.doc_ids[starts]] = False
    return plain


def _rank_rects(sched: AttentionSchedule, r: int) -> list[torch.Tensor]:
    """Rank r's rectangles, joined, ungrouped, in its call order: columns (step, doc, q0, q1,
    k0, k1, kind, a, a2, c0, c1), the last four the global rows and columns of an edge."""
    plan, b, runs, w = sched.plan, sched._bands, sched._runs, sched.plan.cp_size
    lo_r, hi_r = int(runs.rank_first[r]), int(runs.rank_first[r + 1])
    q_doc, q_l0, q_l1 = runs.doc[lo_r:hi_r], runs.lstart[lo_r:hi_r], runs.lstop[lo_r:hi_r]
    q_g0 = runs.gstart[lo_r:hi_r]
    q_g1 = q_g0 + q_l1 - q_l0

    # The plain causal documents whose runs on this rank touch: one causal square at step 0.
    square = torch.zeros(q_doc.numel(), dtype=torch.bool)
    if sched.causal and q_doc.numel():
        touch = torch.ones_like(square)
        touch[1:] = (q_doc[1:] != q_doc[:-1]) | (q_l0[1:] == q_l1[:-1])
        bad = torch.zeros(len(plan.doc_lens), dtype=torch.bool)
        bad[q_doc[~touch]] = True
        square = take(_plain_docs(plan, sched.mask) & ~bad, q_doc)

    # (query run, key run) pairs of one document that see each other, key runs in global order:
    # lo, hi are monotone and runs in global order disjoint, so the key runs a query run sees
    # (kg <= hi(its last row), kend >= lo(its first)) are one stretch, found by bisection.
    first = torch.maximum(
        torch.searchsorted(runs.sorted_gend, b.lo(q_g0, q_doc)), take(runs.doc_first, q_doc)
    )
    stop = torch.minimum(
        torch.searchsorted(runs.sorted_gstart, b.hi(q_g1 - 1, q_doc), right=True),
        take(runs.doc_first, q_doc + 1),
    )
    qp, j = bd._expand((stop - first).clamp(min=0))
    kp = take(runs.by_pos, take(first, qp) + j)
    if sched.causal and bool(square.any()):
        qp, kp = _select(~(take(square, qp) & (take(runs.rank, kp) == r)), qp, kp)
    doc, kg, kend = take(q_doc, qp), take(runs.gstart, kp), take(runs.gend, kp)

    # Each pair against every piece of its query run, then the parts of each.
    p_run, p_a, p_a2 = bd.pieces(b, q_g0, q_g1)
    p_count = torch.bincount(p_run, minlength=q_doc.numel())
    p_first = torch.cumsum(p_count, 0) - p_count
    pair, j = bd._expand(p_count[qp])
    piece = take(p_first, take(qp, pair)) + j
    a, a2 = take(p_a, piece), take(p_a2, piece)
    part, c0, c1, kind = bd.pair_parts(b, take(doc, pair), a, a2, take(kg, pair), take(kend, pair))
    pair = take(pair, part)
    a, a2, doc_p = take(a, part), take(a2, part), take(doc, pair)
    kind = bd.classify_edges(b, doc_p, a, a2, c0, c1, kind)
    seen = kind >= 0
    pair, a, a2, c0, c1, kind, doc_p = _select(seen, pair, a, a2, c0, c1, kind, doc_p)
    qr, kr = take(qp, pair), take(kp, pair)
    q0 = take(q_l0 - q_g0, qr) + a
    shift = take(runs.lstart - runs.gstart, kr)
    step = (r - take(runs.rank, kr)) % w

    q1, k0, k1 = q0 + a2 - a, c0 + shift, c1 + 1 + shift
    order = torch.arange(step.numel())
    sq = torch.nonzero(square).squeeze(1)
    if sq.numel():  # the causal squares (step 0): first run's start to last run's stop
        first = torch.ones(sq.numel(), dtype=torch.bool)
        first[1:] = q_doc[sq[1:]] != q_doc[sq[:-1]]
        at = torch.nonzero(first).squeeze(1)
        s0, s1 = take(sq, at), take(sq, torch.cat([at[1:] - 1, at.new_tensor([sq.numel() - 1])]))
        zero = torch.zeros(s0.numel(), dtype=torch.long)
        causal = torch.full_like(zero, bd._CAUSAL)
        d0, l0, l1 = take(q_doc, s0), take(q_l0, s0), take(q_l1, s1)
        new = (zero, d0, l0, l1, l0, l1, causal, zero, zero, zero)
        old = (step, doc_p, q0, q1, k0, k1, kind, a, a2, c0)
        step, doc_p, q0, q1, k0, k1, kind, a, a2, c0 = (torch.cat(x) for x in zip(old, new))
        c1, order = torch.cat([c1, zero]), torch.cat([order, zero])
    d = len(plan.doc_lens)
    key = (step * d + doc_p) * (step.numel() + 1) + order
    perm = torch.argsort(key)
    rect = [x.index_select(0, perm) for x in (step, doc_p, q0, q1, k0, k1, kind, a, a2, c0, c1)]
    rect = _join(rect, cols=True)
    return _join(rect, cols=False)


def _select(keep: torch.Tensor, *xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``x[keep]`` for each x, the mask turned into indices once."""
    at = torch.nonzero(keep).squeeze(1)
    return tuple(x.index_select(0, at) for x in xs)


def _join(rect: list[torch.Tensor], cols: bool) -> list[torch.Tensor]:
    """Join FULL rectangles of one document and block with the same rows and adjacent columns
    (``cols``), or with the same columns and adjacent rows (rectangles come query run by query
    run, columns ascending)."""
    step, doc, q0, q1, k0, k1, kind = rect[:7]
    if step.numel() < 2:
        return rect
    same = (step[1:] == step[:-1]) & (doc[1:] == doc[:-1])
    same &= (kind[1:] == bd._FULL) & (kind[:-1] == bd._FULL)
    if cols:
        same &= (q0[1:] == q0[:-1]) & (q1[1:] == q1[:-1]) & (k0[1:] == k1[:-1])
    else:
        same &= (k0[1:] == k0[:-1]) & (k1[1:] == k1[:-1]) & (q0[1:] == q1[:-1])
    start = torch.ones(step.numel(), dtype=torch.bool)
    start[1:] = ~same
    first = torch.nonzero(start).squeeze(1)
    last = torch.cat([first[1:], first.new_tensor([step.numel()])]) - 1
    out = [take(x, first) for x in rect]
    if cols:
        out[5] = take(k1, last)
    else:
        out[3] = take(q1, last)
    return out


def _edge_pairs(b: bd.Bands, doc, a, a2, c0, c1) -> torch.Tensor:
    """Visible pairs of MASKED edge parts (rows [a, a2), columns [c0, c1]), summed per part."""
    part, j = bd._expand(a2 - a)
    row, d = take(a, part) + j, take(doc, part)
    lo = torch.maximum(b.lo(row, d), take(c0, part))
    hi = torch.minimum(b.hi(row, d), take(c1, part))
    per_row = (hi - lo + 1).clamp(min=0)
    return torch.zeros(a.numel(), dtype=torch.long).index_add_(0, part, per_row)


def _grouping(sched: AttentionSchedule, rect) -> tuple:
    """(pairs, area, edge, cols, joins) of rectangles ``rect``: visible pairs and area per
    rectangle, the MASKED edges, the columns as lists, and per rectangle 1 where it joins the
    call before it (``_group``)."""
    step, doc, q0, q1, k0, k1, kind, a, a2, c0, c1 = rect
    b = sched._bands
    height, width = q1 - q0, k1 - k0
    area = height * width
    pairs = torch.where(kind == bd._CAUSAL, height * (height + 1) // 2, area)
    edge = torch.nonzero(kind == bd._MASKED).squeeze(1)
    if edge.numel():
        pairs[edge] = _edge_pairs(b, *(take(x, edge) for x in (doc, a, a2, c0, c1)))
    max_hidden = float("inf") if b.block is None else b.block * b.block
    cols = [x.tolist() for x in (q0, q1, k0, k1, kind, pairs)]
    merges, extends = _pair_merges(step, q0, q1, k0, k1, kind, pairs, area, max_hidden)
    return pairs, area, edge, cols, _group(cols, step.tolist(), merges, extends, max_hidden)


def _step_work(sched: AttentionSchedule, rect, w: int) -> tuple[list[int], list[int]]:
    """(calls, computed pairs) per ring step of the rectangles ``rect`` once grouped: what
    ``_blocks`` makes of them, counted without making a segment (a MASKED call counts its
    bounding box in full)."""
    step, kind, (q0, q1, k0, k1) = rect[0], rect[6], rect[2:6]
    pairs, area, _, _, joins = _grouping(sched, rect)
    computed = torch.where(kind == bd._MASKED, area, pairs)
    if any(joins):
        join = torch.frombuffer(joins, dtype=torch.uint8).bool()
        first = torch.nonzero(~join).squeeze(1)
        call = torch.cumsum(~join, 0) - 1
        n = first.numel()
        box = [
            torch.zeros(n, dtype=torch.long).scatter_reduce_(0, call, x, op, include_self=False)
            for x, op in ((q0, "amin"), (q1, "amax"), (k0, "amin"), (k1, "amax"))
        ]
        size = torch.bincount(call, minlength=n)
        own = take(computed, first)
        computed = torch.where(size > 1, (box[1] - box[0]) * (box[3] - box[2]), own)
        step = take(step, first)
    calls = torch.bincount(step, minlength=w)
    return calls.tolist(), torch.zeros(w, dtype=torch.long).index_add_(0, step, computed).tolist()


def _blocks(sched: AttentionSchedule, rank: int, rect) -> tuple[tuple[Segment, ...], ...]:
    """The segments of every block, grouped, with their overwrite flags, in ring-step order."""
    step, doc, q0, q1, k0, k1, kind, a, a2, c0, c1 = rect
    b, w = sched._bands, sched.plan.cp_size
    pairs, area, edge, cols, joins = _grouping(sched, rect)
    kinds = [KINDS[k] for k in cols[4]]
    segs = list(map(tuple.__new__, repeat(Segment), zip(*cols[:4], kinds, cols[5])))
    for n, d, x, x2, y, y2 in zip(
        edge.tolist(), *(take(t, edge).tolist() for t in (doc, a, a2, c0, c1))
    ):
        segs[n]._visible = _edge_mask(b, d, x, x2, y, y2)  # built on first use
    if any(joins):
        join = torch.frombuffer(joins, dtype=torch.uint8).bool()
        first = torch.nonzero(~join).squeeze(1)
        call = torch.cumsum(~join, 0) - 1
        box = [
            torch.zeros(first.numel(), dtype=torch.long).scatter_reduce_(
                0, call, x, op, include_self=False
            )
            for x, op in ((q0, "amin"), (q1, "amax"), (k0, "amin"), (k1, "amax"), (pairs, "sum"))
        ]
        dense = torch.zeros(first.numel(), dtype=torch.bool).index_put_(
            (call,), kind == bd._MASKED, accumulate=True
        )
        stop = torch.cat([first[1:], first.new_tensor([len(segs)])])
        many = stop - first > 1
        calls, at = [], 0
        grouped = zip(*(x[many].tolist() for x in (first, stop, *box, dense)))
        for a0, a1, bq0, bq1, bk0, bk1, total, edges in grouped:
            calls += segs[at:a0]
            group = segs[a0:a1]
            call = tuple.__new__(Segment, (bq0, bq1, bk0, bk1, MASKED, total))
            call._visible = partial(_union, group, bq0, bk0)  # built on first use
            if not edges:  # an edge's mask is no rectangle: a group with one runs dense
                call.parts = tuple(group)
            calls.append(call)
            at = a1
        segs = calls + segs[at:]
        step, q0, q1 = take(step, first), box[0], box[1]
    bounds = torch.searchsorted(step, torch.arange(w + 1)).tolist()
    runs = sched._runs
    lo, hi = int(runs.rank_first[rank]), int(runs.rank_first[rank + 1])
    real = (runs.lstart[lo:hi], runs.lstop[lo:hi])
    _mark_overwrites(segs, q0[: bounds[1]], q1[: bounds[1]], real, sched.plan.local_len)
    return tuple(tuple(segs[bounds[i] : bounds[i + 1]]) for i in range(w))


def _mark_overwrites(segs: list[Segment], q0, q1, real, local_len: int):
    """Mark the calls that are the first, in this rank's order, to write any of their rows.

    ``q0``, ``q1``: the rows of the step-0 calls; ``real``: the rank's runs (starts, stops).
    Step 0 writes every real row (each sees itself), so no later call is first; its calls come
    in ascending first rows, so a call is first iff every call before it stops at or before its
    first row (a running maximum), and the rows left unwritten are the gaps that maximum leaves.
    """
    n0 = q0.numel()
    if not n0 or not bool((q0[1:] >= q0[:-1]).all()):
        return _mark_overwrites_from(segs, 0, bytearray(local_len))
    reach = torch.cummax(q1, 0).values
    before = torch.cat([q1.new_zeros(1), reach[:-1]])
    for n in torch.nonzero((before <= q0) | (q1 == q0)).squeeze(1).tolist():
        segs[n].overwrite = True  # the class default is False
    gap = torch.nonzero(before < q0).squeeze(1)
    g0 = torch.cat([take(before, gap), reach[-1:]])
    g1 = torch.cat([take(q0, gap), q0.new_tensor([local_len])])
    # The first real run that ends after a gap's start; it is unwritten iff it starts before the
    # gap's stop (runs are disjoint and ascending).
    r0, r1 = real
    k = torch.searchsorted(r1, g0, right=True)
    inside = k < r0.numel()
    if not bool((take(r0, k[inside]) < g1[inside]).any()):
        return
    written = bytearray(local_len)  # some real row unwritten (no mask leaves one today)
    for a, b in zip(q0.tolist(), q1.tolist()):
        written[a:b] = b"\x01" * (b - a)
    _mark_overwrites_from(segs, n0, written)


def _mark_overwrites_from(segs: list[Segment], start: int, written: bytearray) -> None:
    ones = memoryview(b"\x01" * len(written))
    for seg in segs[start:]:
        q0, q1 = seg[0], seg[1]
        if written.find(1, q0, q1) < 0:
            seg.overwrite = True
        written[q0:q1] = ones[: q1 - q0]


def _edge_mask(b: bd.Bands, doc: int, a: int, a2: int, c0: int, c1: int):
    return lambda: bd.visible(b, doc, a, a2, c0, c1)


def _single_cost(kind, pairs, area):
    masked = _CALL_COST + _MASKED_PAIR_COST * area
    return torch.where(
        kind == bd._MASKED,
        masked,
        _CALL_COST + torch.where(kind == bd._CAUSAL, pairs, area).double(),
    )


def _pair_merges(step, q0, q1, k0, k1, kind, pairs, area, max_hidden: float):
    """The rectangles n that the greedy of ``_group`` merges into rectangle n - 1 when that one
    is a call of its own (the test against a one-rectangle call, for all n at once), and for
    each whether rectangle n + 1 then joins the two (the greedy's next test, also at once)."""
    if step.numel() < 2:
        return [], []
    cost = _single_cost(kind, pairs, area.double())
    rows = torch.maximum(q1[1:], q1[:-1]) - torch.minimum(q0[1:], q0[:-1])
    merged = rows * (torch.maximum(k1[1:], k1[:-1]) - torch.minimum(k0[1:], k0[:-1]))
    pair_cost = _CALL_COST + _MASKED_PAIR_COST * merged.double()
    ok = (step[1:] == step[:-1]) & (merged <= _MAX_MASK_ELEMENTS)
    ok &= pair_cost <= cost[1:] + cost[:-1]
    ok &= (merged - (pairs[1:] + pairs[:-1])).double() <= max_hidden
    n = torch.nonzero(ok).squeeze(1) + 1
    # Rectangle m = n + 1 against the call (n - 1, n); n = len - 1 has no next rectangle.
    n3 = n[n < step.numel() - 1]
    m, p = n3 + 1, n3 - 1
    rows = _max3(q1, p, n3, m) - torch.minimum(
        take(q0, m), torch.minimum(take(q0, p), take(q0, n3))
    )
    cols = _max3(k1, p, n3, m) - torch.minimum(
        take(k0, m), torch.minimum(take(k0, p), take(k0, n3))
    )
    merged3 = rows * cols
    ext = (take(step, m) == take(step, n3)) & (merged3 <= _MAX_MASK_ELEMENTS)
    ext &= _CALL_COST + _MASKED_PAIR_COST * merged3.double() <= take(pair_cost, p) + take(cost, m)
    hidden = merged3 - (take(pairs, p) + take(pairs, n3) + take(pairs, m))
    ext &= hidden.double() <= max_hidden
    return n.tolist(), ext.tolist() + [False] * (n.numel() - n3.numel())


def _max3(x, i, j, k):
    return torch.maximum(take(x, k), torch.maximum(take(x, i), take(x, j)))


def _group(cols, step: list[int], merges: list[int], extends: list[bool], max_hidden: float):
    """Greedily merge consecutive rectangles of a block into masked calls when that is cheaper
    and the call computes at most ``max_hidden`` hidden pairs (under a window one strip's h x h,
    so that grouping never undoes the skipping): per rectangle, 1 where it joins the call of the
    one before (a bytearray). The greedy runs only from the pairs ``merges`` on (elsewhere every
    rectangle after a call of its own is one too), and past the pair only where ``extends``
    (``_pair_merges``) says the next rectangle joins it."""
    q0s, q1s, k0s, k1s, kinds, pairs = cols
    joins = bytearray(len(q0s))
    decided = -1
    for n, more in zip(merges, extends):
        if n <= decided:
            continue
        joins[n] = 1
        if not more:
            decided = n + 1
            continue
        p = n - 1
        bq0, bq1 = min(q0s[p], q0s[n]), max(q1s[p], q1s[n])
        bk0, bk1 = min(k0s[p], k0s[n]), max(k1s[p], k1s[n])
        total = pairs[p] + pairs[n]
        cost = _CALL_COST + _MASKED_PAIR_COST * (bq1 - bq0) * (bk1 - bk0)
        m = n + 1
        while m < len(q0s) and step[m] == step[n]:
            q0, q1, k0, k1, kind, pm = q0s[m], q1s[m], k0s[m], k1s[m], kinds[m], pairs[m]
            area = (q1 - q0) * (k1 - k0)
            if kind == bd._MASKED:
                own = _CALL_COST + _MASKED_PAIR_COST * area
            else:
                own = _CALL_COST + (pm if kind == bd._CAUSAL else area)
            cq0, cq1, ck0, ck1 = min(bq0, q0), max(bq1, q1), min(bk0, k0), max(bk1, k1)
            merged = (cq1 - cq0) * (ck1 - ck0)
            joined = _CALL_COST + _MASKED_PAIR_COST * merged
            if not (
                merged <= _MAX_MASK_ELEMENTS
                and joined <= cost + own
                and merged - (total + pm) <= max_hidden
            ):
                break
            bq0, bq1, bk0, bk1, total, cost = cq0, cq1, ck0, ck1, total + pm, joined
            joins[m] = 1
            m += 1
        decided = m
    return joins


def _area(seg: Segment) -> int:
    return (seg.q_stop - seg.q_start) * (seg.k_stop - seg.k_start)


def _computed(seg: Segment) -> int:
    return _area(seg) if seg.kind == MASKED else seg.pairs


def _union(group: list[Segment], q0: int, k0: int) -> torch.Tensor:
    q1, k1 = max(s.q_stop for s in group), max(s.k_stop for s in group)
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
    return visible


# ---- what every rank agrees on ----------------------------------------------------------------


def _last_step(sched: AttentionSchedule) -> int:
    """The last ring step i at which some rank r sees a key of rank (r - i) mod W: tested run
    pair by run pair (lo, hi are monotone: a run sees a key run iff its first row that reaches
    the key run's start sees no further than the key run's end), from i = W - 1 down."""
    plan, b, runs, w = sched.plan, sched._bands, sched._runs, sched.plan.cp_size
    d = len(plan.doc_lens)
    # Runs are in (rank, document) order: a table of each (rank, document)'s first run and count.
    count = torch.bincount(runs.rank * d + runs.doc, minlength=w * d)
    first_of = torch.cumsum(count, 0) - count
    qa = runs.gstart
    qb = qa + runs.lstop - runs.lstart
    for i in range(w - 1, 0, -1):
        target = ((runs.rank - i) % w) * d + runs.doc
        q, j = bd._expand(take(count, target))
        k = take(take(first_of, target), q) + j
        doc, kg, kend, qb_q = (
            take(runs.doc, q),
            take(runs.gstart, k),
            take(runs.gend, k),
            take(qb, q),
        )
        row = b.first_row_reaching(take(qa, q), doc, kg)
        if bool(((row < qb_q) & (b.lo(torch.minimum(row, qb_q - 1), doc) <= kend)).any()):
            return i
    return 0
