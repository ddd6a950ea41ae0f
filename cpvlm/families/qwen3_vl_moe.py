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

from .qwen3_vl import TINY_TEXT, Qwen3VLAdapter, Qwen3VLKit, qwen3_vl_8b_config, tiny_vision


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


def qwen3_vl_235b_a22b_config() -> Qwen3VLMoeConfig:
    """qwen3-vl-235b-a22b: Qwen3-VL-235B-A22B-Instruct's config.json dimensions, written out (94
    MoE decoder layers of 128 experts, top 8, expert width 1536; 64 query / 4 key-value heads of
    128; the 27-block tower of Qwen3-VL-8B). The router loss is left off, as in every published
    config here (fake tensors cannot run it; docs/plan.md)."""
    return Qwen3VLMoeConfig(
        text_config={
            "vocab_size": 151936,
            "hidden_size": 4096,
            "intermediate_size": 12288,
            "moe_intermediate_size": 1536,
            "num_experts": 128,
            "num_experts_per_tok": 8,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
            "num_hidden_layers": 94,
            "num_attention_heads": 64,
            "num_key_value_heads": 4,
            "head_dim": 128,
            "max_position_embeddings": 262144,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 5_000_000.0,
                "mrope_section": [24, 20, 20],
                "mrope_interleaved": True,
            },
            "output_router_logits": False,
            "tie_word_embeddings": False,
        },
        vision_config=qwen3_vl_8b_config().vision_config.to_dict(),
        tie_word_embeddings=False,
    )


class Qwen3VLMoeKit(MoeKit, Qwen3VLKit):
    tiny_configs = {"qwen3-vl-moe-tiny": tiny_qwen3_vl_moe_config}
    published_configs = {"qwen3-vl-235b-a22b": qwen3_vl_235b_a22b_config}
    tiny_processor = None


@register
class Qwen3VLMoeAdapter(MoeRouter, Qwen3VLAdapter):
    family = "qwen3_vl_moe"
    model_classes = ("Qwen3VLMoeForConditionalGeneration",)
    model_types = ("qwen3_vl_moe",)
    kit = Qwen3VLMoeKit
