"""The vision cost model of a transformers VLM, from its family's adapter.

Every family's cost model lives in its adapter file (``VLMAdapter.vision_cost``): every
coefficient is a matrix product of the tower's forward pass, in MACs per patch (linear) or per
attended pair (attention), with the widths the tower's modules are built from (see
``cpvlm.vision.cost``). tests/vision/test_vision_cost_hf.py counts the MACs of each real tower
(torch's FLOP counter, tiny configs) and checks that the adapters give exactly that.
"""

from __future__ import annotations

from math import prod

from cpvlm.vision.cost import VisionCost

from .registry import adapter_for


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


def vision_cost(model_or_config) -> VisionCost:
    """The vision tower's cost model for a transformers VLM or its (top-level) config."""
    return adapter_for(model_or_config).vision_cost()
