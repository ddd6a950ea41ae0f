"""Hugging Face transformers Qwen2.5-VL / Qwen3-VL: tiny models, synthetic batches, reference."""

from cpvlm.integrations.hf.attention import CP_ATTENTION, CPAttentionContext
from cpvlm.integrations.hf.context_parallel import ContextParallelOutput, ContextParallelVLM
from cpvlm.integrations.hf.inputs import PreparedBatch, prepare_batch
from cpvlm.integrations.hf.models import (
    IGNORE_INDEX,
    TINY_MODELS,
    SampleSpec,
    build_model,
    causal_lm_loss,
    model_family,
    mrope_position_ids,
    reference_loss_and_grads,
    synthetic_batch,
    tiny_qwen2_5_vl_config,
    tiny_qwen3_vl_config,
)
from cpvlm.integrations.hf.vision_cost import vision_cost

__all__ = [
    "CP_ATTENTION",
    "CPAttentionContext",
    "ContextParallelOutput",
    "ContextParallelVLM",
    "PreparedBatch",
    "prepare_batch",
    "IGNORE_INDEX",
    "TINY_MODELS",
    "SampleSpec",
    "build_model",
    "causal_lm_loss",
    "model_family",
    "mrope_position_ids",
    "reference_loss_and_grads",
    "synthetic_batch",
    "tiny_qwen2_5_vl_config",
    "tiny_qwen3_vl_config",
    "vision_cost",
]
