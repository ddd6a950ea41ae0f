"""Differentiable collectives used by sharding, vision routing and attention.

Each forward is a plain `torch.distributed` collective; each backward is its exact adjoint, so that
the gradient a rank receives is the sum over ranks of what every rank's loss says about its input.
All of them are portable to gloo: sizes are equal on every rank (callers pad and trim).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping

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


# ---- agreement before a data collective --------------------------------------------------------
#
# A collective whose sizes depend on a value known only locally (a row count, a local length, a
# tower's output shape) hangs or fails on some ranks only when one rank's value is wrong: that
# rank raises, the others wait in the collective until the process-group timeout. So before the
# data moves, every rank states what the collective depends on (and any error it found in its own
# inputs), and one small all-reduce tells every rank whether all agree. Only when they do not is
# more exchanged (the facts themselves), so that every rank raises the same message.


def fingerprint(*values: object) -> int:
    """A 56-bit hash, the same in every process, of tensors (dtype, shape, contents) and values
    with a stable ``repr`` (ints, strings, tuples, dtypes)."""
    h = hashlib.blake2b(digest_size=7)
    for v in values:
        if isinstance(v, torch.Tensor):
            t = v.detach().to("cpu").contiguous()
            h.update(f"{t.dtype}{tuple(t.shape)}".encode())
            h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
        else:
            h.update(repr(v).encode())
        h.update(b"|")
    return int.from_bytes(h.digest(), "little")


class StepAgreement:
    """The facts of one CP step that all of its collectives depend on, agreed once.

    A CP step (one forward of a CP model) runs several collectives: the vision rows, then
    ``cp_attention`` in every decoder layer. The first of them agrees on the step's facts (the
    batch, the plan) together with its own, through its one small all-reduce. Later calls that
    pass ``follows_from_step=True`` depend only on facts that follow from those (the local length
    from the plan) and on the model, which every rank holds alike, so they skip the collective and
    keep their local checks; a call whose values can differ on its own (row counts) always agrees.

    ``fail(message)`` records an error found on this rank before the step's first collective (a
    tower that returned too few rows): that collective's agreement raises it on every rank.
    """

    def __init__(self, facts: Mapping[str, object] | None = None):
        self.facts = dict(facts or {})
        self.agreed = False
        self._error: str | None = None

    def fail(self, message: str) -> None:
        if self._error is None:
            self._error = message

    def take_error(self) -> str | None:
        error, self._error = self._error, None
        return error


def agree(
    op: str,
    group: dist.ProcessGroup | None,
    facts: Mapping[str, object],
    *,
    error: str | None = None,
    step: StepAgreement | None = None,
    follows_from_step: bool = False,
) -> None:
    """Every rank of ``group`` checks that all ranks are about to run ``op`` on the same ``facts``.

    Call it on every rank right before a collective whose sizes or meaning depend on ``facts``
    (ints, strings, tuples, dtypes: anything with a stable ``repr``) that must be equal on every
    rank, passing ``error`` if this rank found its own inputs wrong. One all-reduce of three
    int64s; if a rank passed an error or the facts differ, the ranks exchange them and every rank
    raises the same ``ValueError``: a single rank's error is prefixed with its rank, and a fact
    that differs is shown with each rank's value.
    """
    if step is not None:
        error = step.take_error() or error
        if step.agreed and follows_from_step:
            if error is not None:  # follows from agreed facts and the model: the same everywhere
                raise ValueError(error)
            return
        if not step.agreed:
            facts = {**{f"step.{k}": v for k, v in step.facts.items()}, **facts}
    key = fingerprint((op, sorted(facts.items())))
    flags = torch.tensor(
        [int(error is not None), key, -key], dtype=torch.int64, device=_device_of(group)
    )
    dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
    failed, key_max, neg_key_min = flags.tolist()
    if not failed and key_max == -neg_key_min:
        if step is not None:
            step.agreed = True
        return
    states: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(states, (op, dict(facts), error), group=group)
    raise ValueError(_disagreement(states))


def _device_of(group: dist.ProcessGroup | None) -> torch.device:
    """Where small tensors travel in ``group``: CUDA for an NCCL-only group, else the CPU."""
    backend = str(dist.get_backend(group))
    if "nccl" in backend and "gloo" not in backend:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _ranks(ranks: list[int], world: int) -> str:
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))} of {world}"


def _disagreement(states: list[tuple[str, dict, str | None]]) -> str:
    """The one message every rank raises, built from every rank's (op, facts, error)."""
    world = len(states)
    errors: dict[str, list[int]] = {}
    for rank, (_, _, error) in enumerate(states):
        if error is not None:
            errors.setdefault(error, []).append(rank)
    if errors:
        if len(errors) == 1 and len(next(iter(errors.values()))) == world:
            return next(iter(errors))  # every rank found the same problem
        return "; ".join(f"{_ranks(ranks, world)}: {error}" for error, ranks in errors.items())
    ops = sorted({op for op, _, _ in states})
    if len(ops) > 1:
        where = "; ".join(
            f"{_ranks([r for r, s in enumerate(states) if s[0] == op], world)} in {op}"
            for op in ops
        )
        return f"the ranks are in different collectives: {where}"
    op = ops[0]
    names = sorted({name for _, facts, _ in states for name in facts})
    differ = []
    for name in names:
        values = [facts.get(name) for _, facts, _ in states]
        if len({repr(v) for v in values}) > 1:
            shown = ", ".join(f"rank {r}: {v!r}" for r, v in enumerate(values))
            differ.append(f"{name} ({shown})")
    return (
        f"{op}: the ranks of the group must agree before the collective, but they passed "
        f"different {'; '.join(differ)}"
    )
