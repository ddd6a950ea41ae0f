"""Qwen2.5-VL: Qwen2-VL's layout with window attention in the tower and video time steps.

Videos carry ``second_per_grid_ts`` (one entry per video), which ``get_rope_index`` turns into
temporal position steps; the tower's windows are per frame, so frames stay independent units. Under ``vision="split"``
each unit's merge groups are put in the tower's window order before they are cut (the window
reordering the tower does itself), so every window is contiguous on the line.

Cost model: blocks 4 w^2 + 3 w I (gated MLP); one merger; the blocks in
``fullatt_block_indexes`` attend the whole frame, the others windows of
(window_size // m // patch_size) merged tokens a side, i.e. that times m patches.
"""

from __future__ import annotations

import torch
from transformers import Qwen2_5_VLConfig
from transformers.vision_utils import get_vision_window_index

from cpvlm.encoders.cost import EncoderCost, block_linear_macs
from cpvlm.encoders.split import UnitOrder
from cpvlm.hf.adapter import VLMAdapter
from cpvlm.hf.kit import FamilyKit
from cpvlm.hf.registration import register
from cpvlm.hf.tiny import TEXT, VISION, VISION_TOKEN_IDS, split_overrides, with_overrides
from cpvlm.hf.tower_cost import patch_merger_macs, values_per_patch

from .qwen2_vl import QwenVLMedia, tiny_qwen_vl_processor


def tiny_qwen2_5_vl_config(**overrides) -> Qwen2_5_VLConfig:
    """A Qwen2.5-VL config small enough for float64 CPU tests (~200k parameters).

    Window attention is on (window of 2x2 merged tokens) in block 0, full attention in the last
    block, as in the real checkpoints.
    """
    vision, text, top = split_overrides(overrides)
    vision = with_overrides(
        {
            **VISION,
            "window_size": 32,  # pixels: 32 // merge 2 // patch 8 = 2 merged tokens per side
            "tokens_per_second": 2,
        },
        vision,
    )
    vision.setdefault("fullatt_block_indexes", [vision["depth"] - 1])
    text = with_overrides(
        {
            **TEXT,  # head_dim = hidden_size / num_attention_heads = 16
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
    return Qwen2_5_VLConfig(text_config=text, vision_config=vision, **top)


def qwen2_5_vl_vision_cost(vc) -> EncoderCost:
    w, m = vc.hidden_size, vc.spatial_merge_size
    full = sorted(set(vc.fullatt_block_indexes))
    if any(not 0 <= i < vc.depth for i in full):
        raise ValueError(
            f"vision_config.fullatt_block_indexes {full} must lie in [0, depth={vc.depth})"
        )
    linear = (
        values_per_patch(vc) * w
        + vc.depth * block_linear_macs(w, vc.intermediate_size, gated=True)
        + patch_merger_macs(w, m, vc.out_hidden_size)
    )
    windowed = vc.depth - len(full)
    window = vc.window_size // m // vc.patch_size * m
    if windowed and window < 1:
        raise ValueError(
            f"vision_config.window_size {vc.window_size} is smaller than one merged token "
            f"(spatial_merge_size {m} x patch_size {vc.patch_size}) but {windowed} blocks are windowed"
        )
    return EncoderCost(
        linear_per_patch=linear,
        pair=2 * w,
        full_blocks=len(full),
        windowed_blocks=windowed,
        window=window if windowed else 0,
    )


def qwen2_5_vl_72b_config() -> Qwen2_5_VLConfig:
    """qwen2.5-vl-72b: the published checkpoint's config.json dimensions (``cpvlm plan --model qwen2.5-vl-72b``)."""
    return Qwen2_5_VLConfig(
        text_config={
            "vocab_size": 152064,
            "hidden_size": 8192,
            "intermediate_size": 29568,
            "num_hidden_layers": 80,
            "num_attention_heads": 64,
            "num_key_value_heads": 8,
            "max_position_embeddings": 128000,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 1_000_000.0,
                "mrope_section": [16, 24, 24],
            },
            "tie_word_embeddings": False,
        },
        vision_config={
            "depth": 32,
            "hidden_size": 1280,
            "intermediate_size": 3456,
            "num_heads": 16,
            "patch_size": 14,
            "temporal_patch_size": 2,
            "spatial_merge_size": 2,
            "window_size": 112,
            "fullatt_block_indexes": [7, 15, 23, 31],
            "out_hidden_size": 8192,
        },
        tie_word_embeddings=False,
    )


class Qwen2_5_VLKit(FamilyKit):
    tiny_configs = {"qwen2.5-vl-tiny": tiny_qwen2_5_vl_config}
    published_configs = {"qwen2.5-vl-72b": qwen2_5_vl_72b_config}
    published_towers = {
        "Qwen2.5-VL-7B": {"depth": 32, "hidden_size": 1280, "intermediate_size": 3420,
         "num_heads": 16, "out_hidden_size": 3584, "patch_size": 14, "temporal_patch_size": 2,
         "spatial_merge_size": 2, "in_channels": 3, "window_size": 112,
         "fullatt_block_indexes": [7, 15, 23, 31]},
    }  # fmt: skip
    tiny_processor = tiny_qwen_vl_processor(
        "Qwen2_5_VLProcessor", "Qwen2VLVideoProcessor", system_prompt=True
    )


@register
class Qwen2_5_VLAdapter(VLMAdapter):
    family = "qwen2_5_vl"
    model_classes = ("Qwen2_5_VLForConditionalGeneration",)
    model_types = ("qwen2_5_vl",)
    kit = Qwen2_5_VLKit
    chat_media = QwenVLMedia
    video_keys = ("second_per_grid_ts",)
    split_vision = True

    def vision_cost(self):
        return qwen2_5_vl_vision_cost(self.config.vision_config)

    def unit_order(self, grid):
        """The tower's own window order of the unit's groups, and its window lengths."""
        vc = self.config.vision_config
        index, cu = get_vision_window_index(
            torch.tensor([grid]), vc.spatial_merge_size, vc.window_size, vc.patch_size
        )
        windows = torch.diff(cu) // self.merge_size**2
        return UnitOrder(index.long(), tuple(int(n) for n in windows))

    def windowed_attention(self, tower):
        full = set(tower.fullatt_block_indexes)
        return [blk.attn for i, blk in enumerate(tower.blocks) if i not in full]

    def split_tower_kwargs(self, tower, pieces, n):
        """Positions of the local patches, already in window order: the identity window index."""
        kwargs = super().split_tower_kwargs(tower, pieces, n)
        device = kwargs["position_ids"].device
        kwargs["window_index"] = torch.arange(n // self.merge_size**2, device=device)
        kwargs["cu_window_seqlens"] = kwargs["cu_seqlens"]
        return kwargs
