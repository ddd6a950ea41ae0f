"""Real model configs without downloads: published dimensions in transformers' config classes.

Each entry builds the model's config from its transformers config class with the dimensions of
the published checkpoint's ``config.json`` (written here, so nothing is fetched); anything else is
a local directory holding a ``config.json``. ``cpvlm plan --model`` takes either.
"""

from __future__ import annotations

from pathlib import Path


def qwen3_vl_8b():
    from transformers import Qwen3VLConfig

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


def qwen2_5_vl_72b():
    from transformers import Qwen2_5_VLConfig

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


def qwen3_5_9b():
    """Qwen3.5 dense, 3 Gated-DeltaNet layers to 1 attention layer (transformers' Qwen3_5Config
    defaults, written out)."""
    from transformers import Qwen3_5Config

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


def gemma3_27b():
    from transformers import Gemma3Config

    return Gemma3Config(
        text_config={
            "vocab_size": 262208,
            "hidden_size": 5376,
            "intermediate_size": 21504,
            "num_hidden_layers": 62,
            "num_attention_heads": 32,
            "num_key_value_heads": 16,
            "head_dim": 128,
            "query_pre_attn_scalar": 168,
            "sliding_window": 1024,
            "max_position_embeddings": 131072,
        },
        vision_config={
            "hidden_size": 1152,
            "intermediate_size": 4304,
            "num_hidden_layers": 27,
            "num_attention_heads": 16,
            "image_size": 896,
            "patch_size": 14,
        },
        mm_tokens_per_image=256,
    )


PUBLISHED = {
    "qwen3-vl-8b": qwen3_vl_8b,
    "qwen2.5-vl-72b": qwen2_5_vl_72b,
    "qwen3.5-9b": qwen3_5_9b,
    "gemma3-27b": gemma3_27b,
}
"""``{name: config builder}``: the published models ``cpvlm plan`` and the scale table use."""


def load_config(name_or_dir: str):
    """The config of a ``PUBLISHED`` name, a tiny model (``TINY_MODELS``) or a local directory
    with a ``config.json``; a ValueError says which names exist otherwise."""
    from cpvlm.hf import TINY_MODELS

    if name_or_dir in PUBLISHED:
        return PUBLISHED[name_or_dir]()
    if name_or_dir in TINY_MODELS:
        return TINY_MODELS[name_or_dir]()
    path = Path(name_or_dir)
    if not (path / "config.json").is_file():
        raise ValueError(
            f"--model {name_or_dir!r}: not a known config ({', '.join(PUBLISHED)}, or a tiny "
            f"model: {', '.join(TINY_MODELS)}) and not a directory with a config.json"
        )
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(path, local_files_only=True)
