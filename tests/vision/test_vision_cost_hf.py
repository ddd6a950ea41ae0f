"""The transformers towers' cost models: read from their configs by the family adapters, equal to
what the towers really compute (torch's FLOP counter on tiny towers built from the real config
classes; the tiling families' in tests/hf/test_tiled_families.py)."""

import importlib

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

transformers = pytest.importorskip("transformers")

from cpvlm.encoders.cost import EncoderCost  # noqa: E402
from cpvlm.hf import TINY_MODELS, adapter_for, build_model  # noqa: E402
from cpvlm.hf.adapter import VLMAdapter  # noqa: E402
from cpvlm.hf.vision_cost import vision_cost  # noqa: E402
from cpvlm.testing.vision_cases import PUBLISHED_TOWERS  # noqa: E402

_TINY = {
    "depth": 3,
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_heads": 2,
    "in_channels": 3,
    "patch_size": 4,
    "temporal_patch_size": 2,
    "spatial_merge_size": 2,
    "out_hidden_size": 40,
}
# model_type: (tower module, tower class, tiny vision_config)
FAMILIES = {
    "qwen2_vl": (
        "qwen2_vl",
        "Qwen2VisionTransformerPretrainedModel",
        {**_TINY, "embed_dim": 32, "mlp_ratio": 3, "hidden_size": 40},
    ),
    # window_size 16 = 2 merged tokens of 2 x 4 pixels: windows of 4 x 4 patches, and edge
    # windows of 4 x 2 and 2 x 2 in the grids below.
    "qwen2_5_vl": (
        "qwen2_5_vl",
        "Qwen2_5_VisionTransformerPretrainedModel",
        {**_TINY, "window_size": 16, "fullatt_block_indexes": [1]},
    ),
    "qwen3_vl": (
        "qwen3_vl",
        "Qwen3VLVisionModel",
        {**_TINY, "deepstack_visual_indexes": [0, 2], "num_position_embeddings": 64},
    ),
    "qwen3_vl_moe": (
        "qwen3_vl_moe",
        "Qwen3VLMoeVisionModel",
        {**_TINY, "deepstack_visual_indexes": [1], "num_position_embeddings": 64},
    ),
    "qwen3_5": ("qwen3_5", "Qwen3_5VisionModel", {**_TINY, "num_position_embeddings": 64}),
    "qwen3_omni_moe_thinker": (
        "qwen3_omni_moe",
        "Qwen3OmniMoeVisionEncoder",
        {**_TINY, "deepstack_visual_indexes": [1], "num_position_embeddings": 64},
    ),
    "qwen3_5_moe": (
        "qwen3_5_moe",
        "Qwen3_5MoeVisionModel",
        {**_TINY, "num_position_embeddings": 64},
    ),
    "glm4v": ("glm4v", "Glm4vVisionModel", {**_TINY, "image_size": 32}),
    "glm4v_moe": ("glm4v_moe", "Glm4vMoeVisionModel", {**_TINY, "image_size": 32}),
    "glm46v": ("glm4v", "Glm4vVisionModel", {**_TINY, "image_size": 32}),
}
# Two frames of one video, windows cut at the edges, a lone merge block. GLM-4V's position
# interpolation indexes grids per frame, so its tower takes videos as frames (t = 1).
GRIDS = [[1, 6, 10], [2, 4, 4], [1, 2, 2], [1, 10, 12]]
GLM_GRIDS = [[1, 6, 10], [1, 4, 4], [1, 4, 4], [1, 2, 2], [1, 10, 12]]


# Not counted here: the tiling towers (tiles, crops: tests/hf/test_tiled_families.py counts them)
# and Gemma's towers, whose models leave out the pooling projector (the same for every unit);
# RADIO's prefix tokens (Nemotron Omni: tests/hf/test_nemotron_h_omni.py counts them).
COUNTED_ELSEWHERE_OR_NOT_EXACT = {
    "internvl",
    "llava_onevision",
    "gemma3",
    "gemma4",
    "nemotron_h_omni",
}


def test_every_family_has_its_own_cost_model_and_the_pixel_row_towers_are_counted():
    configs = {name: make() for name, make in TINY_MODELS.items()}
    model_types = {config.model_type for config in configs.values()}
    assert model_types - COUNTED_ELSEWHERE_OR_NOT_EXACT <= set(FAMILIES)
    for name, config in configs.items():
        adapter = adapter_for(config)
        assert type(adapter).vision_cost is not VLMAdapter.vision_cost, name
        assert adapter.vision_cost() != EncoderCost.patches(), name


@pytest.mark.parametrize(
    "name", ["gemma3-tiny", "gemma4-tiny", "internvl-tiny", "llava-onevision-tiny"]
)
def test_vision_cost_of_a_model_is_its_adapters(name):
    """``vision_cost(model)`` (and of its config) is the family adapter's, for every family."""
    model = build_model(name)
    assert vision_cost(model) == vision_cost(model.config) == adapter_for(model).vision_cost()
    assert vision_cost(model).unit_cost((1, 4, 4)) > 0


@pytest.mark.parametrize("model_type", list(FAMILIES))
def test_cost_model_counts_exactly_the_towers_matrix_products(model_type):
    # Eager attention, so that the counter sees the attention matmuls (it has no formula for
    # the CPU flash kernel); 2 FLOPs per MAC; elementwise work is not counted on either side.
    module, cls_name, vc = FAMILIES[model_type]
    config = transformers.AutoConfig.for_model(model_type, vision_config=vc)
    config.vision_config._attn_implementation = "eager"
    cls = getattr(
        importlib.import_module(f"transformers.models.{module}.modeling_{module}"), cls_name
    )
    torch.manual_seed(0)
    tower = cls._from_config(config.vision_config).double()
    grids = torch.tensor(GLM_GRIDS if model_type.startswith("glm") else GRIDS)
    vcfg = config.vision_config
    width = vcfg.in_channels * vcfg.temporal_patch_size * vcfg.patch_size**2
    pixels = torch.randn(int(grids.prod(-1).sum()), width, dtype=torch.float64)
    with FlopCounterMode(display=False) as counter:
        tower(pixels, grid_thw=grids)
    cost = vision_cost(config)
    assert counter.get_total_flops() == 2 * sum(cost.unit_cost(g) for g in grids.tolist())


def test_qwen2_5_vl_reads_its_full_and_windowed_blocks_and_window():
    model_type, vc = PUBLISHED_TOWERS["Qwen2.5-VL-7B"]
    cost = vision_cost(transformers.AutoConfig.for_model(model_type, vision_config=vc))
    # fullatt_block_indexes [7, 15, 23, 31] of 32; window 112 px // merge 2 // patch 14 = 4
    # merged tokens = 8 patches a side.
    assert (cost.full_blocks, cost.windowed_blocks, cost.window) == (4, 28, 8)
    assert cost.pair == 2 * 1280
    # Patch embed 3*2*14*14 x 1280, 32 gated blocks, a merger of 4 x 1280 -> 5120 -> 3584.
    block = 4 * 1280**2 + 3 * 1280 * 3420
    assert cost.linear_per_patch == 1176 * 1280 + 32 * block + 4 * 1280**2 + 1280 * 3584


def test_published_qwen3_vl_attention_share():
    # The benchmark's timing tower matches this ratio: attention/linear of one frame is
    # pair * depth * p / linear = 2304 * 27 * p / 452947968, 0.141 at 1024 patches.
    model_type, vc = PUBLISHED_TOWERS["Qwen3-VL-8B"]
    cost = vision_cost(transformers.AutoConfig.for_model(model_type, vision_config=vc))
    assert cost.linear_per_patch == 452947968 and cost.pair * cost.full_blocks == 62208
    linear = cost.linear_per_patch * 1024
    assert round((cost.unit_cost((1, 32, 32)) - linear) / linear, 3) == 0.141


def test_unknown_models_and_bad_configs_are_rejected():
    with pytest.raises(ValueError, match="unsupported config model_type 'llama'"):
        vision_cost(transformers.LlamaConfig())
    model_type, vc = PUBLISHED_TOWERS["Qwen2.5-VL-7B"]
    config = transformers.AutoConfig.for_model(
        model_type, vision_config={**vc, "fullatt_block_indexes": [7, 32]}
    )
    with pytest.raises(ValueError, match=r"fullatt_block_indexes \[7, 32\] must lie in"):
        vision_cost(config)
