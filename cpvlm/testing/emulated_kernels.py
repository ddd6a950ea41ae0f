"""A CPU stand-in for the fused CUDA attention kernels' calling convention, to test what feeds them.

``EmulatedKernel("flash" | "efficient").kernel`` is a ``compat.FusedAttentionKernel`` that runs
anywhere, in any dtype. It checks its arguments as the CUDA kernels need them (dense [B, S, H, D]
or packed [T, H, D] layouts with a contiguous last dim; int32 cu_seqlens on q's device that start
at 0, never decrease and cover every row; max lengths that cover every sequence, since the
kernels size their grids by them and silently drop rows past them; square sequences when causal,
where flash and the efficient kernel align differently; an additive mask only where the real
kernel takes one), then computes each sequence with block.py's plain-torch math in the acc dtype.
So the packing of a block's rectangles into one call (attention/fused.py) and the mapping of out,
lse, dq, dk, dv back are tested on any machine: a wrong offset, length or index moves float64
results by O(1), far above the 1e-10 the tests allow. Every call is recorded for counting.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from cpvlm.attention import block
from cpvlm.distributed import compat


@dataclass(eq=False)
class EmulatedKernel:
    name: str
    """"flash" (no additive mask) or "efficient" (an additive mask in dense calls)."""
    calls: list[tuple[str, str, int]] = field(default_factory=list)
    """(forward | backward, dense | packed, number of sequences) of every call."""

    def __post_init__(self):
        if self.name not in ("flash", "efficient"):
            raise ValueError(f"name must be 'flash' or 'efficient', got {self.name!r}")

    @property
    def kernel(self) -> compat.FusedAttentionKernel:
        return compat.FusedAttentionKernel(
            f"emulated {self.name}", self.name == "efficient", self._forward, self._backward
        )

    def _forward(self, q, k, v, *, causal, scale, packing=None, bias=None):
        spans = self._check("forward", q, k, v, causal, packing, bias)
        if packing is None:
            out, lse = block._math_forward(*_bhsd(q, k, v), causal=causal, scale=scale, mask=bias)
            return out.transpose(1, 2), lse
        out, lse = torch.empty_like(q), q.new_empty(q.shape[1], q.shape[0], dtype=_acc(q))
        for rows, cols in spans:
            o, l = block._math_forward(
                *_bhsd(q[rows], k[cols], v[cols], batch=True), causal=causal, scale=scale, mask=None
            )
            out[rows], lse[:, rows] = o[0].transpose(0, 1), l[0]
        return out, lse

    def _backward(self, dout, q, k, v, out, lse, *, causal, scale, packing=None, bias=None):
        spans = self._check("backward", q, k, v, causal, packing, bias)
        want = (q.shape[0], q.shape[2], q.shape[1]) if packing is None else q.shape[1::-1]
        if dout.shape != q.shape or out.shape != q.shape or tuple(lse.shape) != tuple(want):
            raise ValueError(f"dout {dout.shape}, out {out.shape}, lse {lse.shape} for q {q.shape}")
        if packing is None:
            grads = block._math_backward(
                *_bhsd(dout, q, k, v, out), lse, causal=causal, scale=scale, mask=bias
            )
            return tuple(g.transpose(1, 2) for g in grads)
        dq, dk, dv = torch.empty_like(q), torch.zeros_like(k), torch.zeros_like(v)
        for rows, cols in spans:
            g = block._math_backward(
                *_bhsd(dout[rows], q[rows], k[cols], v[cols], out[rows], batch=True),
                lse[None, :, rows],
                causal=causal,
                scale=scale,
                mask=None,
            )
            dq[rows], dk[cols], dv[cols] = (t[0].transpose(0, 1) for t in g)
        return dq, dk, dv

    def _check(self, direction, q, k, v, causal, packing, bias) -> list[tuple[slice, slice]]:
        """The (rows, cols) of every sequence, after checking the call as the kernels would."""
        dims = 4 if packing is None else 3
        if any(t.dim() != dims or t.stride(-1) != 1 for t in (q, k, v)):
            raise ValueError(f"q, k, v must be {dims}-d with a contiguous last dim")
        if q.shape[-2] % k.shape[-2] or k.shape != v.shape or q.shape[-1] != k.shape[-1]:
            raise ValueError(f"q {q.shape} and k/v {k.shape} / {v.shape} do not fit")
        if bias is not None and (self.name != "efficient" or packing is not None):
            raise ValueError(f"the {self.name} kernel takes no mask in this call")
        if packing is None:
            if bias is not None and (
                bias.shape != (q.shape[1], k.shape[1]) or bias.dtype != q.dtype
            ):
                raise ValueError(
                    f"bias must be [Sq, Sk] in q's dtype, got {bias.shape} {bias.dtype}"
                )
            spans = [(slice(0, q.shape[1]), slice(0, k.shape[1]))]
        else:
            spans = _spans(packing, q, k)
        if causal and any(r.stop - r.start != c.stop - c.start for r, c in spans):
            raise ValueError("causal sequences must be square")
        self.calls.append((direction, "dense" if packing is None else "packed", len(spans)))
        return spans


def _spans(packing: compat.Packing, q, k) -> list[tuple[slice, slice]]:
    cu_q, cu_k = packing.cu_q, packing.cu_k
    for cu, rows, name in ((cu_q, q.shape[0], "cu_q"), (cu_k, k.shape[0], "cu_k")):
        if cu.dtype != torch.int32 or cu.dim() != 1 or cu.device != q.device:
            raise ValueError(f"{name} must be int32 [N+1] on {q.device}, got {cu.dtype} {cu.shape}")
        if cu[0] != 0 or bool((cu.diff() < 0).any()) or cu[-1] != rows:
            raise ValueError(f"{name} = {cu.tolist()} must run from 0 up to {rows}")
    if cu_q.numel() != cu_k.numel():
        raise ValueError(f"cu_q and cu_k hold {cu_q.numel()} and {cu_k.numel()} offsets")
    if packing.max_q < int(cu_q.diff().max()) or packing.max_k < int(cu_k.diff().max()):
        raise ValueError(f"max lengths {packing.max_q}, {packing.max_k} miss a sequence")
    a, b = cu_q.tolist(), cu_k.tolist()
    return [(slice(a[i], a[i + 1]), slice(b[i], b[i + 1])) for i in range(len(a) - 1)]


def _acc(q: torch.Tensor) -> torch.dtype:
    return block.acc_dtype(q.dtype)


def _bhsd(*tensors: torch.Tensor, batch: bool = False) -> list[torch.Tensor]:
    """[B, S, H, D] (or [S, H, D] with ``batch``: one sequence) -> [B, H, S, D] views."""
    return [(t[None] if batch else t).transpose(1, 2) for t in tensors]
