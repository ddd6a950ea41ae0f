"""Dry runs on fake tensors: FakeTensorMode, a fake process group, real host integers.

``cpvlm.simulate`` runs one rank's step on fake tensors (``FakeTensorMode``: shapes, dtypes and
storages without data) in a process group that answers every collective without communicating
(the "fake" backend of torch.testing); attention detects the fake mode and plans its schedules
on real tensors. Wraps ``torch._subclasses.fake_tensor``, ``torch._guards.detect_fake_mode``,
``torch.testing._internal.distributed.fake_pg`` and ``TorchDispatchMode``: private APIs with these
names in torch 2.11 to 2.15, nothing to detect.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode


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
