"""Hugging Face transformers VLMs under CP: a family-agnostic core and one adapter per family.

Read in this order: adapter.py (what a family says), registry.py (model class -> adapter),
families/ (one file per family), inputs.py (the replicated integer inputs of a step),
context_parallel.py (ContextParallelVLM, one step top to bottom), attention.py.

synthetic.py makes batches in any family's layout (``cpvlm train --data synthetic``, ``cpvlm
verify``, the examples); tiny_checkpoint.py writes a tiny checkpoint directory with a real
processor; float64.py reads transformers' float32 casts as float64 for a float64 reference.
"""

from cpvlm.integrations.hf.adapter import ExtraLoss, LossContext, RouterLoss, VLMAdapter
from cpvlm.integrations.hf.attention import CP_ATTENTION, CPAttentionContext
from cpvlm.integrations.hf.context_parallel import ContextParallelOutput, ContextParallelVLM
from cpvlm.integrations.hf.inputs import PreparedBatch, prepare_batch
from cpvlm.integrations.hf.models import (
    TINY_MODELS,
    build_model,
    model_family,
    tiny_qwen2_5_vl_config,
    tiny_qwen3_vl_config,
)
from cpvlm.integrations.hf.registry import adapter_for, register, supported
from cpvlm.integrations.hf.synthetic import SampleSpec, pack_documents, synthetic_batch
from cpvlm.integrations.hf.vision_cost import vision_cost
from cpvlm.loss import IGNORE_INDEX

__all__ = [
    "CP_ATTENTION",
    "CPAttentionContext",
    "ContextParallelOutput",
    "ContextParallelVLM",
    "ExtraLoss",
    "IGNORE_INDEX",
    "LossContext",
    "PreparedBatch",
    "RouterLoss",
    "SampleSpec",
    "TINY_MODELS",
    "VLMAdapter",
    "adapter_for",
    "build_model",
    "model_family",
    "pack_documents",
    "prepare_batch",
    "register",
    "supported",
    "synthetic_batch",
    "tiny_qwen2_5_vl_config",
    "tiny_qwen3_vl_config",
    "vision_cost",
]
