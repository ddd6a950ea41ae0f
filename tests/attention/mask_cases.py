"""Shared by the MaskSpec tests: the visibility rule written out densely, independently of the
schedule, and span placements that cross chunk and rank boundaries.

Legend: S real tokens, P padded length; "offsets" = positions inside a document (0..n-1).
"""

from __future__ import annotations

import itertools

import torch

from cpvlm import ShardPlan


def doc_padded_starts(plan: ShardPlan) -> list[int]:
    return [0, *itertools.accumulate(plan.padded_doc_lens)][:-1]


def span_offsets(n: int, padded: int, cp: int) -> list[tuple[int, int]]:
    """Spans (document offsets) of a document of n tokens, padded to ``padded``: one across the
    boundary of head-tail chunks 0 and 1 (ranks 0 and 1), one across chunks cp-1 and cp (the
    middle, both on rank cp-1), one of 5 near the end, and one at the start; overlapping or
    out-of-range candidates are dropped."""
    c = padded // (2 * cp)
    candidates = sorted([(c - 2, c + 3), (cp * c - 1, cp * c + 2), (n - 6, n - 1), (0, 2)])
    kept: list[tuple[int, int]] = []
    for a, b in candidates:
        if 0 <= a < b <= n and (not kept or a >= kept[-1][1]):
            kept.append((a, b))
    return kept


def spans_of(plan: ShardPlan, cp: int) -> tuple[list[list[tuple[int, int]]], tuple]:
    """(per document its span offsets, all spans as global padded positions)."""
    per_doc = [
        span_offsets(n, p, cp) if n >= 4 else []
        for n, p in zip(plan.doc_lens, plan.padded_doc_lens)
    ]
    starts = doc_padded_starts(plan)
    glob = tuple((s + a, s + b) for s, spans in zip(starts, per_doc) for a, b in spans)
    return per_doc, glob


def rule_mask(doc_lens, span_offsets_per_doc, causal: bool, window: int | None) -> torch.Tensor:
    """[S, S] bool over the real tokens in order, from the rule of the issue (transformers'
    Gemma masks): same document, and
      causal:      (j <= i or i, j in one span), and with a window i - w < j;
      not causal:  every j, and with a window |i - j| < w."""
    doc = torch.repeat_interleave(torch.arange(len(doc_lens)), torch.tensor(doc_lens))
    off = torch.cat([torch.arange(n) for n in doc_lens])
    span = torch.full((len(off),), -1)
    start, sid = 0, 0
    for n, spans in zip(doc_lens, span_offsets_per_doc):
        for a, b in spans:
            span[start + a : start + b] = sid
            sid += 1
        start += n
    i, j = off[:, None], off[None, :]
    same_span = (span[:, None] == span[None, :]) & (span[:, None] >= 0)
    if causal:
        visible = (j <= i) | same_span
        if window is not None:
            visible &= j > i - window
    else:
        visible = torch.ones_like(same_span)
        if window is not None:
            visible = (i - j).abs() < window
    return (doc[:, None] == doc[None, :]) & visible


def padded_rule_mask(plan: ShardPlan, cp: int, causal: bool, window, with_spans: bool):
    """``rule_mask`` placed on the padded positions: [P, P], False at padding."""
    per_doc, _ = spans_of(plan, cp)
    real = rule_mask(plan.doc_lens, per_doc if with_spans else [[]] * len(per_doc), causal, window)
    idx = plan.padded_index
    full = torch.zeros(plan.padded_len, plan.padded_len, dtype=torch.bool)
    full[idx[:, None], idx[None, :]] = real
    return full
