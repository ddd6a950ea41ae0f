"""Several row tensors (main embeddings, deepstack levels) travel as one, packed along features.

Legend: n rows, D_i feature width of tensor i, D = sum D_i.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def as_tensor_list(x: torch.Tensor | Sequence[torch.Tensor], op: str) -> tuple[list, bool]:
    """``(tensors, single)``: a lone tensor becomes a one-element list."""
    if isinstance(x, torch.Tensor):
        return [x], True
    tensors = list(x)
    if not tensors or not all(isinstance(t, torch.Tensor) for t in tensors):
        raise ValueError(f"{op}: expected a tensor or a non-empty sequence of tensors")
    return tensors, False


def check_rows(tensors: list[torch.Tensor], rows: int, op: str, who: str) -> None:
    """Every tensor is [rows, D_i], and all share dtype and device (they travel together)."""
    first = tensors[0]
    for i, t in enumerate(tensors):
        if t.dim() != 2:
            raise ValueError(f"{op}: tensor {i} has shape {tuple(t.shape)}; expected [rows, D]")
        if t.shape[0] != rows:
            raise ValueError(
                f"{op}: tensor {i} has {t.shape[0]} rows but {who} says {rows} for this rank"
            )
        if t.dtype != first.dtype or t.device != first.device:
            raise ValueError(
                f"{op}: tensors travel in one collective and must share dtype and device; tensor "
                f"{i} is {t.dtype} on {t.device}, tensor 0 is {first.dtype} on {first.device}"
            )


def pack_features(tensors: list[torch.Tensor]) -> tuple[torch.Tensor, list[int]]:
    """``[n, D]`` concatenation along features, and the widths to undo it."""
    dims = [t.shape[1] for t in tensors]
    packed = tensors[0] if len(tensors) == 1 else torch.cat(tensors, dim=1)
    return packed, dims


def unpack_features(packed_nD: torch.Tensor, dims: list[int]) -> list[torch.Tensor]:
    return list(torch.split(packed_nD, dims, dim=1)) if len(dims) > 1 else [packed_nD]


def check_counts(counts: Sequence[int] | torch.Tensor, world: int, op: str) -> tuple[int, ...]:
    if isinstance(counts, torch.Tensor):
        counts = counts.tolist()
    counts = tuple(counts)
    if len(counts) != world:
        raise ValueError(f"{op}: got {len(counts)} counts for a group of {world} ranks")
    for r, n in enumerate(counts):
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"{op}: counts[{r}] = {n!r}; row counts must be ints >= 0")
    return counts
