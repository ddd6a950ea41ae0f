"""Differentiable collectives used by sharding, vision routing and attention.

Each forward is a plain `torch.distributed` collective; each backward is its exact adjoint, so that
the gradient a rank receives is the sum over ranks of what every rank's loss says about its input.
All of them are portable to gloo: sizes are equal on every rank (callers pad and trim).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from cpvlm.distributed import compat

# gloo has no bool reductions; these travel as uint8 and come back as bool.
_WIRE_DTYPE = {torch.bool: torch.uint8}


def to_wire(x: torch.Tensor) -> torch.Tensor:
    """``x`` as gloo can send it (bools as uint8), contiguous; ``.to(x.dtype)`` undoes it."""
    wire = _WIRE_DTYPE.get(x.dtype)
    return (x.to(wire) if wire is not None else x).contiguous()


def all_gather_dim0(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Concatenate equal-sized tensors of all ranks along dim 0, in rank order (no autograd)."""
    world = dist.get_world_size(group)
    wire = to_wire(x)
    out = wire.new_empty((world * wire.shape[0], *wire.shape[1:]))
    compat.all_gather_tensor(out, wire, group)
    return out.to(x.dtype)


def reduce_scatter_dim0(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Sum over ranks, then keep this rank's equal slice of dim 0 (no autograd)."""
    world = dist.get_world_size(group)
    if x.shape[0] % world:
        raise ValueError(f"reduce_scatter: dim 0 ({x.shape[0]}) is not divisible by {world} ranks")
    x = x.contiguous()
    out = x.new_empty((x.shape[0] // world, *x.shape[1:]))
    compat.reduce_scatter_tensor(out, x, group)
    return out


class _AllGatherDim0(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
        ctx.group = group
        return all_gather_dim0(x, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        # Every rank used the whole gathered tensor, so the gradient of a rank's slice is the sum
        # over ranks of the gradient of that slice: a reduce-scatter, not a local slice.
        return reduce_scatter_dim0(grad, ctx.group), None


def ensure_requires_grad_for_cp_collective(t: torch.Tensor) -> torch.Tensor:
    """In grad mode, return ``t`` or a leaf copy of it that requires grad; else ``t`` unchanged.

    A collective's backward runs on a rank only if autograd reaches it there. If one rank's input
    happens not to require grad (no images, a frozen tower, an empty slice), autograd skips the
    backward there and every other rank hangs in it. Grad mode is the same on every rank, so keying
    on it makes all ranks take the same decision. Integer tensors never carry gradients anywhere.
    """
    if not torch.is_grad_enabled() or t.requires_grad or not t.is_floating_point():
        return t
    return t.detach().requires_grad_()


def differentiable_all_gather_dim0(
    x: torch.Tensor, group: dist.ProcessGroup | None
) -> torch.Tensor:
    """All-gather along dim 0 whose backward is the matching reduce-scatter.

    In grad mode every rank records the backward collective (see
    ensure_requires_grad_for_cp_collective), whether or not its own input requires grad.
    """
    if not (torch.is_grad_enabled() and x.is_floating_point()):
        return all_gather_dim0(x, group)
    return _AllGatherDim0.apply(ensure_requires_grad_for_cp_collective(x), group)
