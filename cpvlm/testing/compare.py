"""Comparison helpers for exactness tests."""

from __future__ import annotations

import torch


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |actual - expected| / max |expected|, in float64 (absolute when expected is all zero)."""
    if actual.shape != expected.shape:
        raise ValueError(f"shape mismatch: {tuple(actual.shape)} vs {tuple(expected.shape)}")
    a, b = actual.detach().double(), expected.detach().double()
    if a.numel() == 0:
        return 0.0
    diff = (a - b).abs().max().item()
    denom = b.abs().max().item()
    return diff / denom if denom > 0 else diff
