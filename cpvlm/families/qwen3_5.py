"""Qwen3.5 and Qwen3.5-MoE: Gated DeltaNet linear attention between full-attention layers.

Legend: B batch, L local length, D hidden size, Hk/Hv linear key/value heads, K/V their head dims.

Most decoder layers are ``linear_attention``: a causal depthwise conv over the mixed q|k|v
projections, then the gated delta rule, whose state runs from a document's first token to its
last. Neither is local to a token, and transformers offers no registry for them (only
AttentionInterface, which the ``full_attention`` layers go through as in every family). So
``install_context_parallel`` gives each ``Qwen3_5(Moe)GatedDeltaNet`` of the model the
class ``ContextParallel...GatedDeltaNet`` (a subclass, as FSDP2's ``fully_shard`` does: the same
module object, parameters and state_dict keys). With the ``cpvlm_cp`` keyword that
``ContextParallelVLM`` passes to the text model, its forward is the transformers forward with the
conv replaced by ``cp_causal_conv1d`` (halo exchange) and the delta rule by
``cp_gated_delta_rule`` (state passing), both restarting at every document start of the plan;
without it, it is transformers' own forward, unchanged.

The vision tower is Qwen3-VL's without deepstack (``pooler_output`` only); video frames carry
timestamps as in Qwen3-VL. Qwen3.5-MoE adds Qwen3-VL-MoE's router load-balancing loss.

Precision: transformers' torch fallback casts the delta rule and the decay to float32 whatever
the model's dtype, ``Qwen3_5RMSNorm`` sums its weight gradients in float32, and the gated output
norm runs in float32. Under CP a float64 model runs the delta rule and the decay in float64
(float32 and bfloat16 models in float32, as transformers). ``float64_islands`` runs
transformers' own code for those four with its float32 casts kept in float64 (``KeepFloat64``),
so that ``cpvlm verify`` and the tests compare float64 with float64 at 1e-10; against the
unchanged float64 model the CP gradients differ by transformers' float32 round-off (measured
<= 6e-6 on the tiny model, tests/hf/test_qwen3_5.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import Qwen3_5Config, Qwen3_5MoeConfig
from transformers.models.qwen3_5.modeling_qwen3_5 import (
    Qwen3_5GatedDeltaNet,
)
from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import (
    Qwen3_5MoeGatedDeltaNet,
)

from cpvlm.attention.linear import cp_causal_conv1d, cp_gated_delta_rule
from cpvlm.attention.linear.delta_rule import compute_dtype
from cpvlm.hf.adapter import MoeRouter
from cpvlm.hf.kit import MoeKit
from cpvlm.hf.registration import register
from cpvlm.hf.tiny import TEXT, VISION, VISION_TOKEN_IDS, split_overrides, with_overrides

from .qwen3_vl import Qwen3VLAdapter, Qwen3VLKit

# ---- the CP linear-attention layer ---------------------------------------------------------------


class _ContextParallelGatedDeltaNet:
    """The forward of a Gated DeltaNet on a CP shard (mixed in before the transformers class)."""

    def forward(self, hidden_states, cache=None, attention_mask=None, cpvlm_cp=None, **kwargs):
        if cpvlm_cp is None:
            return super().forward(
                hidden_states, cache=cache, attention_mask=attention_mask, **kwargs
            )
        if cache is not None:
            raise ValueError(
                "Qwen3.5 linear attention under context parallelism keeps no cache: pass "
                "use_cache=False"
            )
        # The plan's documents and padding replace attention_mask (ContextParallelVLM passes
        # None); the CP functions output 0 at padding and restart at every document start.
        plan, group = cpvlm_cp.plan, cpvlm_cp.group
        b, s, _ = hidden_states.shape
        mixed_BLC = cp_causal_conv1d(
            self.in_proj_qkv(hidden_states),
            self.conv1d.weight.squeeze(1),
            self.conv1d.bias,
            plan=plan,
            group=group,
            activation=self.activation,
        )
        q, k, v = torch.split(mixed_BLC, [self.key_dim, self.key_dim, self.value_dim], dim=-1)
        z = self.in_proj_z(hidden_states).reshape(b, s, -1, self.head_v_dim)
        beta = self.in_proj_b(hidden_states).sigmoid()
        # transformers forms the decay in float32 (A would be -inf in float16); like the delta
        # rule, a float64 model forms it in float64.
        dtype = compute_dtype(hidden_states.dtype)
        g = -self.A_log.to(dtype).exp() * F.softplus(
            self.in_proj_a(hidden_states).to(dtype) + self.dt_bias
        )
        core = cp_gated_delta_rule(
            q.reshape(b, s, -1, self.head_k_dim),
            k.reshape(b, s, -1, self.head_k_dim),
            v.reshape(b, s, -1, self.head_v_dim),
            g,
            beta,
            plan=plan,
            group=group,
            use_qk_l2norm=True,
        )
        core = self.norm(core.reshape(-1, self.head_v_dim), z.reshape(-1, self.head_v_dim))
        return self.out_proj(core.reshape(b, s, -1))


class ContextParallelQwen3_5GatedDeltaNet(_ContextParallelGatedDeltaNet, Qwen3_5GatedDeltaNet):
    pass


class ContextParallelQwen3_5MoeGatedDeltaNet(
    _ContextParallelGatedDeltaNet, Qwen3_5MoeGatedDeltaNet
):
    pass


CP_LINEAR_ATTENTION = {
    Qwen3_5GatedDeltaNet: ContextParallelQwen3_5GatedDeltaNet,
    Qwen3_5MoeGatedDeltaNet: ContextParallelQwen3_5MoeGatedDeltaNet,
}


# ---- float64 islands (checks only) ---------------------------------------------------------------


# ---- tiny configs --------------------------------------------------------------------------------

TINY_TEXT = {
    **TEXT,
    "head_dim": 16,
    # Partial rotary (the real 0.25 of 256): 8 of 16 dims rotate, 4 frequencies as T,H,W.
    "rope_parameters": {
        "rope_type": "default",
        "rope_theta": 10_000_000.0,
        "partial_rotary_factor": 0.5,
        "mrope_section": [2, 1, 1],
        "mrope_interleaved": True,
    },
    # One Gated DeltaNet layer, then one full-attention layer (the real ones: 3 to 1). Grouped
    # value heads (2 key heads, 4 value heads) and K != V, as in the real checkpoints.
    "layer_types": ["linear_attention", "full_attention"],
    "linear_conv_kernel_dim": 4,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 8,
    "linear_value_head_dim": 12,
}
TINY_VISION = {**VISION, "num_position_embeddings": 64}


def tiny_qwen3_5_config(**overrides) -> Qwen3_5Config:
    """A Qwen3.5 config small enough for float64 CPU tests: a linear-attention layer and a
    full-attention layer."""
    vision, text, top = split_overrides(overrides)
    top = with_overrides({**VISION_TOKEN_IDS, "attn_implementation": "sdpa"}, top)
    return Qwen3_5Config(
        text_config=with_overrides(TINY_TEXT, text),
        vision_config=with_overrides(TINY_VISION, vision),
        **top,
    )


def tiny_qwen3_5_moe_config(**overrides) -> Qwen3_5MoeConfig:
    """Qwen3.5-MoE, as tiny: both layers sparse (4 experts, top 2, a shared expert), the router
    loss on (``output_router_logits``) with the real coefficient."""
    vision, text, top = split_overrides(overrides)
    moe_text = {k: v for k, v in TINY_TEXT.items() if k != "intermediate_size"}
    moe_text.update(
        moe_intermediate_size=32,
        shared_expert_intermediate_size=32,
        num_experts=4,
        num_experts_per_tok=2,
        output_router_logits=True,
        router_aux_loss_coef=0.001,
    )
    top = with_overrides({**VISION_TOKEN_IDS, "attn_implementation": "sdpa"}, top)
    return Qwen3_5MoeConfig(
        text_config=with_overrides(moe_text, text),
        vision_config=with_overrides(TINY_VISION, vision),
        **top,
    )


def qwen3_5_9b_config() -> Qwen3_5Config:
    """Qwen3.5 dense, 3 Gated-DeltaNet layers to 1 attention layer (transformers' Qwen3_5Config
    defaults, written out)."""
    return Qwen3_5Config(
        text_config={
            "vocab_size": 248320,
            "hidden_size": 4096,
            "intermediate_size": 12288,
            "num_hidden_layers": 32,
            "num_attention_heads": 16,
            "num_key_value_heads": 4,
            "head_dim": 256,
            "linear_num_key_heads": 16,
            "linear_num_value_heads": 32,
            "linear_key_head_dim": 128,
            "linear_value_head_dim": 128,
            "linear_conv_kernel_dim": 4,
            "max_position_embeddings": 262144,
        },
        vision_config={
            "depth": 27,
            "hidden_size": 1152,
            "intermediate_size": 4304,
            "num_heads": 16,
            "patch_size": 16,
            "temporal_patch_size": 2,
            "spatial_merge_size": 2,
            "out_hidden_size": 4096,
            "num_position_embeddings": 2304,
        },
    )


def qwen3_5_122b_a10b_config() -> Qwen3_5MoeConfig:
    """qwen3.5-122b-a10b: Qwen/Qwen3.5-122B-A10B's config.json dimensions, written out (48 layers,
    3 Gated DeltaNet to 1 attention; 256 experts, top 8, expert and shared-expert width 1024; 32
    query / 2 key-value heads of 256; the 27-block tower of Qwen3.5-9B into hidden 3072). The
    model NeMo Automodel's published 128k EP 8 x CP 32 recipe trains (docs/plan.md). The router
    loss is left off, as in every published config here (fake tensors cannot run it)."""
    vision = qwen3_5_9b_config().vision_config.to_dict()
    vision["out_hidden_size"] = 3072
    return Qwen3_5MoeConfig(
        text_config={
            "vocab_size": 248320,
            "hidden_size": 3072,
            "num_hidden_layers": 48,
            "num_attention_heads": 32,
            "num_key_value_heads": 2,
            "head_dim": 256,
            "moe_intermediate_size": 1024,
            "shared_expert_intermediate_size": 1024,
            "num_experts": 256,
            "num_experts_per_tok": 8,
            "linear_num_key_heads": 16,
            "linear_num_value_heads": 64,
            "linear_key_head_dim": 128,
            "linear_value_head_dim": 128,
            "linear_conv_kernel_dim": 4,
            "max_position_embeddings": 262144,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 10_000_000.0,
                "partial_rotary_factor": 0.25,
                "mrope_section": [11, 11, 10],
                "mrope_interleaved": True,
            },
            "output_router_logits": False,
            "tie_word_embeddings": False,
        },
        vision_config=vision,
        tie_word_embeddings=False,
    )


# ---- the adapters --------------------------------------------------------------------------------


class Qwen3_5Kit(Qwen3VLKit):
    tiny_configs = {"qwen3.5-tiny": tiny_qwen3_5_config}
    published_configs = {"qwen3.5-9b": qwen3_5_9b_config}
    traits = frozenset({"linear_attention", "frame_timestamps"})
    tiny_processor = None

    float32_islands = (
        "Qwen3_5GatedDeltaNet",
        "Qwen3_5RMSNorm",
        "Qwen3_5RMSNormGated",
        "Qwen3_5MoeGatedDeltaNet",
        "Qwen3_5MoeRMSNorm",
        "Qwen3_5MoeRMSNormGated",
    )
    """Where a float64 Qwen3.5 rounds to float32: the torch delta rule (all of it) and the decay
    (``A_log.float()``), ``Qwen3_5RMSNorm``'s ``(1 + w)`` (weight gradients summed in float32), and
    the Gated DeltaNet's output norm ``Qwen3_5RMSNormGated`` (the norm and its gate's ``silu`` in
    float32). The gate's float32 ``silu`` is not even the same function on every element: ATen's
    AVX2/AVX-512 kernels compute a tensor's last elements (fewer than 2 vector widths) with the scalar
    formula, whose result differs from the vectorised one in the last float32 bit for ~4% of inputs
    (none under ``ATEN_CPU_CAPABILITY=default``), and a CP shard ends elsewhere than the one-process
    run's tensor. The linear-attention gradients move by up to 1.5e-7 (relative) between this norm in
    float32 and in float64, so a few such elements put the conv weight's gradient at 4e-10 on an
    AVX-512 machine, whose 32-element step leaves 16 of a token's 48 gate values to the scalar
    formula; in float64 the same effect is float64 round-off."""

    def module_groups(self):
        groups = list(super().module_groups())
        i = [label for label, _ in groups].index("decoder layers")
        linear = r"model\.language_model\.layers\.\d+\.linear_attn\."
        groups.insert(i, ("linear attention", (linear,)))
        return tuple(groups)


class Qwen3_5MoeKit(MoeKit, Qwen3_5Kit):
    tiny_configs = {"qwen3.5-moe-tiny": tiny_qwen3_5_moe_config}
    published_configs = {"qwen3.5-122b-a10b": qwen3_5_122b_a10b_config}
    shared_tests = False  # tests/hf/test_qwen3_5.py (the shared suite's time)


@register
class Qwen3_5Adapter(Qwen3VLAdapter):
    family = "qwen3_5"
    model_classes = ("Qwen3_5ForConditionalGeneration",)
    model_types = ("qwen3_5",)
    kit = Qwen3_5Kit

    def install_context_parallel(self, model) -> None:
        for module in self.text_model(model).modules():
            cp_class = CP_LINEAR_ATTENTION.get(type(module))
            if cp_class is not None:
                module.__class__ = cp_class


@register
class Qwen3_5MoeAdapter(MoeRouter, Qwen3_5Adapter):
    family = "qwen3_5_moe"
    model_classes = ("Qwen3_5MoeForConditionalGeneration",)
    model_types = ("qwen3_5_moe",)
    kit = Qwen3_5MoeKit
