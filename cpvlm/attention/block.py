"""Local block attention with log-sum-exp, and the loops that run a block's segments.

Legend: B batch, Hq/Hkv query/key heads (Hq = G * Hkv, query head h uses key head h // G), Sq/Sk
query/key rows of a call, S local length, D head dim; lse = log-sum-exp of the scaled scores of a
row, natural log. Accumulators are float32 for half types and float64 for float64 ("acc dtype").

A block's contribution to a row merges with the others through the lse; its backward uses the
row's final out and lse, which gives exactly this block's share of dq, dk and dv. Three kernels:
  - CUDA (bf16/fp16: flash; fp32: memory-efficient): every rectangle of a block in one packed
    call (fused.py), MASKED segments unpacked into their rectangles;
  - CPU: the fused CPU flash kernel, one call per segment (FULL, CAUSAL, MASKED with its mask);
  - elsewhere (float64 on CUDA, other devices): a plain-torch path, the same math in the acc dtype.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from cpvlm.attention import fused
from cpvlm.attention.fused import Index
from cpvlm.attention.schedule import CAUSAL, MASKED, Segment
from cpvlm.distributed import compat

KeyGrads = list[tuple[Index, torch.Tensor, torch.Tensor]]
"""(local key columns, dk, dv) of a block's calls, to add where the key block's gradient lives."""


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


# ---- one call ---------------------------------------------------------------------------------


def block_forward(
    q_BHSD: torch.Tensor,
    k_BHSD: torch.Tensor,
    v_BHSD: torch.Tensor,
    *,
    causal: bool,
    scale: float,
    mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (out [B,Hq,Sq,D] in the input dtype, lse [B,Hq,Sq] in the acc dtype).

    ``causal`` is top-left; ``mask`` is additive [Sq,Sk] in the input dtype. Rows that see no key
    return out 0 and an lse the caller must replace by -inf.
    """
    if compat.cpu_flash_supported(q_BHSD):
        return compat.cpu_flash_forward(
            q_BHSD, k_BHSD, v_BHSD, causal=causal, scale=scale, mask=mask
        )
    return _math_forward(q_BHSD, k_BHSD, v_BHSD, causal=causal, scale=scale, mask=mask)


def block_backward(
    dout_BHSD: torch.Tensor,
    q_BHSD: torch.Tensor,
    k_BHSD: torch.Tensor,
    v_BHSD: torch.Tensor,
    out_BHSD: torch.Tensor,
    lse_BHS: torch.Tensor,
    *,
    causal: bool,
    scale: float,
    mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> (dq [B,Hq,Sq,D], dk [B,Hkv,Sk,D], dv [B,Hkv,Sk,D]) of this call, given the rows' final
    out and (finite) lse."""
    if compat.cpu_flash_supported(q_BHSD):
        return compat.cpu_flash_backward(
            dout_BHSD,
            q_BHSD,
            k_BHSD,
            v_BHSD,
            out_BHSD,
            lse_BHS,
            causal=causal,
            scale=scale,
            mask=mask,
        )
    return _math_backward(
        dout_BHSD, q_BHSD, k_BHSD, v_BHSD, out_BHSD, lse_BHS, causal=causal, scale=scale, mask=mask
    )


def _scores(q, k, *, causal, scale, mask):
    """(q as [B,Hkv,G,Sq,D], masked scaled scores [B,Hkv,G,Sq,Sk]), both in the acc dtype."""
    b, hq, sq, d = q.shape
    hkv, sk = k.shape[1], k.shape[2]
    acc = acc_dtype(q.dtype)
    q5 = q.to(acc).reshape(b, hkv, hq // hkv, sq, d)
    scores = torch.einsum("bhgqd,bhkd->bhgqk", q5, k.to(acc)) * scale
    if mask is not None:
        scores = scores + mask.to(acc)
    if causal:
        hidden = torch.ones(sq, sk, dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(hidden, float("-inf"))
    return q5, scores


def _math_forward(q, k, v, *, causal, scale, mask):
    b, hq, sq, d = q.shape
    _, scores = _scores(q, k, causal=causal, scale=scale, mask=mask)
    lse = scores.logsumexp(dim=-1)
    finite = lse.masked_fill(lse == float("-inf"), 0)
    p = (scores - finite.unsqueeze(-1)).exp()
    out = torch.einsum("bhgqk,bhkd->bhgqd", p, v.to(p.dtype))
    return out.reshape(b, hq, sq, d).to(q.dtype), finite.reshape(b, hq, sq)


def _math_backward(dout, q, k, v, out, lse, *, causal, scale, mask):
    b, hq, sq, d = q.shape
    hkv = k.shape[1]
    q5, scores = _scores(q, k, causal=causal, scale=scale, mask=mask)
    acc = scores.dtype
    lse5 = lse.to(acc).reshape(b, hkv, hq // hkv, sq, 1)
    p = (scores - lse5).exp()
    do5 = dout.to(acc).reshape(q5.shape)
    delta = (do5 * out.to(acc).reshape(q5.shape)).sum(-1, keepdim=True)
    dp = torch.einsum("bhgqd,bhkd->bhgqk", do5, v.to(acc))
    ds = p * (dp - delta) * scale
    dq = torch.einsum("bhgqk,bhkd->bhgqd", ds, k.to(acc)).reshape(b, hq, sq, d)
    dk = torch.einsum("bhgqk,bhgqd->bhkd", ds, q5)
    dv = torch.einsum("bhgqk,bhgqd->bhkd", p, do5)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


# ---- a block's segments -----------------------------------------------------------------------


def attend_block(
    q_BHSD: torch.Tensor,
    k_BHSD: torch.Tensor,
    v_BHSD: torch.Tensor,
    segments: tuple[Segment, ...],
    out_acc: torch.Tensor,
    lse_acc: torch.Tensor,
    scale: float,
    *,
    kernel: compat.FusedAttentionKernel | None = None,
) -> None:
    """Run a block's segments and merge them into ``out_acc`` [B,Hq,S,D] / ``lse_acc`` [B,Hq,S]
    (acc dtype) in place. ``kernel``: a fused kernel to use instead of the device's own (tests)."""
    kernel = kernel or compat.cuda_fused_kernel(q_BHSD)
    if kernel is not None:
        calls = fused.block_forward(q_BHSD, k_BHSD, v_BHSD, segments, scale, kernel)
    else:
        calls = _segments_forward(q_BHSD, k_BHSD, v_BHSD, segments, scale)
    for rows, out, lse, overwrite in calls:
        _merge_rows(out_acc, lse_acc, rows, out, lse.to(lse_acc.dtype), overwrite)


def _segments_forward(q_BHSD, k_BHSD, v_BHSD, segments, scale) -> Iterator:
    for seg in segments:
        mask = seg.additive_mask(q_BHSD.dtype, q_BHSD.device) if seg.kind == MASKED else None
        out, lse = block_forward(
            q_BHSD[:, :, seg.rows],
            k_BHSD[:, :, seg.cols],
            v_BHSD[:, :, seg.cols],
            causal=seg.kind == CAUSAL,
            scale=scale,
            mask=mask,
        )
        if seg.kind == MASKED:
            lse = lse.masked_fill(seg.empty_rows(lse.device), float("-inf"))
        yield seg.rows, out, lse, seg.overwrite


def _merge_rows(out_acc, lse_acc, rows: Index, out, lse, overwrite: bool) -> None:
    if isinstance(rows, slice):
        _merge(out_acc[:, :, rows], lse_acc[:, :, rows], out, lse, overwrite)
        return
    if not overwrite:  # rows of several rectangles: gather, merge, put back
        out_rows, lse_rows = out_acc.index_select(2, rows), lse_acc.index_select(2, rows)
        _merge(out_rows, lse_rows, out, lse, overwrite=False)
        out, lse = out_rows, lse_rows
    out_acc.index_copy_(2, rows, out.to(out_acc.dtype))
    lse_acc.index_copy_(2, rows, lse)


def _merge(out_acc, lse_acc, out, lse, overwrite: bool) -> None:
    """Combine two partial softmax results of the same rows; -inf rows (nothing seen) are safe."""
    if overwrite:
        out_acc.copy_(out)
        lse_acc.copy_(lse)
        return
    m = torch.maximum(lse_acc, lse)
    m = m.masked_fill(m == float("-inf"), 0)
    a, b = (lse_acc - m).exp(), (lse - m).exp()
    total = a + b
    lse_acc.copy_(m + total.log())
    total = total.masked_fill(total == 0, 1)
    out_acc.mul_((a / total).unsqueeze(-1)).add_(out * (b / total).unsqueeze(-1))


def attend_block_backward(
    dout_BHSD: torch.Tensor,
    q_BHSD: torch.Tensor,
    k_BHSD: torch.Tensor,
    v_BHSD: torch.Tensor,
    out_BHSD: torch.Tensor,
    lse_BHS: torch.Tensor,
    segments: tuple[Segment, ...],
    dq_acc: torch.Tensor,
    scale: float,
    *,
    kernel: compat.FusedAttentionKernel | None = None,
) -> KeyGrads:
    """Add the block's dq into ``dq_acc`` (acc dtype) in place; return its (columns, dk, dv)
    parts for the caller to add where the key block's gradient lives (``add_key_grads``).

    ``lse_BHS`` must be finite: rows that see nothing anywhere (padding) carry 0, and since
    every key is masked for them, their probabilities are exp(-inf) = 0 whatever the lse.
    """
    args = (dout_BHSD, q_BHSD, k_BHSD, v_BHSD, out_BHSD, lse_BHS, segments, scale)
    kernel = kernel or compat.cuda_fused_kernel(q_BHSD)
    calls = fused.block_backward(*args, kernel) if kernel else _segments_backward(*args)
    parts = []
    for rows, dq, cols, dk, dv in calls:
        _add_rows(dq_acc, rows, dq)
        parts.append((cols, dk, dv))
    return parts


def _segments_backward(dout_BHSD, q_BHSD, k_BHSD, v_BHSD, out_BHSD, lse_BHS, segments, scale):
    for seg in segments:
        mask = seg.additive_mask(q_BHSD.dtype, q_BHSD.device) if seg.kind == MASKED else None
        dq, dk, dv = block_backward(
            dout_BHSD[:, :, seg.rows],
            q_BHSD[:, :, seg.rows],
            k_BHSD[:, :, seg.cols],
            v_BHSD[:, :, seg.cols],
            out_BHSD[:, :, seg.rows],
            lse_BHS[:, :, seg.rows],
            causal=seg.kind == CAUSAL,
            scale=scale,
            mask=mask,
        )
        yield seg.rows, dq, seg.cols, dk, dv


def _add_rows(acc_BHSD: torch.Tensor, index: Index, x: torch.Tensor) -> None:
    if isinstance(index, slice):
        acc_BHSD[:, :, index] += x
    else:
        acc_BHSD.index_add_(2, index, x.to(acc_BHSD.dtype))


def add_key_grads(dkv_acc: torch.Tensor, parts: KeyGrads) -> None:
    """Add (columns, dk, dv) parts into ``dkv_acc`` [2,B,Hkv,S,D] (acc dtype) in place."""
    for cols, dk, dv in parts:
        _add_rows(dkv_acc[0], cols, dk)
        _add_rows(dkv_acc[1], cols, dv)
