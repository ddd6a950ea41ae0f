"""torch's fused CPU flash attention, called directly for its log-sum-exp and its backward.

Legend: B batch, Hq/Hkv query/key heads, Sq/Sk query/key length, D head dim.

Wraps ``aten._scaled_dot_product_flash_attention_for_cpu`` and its ``_backward``: private ops
with the same signature in torch 2.11 to 2.15, so nothing is detected; a change of either is
fixed here.
"""

from __future__ import annotations

import torch

_aten = torch.ops.aten

# The fused CPU flash kernel (tiled, multithreaded, O(S) memory) accepts these dtypes, returns the
# log-sum-exp (float32 for half types, float64 for float64) and takes GQA key/value heads as they
# are, in the forward and in the backward (which returns dK/dV with Hkv heads).
_CPU_FLASH_DTYPES = (torch.float64, torch.float32, torch.bfloat16, torch.float16)


def cpu_flash_supported(q_BHSD: torch.Tensor) -> bool:
    """True when the fused CPU flash attention kernel handles tensors like ``q_BHSD``."""
    return q_BHSD.device.type == "cpu" and q_BHSD.dtype in _CPU_FLASH_DTYPES


def cpu_flash_forward(
    q_BHSD: torch.Tensor,
    k_BHSD: torch.Tensor,
    v_BHSD: torch.Tensor,
    *,
    causal: bool,
    scale: float,
    mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused CPU attention -> (out [B,Hq,Sq,D], lse [B,Hq,Sq]).

    ``causal`` is top-left aligned (query i sees keys 0..i). ``mask`` is additive, of the query
    dtype, broadcastable to [B,Hq,Sq,Sk]. A row whose keys are all masked comes back with out 0
    and lse 0 (not -inf): callers that can produce such rows must fix the lse themselves.
    """
    out, lse = _aten._scaled_dot_product_flash_attention_for_cpu(
        q_BHSD, k_BHSD, v_BHSD, 0.0, causal, attn_mask=mask, scale=scale
    )
    return out, lse


def cpu_flash_backward(
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
    """Backward of ``cpu_flash_forward`` from a saved (possibly global) out and lse -> dq, dk, dv.

    Passing the final merged ``out`` and ``lse`` of a row instead of this block's own gives this
    block's exact share of the gradient (the ring-attention identity), which is how CP uses it.
    """
    dq, dk, dv = _aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dout_BHSD,
        q_BHSD,
        k_BHSD,
        v_BHSD,
        out_BHSD,
        lse_BHS,
        0.0,
        causal,
        attn_mask=mask,
        scale=scale,
    )
    return dq, dk, dv
