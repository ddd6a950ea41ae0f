"""A block's segments as fused-kernel calls: all its rectangles of a kind in ONE packed call.

Legend: B batch, Hq/Hkv heads, S local length, D head dim; a block is the segments of one
(query rank, key rank) pair; its rectangles are its FULL and CAUSAL segments and the parts of its
MASKED ones. A call takes the R rectangles of one kind: n_q query rows and n_k key columns in all,
packed as [T, H, D] with T = B * n_q (or B * n_k), batch row by batch row, rectangle by rectangle,
so that rectangle r of batch row b is sequence b * R + r of the kernel (``compat.Packing``).

On a GPU what a block costs is its number of kernel calls (each a fixed ~10 us, whatever its
size), and a packed (varlen) call takes any number of rectangles of different sizes. So the
CPU schedule's grouping of small rectangles into masked calls is undone here: the rectangles of
a kind go into one call (or as few as share no rows: a window's strip can see two key runs of a
rank). A block with one rectangle goes in as a strided view, without copies. A MASKED segment
with no parts (a mask that is not a union of rectangles: a sliding window's edges, a span's
corner) takes a dense call with its additive mask, on a kernel that takes one (the memory-
efficient kernel, for the flash kernel has no mask argument).

These functions only lay out calls and hand back results with the local rows/columns they belong
to; merging them is block.py's job, as for the CPU kernel.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from cpvlm.attention.schedule import CAUSAL, FULL, MASKED, Segment
from cpvlm.distributed import compat

Index = slice | torch.Tensor
"""Local rows (or columns) of a call: a slice for one rectangle, a LongTensor for several."""


@dataclass(frozen=True, eq=False)
class _Call:
    """The rectangles of one kind of one block, laid out for one kernel call."""

    causal: bool
    overwrite: bool
    """No earlier call of this rank wrote any of these rows (a store, not a merge)."""
    rows: Index
    cols: Index
    packing: compat.Packing | None
    """None: one rectangle, called dense."""


def _calls(
    segments: tuple[Segment, ...], batch: int, device: torch.device
) -> tuple[tuple[_Call, ...], tuple[tuple[Segment, bool], ...]]:
    """(the packed calls of a block, its MASKED segments without parts with their overwrite
    flags), in the order they run, built once per block; under fake tensors (torch.compile's
    tracing, dry runs) built anew, since their index tensors must not outlive the fake mode."""
    if compat.fake_mode_active():
        return _cached_calls.__wrapped__(segments, batch, device)
    return _cached_calls(segments, batch, device)


@functools.lru_cache(maxsize=4096)
def _cached_calls(
    segments: tuple[Segment, ...], batch: int, device: torch.device
) -> tuple[tuple[_Call, ...], tuple[tuple[Segment, bool], ...]]:
    """``_calls``, cached.

    The rectangles of one kind go into as few calls as share no rows (a windowed strip sees
    two key runs of one rank with the same rows; a packed call merges its rows by index). A
    call stores instead of merging only if no earlier call, of any block, wrote its rows: the
    kinds run in another order than the schedule's, so the flags are redone in this order.
    The cache holds the segments themselves (they hash by identity), so an entry can never be
    mistaken for another schedule's block.
    """
    by_kind: dict[str, list[list[tuple[Segment, bool]]]] = {FULL: [], CAUSAL: []}
    masked = []
    for seg in segments:
        if seg.kind != MASKED:
            _place(by_kind[seg.kind], seg, seg.overwrite)
        elif seg.parts:
            for part in seg.parts:
                _place(by_kind[part.kind], part, seg.overwrite)
        else:
            masked.append(seg)
    written: list[tuple[int, int]] = []
    calls = []
    for kind, buckets in by_kind.items():
        for rects in buckets:
            first = all(f for _, f in rects) and not _overlaps(written, [s for s, _ in rects])
            written += [(s.q_start, s.q_stop) for s, _ in rects]
            calls.append(_call(kind == CAUSAL, rects, batch, device, first))
    dense = []
    for seg in masked:
        dense.append((seg, seg.overwrite and not _overlaps(written, [seg])))
        written.append((seg.q_start, seg.q_stop))
    return tuple(calls), tuple(dense)


def _overlaps(written: list[tuple[int, int]], segs: list[Segment]) -> bool:
    return any(a < s.q_stop and s.q_start < b for a, b in written for s in segs)


def _place(buckets: list[list[tuple[Segment, bool]]], seg: Segment, overwrite: bool) -> None:
    """Put ``seg`` into the first call whose rectangles share no row with it."""
    for rects in buckets:
        if not _overlaps([(s.q_start, s.q_stop) for s, _ in rects], [seg]):
            rects.append((seg, overwrite))
            return
    buckets.append([(seg, overwrite)])


def _call(
    causal: bool,
    rects: list[tuple[Segment, bool]],
    batch: int,
    device: torch.device,
    overwrite: bool | None = None,
) -> _Call:
    segs = sorted((seg for seg, _ in rects), key=lambda seg: seg.q_start)
    if overwrite is None:
        overwrite = all(first for _, first in rects)
    if causal and any(s.q_stop - s.q_start != s.k_stop - s.k_start for s in segs):
        # The flash kernel aligns causal masks bottom-right, the efficient one top-left: only
        # square rectangles mean the same to both (the schedule's causal ones are).
        raise ValueError(f"causal rectangles must be square, got {segs}")
    if len(segs) == 1:
        return _Call(causal, overwrite, segs[0].rows, segs[0].cols, None)
    q_lens = [s.q_stop - s.q_start for s in segs]
    k_lens = [s.k_stop - s.k_start for s in segs]
    packing = compat.Packing(
        cu_q=_cumulative(q_lens * batch, device),
        cu_k=_cumulative(k_lens * batch, device),
        max_q=max(q_lens),
        max_k=max(k_lens),
    )
    if any(a.q_stop > b.q_start for a, b in zip(segs, segs[1:])):  # sorted by q_start
        raise ValueError(
            f"rectangles of one call must not share rows (merged by index), got {segs}"
        )
    rows = torch.cat([torch.arange(s.q_start, s.q_stop) for s in segs])
    cols = torch.cat([torch.arange(s.k_start, s.k_stop) for s in segs])
    return _Call(causal, overwrite, rows.to(device), cols.to(device), packing)


def _cumulative(lengths: list[int], device: torch.device) -> torch.Tensor:
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(lengths).cumsum(0)
    return cu.to(device)


# ---- layouts: [B, H, S, D] and [B, H, S] <-> the kernel's ------------------------------------


def _take(x_BHSD: torch.Tensor, index: Index, packing: compat.Packing | None) -> torch.Tensor:
    """The call's rows of x: a [B, n, H, D] view (dense) or a packed [B * n, H, D] copy."""
    x = x_BHSD.transpose(1, 2)[:, index]
    return x if packing is None else x.flatten(0, 1)


def _give(x: torch.Tensor, batch: int, packing: compat.Packing | None) -> torch.Tensor:
    """A kernel output ([B, n, H, D] or [B * n, H, D]) as [B, H, n, D]."""
    if packing is not None:
        x = x.unflatten(0, (batch, -1))
    return x.transpose(1, 2)


def _take_lse(lse_BHS: torch.Tensor, index: Index, packing: compat.Packing | None):
    """The call's rows of an lse: [B, H, n] (dense) or packed [H, B * n]."""
    lse = lse_BHS[:, :, index]
    return lse if packing is None else lse.transpose(0, 1).flatten(1)


def _give_lse(lse: torch.Tensor, batch: int, packing: compat.Packing | None) -> torch.Tensor:
    """A kernel lse ([B, H, n] or [H, B * n]) as [B, H, n]."""
    return lse if packing is None else lse.unflatten(1, (batch, -1)).transpose(0, 1)


# ---- forward and backward of a block -----------------------------------------------------------


def block_forward(
    q_BHSD: torch.Tensor,
    k_BHSD: torch.Tensor,
    v_BHSD: torch.Tensor,
    segments: tuple[Segment, ...],
    scale: float,
    kernel: compat.FusedAttentionKernel,
) -> Iterator[tuple[Index, torch.Tensor, torch.Tensor, bool]]:
    """Yield (rows, out [B,Hq,n,D], lse [B,Hq,n] with -inf where nothing is seen, overwrite) of
    each call of the block, in the order they must be merged."""
    b = q_BHSD.shape[0]
    calls, masked = _calls(segments, b, q_BHSD.device)
    for call in calls:
        out, lse = kernel.forward(
            _take(q_BHSD, call.rows, call.packing),
            _take(k_BHSD, call.cols, call.packing),
            _take(v_BHSD, call.cols, call.packing),
            causal=call.causal,
            scale=scale,
            packing=call.packing,
        )
        yield (
            call.rows,
            _give(out, b, call.packing),
            _give_lse(lse, b, call.packing),
            call.overwrite,
        )
    for seg, overwrite in masked:
        out, lse = _masked_kernel(kernel).forward(
            _take(q_BHSD, seg.rows, None),
            _take(k_BHSD, seg.cols, None),
            _take(v_BHSD, seg.cols, None),
            causal=False,
            scale=scale,
            bias=seg.additive_mask(q_BHSD.dtype, q_BHSD.device),
        )
        # Rows that see nothing: whatever the kernel made of 0/0, they hold nothing.
        empty = seg.empty_rows(q_BHSD.device)
        out = _give(out, b, None).masked_fill(empty[:, None], 0)
        yield seg.rows, out, lse.masked_fill(empty, float("-inf")), overwrite


def block_backward(
    dout_BHSD: torch.Tensor,
    q_BHSD: torch.Tensor,
    k_BHSD: torch.Tensor,
    v_BHSD: torch.Tensor,
    out_BHSD: torch.Tensor,
    lse_BHS: torch.Tensor,
    segments: tuple[Segment, ...],
    scale: float,
    kernel: compat.FusedAttentionKernel,
) -> Iterator[tuple[Index, torch.Tensor, Index, torch.Tensor, torch.Tensor]]:
    """Yield (rows, dq [B,Hq,n_q,D], cols, dk, dv [B,Hkv,n_k,D]) of each call of the block, from
    the rows' final out and (finite) lse."""
    b = q_BHSD.shape[0]
    calls, masked = _calls(segments, b, q_BHSD.device)
    for call in calls:
        p = call.packing
        dq, dk, dv = kernel.backward(
            _take(dout_BHSD, call.rows, p),
            _take(q_BHSD, call.rows, p),
            _take(k_BHSD, call.cols, p),
            _take(v_BHSD, call.cols, p),
            _take(out_BHSD, call.rows, p),
            _take_lse(lse_BHS, call.rows, p),
            causal=call.causal,
            scale=scale,
            packing=p,
        )
        yield call.rows, _give(dq, b, p), call.cols, _give(dk, b, p), _give(dv, b, p)
    for seg, _ in masked:
        dq, dk, dv = _masked_kernel(kernel).backward(
            *(_take(t, seg.rows, None) for t in (dout_BHSD, q_BHSD)),
            *(_take(t, seg.cols, None) for t in (k_BHSD, v_BHSD)),
            _take(out_BHSD, seg.rows, None),
            lse_BHS[:, :, seg.rows],
            causal=False,
            scale=scale,
            bias=seg.additive_mask(q_BHSD.dtype, q_BHSD.device),
        )
        yield seg.rows, _give(dq, b, None), seg.cols, _give(dk, b, None), _give(dv, b, None)


def _masked_kernel(kernel: compat.FusedAttentionKernel) -> compat.FusedAttentionKernel:
    return kernel if kernel.takes_bias else compat.CUDA_EFFICIENT
