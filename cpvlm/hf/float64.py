"""transformers' own code run with its float32 casts kept in float64, for float64 references.

A float64 exactness check at 1e-10 needs a reference that does its sums in float64. Where
transformers casts to float32 inside a float64 model (docs/hf_internals.md, "Where transformers
rounds"), ``KeepFloat64`` runs the unmodified code (the module's forward, a function however it is
wrapped) with every request for float32 answered with float64, so that a check still compares with
transformers' algorithm and not with a rewrite of it. It reads no source text and no attribute of
the module: a renamed attribute or a function wrapped in a hub-kernel object changes nothing
(tests/hf/test_float64_mode.py plants both). Adapters' ``float64_islands`` use it; nothing in a
training step does.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.overrides import TorchFunctionMode

_NARROW, _WIDE = torch.float32, torch.float64

# Methods whose positional arguments may name a dtype to cast to.
_CASTS = (torch.Tensor.to, torch.Tensor.type)
_TYPE_NAMES = {"torch.FloatTensor": "torch.DoubleTensor", "torch.float32": "torch.float64"}


def _wide(value):
    if value is _NARROW:
        return _WIDE
    if isinstance(value, str):
        return _TYPE_NAMES.get(value, value)
    return value


class KeepFloat64(TorchFunctionMode):
    """Under this mode a float32 cast gives float64: ``x.float()``, ``x.to(torch.float32)`` (any
    argument order, or ``dtype=``), ``x.type(torch.float32)``, and any ``dtype=torch.float32``
    keyword (factories, ``softmax``, ``sum``). Everything else runs as it is, and autograd records
    the float64 ops, so the backward's sums are float64 too. ``x.view(torch.float32)`` (a bit
    reinterpretation, not a cast) is left alone."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.float:
            func = torch.Tensor.double
        elif func in _CASTS:
            args = tuple(_wide(a) for a in args)
        if func is not torch.Tensor.view and kwargs.get("dtype") is _NARROW:
            kwargs = {**kwargs, "dtype": _WIDE}
        return func(*args, **kwargs)


def in_float64(fn: Callable) -> Callable:
    """``fn`` (any callable: a function, a hub-kernel object, a bound forward) run under
    ``KeepFloat64``."""

    def run(*args, **kwargs):
        with KeepFloat64():
            return fn(*args, **kwargs)

    return run
