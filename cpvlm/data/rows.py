"""The global row stream: samples in seeded order, planned, packed window by window.

Legend: K samples per packing window, R rows per DP rank per step, S tokens of a row.

Every rank builds the same stream: it plans every sample (token ids, labels, grids from image
headers; no pixels), packs each window of K stream positions with ``pack_window``, and emits the
rows in order. The position in the stream, ``{"window": w, "row": j}`` (the next row is row j of
window w), is the data state a checkpoint keeps: re-planning window w gives the same rows, so a
resumed run continues with exactly the next row, at any DP x CP size.

Bad samples (``DataError`` while planning) are dropped from their window and handed, with the
next emitted row, to whoever reports them; a text-only sample longer than ``seq_len`` is cut to
``seq_len`` tokens, one with images or videos is dropped as ``too_long``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from cpvlm.data.errors import DataError
from cpvlm.data.order import SampleOrder
from cpvlm.data.packing import pack_window
from cpvlm.data.sample import SamplePlan, VisionItem


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

    def grid_thw(self) -> torch.Tensor:
        """``[items, 3]``: the images, then the videos (the order of the model's tower)."""
        grids = [it.grid for _, it in self.images + self.videos]
        return torch.tensor(grids, dtype=torch.long).reshape(-1, 3)


@dataclass
class StreamRow:
    row: PackedPlan
    state_after: dict[str, int]  # the stream position after this row
    errors: list[DataError] = field(default_factory=list)  # found since the previous row
    truncated: int = 0  # text-only samples cut to seq_len since the previous row


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

    def _plan(self, position: int) -> SamplePlan:
        index = self.order[position]
        try:
            record = self.source[index]
        except DataError as err:
            raise err if err.where else err.at(f"sample {index}") from None
        try:
            sample = self.plan(record)
        except DataError as err:
            raise err.at(record.where) from None
        if len(sample) > self.seq_len:
            if sample.has_vision:
                raise DataError(
                    "too_long",
                    f"{len(sample)} tokens with images or videos, more than --seq-len "
                    f"{self.seq_len} (an image is never cut); raise --seq-len or lower "
                    "--max-pixels",
                    record.where,
                )
            sample = sample.truncate(self.seq_len)
        return sample

    def window_rows(self, w: int) -> tuple[list[PackedPlan], list[DataError], int]:
        """The rows of window ``w``, the errors found while planning it, the truncated count."""
        samples, errors = [], []
        for p in range(w * self.window, (w + 1) * self.window):
            try:
                samples.append(self._plan(p))
            except DataError as err:
                errors.append(err)
        rows = pack_window([len(s) for s in samples], self.seq_len) if samples else []
        truncated = sum(s.truncated for s in samples)
        return [PackedPlan([samples[i] for i in r]) for r in rows], errors, truncated

    def rows(self, state: dict[str, int] | None = None) -> Iterator[StreamRow]:
        w, j = (0, 0) if state is None else (int(state["window"]), int(state["row"]))
        errors, truncated, empty = [], 0, 0
        while True:
            rows, found, cut = self.window_rows(w)
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
                yield StreamRow(rows[k], state_after, errors, truncated)
                errors, truncated = [], 0
            w, j = w + 1, 0
