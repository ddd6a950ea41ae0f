"""Mixed precision: compute in a low precision on higher-precision parameters.

``parallelize(..., compute_dtype=torch.bfloat16)`` on a float32 model keeps the parameters, their
gradients and the optimizer state (built from the parameters) in float32, and computes in bf16:
- FSDP2 / HSDP: ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=float32)``: each unit's
  parameters are all-gathered and cast to bf16 for its forward and backward, and the gradients
  are reduced and kept in float32 (torch's own FSDP2 mixed precision);
- DDP and "none": the forward runs under ``torch.autocast(dtype=bf16)``: matmuls, convolutions
  and attention in bf16, reductions and norms in float32 (autocast's op lists), the gradients of
  the float32 parameters in float32. Not bit-for-bit FSDP2's numerics (FSDP2 casts every
  parameter, autocast casts per op), the same division of labour between the two dtypes.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy


def param_dtype_of(model: nn.Module) -> torch.dtype | None:
    """The dtype of the model's floating-point parameters (None if it has none)."""
    for p in model.parameters():
        if p.is_floating_point():
            return p.dtype
    return None


def fsdp_policy(compute_dtype: torch.dtype, param_dtype: torch.dtype) -> MixedPrecisionPolicy:
    """Compute in ``compute_dtype``, reduce and keep gradients in ``param_dtype``."""
    return MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=param_dtype)


class Autocast(nn.Module):
    """``module`` whose forward runs under ``torch.autocast(device, dtype)``.

    The backward needs no autocast: autograd replays each op in the dtype its forward used.
    """

    def __init__(self, module: nn.Module, dtype: torch.dtype):
        super().__init__()
        self.module = module
        self.dtype = dtype

    def forward(self, *args, **kwargs):
        device = next(self.module.parameters()).device.type
        with torch.autocast(device, dtype=self.dtype):
            return self.module(*args, **kwargs)
