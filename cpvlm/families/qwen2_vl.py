"""Qwen2-VL: the base layout (M-RoPE from get_rope_index, merger inside the tower, no deepstack).

Its vision config's ``hidden_size`` is the tower's output (the text width) and ``embed_dim`` the
tower's own width. Cost model (w width, I = embed_dim * mlp_ratio, m merge size, P values per
patch, o output width): P w embedding; blocks 4 w^2 + 2 w I (fc1/fc2); one merger; every block
attends the whole frame.
"""

from __future__ import annotations

from transformers import Qwen2VLConfig

from cpvlm.hf.adapter import VLMAdapter
from cpvlm.hf.kit import FamilyKit
from cpvlm.hf.registration import register
from cpvlm.hf.tiny import TEXT, VISION, VISION_TOKEN_IDS, split_overrides, with_overrides
from cpvlm.vision.cost import VisionCost, block_linear_macs

from .qwen_vl_processing import QwenVLProcessing
from .tower_cost import patch_merger_macs, values_per_patch


def tiny_qwen2_vl_config(**overrides) -> Qwen2VLConfig:
    """A Qwen2-VL config small enough for float64 CPU tests (~190k parameters)."""
    vision, text, top = split_overrides(overrides)
    tower = {k: VISION[k] for k in ("depth", "num_heads", "in_channels", "patch_size")}
    tower |= {"temporal_patch_size": 2, "spatial_merge_size": 2}
    vision = with_overrides(
        {
            **tower,
            "embed_dim": VISION["hidden_size"],
            "hidden_size": TEXT["hidden_size"],
            "mlp_ratio": 2,
        },
        vision,
    )
    text = with_overrides(
        {
            **TEXT,  # head_dim = 64 / 4 = 16: 8 frequencies in contiguous T, H, W sections
            "bos_token_id": 1,
            "eos_token_id": 2,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 1e6,
                "mrope_section": [2, 3, 3],
            },
        },
        text,
    )
    top = with_overrides({**VISION_TOKEN_IDS, "attn_implementation": "sdpa"}, top)
    return Qwen2VLConfig(text_config=text, vision_config=vision, **top)


def qwen2_vl_vision_cost(vc) -> VisionCost:
    w, m = vc.embed_dim, vc.spatial_merge_size
    linear = (
        values_per_patch(vc) * w
        + vc.depth * block_linear_macs(w, int(w * vc.mlp_ratio), gated=False)
        + patch_merger_macs(w, m, vc.hidden_size)
    )
    return VisionCost(linear_per_patch=linear, pair=2 * w, full_blocks=vc.depth)


class Qwen2VLKit(FamilyKit):
    tiny_configs = {"qwen2-vl-tiny": tiny_qwen2_vl_config}
    # hidden_size is the tower's output width; embed_dim is the tower's.
    published_towers = {
        "Qwen2-VL-7B": {"depth": 32, "embed_dim": 1280, "mlp_ratio": 4, "num_heads": 16,
         "hidden_size": 3584, "patch_size": 14, "temporal_patch_size": 2,
         "spatial_merge_size": 2, "in_channels": 3},
    }  # fmt: skip


@register
class Qwen2VLAdapter(QwenVLProcessing, VLMAdapter):
    family = "qwen2_vl"
    model_classes = ("Qwen2VLForConditionalGeneration",)
    model_types = ("qwen2_vl",)
    kit = Qwen2VLKit
    split_vision = True  # positions and cu_seqlens precomputable, everything else per patch

    def vision_cost(self):
        return qwen2_vl_vision_cost(self.config.vision_config)
