"""Qwen3-VL-MoE: Qwen3-VL with sparse MoE decoder layers and the router's load-balancing loss.

With ``text_config.output_router_logits`` the model adds ``router_aux_loss_coef * aux`` to the
loss, aux from the routers of all MoE layers over the batch's valid tokens; under CP every rank
computes its share from statistics summed over the CP group (``cpvlm.router_loss``). The experts'
default ``grouped_mm`` implementation rejects float64, so float64 models load with ``eager``.
"""

from __future__ import annotations

from transformers import Qwen3VLMoeConfig

from cpvlm.hf.adapter import MoeRouter
from cpvlm.hf.kit import MoeKit
from cpvlm.hf.registration import register
from cpvlm.hf.tiny import VISION_TOKEN_IDS, split_overrides, with_overrides

from .qwen3_vl import TINY_TEXT, Qwen3VLAdapter, Qwen3VLKit, tiny_vision


def tiny_qwen3_vl_moe_config(**overrides) -> Qwen3VLMoeConfig:
    """A Qwen3-VL-MoE config small enough for float64 CPU tests: 4 experts, top 2, both decoder
    layers sparse, the router loss on (``output_router_logits``) with the real coefficient."""
    vision, text, top = split_overrides(overrides)
    text = with_overrides(
        {
            **TINY_TEXT,
            "moe_intermediate_size": 32,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "decoder_sparse_step": 1,
            "output_router_logits": True,
            "router_aux_loss_coef": 0.001,
        },
        text,
    )
    top = with_overrides({**VISION_TOKEN_IDS, "attn_implementation": "sdpa"}, top)
    return Qwen3VLMoeConfig(text_config=text, vision_config=tiny_vision(vision), **top)


class Qwen3VLMoeKit(MoeKit, Qwen3VLKit):
    tiny_configs = {"qwen3-vl-moe-tiny": tiny_qwen3_vl_moe_config}
    tiny_processor = None


@register
class Qwen3VLMoeAdapter(MoeRouter, Qwen3VLAdapter):
    family = "qwen3_vl_moe"
    model_classes = ("Qwen3VLMoeForConditionalGeneration",)
    model_types = ("qwen3_vl_moe",)
    kit = Qwen3VLMoeKit
