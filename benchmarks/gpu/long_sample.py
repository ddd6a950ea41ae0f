"""One long document per row for the GPU training comparison (``cpvlm train --data``).

``samples(model_config, seed, seq_len=16384)`` -> a list with one sample of exactly ``seq_len``
tokens: random text ids around one image (a 512 x 512 picture: 32 x 32 patches of 16, 256 merged
tokens at merge 2), laid out as a Qwen3-VL processor writes it. With one document per row, the
cpvlm step and the plain Hugging Face forward on the same sample do the same attention work (a
packed row of many short documents would let cpvlm skip the cross-document pairs the plain model
computes).
"""

from __future__ import annotations

import os

import torch

SEQ_LEN = int(os.environ.get("CPVLM_GPU_SEQ_LEN", "16384"))
GRID = (1, 32, 32)  # (t, h, w) in patches


def samples(model_config, seed: int, seq_len: int = SEQ_LEN) -> list[dict]:
    vision = model_config.vision_config
    merge = vision.spatial_merge_size
    n_image = GRID[0] * GRID[1] * GRID[2] // merge**2
    gen = torch.Generator().manual_seed(seed)
    specials = min(
        model_config.image_token_id,
        model_config.video_token_id,
        model_config.vision_start_token_id,
        model_config.vision_end_token_id,
    )
    n_text = seq_len - n_image - 2
    text = torch.randint(0, specials, (n_text,), generator=gen)
    head = n_text // 8  # a short prompt, the image, then the long text
    image = torch.full((n_image,), model_config.image_token_id)
    ids = torch.cat(
        [
            text[:head],
            torch.tensor([model_config.vision_start_token_id]),
            image,
            torch.tensor([model_config.vision_end_token_id]),
            text[head:],
        ]
    )
    patch_dim = vision.in_channels * vision.temporal_patch_size * vision.patch_size**2
    pixels = torch.randn(GRID[0] * GRID[1] * GRID[2], patch_dim, generator=gen)
    return [{"input_ids": ids, "pixel_values": pixels, "image_grid_thw": torch.tensor([GRID])}]
