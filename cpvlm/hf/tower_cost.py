"""Pieces of the vision cost models that several families' towers share (``cpvlm.encoders.cost``)."""

from __future__ import annotations

from math import prod


def values_per_patch(vc) -> int:
    """Values of one patch row: channels * temporal patch * patch * patch (``vision_config``)."""
    patch = vc.patch_size if isinstance(vc.patch_size, (list, tuple)) else [vc.patch_size] * 2
    temporal = vc.temporal_patch_size
    temporal = prod(temporal) if isinstance(temporal, (list, tuple)) else temporal
    return vc.in_channels * temporal * prod(patch)


def patch_merger_macs(width: int, merge: int, out: int) -> int:
    """MACs per patch of a merger of m*m patches of ``width`` through an MLP of m*m*width to
    ``out``: (m^2 w)^2 + m^2 w o per merged token, i.e. m^2 w^2 + w o per patch."""
    return merge * merge * width * width + width * out
