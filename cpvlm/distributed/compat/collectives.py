"""torch.distributed's tensor collectives under the names the installed torch prefers.

Wraps ``dist.all_gather_single`` / ``dist.reduce_scatter_single`` (torch >= 2.13) and the older
``all_gather_into_tensor`` / ``reduce_scatter_tensor`` (torch 2.11 and 2.12, deprecated since),
same arguments, same semantics. Detected by ``hasattr(dist, ...)``, never by version string.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator

import torch
import torch.distributed as dist

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
