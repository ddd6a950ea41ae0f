"""Bad data: what is wrong with a sample, where it is, and what the run does about it.

A sample that cannot be trained on (a missing or unreadable image, no assistant turn, too long,
image tokens that disagree with the processor, ids outside the vocabulary, a malformed record)
raises ``DataError`` wherever it is found. The loader then either skips it, writing one JSON line
``{"where", "reason", "detail", "step"}`` to ``data_errors.jsonl`` and counting the reason in
the run's summary, or, under ``--strict``, stops the run with the error's one line.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

ERRORS_FILE = "data_errors.jsonl"

REASONS = (
    "bad_record",  # not a conversation nor a tokenized sample: malformed JSON, missing keys
    "missing_media",  # an image or video frame file that does not exist
    "unreadable_media",  # a file that is not an image, or that fails to decode
    "no_assistant_turn",  # --train-on assistant and nothing to learn
    "too_long",  # a sample with images or videos longer than --seq-len (text is truncated)
    "vision_token_mismatch",  # image/video tokens or pixels disagree with the grids
    "out_of_vocab",  # a token id the model's embedding does not have
)


class DataError(ValueError):
    """One bad sample. ``where`` names it ("data.jsonl line 7"), ``reason`` is one of REASONS."""

    def __init__(self, reason: str, detail: str, where: str = ""):
        if reason not in REASONS:
            raise ValueError(f"DataError reason {reason!r} is not one of {REASONS}")
        self.reason, self.detail, self.where = reason, detail, where
        super().__init__(self.line())

    def __reduce__(self):  # travels from DataLoader workers with its fields
        return DataError, (self.reason, self.detail, self.where)

    def at(self, where: str) -> DataError:
        """The same error, located."""
        return DataError(self.reason, self.detail, where)

    def line(self) -> str:
        place = f"{self.where}: " if self.where else ""
        return f"{place}{self.reason}: {self.detail}"

    def record(self) -> dict:
        return {"where": self.where, "reason": self.reason, "detail": self.detail}


class ErrorLog:
    """Counts bad samples by reason and appends them to ``out/data_errors.jsonl``.

    ``strict``: the first error is raised instead (as the one-line ``DataError``). ``out=None``
    counts without writing (the ranks other than the one that writes).
    """

    def __init__(self, out: str | Path | None, *, strict: bool = False):
        self.path = Path(out) / ERRORS_FILE if out else None
        self.strict = strict
        self.counts: Counter[str] = Counter()

    def add(self, err: DataError, step: int | None = None) -> None:
        if self.strict:
            raise err
        self.counts[err.reason] += 1
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.path, "a") as f:
                f.write(json.dumps({**err.record(), "step": step}) + "\n")

    def summary(self) -> dict[str, int]:
        return dict(sorted(self.counts.items()))
