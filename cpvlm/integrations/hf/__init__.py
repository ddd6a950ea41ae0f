"""Hugging Face transformers VLMs under CP: a family-agnostic core and one adapter per family.

Read in this order: adapter.py (what a family says to the CP step), kit.py (what it says to
tests and verify), registry.py (model class -> adapter), families/ (one file per family),
inputs.py (the replicated integer inputs of a step), context_parallel.py (ContextParallelVLM,
one step top to bottom), attention.py.

The synthetic batches and the one-process reference used by tests moved to
``cpvlm.testing.hf_batches`` and ``cpvlm.testing.hf_reference``; their old names here still work.
"""

from cpvlm.integrations.hf.adapter import ExtraLoss, LossContext, RouterLoss, VLMAdapter
from cpvlm.integrations.hf.attention import CP_ATTENTION, CPAttentionContext
from cpvlm.integrations.hf.context_parallel import ContextParallelOutput, ContextParallelVLM
from cpvlm.integrations.hf.inputs import PreparedBatch, prepare_batch
from cpvlm.integrations.hf.kit import FamilyKit
from cpvlm.integrations.hf.models import TINY_MODELS, build_model, model_family
from cpvlm.integrations.hf.registry import adapter_for, kit_for, register, supported
from cpvlm.integrations.hf.vision_cost import vision_cost
from cpvlm.loss import IGNORE_INDEX

_MOVED = {
    "SampleSpec": "cpvlm.testing.hf_batches",
    "synthetic_batch": "cpvlm.testing.hf_batches",
    "causal_lm_loss": "cpvlm.testing.hf_reference",
    "mrope_position_ids": "cpvlm.testing.hf_reference",
    "reference_loss_and_grads": "cpvlm.testing.hf_reference",
}


def __getattr__(name: str):
    # The test fixtures live in cpvlm.testing; importing them from here still works, lazily, so
    # that the product modules never load them.
    if name in _MOVED:
        import importlib

        return getattr(importlib.import_module(_MOVED[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "CP_ATTENTION",
    "CPAttentionContext",
    "ContextParallelOutput",
    "ContextParallelVLM",
    "ExtraLoss",
    "FamilyKit",
    "IGNORE_INDEX",
    "LossContext",
    "PreparedBatch",
    "RouterLoss",
    "TINY_MODELS",
    "VLMAdapter",
    "adapter_for",
    "kit_for",
    "build_model",
    "model_family",
    "prepare_batch",
    "register",
    "supported",
    "vision_cost",
    *_MOVED,
]
