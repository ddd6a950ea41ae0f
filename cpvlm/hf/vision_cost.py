"""The vision cost model of a transformers VLM, from its family's adapter.

Every family's cost model lives in its adapter file (``VLMAdapter.vision_cost``): every
coefficient is a matrix product of the tower's forward pass, in MACs per patch (linear) or per
attended pair (attention), with the widths the tower's modules are built from (see
``cpvlm.encoders.cost``). tests/vision/test_vision_cost_hf.py counts the MACs of each real tower
(torch's FLOP counter, tiny configs) and checks that the adapters give exactly that.
"""

from __future__ import annotations

from cpvlm.encoders.cost import EncoderCost
from cpvlm.hf.registry import adapter_for


def vision_cost(model_or_config) -> EncoderCost:
    """The vision tower's cost model for a transformers VLM or its (top-level) config."""
    return adapter_for(model_or_config).vision_cost()
