"""Hugging Face transformers VLMs under CP: a family-agnostic core and one adapter per family.

Read in this order: adapter.py (what a family says to the CP step), kit.py (what it says to
tests and verify), families/ (one file per family, each registered in registration.py),
registry.py (model class -> adapter), inputs.py (the replicated integer inputs of a step),
context_parallel.py (ContextParallelVLM, one step top to bottom), attention.py.

synthetic.py makes batches in any family's layout (``cpvlm train --data synthetic``, ``cpvlm
verify``, the examples); tiny_checkpoint.py writes a tiny checkpoint directory with a real
processor; float64.py keeps transformers' float32 casts in float64 for a float64 reference;
versions.py warns once when transformers (or trl, peft, ...) is outside the tested window.
"""

# First: importing it warns when a library is outside the tested window, before any family
# import that such a release might break.
from cpvlm.integrations.hf import versions  # noqa: F401  (isort: keep first)
from cpvlm.integrations.hf.adapter import ExtraLoss, LossContext, RouterLoss, VLMAdapter
from cpvlm.integrations.hf.attention import CP_ATTENTION, CPAttentionContext
from cpvlm.integrations.hf.context_parallel import ContextParallelOutput, ContextParallelVLM
from cpvlm.integrations.hf.inputs import PreparedBatch, prepare_batch
from cpvlm.integrations.hf.kit import FamilyKit
from cpvlm.integrations.hf.models import TINY_MODELS, build_model, model_family
from cpvlm.integrations.hf.registration import register
from cpvlm.integrations.hf.registry import adapter_for, kit_for, supported
from cpvlm.integrations.hf.row_cost import row_cost
from cpvlm.integrations.hf.synthetic import SampleSpec, pack_documents, synthetic_batch
from cpvlm.integrations.hf.vision_cost import vision_cost
from cpvlm.loss import IGNORE_INDEX

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
    "SampleSpec",
    "TINY_MODELS",
    "VLMAdapter",
    "adapter_for",
    "kit_for",
    "build_model",
    "model_family",
    "pack_documents",
    "prepare_batch",
    "register",
    "row_cost",
    "supported",
    "synthetic_batch",
    "vision_cost",
]
