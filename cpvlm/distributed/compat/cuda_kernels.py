"""torch's two fused CUDA attention kernels, called directly (the forward returns the lse, the
backward takes a row's final, merged, out and lse, as CP needs) and wrapped as custom ops.

Legend: B batch, S length, H heads, D head dim, T packed rows, N packed sequences.

  flash      aten._flash_attention_forward/_backward: bf16/fp16 on sm80+, takes Hkv key heads;
  efficient  aten._efficient_attention_forward/_backward: fp32/bf16/fp16 and an additive mask,
             equal head counts only (GQA heads are expanded here, for the call, and dK/dV summed
             back: nothing expanded leaves the call).

Both take q/k/v either dense, [B, S, H, D] with the last dim contiguous (other strides free, so
the transpose of a [B, H, S, D] tensor goes in without a copy), or packed, [T, H, D] with a
``Packing``: N independent sequences in one call. ``causal`` is top-left (query i sees keys
0..i); the flash kernel aligns it bottom-right, the same for the square sequences cpvlm gives it.
Whatever layout the installed torch's kernel uses for the lse, the wrappers return and take it
as dense [B, H, S] or packed [H, T], float32; the kernels' own layouts (the efficient kernel
keeps one row per sequence, padded to a multiple of 32) are read from the ops' meta kernels,
which follow the installed torch. Dropout is 0, so the kernels never read their philox / rng
arguments (see ``_unused_rng``).

The four private aten ops run inside two custom ops, ``cpvlm::fused_attention_forward`` and
``_backward`` (``torch.library.custom_op``). What differs between torch 2.11 and 2.15 is found
by feature detection, not by version: whether flash is built
(``torch.backends.cuda.is_flash_attention_available``, where it exists) and each kernel's lse
layout (its meta kernel).
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch

_aten = torch.ops.aten


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
