"""The global row stream: samples in seeded order, sized, packed window by window.

Legend: K samples per packing window, R rows per DP rank per step, S tokens of a row.

Every rank builds the same stream: packing a window of K stream positions (``pack_window``)
needs only each sample's ``SampleMeta`` (its token count and grids), so the stream is first one
of ``RowSlot``s, rows as stream positions and sizes, and a rank plans in full (token ids,
labels, grids from image headers; no pixels) only the samples of the rows it trains
(``plan_rows``). The metas come from the source where it knows them (``source.meta(index)``, a
prepared cache), else from planning: ``measure`` says who plans what (by default this rank
plans every sample; ``RankLoader`` splits it over DP ranks and exchanges the metas). The position
in the stream, ``{"window": w, "row": j}`` (the next row is row j of window w), is the data state
a checkpoint keeps: re-sizing window w gives the same rows, so a resumed run continues with
exactly the next row, at any DP x CP size.

Bad samples (``DataError`` while planning) are dropped from their window and handed, with the
next emitted row, to whoever reports them; a text-only sample longer than ``seq_len`` is cut to
``seq_len`` tokens, one with images, videos or audio is dropped as ``too_long``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from cpvlm.data.errors import DataError
from cpvlm.data.meta import SampleMeta
from cpvlm.data.order import SampleOrder
from cpvlm.data.packing import pack_window
from cpvlm.data.sample import AudioItem, SamplePlan, VisionItem


@dataclass
class PackedPlan:
    """One row of the stream: its documents, in order."""

    docs: list[SamplePlan]

    @property
    def input_ids(self) -> torch.Tensor:
        return torch.cat([d.input_ids for d in self.docs])

    @property
    def labels(self) -> torch.Tensor:
        return torch.cat([d.labels for d in self.docs])

    @property
    def doc_lens(self) -> list[int]:
        return [len(d) for d in self.docs]

    @property
    def num_tokens(self) -> int:
        return sum(self.doc_lens)

    @property
    def images(self) -> list[tuple[SamplePlan, VisionItem]]:
        return [(d, it) for d in self.docs for it in d.images]

    @property
    def videos(self) -> list[tuple[SamplePlan, VisionItem]]:
        return [(d, it) for d in self.docs for it in d.videos]

    @property
    def audios(self) -> list[tuple[SamplePlan, AudioItem]]:
        return [(d, a) for d in self.docs for a in d.audios]

    def grid_thw(self) -> torch.Tensor:
        """``[items, 3]``: the images, then the videos (the order of the model's tower)."""
        grids = [it.grid for _, it in self.images + self.videos]
        return torch.tensor(grids, dtype=torch.long).reshape(-1, 3)

    def kinds(self) -> tuple[str, ...]:
        """The kind of each row of ``grid_thw()``."""
        return ("image",) * len(self.images) + ("video",) * len(self.videos)


@dataclass(frozen=True)
class RowSlot:
    """One row of the stream before planning: its samples' stream positions and sizes."""

    positions: tuple[int, ...]  # in row order
    metas: tuple[SampleMeta, ...]
    lengths: tuple[int, ...]  # tokens of each document in the row (text cut to seq_len)

    @property
    def num_tokens(self) -> int:
        return sum(self.lengths)


@dataclass
class StreamRow:
    row: PackedPlan | None  # None from ``slots``: plan it with ``plan_rows``
    state_after: dict[str, int]  # the stream position after this row
    errors: list[DataError] = field(default_factory=list)  # found since the previous row
    truncated: int = 0  # text-only samples cut to seq_len since the previous row
    slot: RowSlot | None = None


Measure = Callable[[list[int]], dict[int, "SampleMeta | DataError"]]
"""``measure(positions)``: every position's meta, or the error that makes it unusable."""


def meta_of(sample: SamplePlan) -> SampleMeta:
    """The sizes of a planned sample."""
    return SampleMeta(
        len(sample),
        tuple(tuple(it.grid) for it in sample.images),
        tuple(tuple(it.grid) for it in sample.videos),
        tuple(a.frames for a in sample.audios),
    )


def _same(a: SampleMeta, b: SampleMeta) -> bool:
    def key(m):
        grids = (m.image_grids, m.video_grids)
        grids = tuple(tuple(tuple(int(v) for v in g) for g in gs) for gs in grids)
        return int(m.tokens), grids, tuple(int(n) for n in m.audio_frames)

    return key(a) == key(b)


class RowStream:
    """``rows(state)``: the global rows from a stream position on (see the module docstring)."""

    def __init__(
        self,
        source,
        plan: Callable[[object], SamplePlan],
        *,
        seq_len: int,
        window: int = 64,
        seed: int = 0,
        shuffle: bool = True,
    ):
        endless = getattr(source, "endless", False) or not hasattr(source, "__len__")
        self.source, self.plan = source, plan
        self.seq_len, self.window = seq_len, window
        self.order = SampleOrder(None if endless else len(source), seed=seed, shuffle=shuffle)
        self.has_meta = callable(getattr(source, "meta", None))
        self.plan_calls = 0  # samples this stream planned (what DP splitting divides)

    def _fits(self, meta: SampleMeta, where: str) -> SampleMeta:
        if meta.tokens > self.seq_len and meta.has_media:
            raise DataError(
                "too_long",
                f"{meta.tokens} tokens with images, videos or audio, more than --seq-len "
                f"{self.seq_len} (an image or a clip is never cut); raise --seq-len or lower "
                "--max-pixels",
                where,
            )
        return meta

    def plan_full(self, position: int) -> SamplePlan:
        """The sample at ``position``, planned, not yet cut to ``seq_len``."""
        index = self.order[position]
        try:
            record = self.source[index]
        except DataError as err:
            raise err if err.where else err.at(f"sample {index}") from None
        self.plan_calls += 1
        try:
            sample = self.plan(record)
        except DataError as err:
            raise err.at(record.where) from None
        self._fits(meta_of(sample), record.where)
        return sample

    def cut(self, sample: SamplePlan) -> SamplePlan:
        return sample.truncate(self.seq_len) if len(sample) > self.seq_len else sample

    def source_meta(self, position: int) -> SampleMeta:
        """The sizes of the sample at ``position`` from ``source.meta`` (no planning)."""
        index = self.order[position]
        try:
            meta = self.source.meta(index)
        except DataError as err:
            raise err if err.where else err.at(f"sample {index}") from None
        return self._fits(meta, f"sample {index}")

    def plan_costs(self, positions: list[int]) -> list[int]:
        """Estimated planning costs of the samples at ``positions`` from ``source.plan_cost``
        (known without planning; the same on every rank), or 1 each."""
        cost = getattr(self.source, "plan_cost", None)
        return [cost(self.order[p]) for p in positions] if callable(cost) else [1] * len(positions)

    def measure_here(self, positions: list[int], keep: dict[int, SamplePlan] | None = None):
        """Every position's meta (or error), found on this rank: from the source's metas, or by
        planning (the plans go into ``keep``)."""
        out: dict[int, SampleMeta | DataError] = {}
        for p in positions:
            try:
                if self.has_meta:
                    out[p] = self.source_meta(p)
                else:
                    sample = self.plan_full(p)
                    out[p] = meta_of(sample)
                    if keep is not None:
                        keep[p] = sample
            except DataError as err:
                out[p] = err
        return out

    def window_slots(self, w: int, measure: Measure) -> tuple[list[RowSlot], list[DataError], int]:
        """The rows of window ``w``, the errors found while sizing it, the truncated count."""
        positions = list(range(w * self.window, (w + 1) * self.window))
        found = measure(positions)
        good = [p for p in positions if isinstance(found[p], SampleMeta)]
        errors = [found[p] for p in positions if not isinstance(found[p], SampleMeta)]
        metas = [found[p] for p in good]
        lengths = [min(m.tokens, self.seq_len) for m in metas]
        rows = pack_window(lengths, self.seq_len) if good else []
        truncated = sum(m.tokens > self.seq_len for m in metas)
        slots = [
            RowSlot(
                tuple(good[i] for i in r), tuple(metas[i] for i in r), tuple(lengths[i] for i in r)
            )
            for r in rows
        ]
        return slots, errors, truncated

    def slots(self, state: dict[str, int] | None = None, measure: Measure | None = None):
        """``StreamRow``s with ``slot`` set and ``row`` None, from ``state`` on."""
        measure = measure or self.measure_here
        w, j = (0, 0) if state is None else (int(state["window"]), int(state["row"]))
        errors, truncated, empty = [], 0, 0
        while True:
            rows, found, cut = self.window_slots(w, measure)
            if j == 0:  # a resumed window reported its errors with its first row, earlier
                errors += found
                truncated += cut
            empty = 0 if rows else empty + self.window
            if self.order.num_samples is not None and empty >= self.order.num_samples + self.window:
                raise ValueError(
                    f"no usable samples: every sample of a whole epoch was skipped as bad data "
                    f"(the last: {errors[-1].line() if errors else '-'})"
                )
            for k in range(j, len(rows)):
                last = k + 1 == len(rows)
                state_after = {"window": w + 1, "row": 0} if last else {"window": w, "row": k + 1}
                yield StreamRow(None, state_after, errors, truncated, rows[k])
                errors, truncated = [], 0
            w, j = w + 1, 0

    def plan_rows(self, slot: RowSlot, have: dict[int, SamplePlan] | None = None) -> PackedPlan:
        """The planned row of ``slot``: its samples from ``have`` (taken out), else planned here.

        A sample whose meta promised a size its plan does not have raises ``DataError``.
        """
        docs = []
        for p, meta in zip(slot.positions, slot.metas, strict=True):
            sample = have.pop(p, None) if have is not None else None
            sample = sample if sample is not None else self.plan_full(p)
            if not _same(meta_of(sample), meta):
                raise DataError(
                    "vision_token_mismatch",
                    f"planned as {len(sample)} tokens and grids {meta_of(sample).image_grids}"
                    f"{meta_of(sample).video_grids}; the source's meta said {meta} (a prepared "
                    "cache made from other data or flags?)",
                    sample.where,
                )
            docs.append(self.cut(sample))
        return PackedPlan(docs)

    def rows(self, state: dict[str, int] | None = None) -> Iterator[StreamRow]:
        """The rows in full, every sample planned on this rank."""
        kept: dict[int, SamplePlan] = {}
        for r in self.slots(state, lambda positions: self.measure_here(positions, kept)):
            r.row = self.plan_rows(r.slot, kept)
            for p in [p for p in kept if p < r.slot.positions[0] - self.window]:
                del kept[p]  # rows skipped on resume
            yield r
