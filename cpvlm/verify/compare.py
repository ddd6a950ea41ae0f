"""The comparison of a CP run with the one-process reference: relative errors per parameter and per
module group, and the tolerance each is held to."""

from __future__ import annotations

import re
from collections.abc import Mapping

import torch

TOLERANCES = {
    # Round-off only: the CP run sums the same terms in another order.
    "float64": 1e-10,
    "float32": 1e-5,
    # bf16 keeps 8 bits: a reordered sum can move a value by a few ulps (2**-8 = 4e-3 each).
    "bfloat16": 5e-2,
}
FLOAT32_IN_FLOAT64 = 1e-6
"""float64 tolerance of module groups the model computes in float32 even in a float64 model (the
family kit's ``float32_groups``: a bicubic position table, a router), and of
``vision="replicate"``: float32 round-off (6e-8) of a reordered sum; measured <= 2e-7."""


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


def tolerance(
    dtype: str, vision: str, tol: float | None = None, group: str = "", float32_groups=()
) -> float:
    """The check's tolerance: ``tol`` if given, else the dtype's.

    In float64 a group in ``float32_groups`` gets ``FLOAT32_IN_FLOAT64``, and so does every group
    under ``vision="replicate"``: every rank encodes every unit and back-propagates only its own
    rows, so the tower's gradient is a sum of cp partial gradients, and the models round each one
    to float32 where they upcast (vision rotary, RMSNorm); measured <= 1e-9.
    """
    if tol is not None:
        return tol
    in_float32 = group in float32_groups or "*" in float32_groups
    if dtype == "float64" and (vision == "replicate" or in_float32):
        return FLOAT32_IN_FLOAT64
    return TOLERANCES[dtype]


def module_groups(model) -> tuple[tuple[str, tuple[str, ...]], ...]:
    """The model's module groups, ``(label, parameter-name regexes)``, from its family's kit."""
    from cpvlm.hf import kit_for

    return kit_for(model).module_groups()


def group_of(param_name: str, groups) -> str:
    for label, patterns in groups:
        if any(re.match(p, param_name) for p in patterns):
            return label
    return "other"


def gradient_errors(
    grads: Mapping[str, torch.Tensor], ref_grads: Mapping[str, torch.Tensor], groups, zero=()
) -> dict[str, float]:
    """The relative error of every reference gradient's counterpart in ``grads``. ``zero``: the
    kit's ``zero_gradients`` (zero in exact arithmetic, round-off in floats, so that their
    own relative error means nothing), measured against their group's largest reference
    gradient instead."""
    scale: dict[str, float] = {}
    for name, ref in ref_grads.items():
        label = group_of(name, groups)
        scale[label] = max(scale.get(label, 0.0), ref.abs().max().item())
    errors = {}
    for name, ref in ref_grads.items():
        if any(re.match(p, name) for p in zero):  # round-off only: against the group's scale
            diff = (grads[name].double() - ref.double()).abs().max().item()
            errors[name] = diff / (scale[group_of(name, groups)] or 1.0)
        else:
            errors[name] = rel_err(grads[name], ref)
    return errors


def compare(loss, grads, ref_loss, ref_grads, groups, zero=()) -> dict[str, float]:
    """``{"loss": its relative error, group label: the group's largest gradient error}``;
    ``zero`` as in ``gradient_errors``."""
    errors = {"loss": rel_err(loss, ref_loss)}
    for name, err in gradient_errors(grads, ref_grads, groups, zero).items():
        label = group_of(name, groups)
        errors[label] = max(errors.get(label, 0.0), err)
    return errors
