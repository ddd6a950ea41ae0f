"""CPU kernels for torch's fused CUDA attention ops, so that compat's real call sites run on CPU.

Legend: B batch, N sequences of a packed call, T packed rows, Hq/Hkv query/key heads, S/Sq/Sk
lengths, D head dim, ceil32(x) = x rounded up to a multiple of 32.

``register_cpu_kernels()`` registers, for the CPU dispatch key (torch has none there), the four
ops that ``compat.CUDA_FLASH`` and ``compat.CUDA_EFFICIENT`` call:
``aten::_flash_attention_forward/_backward`` and ``aten::_efficient_attention_forward/_backward``.
Each checks its arguments as the CUDA kernel does, or stricter where the CUDA kernel would read
past what it was given without a word, and raises RuntimeError (TORCH_CHECK's type):
  flash      q/k/v [B, S, H, D] dense or [T, H, D] with int32 cum_seq_q/k; fp16/bf16 (and float64,
             below); Hkv divides Hq (GQA taken as is, dK/dV summed back to Hkv heads); last dims
             contiguous, D % 8 == 0 and <= 256; causal aligned BOTTOM-RIGHT (query i of Sq sees keys
             up to i + Sk - Sq); lse float32, [B, H, Sq] dense and [H, T] packed, read back by
             the backward in exactly that layout, contiguous; rng_state uint64 [2] on the device.
  efficient  q/k/v [B, S, H, D] (packed: [1, T, H, D] with int32 cu_seqlens); fp32/fp16/bf16 (and
             float64); EQUAL head counts (GQA expanded by the caller); additive bias [B, H, Sq, Sk]
             in q's dtype with a row stride that is a multiple of 16 (what torch's SDPA pads to),
             dense calls only; custom_mask_type 0 none, 1 causal top-left, 2 bottom-right; lse
             float32 [N, H, ceil32(max_q)] (one row per sequence, padded), the same in the
             backward; the backward reads ``out`` with the row stride of a contiguous
             [B, S, H, D] tensor, whatever its strides say.
cu_seqlens must start at 0, never decrease and cover every row, and max_q/max_k cover every
sequence: the CUDA kernels size their grids by them and silently drop rows past them. Dropout is
0. What the kernels leave unspecified is made to hurt: the lse padding past a sequence's length
and the rows that see no key (0/0) come back NaN, so a caller that reads them fails.

float64 inputs are accepted by both (lse float64): the stand-in for the kernels' half types that
keeps the tests exact (1e-10); the other dtypes follow the kernels' rules (flash refuses fp32).
The math is block.py's plain-torch attention in the acc dtype, per sequence.

``EmulatedKernel("flash" | "efficient").kernel`` is ``compat.CUDA_FLASH`` / ``CUDA_EFFICIENT``
itself (the real call sites and their layout conversions), with every op call recorded.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch

from cpvlm.attention import block
from cpvlm.distributed import compat

_FLASH_DTYPES = (torch.float16, torch.bfloat16, torch.float64)
_EFFICIENT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
_LIBRARY: torch.library.Library | None = None
_RECORDERS: list[list[tuple[str, str, int]]] = []


def register_cpu_kernels() -> None:
    """Register the four CPU kernels (once per process; a no-op after the first call)."""
    global _LIBRARY
    if _LIBRARY is not None:
        return
    lib = torch.library.Library("aten", "IMPL")
    lib.impl("_flash_attention_forward", _flash_forward, "CPU")
    lib.impl("_flash_attention_backward", _flash_backward, "CPU")
    lib.impl("_efficient_attention_forward", _efficient_forward, "CPU")
    lib.impl("_efficient_attention_backward", _efficient_backward, "CPU")
    _LIBRARY = lib


@dataclass(eq=False)
class EmulatedKernel:
    name: str
    """"flash" or "efficient": which of compat's CUDA kernels runs, on the CPU kernels above."""
    calls: list[tuple[str, str, int]] = field(default_factory=list)
    """(forward | backward, dense | packed, number of sequences) of every op call."""

    def __post_init__(self):
        if self.name not in ("flash", "efficient"):
            raise ValueError(f"name must be 'flash' or 'efficient', got {self.name!r}")
        register_cpu_kernels()

    @property
    def kernel(self) -> compat.FusedAttentionKernel:
        real = compat.CUDA_FLASH if self.name == "flash" else compat.CUDA_EFFICIENT

        def forward(*args, **kwargs):
            with self._recording():
                return real.forward(*args, **kwargs)

        def backward(*args, **kwargs):
            with self._recording():
                return real.backward(*args, **kwargs)

        return compat.FusedAttentionKernel(
            f"emulated {real.name}", real.takes_bias, forward, backward
        )

    @contextlib.contextmanager
    def _recording(self):
        _RECORDERS.append(self.calls)
        try:
            yield
        finally:
            _RECORDERS.pop()


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise RuntimeError(message)


def _record(direction: str, packed: bool, sequences: int) -> None:
    if _RECORDERS:
        _RECORDERS[-1].append((direction, "packed" if packed else "dense", sequences))


# ---- argument checks shared by the kernels -----------------------------------------------------


def _check_qkv(q, k, v, dims: int, dtypes: tuple[torch.dtype, ...], kernel: str) -> None:
    _check(
        all(t.dim() == dims for t in (q, k, v)), f"{kernel}: q, k, v must be {dims}-d, got "
        f"{q.dim()}, {k.dim()}, {v.dim()}"
    )  # fmt: skip
    _check(q.dtype in dtypes, f"{kernel}: dtype {q.dtype} not supported (takes {dtypes})")
    _check(k.dtype == q.dtype and v.dtype == q.dtype, f"{kernel}: q, k, v must share a dtype")
    _check(
        all(t.stride(-1) == 1 for t in (q, k, v)),
        f"{kernel}: q, k, v must have a contiguous last dimension",
    )
    _check(all(t.device == q.device for t in (k, v)), f"{kernel}: q, k, v must be on one device")
    _check(q.shape[-1] == k.shape[-1], f"{kernel}: q and k head dims differ")
    _check(k.shape[:-1] == v.shape[:-1], f"{kernel}: k {k.shape} and v {v.shape} differ")


def _spans(cu_q, cu_k, rows_q: int, rows_k: int, max_q: int, max_k: int, device, kernel: str):
    """(rows, cols) slices of every packed sequence, after the checks the kernels need."""
    for cu, rows, name in ((cu_q, rows_q, "cu_seqlens_q"), (cu_k, rows_k, "cu_seqlens_k")):
        _check(cu is not None, f"{kernel}: cu_seqlens_q and cu_seqlens_k come together")
        _check(
            cu.dtype == torch.int32 and cu.dim() == 1 and cu.is_contiguous(),
            f"{kernel}: {name} must be a contiguous int32 [N+1] tensor, got {cu.dtype} "
            f"{tuple(cu.shape)}",
        )
        _check(cu.device == device, f"{kernel}: {name} must be on {device}, got {cu.device}")
        _check(
            int(cu[0]) == 0 and not bool((cu.diff() < 0).any()) and int(cu[-1]) == rows,
            f"{kernel}: {name} = {cu.tolist()} must run from 0 up to {rows}",
        )
    _check(cu_q.numel() == cu_k.numel(), f"{kernel}: cu_seqlens_q and _k differ in length")
    _check(
        max_q >= int(cu_q.diff().max()) and max_k >= int(cu_k.diff().max()),
        f"{kernel}: max lengths {max_q}, {max_k} miss a sequence",
    )
    a, b = cu_q.tolist(), cu_k.tolist()
    return [(slice(a[i], a[i + 1]), slice(b[i], b[i + 1])) for i in range(len(a) - 1)]


def _lse_dtype(q: torch.Tensor) -> torch.dtype:
    return block.acc_dtype(q.dtype)


def _check_lse(lse, shape: tuple[int, ...], q, kernel: str) -> None:
    _check(
        tuple(lse.shape) == shape and lse.dtype == _lse_dtype(q) and lse.is_contiguous(),
        f"{kernel}: logsumexp must be a contiguous {_lse_dtype(q)} {list(shape)} tensor, got "
        f"{lse.dtype} {list(lse.shape)} with strides {lse.stride()}",
    )


def _ceil32(n: int) -> int:
    return -(-n // 32) * 32


# ---- the math: block.py's attention of one sequence ([1, H, S, D]) -----------------------------


def _visible(sq: int, sk: int, causal: str | None, device) -> torch.Tensor | None:
    """Additive mask of a causal alignment ("top_left", "bottom_right"), or None."""
    if causal is None:
        return None
    shift = 0 if causal == "top_left" else sk - sq
    hidden = torch.ones(sq, sk, dtype=torch.bool, device=device).triu(1 + shift)
    return torch.zeros(sq, sk, device=device).masked_fill(hidden, float("-inf"))


def _mask(q, k, causal, bias) -> torch.Tensor | None:
    """The additive mask of one sequence, [H, 1, Sq, Sk] (block.py's [Hkv, G, Sq, Sk] scores with
    G = 1 for a bias, which only the equal-heads efficient kernel takes), or [Sq, Sk]."""
    sq, sk = q.shape[1], k.shape[1]
    causal_mask = _visible(sq, sk, causal, q.device)
    if bias is None:
        return causal_mask
    mask = bias[:, None].to(block.acc_dtype(q.dtype))
    return mask if causal_mask is None else mask + causal_mask.to(mask.dtype)


def _attend(q, k, v, *, causal, scale, bias=None):
    """q [1, Sq, H, D], k/v [1, Sk, Hk, D], bias [H, Sq, Sk] -> out [1, Sq, H, D], lse [1, H, Sq];
    rows that see nothing get NaN (what a kernel makes of 0/0 is its own)."""
    mask = _mask(q, k, causal, bias)
    out, lse = block._math_forward(
        *(t.transpose(1, 2) for t in (q, k, v)), causal=False, scale=scale, mask=mask
    )
    if mask is not None:
        empty = (mask == float("-inf")).all(-1).reshape(-1, q.shape[1])  # [H or 1, Sq]
        out = out.masked_fill(empty[None, :, :, None], float("nan"))
        lse = lse.masked_fill(empty[None], float("nan"))
    return out.transpose(1, 2), lse


def _attend_backward(dout, q, k, v, out, lse, *, causal, scale, bias=None):
    grads = block._math_backward(
        *(t.transpose(1, 2) for t in (dout, q, k, v, out)), lse, causal=False, scale=scale,
        mask=_mask(q, k, causal, bias),
    )  # fmt: skip
    return [g.transpose(1, 2) for g in grads]


def _scale(scale, q) -> float:
    return q.shape[-1] ** -0.5 if scale is None else scale


# ---- aten::_flash_attention_forward / _backward ------------------------------------------------


def _flash_common(q, k, v, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, extras) -> list:
    packed = cum_seq_q is not None or cum_seq_k is not None
    _check_qkv(q, k, v, 3 if packed else 4, _FLASH_DTYPES, "flash")
    _check(dropout_p == 0.0, "flash (CPU emulation): dropout is not emulated")
    _check(all(x is None for x in extras), "flash (CPU emulation): windows, seqused_k, alibi, "
           "block tables and num_splits are not emulated")  # fmt: skip
    d = q.shape[-1]
    _check(d % 8 == 0 and d <= 256, f"flash: head dim {d} must be a multiple of 8, at most 256")
    _check(q.shape[-2] % k.shape[-2] == 0, "flash: key heads must divide query heads")
    if not packed:
        _check(q.shape[0] == k.shape[0], "flash: q and k batch sizes differ")
        return [(b, slice(0, q.shape[1]), slice(0, k.shape[1])) for b in range(q.shape[0])]
    spans = _spans(cum_seq_q, cum_seq_k, q.shape[0], k.shape[0], max_q, max_k, q.device, "flash")
    return [(None, r, c) for r, c in spans]


def _flash_forward(
    query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal,
    return_debug_mask, *, scale=None, window_size_left=None, window_size_right=None,
    seqused_k=None, alibi_slopes=None, block_table=None, num_splits=None,
):  # fmt: skip
    extras = (window_size_left, window_size_right, seqused_k, alibi_slopes, block_table, num_splits)
    spans = _flash_common(query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, extras)
    _check(not return_debug_mask, "flash (CPU emulation): no debug mask")
    packed = cum_seq_q is not None
    _record("forward", packed, len(spans))
    out = torch.empty_like(query)
    h = query.shape[-2]
    lse_shape = (h, query.shape[0]) if packed else (query.shape[0], h, query.shape[1])
    lse = query.new_empty(lse_shape, dtype=_lse_dtype(query))
    causal = "bottom_right" if is_causal else None
    for b, rows, cols in spans:
        q, k, v = _pick(query, b, rows), _pick(key, b, cols), _pick(value, b, cols)
        o, l = _attend(q, k, v, causal=causal, scale=_scale(scale, query))
        if packed:
            out[rows], lse[:, rows] = o[0], l[0]
        else:
            out[b], lse[b] = o[0], l[0]
    rng_state = torch.zeros(2, dtype=torch.uint64, device=query.device)
    unused = torch.empty((), dtype=torch.uint64, device=query.device)
    return out, lse, rng_state, unused, torch.empty(0, dtype=query.dtype, device=query.device)


def _flash_backward(
    grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p,
    is_causal, rng_state, unused, *, scale=None, window_size_left=None, window_size_right=None,
):  # fmt: skip
    extras = (window_size_left, window_size_right)
    spans = _flash_common(query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, extras)
    packed = cum_seq_q is not None
    _record("backward", packed, len(spans))
    for name, t in (("grad_out", grad_out), ("out", out)):
        _check(
            t.shape == query.shape and t.dtype == query.dtype and t.stride(-1) == 1,
            f"flash: {name} must be shaped like q, in its dtype, with a contiguous last dim",
        )
    h = query.shape[-2]
    lse_shape = (h, query.shape[0]) if packed else (query.shape[0], h, query.shape[1])
    _check_lse(logsumexp, lse_shape, query, "flash")
    _check(
        rng_state.dtype == torch.uint64 and rng_state.numel() == 2
        and rng_state.device == query.device,
        "flash: rng_state must be a uint64 [2] tensor on q's device",
    )  # fmt: skip
    dq, dk, dv = (torch.zeros_like(t) for t in (query, key, value))
    causal = "bottom_right" if is_causal else None
    for b, rows, cols in spans:
        q, k, v = _pick(query, b, rows), _pick(key, b, cols), _pick(value, b, cols)
        do, o = _pick(grad_out, b, rows), _pick(out, b, rows)
        lse = logsumexp[None, :, rows] if packed else logsumexp[b : b + 1]
        g = _attend_backward(do, q, k, v, o, lse, causal=causal, scale=_scale(scale, query))
        if packed:
            dq[rows], dk[cols], dv[cols] = (t[0] for t in g)
        else:
            dq[b], dk[b], dv[b] = (t[0] for t in g)
    return dq, dk, dv


def _pick(t: torch.Tensor, b: int | None, index: slice) -> torch.Tensor:
    """Rows ``index`` of batch row ``b`` (dense) or of the packed rows (b None), as [1, n, H, D]."""
    return t[index][None] if b is None else t[b : b + 1, index]


# ---- aten::_efficient_attention_forward / _backward --------------------------------------------


_MASK_TYPES = {0: None, 1: "top_left", 2: "bottom_right"}


def _efficient_common(q, k, v, bias, cu_q, cu_k, max_q, max_k, dropout_p, mask_type, extras):
    _check_qkv(q, k, v, 4, _EFFICIENT_DTYPES, "efficient")
    _check(dropout_p == 0.0, "efficient (CPU emulation): dropout is not emulated")
    _check(all(x is None for x in extras), "efficient (CPU emulation): windows not emulated")
    _check(mask_type in _MASK_TYPES, f"efficient: custom_mask_type {mask_type} unknown")
    _check(q.shape[0] == k.shape[0], "efficient: q and k batch sizes differ")
    _check(
        q.shape[2] == k.shape[2] == v.shape[2],
        f"efficient: q, k, v must have equal head counts, got {q.shape[2]}, {k.shape[2]}",
    )
    if bias is not None:
        _check(cu_q is None, "efficient: cu seqlen + bias not supported")
        want = (q.shape[0], q.shape[2], q.shape[1], k.shape[1])
        _check(
            bias.dim() == 4 and tuple(bias.shape) == want,
            f"efficient: attn_bias must be {list(want)}, got {list(bias.shape)}",
        )
        _check(bias.dtype == q.dtype, "efficient: invalid dtype for bias - should match query's")
        _check(
            bias.stride(-1) == 1 and bias.stride(-2) % 16 == 0,
            f"efficient: attn_bias is not correctly aligned (strides {bias.stride()})",
        )
    if cu_q is None and cu_k is None:
        return [(b, slice(0, q.shape[1]), slice(0, k.shape[1])) for b in range(q.shape[0])]
    _check(q.shape[0] == 1, "efficient: cu_seqlen only supports batch_size=1")
    _check(max_q is not None and max_q > 0, "efficient: max_seqlen_q required with cu_seqlens")
    spans = _spans(
        cu_q, cu_k, q.shape[1], k.shape[1], max_q, max_k or k.shape[1], q.device, "efficient"
    )
    return [(0, r, c) for r, c in spans]


def _efficient_forward(
    query, key, value, bias, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
    custom_mask_type, compute_log_sumexp=False, *, scale=None, seqlen_k=None, window_size=None,
):  # fmt: skip
    spans = _efficient_common(
        query, key, value, bias, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
        dropout_p, custom_mask_type, (seqlen_k, window_size),
    )  # fmt: skip
    packed = cu_seqlens_q is not None
    _record("forward", packed, len(spans))
    b, m, h = query.shape[:3]
    out = query.new_empty(b, m, h, value.shape[-1])
    max_q = max_seqlen_q if packed else m
    width = _ceil32(max_q) if compute_log_sumexp else 0
    lse = query.new_full(
        (len(spans) if packed else b, h, width), float("nan"), dtype=_lse_dtype(query)
    )
    causal = _MASK_TYPES[custom_mask_type]
    for i, (bi, rows, cols) in enumerate(spans):
        q, k, v = (query[bi : bi + 1, rows], key[bi : bi + 1, cols], value[bi : bi + 1, cols])
        seq_bias = None if bias is None else bias[bi, :, rows, cols]
        o, l = _attend(q, k, v, causal=causal, scale=_scale(scale, query), bias=seq_bias)
        out[bi, rows] = o[0]
        if width:
            lse[i if packed else bi, :, : rows.stop - rows.start] = l[0]
    seed, offset = (torch.zeros((), dtype=torch.long) for _ in range(2))
    return out, lse, seed, offset, max_q, max_seqlen_k if packed else key.shape[1]


def _efficient_backward(
    grad_out_, query, key, value, bias, out, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
    max_seqlen_k, logsumexp, dropout_p, philox_seed, philox_offset, custom_mask_type,
    bias_requires_grad, *, scale=None, num_splits_key=None, window_size=None,
    shared_storage_dqdkdv=False,
):  # fmt: skip
    spans = _efficient_common(
        query, key, value, bias, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
        dropout_p, custom_mask_type, (window_size,),
    )  # fmt: skip
    packed = cu_seqlens_q is not None
    _record("backward", packed, len(spans))
    _check(not bias_requires_grad, "efficient (CPU emulation): no bias gradient")
    _check(not shared_storage_dqdkdv, "efficient (CPU emulation): no shared dq/dk/dv storage")
    if packed:
        _check(max_seqlen_k <= key.shape[1], f"efficient: Invalid max_seqlen_k: {max_seqlen_k}")
        _check(max_seqlen_q <= query.shape[1], f"efficient: Invalid max_seqlen_q: {max_seqlen_q}")
    b, m, h = query.shape[:3]
    grad_out = grad_out_.contiguous()  # as the kernel does
    for name, t in (("grad_out", grad_out), ("out", out)):
        _check(t.shape == query.shape[:3] + value.shape[-1:] and t.dtype == query.dtype,
               f"efficient: {name} must be shaped like q, in its dtype")  # fmt: skip
    # The kernel takes out's batch and head strides but its row stride from the shape (H * D).
    _check(
        out.stride(-1) == 1 and out.stride(1) == h * out.shape[-1],
        f"efficient: out is read with the row stride of a contiguous [B, S, H, D] tensor "
        f"({h * out.shape[-1]}), its own is {out.stride(1)}",
    )
    max_q = max_seqlen_q if packed else m
    _check_lse(logsumexp, (len(spans) if packed else b, h, _ceil32(max_q)), query, "efficient")
    _check(
        isinstance(philox_seed, torch.Tensor) and isinstance(philox_offset, torch.Tensor),
        "efficient: philox_seed and philox_offset must be tensors",
    )
    dq, dk, dv = (torch.zeros_like(t) for t in (query, key, value))
    causal = _MASK_TYPES[custom_mask_type]
    for i, (bi, rows, cols) in enumerate(spans):
        q, do, o = (t[bi : bi + 1, rows] for t in (query, grad_out, out))
        k, v = (t[bi : bi + 1, cols] for t in (key, value))
        lse = logsumexp[i if packed else bi, :, : rows.stop - rows.start][None]
        seq_bias = None if bias is None else bias[bi, :, rows, cols]
        g = _attend_backward(
            do, q, k, v, o, lse, causal=causal, scale=_scale(scale, query), bias=seq_bias
        )
        dq[bi, rows], dk[bi, cols], dv[bi, cols] = (t[0] for t in g)
    return dq, dk, dv, torch.empty(0, dtype=query.dtype, device=query.device)
