"""Length-aware packing of samples into rows, and the split of a step's rows over DP ranks.

Both are pure functions of token counts, so every rank computes the same rows and the same split
without communicating.

- ``pack_window``: first-fit decreasing over a window of samples: longest first, each into the
  first row with room. Rows come out nearly full (DP ranks then hold similar token counts, and
  little of a row is padding), each sample whole in one row (per-document boundaries).
- ``dp_split``: a step takes the next ``R * dp`` rows of the global row stream; they are dealt to
  DP ranks longest first, each to the rank with the fewest tokens that still has room for a row
  (ties: the lower rank), R rows each, every rank's rows in stream order.

This is the DP rule of ``cpvlm train --dp-balance tokens`` (``--dp-balance cost``, the default,
deals the same rows by modelled cost: ``cpvlm.data.balance``), for every source alike. It
keeps resume exact and the step the same at any dp x cp because a step is defined by its rows,
not by who trains them: the set of the step's rows is the next ``R * dp`` of the stream whatever
dp is (a resumed run with another dp keeps ``R * dp`` by its grad accumulation), the loss is the
step's global token mean and the gradients are summed over dp x cp, so which rank trains which
row changes only the order of a sum. The stream position after the step is the data state, the
same on every rank. A contiguous split would be as exact; the token-balanced deal also keeps the
DP ranks' work even when rows are not full.
"""

from __future__ import annotations

from collections.abc import Sequence


def pack_window(lengths: Sequence[int], seq_len: int) -> list[list[int]]:
    """Rows of sample indices (into ``lengths``) with at most ``seq_len`` tokens each.

    Rows are ordered by their first sample, samples within a row by index. Every length must be
    in ``1..seq_len``.
    """
    for i, n in enumerate(lengths):
        if not 1 <= n <= seq_len:
            raise ValueError(f"sample {i} has {n} tokens; pack_window needs 1..{seq_len}")
    rows: list[list[int]] = []
    free: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        for r, room in enumerate(free):
            if lengths[i] <= room:
                rows[r].append(i)
                free[r] -= lengths[i]
                break
        else:
            rows.append([i])
            free.append(seq_len - lengths[i])
    rows = [sorted(r) for r in rows]
    return sorted(rows, key=lambda r: r[0])


def dp_split(row_tokens: Sequence[int], dp: int) -> list[list[int]]:
    """Indices (into ``row_tokens``, one step's rows) for each of ``dp`` ranks, balanced by tokens."""
    if dp < 1 or len(row_tokens) % dp:
        raise ValueError(f"dp_split: {len(row_tokens)} rows do not split over {dp} DP ranks")
    per_rank = len(row_tokens) // dp
    shares: list[list[int]] = [[] for _ in range(dp)]
    load = [0] * dp
    for i in sorted(range(len(row_tokens)), key=lambda i: (-row_tokens[i], i)):
        d = min((d for d in range(dp) if len(shares[d]) < per_rank), key=lambda d: (load[d], d))
        shares[d].append(i)
        load[d] += row_tokens[i]
    return [sorted(s) for s in shares]
