"""GLM-4.1V / GLM-4.6V (glm4v, glm46v) and GLM-4.5V (glm4v_moe): M-RoPE, video frames as images.

A GLM video is ``<|begin_of_video|>`` then, per temporal patch-frame, ``<|begin_of_image|>``
image-token pads ``<|end_of_image|>`` and its timestamp as text, then ``<|end_of_video|>``: video
placeholders are *image* tokens, and ``mm_token_type_ids`` (2 inside a video, 1 elsewhere) is what
tells them apart. The tower encodes every frame as its own (1, h, w) grid (``get_video_features``
flattens videos; the tower cannot take t > 1), so frames are independent units. Its patch merger is
a strided convolution (``downsample``) and an MLP (``merger``). The model's own forward puts image
features at every image-token position, so it cannot take images and videos in one call; the CP
path can (it places rows by token type).

GLM-4.5V's MoE layers route with a sigmoid router computed in float32 whatever the model dtype,
so a float64 GLM-4.5V is exact under CP only to float32 round-off (~1e-7); its optional
load-balancing loss (``output_router_logits``) is computed like Qwen3-VL-MoE's. The kit's
``float64_islands`` runs both float32 parts with their casts kept in the model's dtype, so that
float64 checks hold every gradient to 1e-10; ``float32_groups`` names what the unchanged models
round to float32.

Cost model (w width, o ``out_hidden_size``, I the merger's width, m merge size): blocks
4 w^2 + 3 w o (the block MLP is gated with width o); a 2-d convolution of m x m patches to o
(w o per patch) and a merger o^2 + 3 o I per merged token; full attention everywhere.
"""

from __future__ import annotations

import torch
from transformers import Glm4vConfig, Glm4vMoeConfig, Glm46VConfig

from cpvlm.encoders.cost import EncoderCost, block_linear_macs
from cpvlm.hf.adapter import ModulePaths, MoeRouter, VLMAdapter
from cpvlm.hf.kit import FamilyKit, MoeKit
from cpvlm.hf.registration import register
from cpvlm.hf.tiny import (
    IMAGE_TOKEN_ID,
    TEXT,
    VIDEO_END_TOKEN_ID,
    VIDEO_START_TOKEN_ID,
    VIDEO_TOKEN_ID,
    VISION,
    VISION_END_TOKEN_ID,
    VISION_START_TOKEN_ID,
    split_overrides,
    with_overrides,
)
from cpvlm.hf.tower_cost import values_per_patch

TIMESTAMP_TOKENS = 1
"""Text tokens of the timestamp the processor writes after every video frame (``int(seconds)``)."""

_TOKENS = {
    "image_token_id": IMAGE_TOKEN_ID,
    "video_token_id": VIDEO_TOKEN_ID,
    "image_start_token_id": VISION_START_TOKEN_ID,
    "image_end_token_id": VISION_END_TOKEN_ID,
    "video_start_token_id": VIDEO_START_TOKEN_ID,
    "video_end_token_id": VIDEO_END_TOKEN_ID,
}
_VISION = {
    **VISION,
    "intermediate_size": 2 * TEXT["hidden_size"],  # the merger's width (the text MLP's, as in GLM)
    "image_size": 64,  # an 8 x 8 table of position embeddings, interpolated per grid
}
_TEXT = {
    **TEXT,
    # head_dim 16, half of it rotary: 4 frequencies in T, H, W sections.
    "rope_parameters": {
        "rope_type": "default",
        "rope_theta": 10000.0,
        "mrope_section": [2, 1, 1],
        "partial_rotary_factor": 0.5,
    },
}


def _tiny(config_class, text_defaults: dict, overrides: dict):
    vision, text, top = split_overrides(overrides)
    top = with_overrides({**_TOKENS, "attn_implementation": "sdpa"}, top)
    return config_class(
        text_config=with_overrides(text_defaults, text),
        vision_config=with_overrides(_VISION, vision),
        **top,
    )


def tiny_glm4v_config(**overrides) -> Glm4vConfig:
    """A GLM-4.1V config small enough for float64 CPU tests (~200k parameters)."""
    return _tiny(Glm4vConfig, _TEXT, overrides)


def tiny_glm46v_config(**overrides) -> Glm46VConfig:
    """A GLM-4.6V config (GLM-4.1V text and vision configs under the glm46v wrapper)."""
    overrides.setdefault("text_config", {})
    overrides["text_config"] = {"model_type": "glm4v_text", **overrides["text_config"]}
    overrides.setdefault("vision_config", {})
    overrides["vision_config"] = {"model_type": "glm4v_vision", **overrides["vision_config"]}
    return _tiny(Glm46VConfig, _TEXT, overrides)


def tiny_glm4v_moe_config(**overrides) -> Glm4vMoeConfig:
    """A GLM-4.5V config: layer 0 dense, layer 1 MoE (4 routed experts, top 2, one shared)."""
    text = {
        **_TEXT,
        "moe_intermediate_size": 32,
        "n_routed_experts": 4,
        "num_experts_per_tok": 2,
        "n_shared_experts": 1,
        "first_k_dense_replace": 1,
    }
    return _tiny(Glm4vMoeConfig, text, overrides)


def glm4v_vision_cost(vc) -> EncoderCost:
    w, m, o = vc.hidden_size, vc.spatial_merge_size, vc.out_hidden_size
    merger_per_token = o * o + 3 * o * vc.intermediate_size
    if merger_per_token % (m * m):
        raise ValueError(
            f"GLM-4V merger MACs {merger_per_token} are not divisible by m^2 = {m * m}"
        )
    linear = (
        values_per_patch(vc) * w
        + vc.depth * block_linear_macs(w, o, gated=True)
        + w * o
        + merger_per_token // (m * m)
    )
    return EncoderCost(linear_per_patch=linear, pair=2 * w, full_blocks=vc.depth)


class _GlmKit(FamilyKit):
    traits = frozenset({"frames_as_images"})
    mixes_images_and_videos = False
    # The position table is resampled by a float32 bicubic grid_sample: its gradient is a float32
    # sum over the patches of one tower call (docs/hf_internals.md section 8).
    float32_groups = ("vision position table",)

    # The vision position table's bicubic resampling and the MoE router's logits and scores run
    # in float32 whatever the model dtype.
    float32_islands = (
        "Glm4vVisionEmbeddings",
        "Glm4vMoeVisionEmbeddings",
        "Glm4vMoeTextTopkRouter",
    )

    def item_tokens(self, kind, grid, text):
        c = self.config
        t, h, w = grid
        frame = [c.image_start_token_id]
        frame += [c.image_token_id] * (h * w // self.adapter.merge_size**2)
        frame.append(c.image_end_token_id)
        if kind == "image":
            return frame * t
        tokens = [c.video_start_token_id]
        for _ in range(t):
            tokens += frame + text(TIMESTAMP_TOKENS)
        return tokens + [c.video_end_token_id]

    def module_groups(self):
        v = r"model\.visual\."
        return (
            ("vision position table", (v + r"embeddings\.position_embedding\.",)),
            ("vision patch embed", (v + r"(patch_embed|post_conv_layernorm)\.",)),
            ("vision blocks", (v + r"blocks\.",)),
            ("vision merger", (v + r"(post_layernorm|downsample|merger)\.",)),
            *super().module_groups()[3:],
        )


class Glm4vKit(_GlmKit):
    tiny_configs = {"glm4v-tiny": tiny_glm4v_config, "glm46v-tiny": tiny_glm46v_config}
    published_towers = {
        "GLM-4.1V-9B": {"depth": 24, "hidden_size": 1536, "intermediate_size": 13696,
         "num_heads": 12, "out_hidden_size": 4096, "patch_size": 14, "temporal_patch_size": 2,
         "spatial_merge_size": 2, "in_channels": 3, "image_size": 336},
    }  # fmt: skip


class MoeGlmKit(MoeKit, _GlmKit):
    tiny_configs = {"glm4v-moe-tiny": tiny_glm4v_moe_config}
    # The sigmoid router casts its input and weight to float32 (any model dtype): its backward
    # rounds every gradient upstream of an MoE layer to float32, and its routing weights the loss.
    float32_groups = ("*",)
    experts_pattern = r"(experts|shared_experts)\."


class _GlmLayout(VLMAdapter):
    modules = ModulePaths(projector=("downsample", "merger"))

    @property
    def special_token_ids(self):
        c = self.config
        return (
            c.image_token_id,
            c.video_token_id,
            c.image_start_token_id,
            c.image_end_token_id,
            c.video_start_token_id,
            c.video_end_token_id,
        )

    def mm_token_type_ids(self, input_ids, attention_mask=None):
        c = self.config
        inside = (input_ids == c.video_start_token_id).long().cumsum(-1) > (
            input_ids == c.video_end_token_id
        ).long().cumsum(-1)
        pads = input_ids == c.image_token_id
        types = pads.long() + (pads & inside).long()
        return types if attention_mask is None else types * attention_mask.bool()

    def encode(self, model, pixel_values, grid_thw, kinds=None):
        # One (1, h, w) grid per frame, as get_video_features passes videos.
        hw = torch.repeat_interleave(grid_thw[:, 1:], grid_thw[:, 0], dim=0)
        frames = torch.cat([hw.new_ones(hw.shape[0], 1), hw], dim=1)
        tower = self.vision_tower(model)
        return tower(pixel_values, grid_thw=frames, return_dict=True).pooler_output

    def vision_cost(self):
        return glm4v_vision_cost(self.config.vision_config)


@register
class Glm4vAdapter(_GlmLayout):
    family = "glm4v"
    model_classes = ("Glm4vForConditionalGeneration", "Glm46VForConditionalGeneration")
    model_types = ("glm4v", "glm46v")
    kit = Glm4vKit


@register
class Glm4vMoeAdapter(MoeRouter, _GlmLayout):
    family = "glm4v_moe"
    model_classes = ("Glm4vMoeForConditionalGeneration",)
    model_types = ("glm4v_moe",)
    kit = MoeGlmKit
