"""Qwen3-VL: deepstack levels from the tower, a timestamp before every video frame.

Legend: L local length, N local visual rows, D text width.

The tower returns the merged rows and one ``[R, D]`` deepstack level per entry of
``vision_config.deepstack_visual_indexes``; the text model adds level l after decoder layer l at
the visual positions (``visual_pos_masks``, ``deepstack_visual_embeds``), which on a shard are
the local visual mask and the local rows in their order. Under ``vision="split"`` the tower's
learned position table is interpolated per whole unit, by the tower's own function (float32
weights), and taken at the local patches. The processor writes each temporal
patch-frame of a video as ``<t seconds><vision_start> pads <vision_end>``, and ``get_rope_index``
needs that text between frames.

Cost model: blocks 4 w^2 + 2 w I; one merger plus one per deepstack index; full attention
everywhere (Qwen3.5's tower: the same without deepstack).
"""

from __future__ import annotations

from transformers import Qwen3VLConfig

from cpvlm.encoders.cost import EncoderCost, block_linear_macs
from cpvlm.hf.adapter import ModulePaths, VLMAdapter
from cpvlm.hf.kit import FamilyKit
from cpvlm.hf.registration import register
from cpvlm.hf.tiny import TEXT, VISION, VISION_TOKEN_IDS, split_overrides, with_overrides
from cpvlm.hf.tower_cost import patch_merger_macs, values_per_patch

from .qwen2_vl import Qwen3VLMedia, tiny_qwen_vl_processor

TP_PLAN = {
    **{f"layers.*.self_attn.{p}_proj": "colwise" for p in "qkv"},
    "layers.*.self_attn.o_proj": "rowwise",
    # one weight over the head dim, applied to every head: each TP rank sees its own heads
    "layers.*.self_attn.q_norm": "replicated_with_grad_allreduce",
    "layers.*.self_attn.k_norm": "replicated_with_grad_allreduce",
    "layers.*.mlp.gate_proj": "colwise",
    "layers.*.mlp.up_proj": "colwise",
    "layers.*.mlp.down_proj": "rowwise",
}
"""The decoder's tensor-parallel plan (``cpvlm.hf.tensor_plan``): transformers 5.25's Qwen3-VL
text config plans only its embedding."""

TIMESTAMP_TOKENS = 3
"""Text tokens of the timestamp the processor writes before every video frame ("<0.5 seconds>")."""


def tiny_vision(vision: dict | None) -> dict:
    vision = with_overrides({**VISION, "num_position_embeddings": 64}, vision)
    vision.setdefault("deepstack_visual_indexes", sorted({0, vision["depth"] - 1}))
    bad = [i for i in vision["deepstack_visual_indexes"] if not 0 <= i < vision["depth"]]
    if bad:
        raise ValueError(
            f"vision_config.deepstack_visual_indexes {bad} are outside the vision depth "
            f"{vision['depth']}; pass indexes in [0, depth)"
        )
    return vision


TINY_TEXT = {
    **TEXT,
    "head_dim": 16,
    # head_dim/2 = 8 frequencies, interleaved T,H,W as in the real checkpoints.
    "rope_parameters": {
        "rope_type": "default",
        "rope_theta": 5_000_000.0,
        "mrope_section": [4, 2, 2],
        "mrope_interleaved": True,
    },
}


def tiny_qwen3_vl_config(**overrides) -> Qwen3VLConfig:
    """A Qwen3-VL config small enough for float64 CPU tests (~250k parameters). Deepstack taps
    the first and last vision block unless ``deepstack_visual_indexes`` is given."""
    vision, text, top = split_overrides(overrides)
    top = with_overrides({**VISION_TOKEN_IDS, "attn_implementation": "sdpa"}, top)
    return Qwen3VLConfig(
        text_config=with_overrides(TINY_TEXT, text), vision_config=tiny_vision(vision), **top
    )


def qwen3_vl_vision_cost(vc) -> EncoderCost:
    w, m = vc.hidden_size, vc.spatial_merge_size
    mergers = 1 + len(getattr(vc, "deepstack_visual_indexes", None) or ())
    linear = (
        values_per_patch(vc) * w
        + vc.depth * block_linear_macs(w, vc.intermediate_size, gated=False)
        + mergers * patch_merger_macs(w, m, vc.out_hidden_size)
    )
    return EncoderCost(linear_per_patch=linear, pair=2 * w, full_blocks=vc.depth)


def has_deepstack(config) -> bool:
    return bool(getattr(config.vision_config, "deepstack_visual_indexes", None))


def qwen3_vl_8b_config() -> Qwen3VLConfig:
    """qwen3-vl-8b: the published checkpoint's config.json dimensions (``cpvlm plan --model qwen3-vl-8b``)."""
    return Qwen3VLConfig(
        text_config={
            "vocab_size": 151936,
            "hidden_size": 4096,
            "intermediate_size": 12288,
            "num_hidden_layers": 36,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "head_dim": 128,
            "max_position_embeddings": 262144,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 5_000_000.0,
                "mrope_section": [24, 20, 20],
                "mrope_interleaved": True,
            },
            "tie_word_embeddings": False,
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
            "deepstack_visual_indexes": [8, 16, 24],
        },
        tie_word_embeddings=False,
    )


class Qwen3VLKit(FamilyKit):
    tiny_configs = {"qwen3-vl-tiny": tiny_qwen3_vl_config}
    published_configs = {"qwen3-vl-8b": qwen3_vl_8b_config}
    default_model = True
    published_towers = {
        "Qwen3-VL-8B": {"depth": 27, "hidden_size": 1152, "intermediate_size": 4304,
         "num_heads": 16, "out_hidden_size": 4096, "patch_size": 16, "temporal_patch_size": 2,
         "spatial_merge_size": 2, "in_channels": 3, "num_position_embeddings": 2304,
         "deepstack_visual_indexes": [8, 16, 24]},
    }  # fmt: skip
    traits = frozenset({"deepstack", "frame_timestamps"})
    tiny_processor = tiny_qwen_vl_processor(
        "Qwen3VLProcessor", "Qwen3VLVideoProcessor", system_prompt=False
    )

    def item_tokens(self, kind, grid, text):
        if kind == "image":
            return super().item_tokens(kind, grid, text)
        t, h, w = grid
        frame = super().item_tokens(kind, (1, h, w), text)
        return [tok for _ in range(t) for tok in text(TIMESTAMP_TOKENS) + frame]

    def module_groups(self):
        groups = list(super().module_groups())
        if has_deepstack(self.config):
            deepstack = (r"model\.visual\.deepstack_merger_list\.",)
            groups.insert(3, ("deepstack mergers", deepstack))
        return tuple(groups)


@register
class Qwen3VLAdapter(VLMAdapter):
    family = "qwen3_vl"
    model_classes = ("Qwen3VLForConditionalGeneration",)
    model_types = ("qwen3_vl",)
    kit = Qwen3VLKit
    chat_media = Qwen3VLMedia
    modules = ModulePaths(projector=("merger", "deepstack_merger_list"))
    tp_plan = TP_PLAN

    def vision_cost(self):
        return qwen3_vl_vision_cost(self.config.vision_config)

    def encode(self, model, pixel_values, grid_thw, kinds=None, **kwargs):
        out = self.vision_tower(model)(pixel_values, grid_thw=grid_thw, return_dict=True, **kwargs)
        if not has_deepstack(self.config):
            return out.pooler_output
        return out.pooler_output, list(out.deepstack_features)

    split_vision = True

    def split_tower_kwargs(self, tower, pieces, n):
        """The learned position table's interpolation taps and float32 weights, computed by the
        tower's own function and arguments on each whole unit's grid, at the local patches."""
        from cpvlm.hf.vision_attention import local_rows, tower_function

        kwargs = super().split_tower_kwargs(tower, pieces, n)
        interpolation = tower_function(tower, "get_vision_interpolation_indices_and_weights")
        kwargs["interp_indices"], kwargs["interp_weights"] = local_rows(
            pieces,
            lambda grid: interpolation(
                grid,
                num_grid_per_side=tower.num_grid_per_side,
                mode=tower.interpolation_mode,
                align_corners=tower.interpolation_align_corners,
                spatial_merge_size=tower.config.spatial_merge_size,
            ),
        )
        return kwargs

    def decoder_inputs(self, model, input_ids, visual_mask, deepstack):
        kwargs = super().decoder_inputs(model, input_ids, visual_mask, deepstack)
        if not has_deepstack(self.config):
            return kwargs
        return {
            **kwargs,
            "visual_pos_masks": visual_mask,
            "deepstack_visual_embeds": list(deepstack),
        }
