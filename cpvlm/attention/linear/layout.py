"""Where a rank's chunks sit, for the layers whose state flows along the sequence (conv, delta rule).

Legend: W = cp_size, c_d = padded length of document d / (2W). Rank r holds chunks r and 2W-1-r
of every document, document by document (``ShardPlan``), so its local sequence is a list of
chunks in this order. A chunk's *predecessors* are the chunks before it in the same document:
recurrences reset at each document start, so nothing crosses a document boundary.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from cpvlm.distributed.shard_plan import ShardPlan


@dataclass(frozen=True)
class Chunk:
    """One contiguous run of a document held by one rank."""

    doc: int
    index: int  # 0 .. 2W-1 within its document, in global order
    local_start: int  # first row in the owner's shard
    global_start: int  # first position in the padded sequence
    length: int


@lru_cache(maxsize=64)
def local_chunks(plan: ShardPlan, cp_rank: int) -> tuple[Chunk, ...]:
    """The chunks of ``cp_rank``'s shard in local order: per document, head then tail."""
    plan._check_rank(cp_rank)
    if plan.layout == "contiguous" or any(r >= 0 for r in plan.whole_on):
        # Every rank has the same plan, so every rank raises here, at the same layer.
        raise ValueError(
            f"linear attention under CP needs every document split head-tail, but this plan "
            f"(layout={plan.layout!r}) places documents whole on one rank; use "
            "layout='head_tail' (--layout head_tail) with models that have linear-attention "
            "layers (Gated DeltaNet)"
        )
    w = plan.cp_size
    chunks, local, start = [], 0, 0
    for d, padded in enumerate(plan.padded_doc_lens):
        c = padded // (2 * w)
        for j in (cp_rank, 2 * w - 1 - cp_rank):
            chunks.append(Chunk(d, j, local, start + j * c, c))
            local += c
        start += padded
    return tuple(chunks)


def chunk_owner(j: int, cp_size: int) -> tuple[int, int]:
    """``(rank, slot)`` of a document's chunk ``j``: slot 0 is the rank's head chunk, 1 its tail."""
    return (j, 0) if j < cp_size else (2 * cp_size - 1 - j, 1)
