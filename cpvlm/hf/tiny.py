"""Shared sizes and token ids of the tiny configs (small enough for float64 CPU tests).

Each family builds its tiny config from its real transformers config class with these sizes;
``vision_config`` / ``text_config`` dicts given to a builder are merged into its defaults, other
keys go to the top-level config.
"""

from __future__ import annotations

from collections.abc import Mapping

# vocab 512: special ids at the top, text ids drawn below them.
VOCAB_SIZE = 512
PAD_TOKEN_ID = 0
VISION_START_TOKEN_ID = 500
VISION_END_TOKEN_ID = 501
IMAGE_TOKEN_ID = 502
VIDEO_TOKEN_ID = 503
VIDEO_START_TOKEN_ID = 504  # video markers, for layouts that write them around a video
VIDEO_END_TOKEN_ID = 505

VISION_TOKEN_IDS = {  # the base layout's ids: <vision_start> pads <vision_end>
    "image_token_id": IMAGE_TOKEN_ID,
    "video_token_id": VIDEO_TOKEN_ID,
    "vision_start_token_id": VISION_START_TOKEN_ID,
    "vision_end_token_id": VISION_END_TOKEN_ID,
}

TEXT = {
    "vocab_size": VOCAB_SIZE,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,  # GQA
    "max_position_embeddings": 4096,
}
VISION = {
    "depth": 2,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_heads": 2,
    "in_channels": 3,
    "patch_size": 8,
    "temporal_patch_size": 2,
    "spatial_merge_size": 2,
    "out_hidden_size": 64,
}


def with_overrides(defaults: Mapping, overrides: Mapping | None) -> dict:
    merged = dict(defaults)
    merged.update(overrides or {})
    return merged


def split_overrides(overrides: dict) -> tuple[dict | None, dict | None, dict]:
    """``(vision_config, text_config, top-level)`` overrides of a tiny builder's keywords."""
    vision = overrides.pop("vision_config", None)
    text = overrides.pop("text_config", None)
    return vision, text, overrides
