"""MaskSpec: the attention mask of ``cp_attention`` inside each document, as a small frozen value.

Legend: i = query, j = key, both global padded positions of the plan (``plan.indices``), w =
``window``, span = one ``[start, stop)`` of ``spans`` (an image's tokens). Every rule below holds
only for i, j real and in the same document; padding is never seen and sees nothing.

Visibility, one line per combination:
    causal                      j <= i
    causal, spans               j <= i  or  (i, j in one span)
    causal, window              i - w < j <= i
    causal, window, spans       i - w < j  and  (j <= i  or  (i, j in one span))
    not causal                  every j of the document
    not causal, window          |i - j| < w
    not causal, spans           every j of the document (a span adds nothing)
    not causal, window, spans   |i - j| < w (a span adds nothing)

These are transformers' masks (5.x), position for position:
  - Gemma 3 full layers = "causal, spans": ``transformers/models/gemma3/modeling_gemma3.py``,
    ``create_masks_for_vision_model``: ``create_causal_mask(block_sequence_ids=...)``, i.e.
    ``or_masks(causal_mask_function, blockwise_overlay(...))`` (masking_utils.py).
  - Gemma 3 sliding layers and Gemma 4 sliding layers = "causal, window, spans": the same
    function in gemma3 and in ``transformers/models/gemma4/modeling_gemma4.py`` builds
    ``and_masks(or_masks(causal, blockwise_overlay), sliding_window_overlay(w))``, and
    ``sliding_window_overlay`` is ``kv_idx > q_idx - w``: the window bounds the past only, so
    an image token still sees the later tokens of its image however far (an image wider than w
    sees its own later tokens, but its earlier ones only within w).
  - Gemma 4 global layers = "causal" (its ``create_masks_for_vision_model``: "causal only").
  - Gemma 3 text layers without images = "causal" / "causal, window"
    (``create_causal_mask`` / ``create_sliding_window_causal_mask``, i.e.
    ``sliding_window_causal_mask_function``: ``kv_idx > q_idx - w`` and ``kv_idx <= q_idx``).
  - Gemma 3 with ``use_bidirectional_attention`` (an encoder) = "not causal" / "not causal,
    window": ``Gemma3TextModel`` adds ``_bidirectional_window_overlay``, ``abs(q - kv) < w``.
Spans that touch (one ends where the next starts) stay two spans; transformers'
``get_block_sequence_ids_for_mask`` numbers one run of image tokens as one block, so an adapter
passes each run (not each image) as a span to match it.
"""

from __future__ import annotations

import bisect
import itertools
import zlib
from dataclasses import dataclass

from cpvlm.distributed.shard_plan import ShardPlan


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


@dataclass(frozen=True)
class MaskSpec:
    """The mask inside each document (rules in the module docstring).

    Args:
        causal: j <= i (else every position of the document), before window and spans.
        window: a sliding window of w >= 1 positions (causal: i - w < j; not causal:
            |i - j| < w); None: no window.
        spans: sorted, disjoint ``(start, stop)`` ranges of global padded positions, each
            inside one document's real tokens (checked against the plan by ``check``); the
            positions of one span see each other in both directions.
    """

    causal: bool = True
    window: int | None = None
    spans: tuple[tuple[int, int], ...] = ()

    def __post_init__(self):
        if not isinstance(self.causal, bool):
            raise ValueError(f"MaskSpec.causal must be a bool, got {self.causal!r}")
        if self.window is not None and (not _is_int(self.window) or self.window < 1):
            raise ValueError(
                f"MaskSpec.window must be None or an int >= 1 (positions a query sees, itself "
                f"included), got {self.window!r}"
            )
        try:
            spans = tuple((a, b) for a, b in self.spans)
        except (TypeError, ValueError):
            raise ValueError(
                f"MaskSpec.spans must be (start, stop) pairs, got {self.spans!r}"
            ) from None
        object.__setattr__(self, "spans", spans)
        prev_stop = 0
        for n, (a, b) in enumerate(spans):
            if not (_is_int(a) and _is_int(b)) or a < 0 or b <= a:
                raise ValueError(
                    f"MaskSpec.spans[{n}] = {(a, b)!r}: a span is (start, stop) with "
                    "0 <= start < stop, ints"
                )
            if a < prev_stop:
                raise ValueError(
                    f"MaskSpec.spans[{n}] = {(a, b)!r} starts before the previous span ends "
                    f"({prev_stop}): spans must be sorted and disjoint"
                )
            prev_stop = b

    def check(self, plan: ShardPlan, where: str = "cp_attention") -> None:
        """Raise ValueError unless every span lies inside one document's real tokens of ``plan``."""
        if not self.spans:
            return
        starts = doc_starts(plan)
        for n, (a, b) in enumerate(self.spans):
            d = bisect.bisect_right(starts, a) - 1
            if b > starts[d] + plan.doc_lens[d]:
                raise ValueError(
                    f"{where}: mask.spans[{n}] = {(a, b)} is not inside one document's real "
                    f"tokens of {plan!r} (documents at padded [start, stop): "
                    f"{_doc_ranges(plan)})"
                )

    def facts(self) -> dict[str, object]:
        """What every rank must share, short enough to print when they differ."""
        spans = self.spans
        summary = (len(spans), spans[:2], spans[-1:], zlib.crc32(repr(spans).encode()))
        return {"mask.causal": self.causal, "mask.window": self.window, "mask.spans": summary}


def doc_starts(plan: ShardPlan) -> list[int]:
    """Each document's first padded position (documents are padded at their end)."""
    return [0, *itertools.accumulate(plan.padded_doc_lens)][:-1]


def _doc_ranges(plan: ShardPlan) -> str:
    ranges = [(s, s + n) for s, n in zip(doc_starts(plan), plan.doc_lens)]
    return ", ".join(map(str, ranges[:4])) + (", ..." if len(ranges) > 4 else "")


def as_mask(mask: MaskSpec | None, causal: bool | None, where: str = "cp_attention") -> MaskSpec:
    """``mask`` itself, or ``MaskSpec(causal=causal)`` when None (causal None: True); a
    ``causal`` given with a mask must equal ``mask.causal``."""
    if causal is not None and not isinstance(causal, bool):
        raise ValueError(f"{where}: causal must be a bool or None, got {causal!r}")
    if mask is None:
        return MaskSpec(causal=True if causal is None else causal)
    if not isinstance(mask, MaskSpec):
        raise ValueError(f"{where}: mask must be a MaskSpec or None, got {type(mask).__name__}")
    if causal is not None and causal is not mask.causal:
        raise ValueError(
            f"{where}: causal={causal!r} contradicts mask.causal={mask.causal!r}; pass the mask "
            "alone or make them agree"
        )
    return mask
