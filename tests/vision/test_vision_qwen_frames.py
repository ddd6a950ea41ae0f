"""Splitting a video into frame units is exact for the real Qwen2.5-VL and Qwen3-VL towers.

EncoderDataParallel encodes each temporal frame of a video (grid (t, h, w)) as its own unit of grid
(1, h, w). That is only correct if the tower treats frames independently. In transformers 5.x
both Qwen towers do: attention segments are per frame (``cu_seqlens`` repeats h*w t times),
rotary (h, w) positions repeat per frame, Qwen2.5-VL's attention windows are cut within each frame,
and Qwen3-VL's interpolated position embedding depends only on (h, w) and the index within a frame.
This test pins that down on tiny float64 towers, so an upstream change shows up here.
"""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import (  # noqa: E402
    Qwen2_5_VLVisionConfig,
)
from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import (  # noqa: E402
    Qwen2_5_VisionTransformerPretrainedModel,
)
from transformers.models.qwen3_vl.configuration_qwen3_vl import Qwen3VLVisionConfig  # noqa: E402
from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel  # noqa: E402

from cpvlm.testing import rel_err  # noqa: E402

TINY = {
    "depth": 2,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_heads": 2,
    "in_channels": 3,
    "patch_size": 8,
    "temporal_patch_size": 2,
    "spatial_merge_size": 2,
    "out_hidden_size": 16,
}


def _qwen2_5_tower():
    # window_size 32 with patch 8 and merge 2: windows of 2x2 merged tokens, so an 8x12 frame has
    # several windows (one of them partial), and block 1 attends the whole frame.
    config = Qwen2_5_VLVisionConfig(**TINY, window_size=32, fullatt_block_indexes=[1])
    return Qwen2_5_VisionTransformerPretrainedModel(config)


def _qwen3_tower():
    config = Qwen3VLVisionConfig(
        **TINY, num_position_embeddings=64, deepstack_visual_indexes=[0, 1]
    )
    return Qwen3VLVisionModel(config)


def _encode(tower, pixels, grids):
    out = tower(pixels, grid_thw=torch.tensor(grids), return_dict=True)
    return [out.pooler_output, *(getattr(out, "deepstack_features", None) or [])]


@pytest.mark.parametrize(
    "make_tower", [_qwen2_5_tower, _qwen3_tower], ids=["qwen2_5_vl", "qwen3_vl"]
)
def test_a_video_encodes_exactly_as_its_frames(make_tower):
    torch.manual_seed(0)
    tower = make_tower().to(torch.float64).eval()
    tower.config._attn_implementation = "sdpa"
    t, h, w = 3, 8, 12
    width = 3 * 2 * 8 * 8
    pixels = torch.randn(t * h * w, width, dtype=torch.float64)
    whole = _encode(tower, pixels, [[t, h, w]])
    frames_one_call = _encode(tower, pixels, [[1, h, w]] * t)
    frame_rows = pixels.split(h * w)
    frames_apart = [_encode(tower, rows, [[1, h, w]]) for rows in frame_rows]
    assert len(whole) == (3 if make_tower is _qwen3_tower else 1)
    for i, expected in enumerate(whole):
        assert expected.shape[0] == t * h * w // 4
        # Same ops on the same rows; only batching may change float64 summation order.
        assert rel_err(frames_one_call[i], expected) <= 1e-12
        assert rel_err(torch.cat([f[i] for f in frames_apart]), expected) <= 1e-12
    # Control: the same pixel rows as one tall image (frames stacked; attention and positions
    # across frames) give different rows, so the check above is not vacuous.
    assert rel_err(_encode(tower, pixels, [[1, t * h, w]])[0], whole[0]) > 1e-3


@pytest.mark.parametrize(
    "make_tower", [_qwen2_5_tower, _qwen3_tower], ids=["qwen2_5_vl", "qwen3_vl"]
)
def test_the_dummy_frame_of_empty_ranks_is_valid_for_the_real_towers(make_tower):
    # EncoderDataParallel's empty ranks encode one zero frame of grid (1, m, m) to learn their
    # placeholders' dtype and widths: it must give one row per output.
    tower = make_tower().to(torch.float64)
    outputs = _encode(tower, torch.zeros(4, 3 * 2 * 8 * 8, dtype=torch.float64), [[1, 2, 2]])
    assert all(o.shape == (1, 16) and o.dtype == torch.float64 for o in outputs)
    assert all(torch.isfinite(o).all() for o in outputs)
