"""Where every position of a packed sequence lives: the two layouts of ``ShardPlan``.

Legend: W = cp_size, n = a document's length, p = its padded length, c = p / 2W (chunk length),
work(n) = n (n + 1) / 2 (the causal (q, k) pairs of a document), M = sum of work / W (a rank's
mean share), L = local length (equal on every rank).

Both layouts keep the documents in their order in the padded sequence, each followed by its own
padding, and give every rank its positions in ascending order (so that a rank's positions of one
document are in the document's order: the block schedule relies on it).

``head_tail`` (the default): every document is padded to a multiple of 2W and cut into 2W chunks;
rank r holds chunks r and 2W-1-r of every document. Every rank gets the same causal work of each
document, whatever the mix, but a short document pays up to 2W-1 padding tokens and is cut into
chunks of a few tokens (many tiny kernel calls).

``balanced``: documents long enough to need splitting keep head-tail; the others are placed whole,
balancing causal work across ranks. The rule, deterministic and computed from the lengths alone:
  1. Sort the documents by length, longest first (ties: lower index first).
  2. For a candidate k, split the k first documents head-tail. Place the others, in that order,
     whole on the rank with the least causal work so far (ties: lower rank) among the ranks whose
     tokens stay within ``cap = ceil(total tokens / W)`` with it (total tokens: whole documents
     unpadded, split documents padded); if no rank has room, on the rank with the fewest tokens
     (ties: least work, then lower rank). This is LPT scheduling with a token capacity.
  3. L is the largest rank's token count; the ranks with fewer tokens get padding positions at the
     end of the sequence (a padding-only tail, rank by rank) so that every rank holds L.
  4. Candidates are k = 0 .. K, where the K longest documents each carry at least M/8 of causal
     work (documents worth splitting), and k = all documents (per-document head-tail, so the rule
     is never worse than the default by its own measure). Keep the k with the smallest
     ``(max rank work / mean rank work - 1) + padding tokens / real tokens``; ties: smaller k.
     The score is compared in exact integers (the denominators are the same for every k).
Large documents thus end up split only where placing them whole would unbalance the ranks or cost
more padding than it saves; every document placed whole costs no padding at all.

``contiguous`` (``ShardPlan.contiguous``, for bidirectional attention such as a vision tower's):
the documents unpadded, one after another; rank r holds the real positions ``[cuts[r],
cuts[r+1])``, which may begin or end inside a document, then its padding in the tail as above.
Under a causal mask this would give the last rank the most work; without one, contiguous ranges of
balanced length are balanced.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

import torch

from cpvlm.constants import LAYOUTS

_SPLIT_WORTH = 8
"""A document is a split candidate when it carries at least M / _SPLIT_WORTH of causal work."""


@dataclass(frozen=True, eq=False)
class Layout:
    """Positions of a packed sequence over W ranks."""

    padded_doc_lens: tuple[int, ...]
    """Each document with its own padding (a multiple of 2W when split, its length when whole)."""
    padded_len: int
    """The padded sequence: the padded documents, then a padding-only tail (balanced only)."""
    ranges: torch.Tensor
    """``[R, 3]`` (rank, start, stop): every rank's ascending ``[start, stop)`` ranges of padded
    positions, rank by rank; every rank's add up to the same length."""
    whole_on: tuple[int, ...]
    """Per document, the rank that holds it whole, or -1 when it is split head-tail."""


def work(n: int) -> int:
    """Causal (query, key) pairs of a document of ``n`` tokens."""
    return n * (n + 1) // 2


def split_padded_len(n: int, w: int) -> int:
    return -(-n // (2 * w)) * (2 * w)


def head_tail_work(n: int, w: int) -> list[int]:
    """Causal pairs of a head-tail split document's real tokens on each rank."""
    c = split_padded_len(n, w) // (2 * w)
    shares = []
    for r in range(w):
        total = 0
        for chunk in (r, 2 * w - 1 - r):
            lo, hi = chunk * c, min((chunk + 1) * c, n)
            total += work(hi) - work(lo) if hi > lo else 0
        shares.append(total)
    return shares


@lru_cache(maxsize=256)
def build_layout(doc_lens: tuple[int, ...], cp_size: int, layout: str) -> Layout:
    """The layout of documents ``doc_lens`` over ``cp_size`` ranks (cached: a pure function)."""
    if layout not in LAYOUTS:
        raise ValueError(f"ShardPlan: layout must be one of {LAYOUTS}, got {layout!r}")
    if layout == "head_tail":
        whole_on = (-1,) * len(doc_lens)
    else:
        whole_on = _balanced_placement(doc_lens, cp_size)
    return _positions(doc_lens, cp_size, whole_on)


def _positions(doc_lens: Sequence[int], w: int, whole_on: Sequence[int]) -> Layout:
    n = torch.tensor(doc_lens, dtype=torch.long)
    owner = torch.tensor(whole_on, dtype=torch.long)
    split = owner < 0
    p = torch.where(split, -(-n // (2 * w)) * (2 * w), n)
    start = torch.cumsum(p, 0) - p
    # Whole documents: one range on their owner. Split ones: chunks r and 2W-1-r on rank r.
    whole = torch.nonzero(~split).squeeze(1)
    cut = torch.nonzero(split).squeeze(1)
    c = (p[cut] // (2 * w))[:, None]
    r = torch.arange(w)[None, :]
    head = start[cut][:, None] + r * c
    tail = start[cut][:, None] + (2 * w - 1 - r) * c
    ranks = torch.cat([owner[whole], r.expand_as(head).flatten(), r.expand_as(tail).flatten()])
    a = torch.cat([start[whole], head.flatten(), tail.flatten()])
    b = torch.cat([start[whole] + n[whole], (head + c).flatten(), (tail + c).flatten()])
    tokens = torch.zeros(w, dtype=torch.long).index_add_(0, ranks, b - a)
    local_len = int(tokens.max())
    # The tail: rank by rank, so every rank's positions stay ascending.
    fill = local_len - tokens
    tail_a = int(p.sum()) + torch.cumsum(fill, 0) - fill
    ranks, a, b = (
        torch.cat([ranks, torch.arange(w)]),
        torch.cat([a, tail_a]),
        torch.cat([b, tail_a + fill]),
    )
    return Layout(
        padded_doc_lens=tuple(p.tolist()),
        padded_len=int(tail_a[-1] + fill[-1]),
        ranges=_table(ranks, a, b),
        whole_on=tuple(whole_on),
    )


def _table(ranks: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``[R, 3]`` (rank, start, stop) of the non-empty ranges, by rank, then start."""
    keep = b > a
    ranks, a, b = ranks[keep], a[keep], b[keep]
    order = torch.argsort(ranks * (int(b.max()) + 1) + a)
    return torch.stack([ranks[order], a[order], b[order]], 1)


def contiguous_layout(doc_lens: tuple[int, ...], cuts: tuple[int, ...]) -> Layout:
    """Rank r holds real positions ``[cuts[r], cuts[r+1])`` of the unpadded documents, then its
    padding at the tail. ``cuts`` ascend from 0 to sum(doc_lens); ``whole_on`` names the rank of
    every document that lies within one range (-1: it is cut)."""
    total = sum(doc_lens)
    if len(cuts) < 2 or cuts[0] != 0 or cuts[-1] != total:
        raise ValueError(
            f"ShardPlan.contiguous: cuts must run from 0 to the total length {total} (one more "
            f"than the ranks), got {list(cuts)}"
        )
    if any(isinstance(c, bool) or not isinstance(c, int) for c in cuts) or any(
        b < a for a, b in zip(cuts[:-1], cuts[1:])
    ):
        raise ValueError(f"ShardPlan.contiguous: cuts must be ascending ints, got {list(cuts)}")
    w = len(cuts) - 1
    local_len = max(b - a for a, b in zip(cuts[:-1], cuts[1:]))
    ranges: list[list[tuple[int, int]]] = [[(cuts[r], cuts[r + 1])] for r in range(w)]
    start = total
    for r in range(w):  # the tail, rank by rank: every rank's positions stay ascending
        pad = local_len - (cuts[r + 1] - cuts[r])
        ranges[r].append((start, start + pad))
        start += pad
    whole_on, doc_start = [], 0
    for n in doc_lens:
        ranks = [r for r in range(w) if cuts[r] <= doc_start and doc_start + n <= cuts[r + 1]]
        whole_on.append(ranks[0] if ranks else -1)
        doc_start += n
    table = [(r, a, b) for r, rs in enumerate(ranges) for a, b in rs]
    return Layout(
        padded_doc_lens=tuple(doc_lens),
        padded_len=start,
        ranges=_table(*torch.tensor(table, dtype=torch.long).T),
        whole_on=tuple(whole_on),
    )


def _balanced_placement(doc_lens: tuple[int, ...], w: int) -> tuple[int, ...]:
    """``whole_on`` of the balanced layout (the rule in the module docstring)."""
    if w == 1:
        return (0,) * len(doc_lens)
    order = sorted(range(len(doc_lens)), key=lambda d: (-doc_lens[d], d))
    total_work = sum(work(n) for n in doc_lens)
    worth = sum(1 for d in order if _SPLIT_WORTH * w * work(doc_lens[d]) >= total_work)
    # Tokens and work per rank of splitting the k longest documents, for every k at once.
    n = torch.tensor([doc_lens[d] for d in order], dtype=torch.long)
    split_tokens = torch.cumsum(-(-n // (2 * w)) * 2, 0).tolist()
    split_works = torch.cumsum(_head_tail_works(n, w), 0).tolist()
    rest = torch.cumsum(n.flip(0), 0).flip(0).tolist() + [0]
    # Every candidate's score is bounded below before its greedy pass: the busiest rank holds at
    # least the cap of tokens (their mean) and at least the work of the split documents' busiest
    # rank, the mean, and the least loaded rank's plus the longest whole document. Candidates go
    # in the order of that bound; one whose bound cannot beat the best so far (by score, then by
    # smaller k) is skipped, so the k kept is the one that scoring every candidate keeps.
    seq_len, mean_work = sum(doc_lens), -(-total_work // w)
    candidates = []
    for k in (*range(worth + 1), len(order)):
        split_total = w * split_tokens[k - 1] if k else 0
        cap = -(-(split_total + rest[k]) // w)
        split_work = split_works[k - 1] if k else [0] * w
        most_work = max(max(split_work), mean_work)
        if k < len(order):
            most_work = max(most_work, min(split_work) + work(doc_lens[order[k]]))
        bound = (w * most_work - total_work) * seq_len + (w * cap - seq_len) * total_work
        candidates.append((bound, k))
    best = None
    for bound, k in sorted(candidates):
        if best is not None and (bound, k) > best[:2]:
            continue
        tokens = [split_tokens[k - 1]] * w if k else [0] * w
        works = list(split_works[k - 1]) if k else [0] * w
        whole_on, tokens, works = _place(doc_lens, w, order, k, tokens, works, rest[k])
        padding = w * max(tokens) - seq_len
        # (max/mean - 1) + padding/S, times total_work * S: the same factor for every k.
        score = (w * max(works) - total_work) * seq_len + padding * total_work
        if best is None or (score, k) < best[:2]:
            best = (score, k, whole_on)
    return best[2]


def _head_tail_works(n: torch.Tensor, w: int) -> torch.Tensor:
    """``[D, W]`` ``head_tail_work`` of every document of lengths ``n``."""
    c = (-(-n // (2 * w)))[:, None]
    r = torch.arange(w)[None, :]

    def chunk(j):
        lo, hi = torch.minimum(j * c, n[:, None]), torch.minimum((j + 1) * c, n[:, None])
        return (hi * (hi + 1) - lo * (lo + 1)) // 2

    return chunk(r) + chunk(2 * w - 1 - r)


def _place(doc_lens, w, order, k, tokens, works, rest):
    """Split ``order[:k]`` head-tail (``tokens``, ``works``: theirs per rank), place the rest
    (``rest`` tokens) whole: LPT on causal work with a token cap."""
    whole_on = [-1] * len(doc_lens)
    cap = -(-(sum(tokens) + rest) // w)
    ranks = range(w)
    by_work = [(works[q], q) for q in ranks]  # a heap: the least work first (ties: lower rank)
    heapq.heapify(by_work)
    for d in order[k:]:
        n = doc_lens[d]
        r = by_work[0][1]
        fast = tokens[r] <= cap - n
        if not fast:  # the least loaded rank is full: the least loaded with room, or the emptiest
            room = min((e for e in by_work if tokens[e[1]] <= cap - n), default=None)
            r = room[1] if room else min(ranks, key=lambda q: (tokens[q], works[q], q))
            by_work.remove((works[r], r))
        tokens[r] += n
        works[r] += n * (n + 1) // 2
        whole_on[d] = r
        if fast:
            heapq.heapreplace(by_work, (works[r], r))
        else:
            heapq.heapify(by_work)
            heapq.heappush(by_work, (works[r], r))
    return tuple(whole_on), tokens, works
