"""Qwen2-VL: the base layout (M-RoPE from get_rope_index, merger inside the tower, no deepstack).

Its vision config's ``hidden_size`` is the tower's output (the text width) and ``embed_dim`` the
tower's own width.
"""

from __future__ import annotations

from transformers import Qwen2VLConfig

from ..adapter import VLMAdapter
from ..registry import register
from ..tiny import QWEN_SPECIAL_TOKEN_IDS, TEXT, VISION, split_overrides, with_overrides


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
    top = with_overrides({**QWEN_SPECIAL_TOKEN_IDS, "attn_implementation": "sdpa"}, top)
    return Qwen2VLConfig(text_config=text, vision_config=vision, **top)


@register
class Qwen2VLAdapter(VLMAdapter):
    family = "qwen2_vl"
    model_classes = ("Qwen2VLForConditionalGeneration",)
    model_types = ("qwen2_vl",)
    tiny_configs = {"qwen2-vl-tiny": tiny_qwen2_vl_config}
    split_vision = True  # positions and cu_seqlens precomputable, everything else per patch
