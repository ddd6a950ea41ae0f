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

from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

from cpvlm.constants import LAYOUTS

Ranges = tuple[tuple[int, int], ...]

_SPLIT_WORTH = 8
"""A document is a split candidate when it carries at least M / _SPLIT_WORTH of causal work."""


@dataclass(frozen=True)
class Layout:
    """Positions of a packed sequence over W ranks."""

    padded_doc_lens: tuple[int, ...]
    """Each document with its own padding (a multiple of 2W when split, its length when whole)."""
    padded_len: int
    """The padded sequence: the padded documents, then a padding-only tail (balanced only)."""
    ranges: tuple[Ranges, ...]
    """Per rank, ascending ``[start, stop)`` ranges of padded positions; equal total length."""
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
    ranges: list[list[tuple[int, int]]] = [[] for _ in range(w)]
    padded_doc_lens, start = [], 0
    for n, owner in zip(doc_lens, whole_on):
        if owner >= 0:
            ranges[owner].append((start, start + n))
            p = n
        else:
            p = split_padded_len(n, w)
            c = p // (2 * w)
            for r in range(w):
                ranges[r].append((start + r * c, start + (r + 1) * c))
                ranges[r].append((start + (2 * w - 1 - r) * c, start + (2 * w - r) * c))
        padded_doc_lens.append(p)
        start += p
    tokens = [sum(b - a for a, b in rs) for rs in ranges]
    local_len = max(tokens)
    for r in range(w):  # the tail: rank by rank, so every rank's positions stay ascending
        ranges[r].append((start, start + local_len - tokens[r]))
        start += local_len - tokens[r]
    return Layout(
        padded_doc_lens=tuple(padded_doc_lens),
        padded_len=start,
        ranges=tuple(tuple((a, b) for a, b in rs if b > a) for rs in ranges),
        whole_on=tuple(whole_on),
    )


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
    return Layout(
        padded_doc_lens=tuple(doc_lens),
        padded_len=start,
        ranges=tuple(tuple((a, b) for a, b in rs if b > a) for rs in ranges),
        whole_on=tuple(whole_on),
    )


def _balanced_placement(doc_lens: tuple[int, ...], w: int) -> tuple[int, ...]:
    """``whole_on`` of the balanced layout (the rule in the module docstring)."""
    if w == 1:
        return (0,) * len(doc_lens)
    order = sorted(range(len(doc_lens)), key=lambda d: (-doc_lens[d], d))
    total_work = sum(work(n) for n in doc_lens)
    worth = sum(1 for d in order if _SPLIT_WORTH * w * work(doc_lens[d]) >= total_work)
    best = None
    for k in (*range(worth + 1), len(order)):
        whole_on, tokens, works = _place(doc_lens, w, order, k)
        padding = w * max(tokens) - sum(doc_lens)
        # (max/mean - 1) + padding/S, times total_work * S: the same factor for every k.
        score = (w * max(works) - total_work) * sum(doc_lens) + padding * total_work
        if best is None or score < best[0]:
            best = (score, whole_on)
    return best[1]


def _place(doc_lens, w, order, k):
    """Split ``order[:k]`` head-tail, place the rest whole: LPT on causal work with a token cap."""
    tokens, works = [0] * w, [0] * w
    whole_on = [-1] * len(doc_lens)
    for d in order[:k]:
        share = split_padded_len(doc_lens[d], w) // w
        for r, pairs in enumerate(head_tail_work(doc_lens[d], w)):
            tokens[r] += share
            works[r] += pairs
    cap = -(-(sum(tokens) + sum(doc_lens[d] for d in order[k:])) // w)
    for d in order[k:]:
        n = doc_lens[d]
        fits = [r for r in range(w) if tokens[r] + n <= cap]
        if fits:
            r = min(fits, key=lambda r: (works[r], r))
        else:
            r = min(range(w), key=lambda r: (tokens[r], works[r], r))
        whole_on[d] = r
        tokens[r] += n
        works[r] += work(n)
    return tuple(whole_on), tokens, works
