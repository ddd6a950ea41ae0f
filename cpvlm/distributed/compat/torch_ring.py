"""PyTorch's own context parallelism, which tests and benchmarks compare cpvlm against.

Legend: B batch, H heads, S length, D head dim.

Wraps the private ``torch.distributed.tensor.experimental._context_parallel``: its ring attention
(``_attention._templated_ring_attention`` and ``_backward``, ``set_rotate_method``) and its
head-tail load balancer (``_load_balancer._HeadTailLoadBalancer``). Present under these names in
torch 2.11 to 2.15; where the balancer cannot be imported, ``torch_head_tail_indices`` says so
(None).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

_aten = torch.ops.aten


def torch_head_tail_indices(seq_len: int, cp_size: int) -> torch.Tensor | None:
    """``[cp_size, seq_len // cp_size]`` positions each rank holds under PyTorch's own head-tail
    load balancer, or None where this torch has no such (private) balancer."""
    try:
        from torch.distributed.tensor.experimental._context_parallel._load_balancer import (
            _HeadTailLoadBalancer,
        )
    except ImportError:
        return None
    balancer = _HeadTailLoadBalancer(seq_len, cp_size, torch.device("cpu"))
    return balancer._generate_indices().reshape(cp_size, -1)


def torch_ring_attention_forward(
    q_BHSD: torch.Tensor,
    k_BHSD: torch.Tensor,
    v_BHSD: torch.Tensor,
    group: dist.ProcessGroup,
    *,
    causal: bool,
    scale: float | None = None,
    rotate: str = "alltoall",
) -> tuple[torch.Tensor, torch.Tensor]:
    """PyTorch's templated ring attention on head-tail shards, with the fused CPU kernel.

    ``torch.distributed.tensor.experimental._context_parallel`` only reaches its ring through
    DTensor dispatch of the CUDA SDPA ops. Its ``_templated_ring_attention`` takes the attention
    op as an argument, so handing it the CPU flash op runs the very same ring on gloo, without
    DTensor and without patching anything. Head-tail load balancing is its default
    (``_cp_options.enable_load_balance``), which is the layout of ``ShardPlan``. ``rotate`` picks
    how K/V move: "alltoall" (a ring step per step) or "allgather" (torch's default).
    """
    from torch.distributed.tensor.experimental._context_parallel import _attention as cp

    _set_torch_rotate(cp, rotate)
    out, lse = cp._templated_ring_attention(
        group,
        2,
        _aten._scaled_dot_product_flash_attention_for_cpu,
        query=q_BHSD,
        key=k_BHSD,
        value=v_BHSD,
        is_causal=causal,
        dropout_p=0.0,
        scale=scale,
    )
    return out, lse


def torch_ring_attention_backward(
    dout_BHSD: torch.Tensor,
    q_BHSD: torch.Tensor,
    k_BHSD: torch.Tensor,
    v_BHSD: torch.Tensor,
    out_BHSD: torch.Tensor,
    lse_BHS: torch.Tensor,
    group: dist.ProcessGroup,
    *,
    causal: bool,
    scale: float | None = None,
    rotate: str = "alltoall",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Backward of ``torch_ring_attention_forward`` -> dq, dk, dv."""
    from torch.distributed.tensor.experimental._context_parallel import _attention as cp

    _set_torch_rotate(cp, rotate)
    dq, dk, dv = cp._templated_ring_attention_backward(
        group,
        2,
        _aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
        grad_out=dout_BHSD,
        grad_out_name="grad_out",
        query=q_BHSD,
        key=k_BHSD,
        value=v_BHSD,
        out=out_BHSD,
        logsumexp=lse_BHS,
        is_causal=causal,
        dropout_p=0.0,
        scale=scale,
    )
    return dq, dk, dv


def _set_torch_rotate(cp, rotate: str) -> None:
    if rotate not in ("alltoall", "allgather"):
        raise ValueError(f"rotate must be 'alltoall' or 'allgather', got {rotate!r}")
    cp.set_rotate_method(rotate)
