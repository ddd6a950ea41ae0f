"""The one place where cpvlm touches private or version-dependent torch APIs.

Legend: B batch, Hq/Hkv query/key heads, Sq/Sk query/key length, D head dim.

Everything here is a thin wrapper with a plain signature, so that a torch upgrade that renames or
changes one of these ops is fixed in this file alone.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator

import torch
import torch.distributed as dist

# Dispatch-level tracing (benchmarks/memory.py counts live tensor bytes with it).
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: F401

_aten = torch.ops.aten

# ---- tensor collectives: the *_single names (torch >= 2.13) or the older ones ------------------
#
# torch 2.13 added dist.all_gather_single / reduce_scatter_single and deprecated
# all_gather_into_tensor / reduce_scatter_tensor (same arguments, same semantics); 2.11 and 2.12
# have only the older names. Chosen by feature detection, never by version string.
_COLLECTIVES = {
    "all_gather": ("all_gather_single", "all_gather_into_tensor"),
    "reduce_scatter": ("reduce_scatter_single", "reduce_scatter_tensor"),
}


def _pick(op: str, legacy: bool):
    new, old = _COLLECTIVES[op]
    fn = None if legacy else getattr(dist, new, None)
    return fn if fn is not None else getattr(dist, old)


_legacy_collectives = False


def uses_single_collectives() -> bool:
    """True when the ``*_single`` tensor collectives are in use (present and not overridden)."""
    return not _legacy_collectives and hasattr(dist, _COLLECTIVES["all_gather"][0])


@contextlib.contextmanager
def legacy_collectives() -> Iterator[None]:
    """Use ``all_gather_into_tensor`` / ``reduce_scatter_tensor`` even where the ``*_single`` names
    exist: how tests exercise the torch 2.11/2.12 branch on a newer torch."""
    global _legacy_collectives
    before, _legacy_collectives = _legacy_collectives, True
    try:
        yield
    finally:
        _legacy_collectives = before


def all_gather_tensor(out: torch.Tensor, x: torch.Tensor, group) -> None:
    """``out`` = the equal-sized ``x`` of every rank, concatenated along dim 0 in rank order."""
    fn = _pick("all_gather", _legacy_collectives)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # the old name on torch >= 2.13
        fn(out, x, group=group)


def reduce_scatter_tensor(out: torch.Tensor, x: torch.Tensor, group) -> None:
    """``out`` = this rank's equal slice (dim 0) of the sum over ranks of ``x``."""
    fn = _pick("reduce_scatter", _legacy_collectives)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        fn(out, x, group=group)


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


# ---- PyTorch's own context parallelism (tests and benchmarks compare against it) --------------


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


# ---- PyTorch's own context-parallel ring attention (benchmarks compare against it) ------------


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


# ---- DCP checkpoint metadata -------------------------------------------------------------------


def dcp_file_extents(path) -> dict[str, int]:
    """``{file name: bytes DCP wrote into it}`` of a DCP checkpoint directory, from its metadata.

    ``Metadata.storage_data`` maps every saved item to a private ``_StorageInfo`` (file, offset,
    length); read through ``getattr`` here so that a change of that class is fixed in one place.
    """
    from torch.distributed.checkpoint import FileSystemReader

    needed: dict[str, int] = {}
    for info in FileSystemReader(str(path)).read_metadata().storage_data.values():
        name = str(info.relative_path)
        needed[name] = max(needed.get(name, 0), int(info.offset) + int(info.length))
    return needed
