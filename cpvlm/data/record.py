"""A record: one raw sample of a source (``cpvlm.data.sources``, ``cpvlm.data.prepared``)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Record:
    """One raw sample and where it came from."""

    index: int  # position in the source
    where: str  # "data.jsonl line 7", for error messages
    data: object  # the record (a dict, normally)
    base_dir: Path | None  # relative media paths resolve here
