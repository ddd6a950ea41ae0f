"""The one place where cpvlm touches private or version-dependent torch APIs.

Legend: B batch, Hq/Hkv query/key heads, Sq/Sk query/key length, D head dim.

Everything here is a thin wrapper with a plain signature, so that a torch upgrade that renames or
changes one of these ops is fixed in this file alone.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass

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


# ---- fused CUDA attention kernels --------------------------------------------------------------
#
# torch's two CUDA attention kernels, called directly so that the forward returns the lse and the
# backward takes a row's final (merged) out and lse, as CP needs:
#   flash      aten._flash_attention_forward/_backward: bf16/fp16 on sm80+, takes Hkv key heads;
#   efficient  aten._efficient_attention_forward/_backward: fp32/bf16/fp16 and an additive mask,
#              equal head counts only (GQA heads are expanded here, for the call, and dK/dV summed
#              back: nothing expanded leaves the call).
# Both take q/k/v either dense, [B, S, H, D] with the last dim contiguous (other strides free, so
# the transpose of a [B, H, S, D] tensor goes in without a copy), or packed, [T, H, D] with a
# ``Packing``: N independent sequences in one call. ``causal`` is top-left (query i sees keys
# 0..i); the flash kernel aligns it bottom-right, the same for the square sequences cpvlm gives it.
# Whatever layout the installed torch's kernel uses for the lse, the wrappers return and take it
# as dense [B, H, S] or packed [H, T], float32; the kernels' own layouts (the efficient kernel
# keeps one row per sequence, padded to a multiple of 32) are read from the ops' meta kernels,
# which follow the installed torch. Dropout is 0, so the kernels never read their philox / rng
# arguments (see ``_unused_rng``).


def fake_mode_active() -> bool:
    """True under a FakeTensorMode: torch.compile's tracing, a dry run on fake tensors."""
    if torch.compiler.is_compiling():  # a constant to dynamo; detect_fake_mode would break
        return True
    return torch._guards.detect_fake_mode() is not None


@contextlib.contextmanager
def real_tensors() -> Iterator[None]:
    """Tensors made inside are real even under a FakeTensorMode: for host-side planning on CPU
    integers (schedules), which a dry run must compute, not fake."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    if torch.compiler.is_compiling():  # dynamo runs host code for real around its graphs
        yield
        return
    with unset_fake_temporarily():
        yield


@dataclass(frozen=True, eq=False)
class Packing:
    """N sequences packed along dim 0: sequence i is rows ``cu_q[i]:cu_q[i+1]`` of q against rows
    ``cu_k[i]:cu_k[i+1]`` of k and v (int32 [N+1] on the device); the longest of each, as ints."""

    cu_q: torch.Tensor
    cu_k: torch.Tensor
    max_q: int
    max_k: int


@dataclass(frozen=True)
class FusedAttentionKernel:
    """A fused attention kernel with the calling convention above.

    ``forward(q, k, v, *, causal, scale, packing=None, bias=None) -> (out, lse)`` and
    ``backward(dout, q, k, v, out, lse, *, causal, scale, packing=None, bias=None) -> (dq, dk, dv)``
    with out/dq shaped like q and dk/dv like k. ``bias`` (dense calls, kernels with ``takes_bias``)
    is an additive [Sq, Sk] mask in q's dtype, the same for every batch row and head.
    """

    name: str
    takes_bias: bool
    forward: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    backward: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


_FUSED_HEAD_DIMS = range(8, 257, 8)
_HALF = (torch.bfloat16, torch.float16)


def cuda_fused_kernel(q_BHSD: torch.Tensor) -> FusedAttentionKernel | None:
    """The fused CUDA kernel for tensors like ``q_BHSD``, or None (the plain-torch path): not CUDA
    (ROCm builds too: their kernels differ), or what ``fused_kernel_for`` refuses."""
    if q_BHSD.device.type != "cuda" or torch.version.cuda is None:
        return None
    built = getattr(torch.backends.cuda, "is_flash_attention_available", lambda: True)()
    return fused_kernel_for(q_BHSD.dtype, q_BHSD.shape[-1], _capability(q_BHSD.device), built)


def fused_kernel_for(
    dtype: torch.dtype, head_dim: int, capability: tuple[int, int], flash_built: bool = True
) -> FusedAttentionKernel | None:
    """The kernel selection on a CUDA GPU of compute ``capability``: flash for bf16/fp16 on sm80+,
    the memory-efficient kernel for fp32, for fp16 before sm80 and where flash is not built;
    None for float64, head dims the kernels do not take, and bf16 before sm80, where neither
    kernel has bf16 code (a one-time warning says so)."""
    if head_dim not in _FUSED_HEAD_DIMS:
        return None
    if dtype in _HALF and flash_built and capability >= (8, 0):
        return CUDA_FLASH
    if dtype == torch.bfloat16 and capability < (8, 0):
        _warn_bf16_before_sm80(capability)
        return None
    if dtype in (torch.float32, *_HALF):
        return CUDA_EFFICIENT
    return None


@functools.lru_cache(maxsize=16)
def _capability(device: torch.device) -> tuple[int, int]:
    return tuple(torch.cuda.get_device_capability(device))


@functools.cache
def _warn_bf16_before_sm80(capability: tuple[int, int]) -> None:
    warnings.warn(
        f"bf16 attention on a GPU of compute capability {capability[0]}.{capability[1]} (before "
        "8.0): torch's fused attention kernels have no bf16 code there, so cpvlm runs its "
        "plain-torch attention (float32 math, memory quadratic in each call's length); fp16 "
        "takes the memory-efficient kernel on such GPUs",
        RuntimeWarning,
        stacklevel=3,
    )


def _lengths(q, k, packing: Packing | None) -> tuple:
    if packing is None:
        return None, None, q.shape[1], k.shape[1]
    return packing.cu_q, packing.cu_k, packing.max_q, packing.max_k


def _flash_forward(q, k, v, *, causal, scale, packing=None, bias=None):
    if bias is not None:
        raise ValueError("the flash kernel takes no additive mask; use the efficient kernel")
    if packing is None and causal and q.shape[1] != k.shape[1]:
        raise ValueError(f"causal flash calls must be square, got {q.shape[1]} x {k.shape[1]}")
    return _fused_forward("flash", q, k, v, *_op_lengths(packing), causal, scale, None)


def _flash_backward(dout, q, k, v, out, lse, *, causal, scale, packing=None, bias=None):
    args = (dout, q, k, v, out, lse, *_op_lengths(packing), causal, scale, None)
    return _fused_backward("flash", *args)


def _efficient_forward(q, k, v, *, causal, scale, packing=None, bias=None):
    if bias is not None and packing is not None:
        raise ValueError("the efficient kernel takes no additive mask with packed sequences")
    return _fused_forward("efficient", q, k, v, *_op_lengths(packing), causal, scale, bias)


def _efficient_backward(dout, q, k, v, out, lse, *, causal, scale, packing=None, bias=None):
    args = (dout, q, k, v, out, lse, *_op_lengths(packing), causal, scale, bias)
    return _fused_backward("efficient", *args)


def _op_lengths(packing: Packing | None) -> tuple:
    if packing is None:
        return None, None, 0, 0
    return packing.cu_q, packing.cu_k, packing.max_q, packing.max_k


# The calls as custom ops with fake kernels of their own: torch.compile and FakeTensorMode see
# an opaque op with known output shapes, never the aten ops' meta kernels (torch 2.13's meta
# kernel of _efficient_attention_backward lacks its ``out`` argument: "got multiple values for
# argument 'scale'"), nor the host work around them (rng tensors, lse padding). The outputs'
# strides are fixed by the fake kernels and enforced on the real ones (``_strided_as``).
@torch.library.custom_op("cpvlm::fused_attention_forward", mutates_args=())
def _fused_forward(
    kernel: str,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_q: torch.Tensor | None,
    cu_k: torch.Tensor | None,
    max_q: int,
    max_k: int,
    causal: bool,
    scale: float,
    bias: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    packing = None if cu_q is None else Packing(cu_q, cu_k, max_q, max_k)
    impl = _flash_forward_impl if kernel == "flash" else _efficient_forward_impl
    out, lse = impl(q, k, v, causal=causal, scale=scale, packing=packing, bias=bias)
    like = _fake_forward(kernel, _meta(q), _meta(k), _meta(v), cu_q, cu_k, max_q, max_k, causal,
                         scale, bias)  # fmt: skip
    return _strided_as(out, like[0]), _strided_as(lse, like[1])


@_fused_forward.register_fake
def _fake_forward(kernel, q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, bias):
    out = torch.empty_like(q) if kernel == "flash" else q.new_empty(q.shape)
    lse_shape = (
        (q.shape[1], q.shape[0]) if cu_q is not None else (q.shape[0], q.shape[2], q.shape[1])
    )
    return out, q.new_empty(lse_shape, dtype=_lse_dtype(q.dtype))


@torch.library.custom_op("cpvlm::fused_attention_backward", mutates_args=())
def _fused_backward(
    kernel: str,
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    cu_q: torch.Tensor | None,
    cu_k: torch.Tensor | None,
    max_q: int,
    max_k: int,
    causal: bool,
    scale: float,
    bias: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    packing = None if cu_q is None else Packing(cu_q, cu_k, max_q, max_k)
    impl = _flash_backward_impl if kernel == "flash" else _efficient_backward_impl
    grads = impl(dout, q, k, v, out, lse, causal=causal, scale=scale, packing=packing, bias=bias)
    return tuple(_strided_as(g, torch.empty_like(_meta(t))) for g, t in zip(grads, (q, k, v)))


@_fused_backward.register_fake
def _fake_backward(kernel, dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal, scale, bias):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _lse_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32, the kernels' lse; float64 for float64 (the CPU test kernels take it)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _meta(t: torch.Tensor) -> torch.Tensor:
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")


def _strided_as(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``t`` with the strides of ``like`` (same shape; a copy only where they differ)."""
    if t.stride() == like.stride():
        return t
    return torch.empty_strided(like.shape, like.stride(), dtype=t.dtype, device=t.device).copy_(t)


def _flash_forward_impl(q, k, v, *, causal, scale, packing=None, bias=None):
    out, lse, *_ = _aten._flash_attention_forward(
        q, k, v, *_lengths(q, k, packing), 0.0, causal, False, scale=scale
    )
    return out, _lse_from_kernel(lse, q, packing)


def _flash_backward_impl(dout, q, k, v, out, lse, *, causal, scale, packing=None, bias=None):
    rng_state, unused = _unused_rng("flash", q.device)
    lse = _lse_to_kernel("flash", lse, q, packing)
    dq, dk, dv = _aten._flash_attention_backward(
        dout, q, k, v, out, lse, *_lengths(q, k, packing), 0.0, causal, rng_state, unused,
        scale=scale,
    )  # fmt: skip
    return dq, dk, dv


def _efficient_forward_impl(q, k, v, *, causal, scale, packing=None, bias=None):
    k, v = (_expand_heads(t, q.shape[-2]) for t in (k, v))
    mask_type = 1 if causal else 0  # 1: causal from the top left
    if packing is None:
        out, lse, *_ = _aten._efficient_attention_forward(
            q, k, v, _aligned_bias(bias, q, k), None, None, None, None, 0.0, mask_type, True,
            scale=scale,
        )  # fmt: skip
        return out, _lse_from_kernel(lse, q, None)
    out, lse, *_ = _aten._efficient_attention_forward(
        q[None], k[None], v[None], None, *_lengths(q, k, packing), 0.0, mask_type, True,
        scale=scale,
    )  # fmt: skip
    return out[0], _lse_from_kernel(lse, q, packing)


def _efficient_backward_impl(dout, q, k, v, out, lse, *, causal, scale, packing=None, bias=None):
    hkv = k.shape[-2]
    k, v = (_expand_heads(t, q.shape[-2]) for t in (k, v))
    seed, offset = _unused_rng("efficient", q.device)
    lse = _lse_to_kernel("efficient", lse, q, packing)
    lengths = _lengths(q, k, packing)
    # The kernel reads `out` with the row stride of a contiguous [B, S, H, D] tensor.
    dout, out = dout.contiguous(), out.contiguous()
    if packing is None:
        bias = _aligned_bias(bias, q, k)
    else:
        dout, q, k, v, out = (t[None] for t in (dout, q, k, v, out))
    dq, dk, dv, _ = _aten._efficient_attention_backward(
        dout, q, k, v, bias, out, *lengths, lse, 0.0, seed, offset, 1 if causal else 0, False,
        scale=scale,
    )  # fmt: skip
    if packing is not None:
        dq, dk, dv = dq[0], dk[0], dv[0]
    return dq, _sum_heads(dk, hkv), _sum_heads(dv, hkv)


CUDA_FLASH = FusedAttentionKernel("flash", False, _flash_forward, _flash_backward)
CUDA_EFFICIENT = FusedAttentionKernel("efficient", True, _efficient_forward, _efficient_backward)


def _expand_heads(t: torch.Tensor, heads: int) -> torch.Tensor:
    """[..., Hkv, D] -> [..., heads, D], query head h using key head h // (heads // Hkv)."""
    hkv = t.shape[-2]
    return t if hkv == heads else t.repeat_interleave(heads // hkv, dim=-2)


def _sum_heads(grad: torch.Tensor, hkv: int) -> torch.Tensor:
    """The adjoint of ``_expand_heads``: [..., Hq, D] -> [..., Hkv, D], summed in float32 (float64
    for float64: the CPU test kernels take it)."""
    hq = grad.shape[-2]
    if hq == hkv:
        return grad
    acc = torch.float64 if grad.dtype == torch.float64 else torch.float32
    return grad.unflatten(-2, (hkv, hq // hkv)).sum(-2, dtype=acc).to(grad.dtype)


def _aligned_bias(bias: torch.Tensor | None, q, k) -> torch.Tensor | None:
    """[Sq, Sk] -> [B, H, Sq, Sk], broadcast, with a row stride the kernel accepts (16 * n)."""
    if bias is None:
        return None
    sq, sk = bias.shape
    storage = bias.new_empty(sq, -(-sk // 16) * 16)
    storage[:, :sk] = bias
    return storage[:, :sk].expand(q.shape[0], q.shape[2], sq, sk)


def _lse_from_kernel(lse: torch.Tensor, q, packing: Packing | None) -> torch.Tensor:
    if packing is None:
        return lse[..., : q.shape[1]]  # [B, H, S], padded or not
    if lse.dim() == 2:
        return lse  # [H, T]
    return lse_rows_from_sequences(lse, packing.cu_q, q.shape[0])


def _lse_to_kernel(name: str, lse: torch.Tensor, q, packing: Packing | None) -> torch.Tensor:
    if packing is None:
        s, width = q.shape[1], _kernel_lse_shape(name, False, q.shape[1])[-1]
        if width == s:
            return lse.contiguous()
        padded = lse.new_zeros(*lse.shape[:-1], width)
        padded[..., :s] = lse
        return padded
    shape = _kernel_lse_shape(name, True, packing.max_q)
    if len(shape) == 2:
        return lse.contiguous()
    return lse_sequences_from_rows(lse, packing.cu_q, shape[-1])


@functools.lru_cache(maxsize=1024)
def _kernel_lse_shape(name: str, packed: bool, max_q: int) -> tuple[int, ...]:
    """The lse shape that this torch's kernel gives one sequence of ``max_q`` queries and one head
    (packed: one of one), read from the op's meta kernel: no device, no computation."""
    q = torch.empty(1, max_q, 1, 64, device="meta", dtype=torch.float16)
    cu = torch.empty(2, device="meta", dtype=torch.int32)
    lengths = (cu, cu, max_q, max_q) if packed else (None, None, max_q, max_q)
    if name == "flash":
        q = q[0] if packed else q
        lse = _aten._flash_attention_forward(q, q, q, *lengths, 0.0, False, False)[1]
    else:
        lse = _aten._efficient_attention_forward(q, q, q, None, *lengths, 0.0, 0, True)[1]
    return tuple(lse.shape)


@functools.lru_cache(maxsize=16)
def _unused_rng(name: str, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The two philox / rng arguments of a backward at dropout 0, which neither kernel reads.

    flash: what torch's own ``torch.nn.attention.varlen`` passes at dropout 0 (a zero [2] uint64
    rng state and an empty tensor, on the device); efficient: zeros shaped as its forward
    returns them (from the meta kernel), on the CPU, where it leaves them outside graph capture.
    """
    if name == "flash":
        return torch.zeros(2, dtype=torch.uint64, device=device), torch.empty(0, device=device)
    q = torch.empty(1, 1, 1, 64, device="meta", dtype=torch.float16)
    outs = _aten._efficient_attention_forward(q, q, q, None, None, None, None, None, 0.0, 0, True)
    return tuple(torch.zeros(t.shape, dtype=t.dtype) for t in outs[2:4])


def _row_coordinates(cu_q: torch.Tensor, total: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(sequence, position in it) of each of the ``total`` packed rows, computed on cu_q's device."""
    cu = cu_q.long()
    rows = torch.arange(total, device=cu.device)
    seq = torch.searchsorted(cu[1:], rows, right=True)
    return seq, rows - cu[seq]


def lse_rows_from_sequences(lse_NHW: torch.Tensor, cu_q: torch.Tensor, total: int) -> torch.Tensor:
    """A per-sequence lse [N, H, W] (query j of sequence i at [i, :, j], W >= its length) -> the
    packed [H, T] layout (at [:, cu_q[i] + j])."""
    seq, pos = _row_coordinates(cu_q, total)
    return lse_NHW[seq, :, pos].T.contiguous()


def lse_sequences_from_rows(lse_HT: torch.Tensor, cu_q: torch.Tensor, width: int) -> torch.Tensor:
    """The inverse of ``lse_rows_from_sequences``: [H, T] -> [N, H, width], 0 past each length."""
    seq, pos = _row_coordinates(cu_q, lse_HT.shape[1])
    out = lse_HT.new_zeros(cu_q.numel() - 1, lse_HT.shape[0], width)
    out[seq, :, pos] = lse_HT.T
    return out


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


def async_save(state: dict, writer, group):
    """Start DCP's asynchronous save of ``state`` on ``group`` (gloo: its collectives run in a
    background thread, so not on the training group); the future of the write.

    The state is staged (copied to host memory) before this returns, so training may change it.
    torch 2.11-2.15 return a Future, or an ``AsyncSaveResponse`` (staging and upload futures)
    when the stager stages in the background.
    """
    import torch.distributed.checkpoint as dcp

    response = dcp.async_save(state, storage_writer=writer, process_group=group)
    staging = getattr(response, "staging_completion", None)
    if staging is not None:
        staging.result()
    return getattr(response, "upload_completion", response)


def checkpoint_error_types() -> tuple[type[BaseException], ...]:
    """What a failed DCP save raises: ``CheckpointException`` (a BaseException) or OSError."""
    from torch.distributed.checkpoint.api import CheckpointException

    return (CheckpointException, OSError)


def checkpoint_failure(err: BaseException) -> str:
    """One line for a failed DCP save: the first rank's error (``CheckpointException.failures``
    maps rank -> (exception, traceback))."""
    failures = getattr(err, "failures", None)
    if failures:
        rank = min(failures)
        exc = failures[rank][0]
        return f"rank {rank}: {type(exc).__name__}: {exc}"
    return f"{type(err).__name__}: {err}"


# ---- the process group's store, and collective timeouts ----------------------------------------


def default_store():
    """The key-value store the default process group was built on (a private torch API)."""
    from torch.distributed import distributed_c10d

    return distributed_c10d._get_default_store()


def is_collective_timeout(err: BaseException) -> bool:
    """A collective that waited longer than the process group's timeout (gloo: "Timed out
    waiting ... for recv"; NCCL's watchdog: "collective operation timeout")."""
    text = str(err)
    return "Timed out waiting" in text or "operation timeout" in text or "timed out" in text


def die_with_parent() -> None:
    """Have this process killed (SIGKILL) when its parent dies (Linux ``PR_SET_PDEATHSIG``,
    through torch's private helper; elsewhere nothing)."""
    import signal

    import torch.multiprocessing as tmp

    set_pdeathsig = getattr(tmp, "_prctl_pr_set_pdeathsig", None)
    if set_pdeathsig is not None:
        set_pdeathsig(signal.SIGKILL)


# ---- dry runs: fake tensors, a fake process group, torch's memory tracker ----------------------
#
# ``cpvlm.simulate`` runs one rank's step on fake tensors (``FakeTensorMode``: shapes, dtypes and
# storages without data) in a process group that answers every collective without communicating
# (the "fake" backend of torch.testing), and counts bytes with ``torch.distributed._tools``'
# MemTracker. All three are private torch APIs (torch 2.11-2.15 have them under these names).


def is_fake(t: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(t, FakeTensor)


def fake_tensor_mode():
    """A FakeTensorMode that takes real tensors as inputs (the batch's integers stay real)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode(allow_non_fake_inputs=True)


def init_fake_process_group(world_size: int, rank: int = 0) -> None:
    """``torch.distributed`` as rank ``rank`` of ``world_size`` ranks that never communicate: a
    collective returns at once with its output buffers as they were."""
    import torch.testing._internal.distributed.fake_pg as fake_pg  # registers the "fake" backend

    dist.init_process_group("fake", store=fake_pg.FakeStore(), rank=rank, world_size=world_size)


# MemTracker's categories, and two that cpvlm attributes by where a storage is made: "Gathered",
# in FSDP2's named all-gather regions (the full-size parameters it gathers, with the all-gather
# buffers), and "Loss", in ``ContextParallelVLM``'s ``cpvlm.loss`` region and in a phase the caller
# opens (the loss's backward: its logit blocks and the head's full-size gradient).
_GATHER_REGIONS = ("FSDP::all_gather",)  # also matches "FSDP::all_gather_copy_out"
_LOSS_REGIONS = ("cpvlm.loss",)
GATHERED, LOSS = "Gathered", "Loss"


def memory_tracker():
    """torch's ``MemTracker`` (bytes by PARAM, BUFFER, GRAD, ACT, TEMP, OPT; peaks per device) with
    two more categories, ``GATHERED`` and ``LOSS`` (above), keeping only the global peak: its
    per-module peaks cost a pass over every module on every op (minutes for a real model), and
    cpvlm reads the global ones.

    ``tracker.push(category)`` / ``tracker.pop(category)`` label what is allocated between them;
    ``tracker.category_of(t)`` is the category of ``t``'s storage (None if untracked)."""
    from torch.distributed._tools import mem_tracker

    names = {m.name: m.value for m in mem_tracker._MemRefType}
    RefType = mem_tracker._RefType("CpvlmRefType", {**names, "GATHERED": GATHERED, "LOSS": LOSS})
    sticky = {RefType.GATHERED, RefType.LOSS}
    regions = [(r, RefType.GATHERED) for r in _GATHER_REGIONS]
    regions += [(r, RefType.LOSS) for r in _LOSS_REGIONS]
    enter_region = torch.ops.profiler._record_function_enter_new.default
    exit_region = torch.ops.profiler._record_function_exit._RecordFunction

    class GlobalPeakTracker(mem_tracker.MemTracker):
        def __init__(self):
            super().__init__()
            self._ref_class = RefType
            # Open labels, innermost last: (True, category or None) for a record_function region
            # (regions nest: each exit closes the innermost), (False, category) for a push.
            self._labels: list = []

        def push(self, category: str) -> None:
            self._labels.append((False, RefType(category)))

        def pop(self, category: str) -> None:
            """Close the innermost push of ``category`` (if open)."""
            for i in range(len(self._labels) - 1, -1, -1):
                if self._labels[i] == (False, category):
                    del self._labels[i]
                    return

        def _label(self):
            return next((c for _, c in reversed(self._labels) if c is not None), None)

        def category_of(self, t: torch.Tensor) -> str | None:
            winfo, _ = self._WINFO.get(t.untyped_storage(), (None, None))
            return None if winfo is None else str(winfo.reftype.value)

        # DTensor's sharding propagation runs each op once more on global-shape fake tensors, in
        # the enclosing fake mode (``detect_fake_mode()``), which MemTracker takes for the real
        # op: a sharded optimizer step counted at the unsharded size (issue 30: 27x its state).
        # Those ops are not tracked; the local ops DTensor then runs are.
        def __enter__(self):
            from torch.distributed.tensor import DTensor

            self._propagator = DTensor._op_dispatcher.sharding_propagator
            inner, self._propagating = self._propagator._propagate_tensor_meta_non_cached, False

            def untracked(*args, **kwargs):
                self._propagating = True
                try:
                    return inner(*args, **kwargs)
                finally:
                    self._propagating = False

            self._propagator._propagate_tensor_meta_non_cached = untracked
            return super().__enter__()

        def __exit__(self, *exc):
            try:
                return super().__exit__(*exc)
            finally:
                del self._propagator._propagate_tensor_meta_non_cached

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if self._propagating:
                return func(*args, **(kwargs or {}))
            if func is enter_region:
                name = str(args[0])
                category = next((c for r, c in regions if name.startswith(r)), None)
                self._labels.append((True, category))
            elif func is exit_region:
                i = next(i for i in range(len(self._labels) - 1, -1, -1) if self._labels[i][0])
                del self._labels[i]
            return super().__torch_dispatch__(func, types, args, kwargs)

        def _track(self, reftype, t: torch.Tensor) -> None:
            label = None if self._in_opt else self._label()
            super()._track(reftype if label is None else label, t)

        def _update_and_maybe_create_winfos(self, t, reftype, update_existing=False):
            # MemTracker relabels a module's parameters PARAM and a parameter's gradient GRAD
            # when it meets them; a gathered full-size parameter (FSDP2 registers it on the
            # module) and the loss's full-size head gradient keep the category they were made in.
            for st in mem_tracker.get_untyped_storages(t):
                winfo, _ = self._WINFO.get(st, (None, None))
                if winfo is not None and winfo.reftype in sticky:
                    reftype = winfo.reftype
            return super()._update_and_maybe_create_winfos(t, reftype, update_existing)

        def reset_peak(self) -> None:
            """Start the global peak again from the bytes live now."""
            self._peak_mem.clear()
            self._peak_mem_snap.clear()
            for dev, snap in self._curr_mem_snap.items():
                self._peak_mem[dev] = snap[mem_tracker._TOTAL_KEY]
                self._peak_mem_snap[dev] = dict(snap)

        def _update_peak_stats(self, peak_state) -> None:
            for dev, snap in self._curr_mem_snap.items():
                if self._peak_mem.get(dev, 0) < snap[mem_tracker._TOTAL_KEY]:
                    self._peak_mem[dev] = snap[mem_tracker._TOTAL_KEY]
                    self._peak_mem_snap[dev] = dict(snap)

    return GlobalPeakTracker()


_INDEX_OPS = ("index.Tensor", "index_put.default", "index_put_.default", "_index_put_impl_.default")


def _real_mask(t) -> bool:
    return isinstance(t, torch.Tensor) and not is_fake(t) and t.dtype == torch.bool


class HostIntegers(TorchDispatchMode):
    """Inside a FakeTensorMode: ops whose inputs are all real run for real, so that a batch's
    integers (positions, grids, plans, masks) keep their values while every float is fake.

    What FakeTensorMode cannot do with real integers is done here: a real boolean mask indexing a
    fake tensor becomes its real ``nonzero`` indices (the output shape depends on the mask's
    values), and ``masked_select`` by a real mask gets its real count. Factory ops (no tensor
    inputs) are fake unless their result is an integer or boolean.
    """

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch._subclasses.fake_tensor import unset_fake_temporarily
        from torch.utils._pytree import tree_leaves

        kwargs = kwargs or {}
        tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        # A meta input (``Module.to_empty``'s ``empty_like``) is no real value: fake, not real.
        if any(is_fake(t) or t.is_meta for t in tensors):
            name = func.__name__
            if name in _INDEX_OPS and any(_real_mask(i) for i in args[1]):
                with unset_fake_temporarily():
                    idx = [
                        j
                        for i in args[1]
                        for j in (i.nonzero().unbind(1) if _real_mask(i) else [i])
                    ]
                args = (args[0], idx, *args[2:])
            elif name == "masked_select.default" and _real_mask(args[1]):
                with unset_fake_temporarily():
                    shape = torch.broadcast_shapes(args[0].shape, args[1].shape)
                    n = int(args[1].expand(shape).sum())
                return args[0].new_empty((n,))
            return func(*args, **kwargs)
        if not tensors:
            out = func(*args, **kwargs)
            if any(isinstance(t, torch.Tensor) and t.is_floating_point() for t in tree_leaves(out)):
                return out
        with unset_fake_temporarily():
            return func(*args, **kwargs)
