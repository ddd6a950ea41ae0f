"""The cost models of the transformers vision towers, read from their configs.

Every coefficient is a matrix product of the tower's forward pass, in MACs per patch (linear) or
per attended pair (attention), with the widths the tower's modules are built from; see
``cpvlm.vision.cost`` for the model. tests/vision/test_vision_cost_hf.py counts the MACs of each
real tower (torch's FLOP counter, tiny configs) and checks that these formulas give exactly that.

Per tower (w width, I MLP width, m merge size, P = channels * temporal patch * patch**2 values
per patch, o output width; a merger of m*m patches costs (m^2 w)^2 + m^2 w o per merged token,
i.e. m^2 w^2 + w o per patch):
- Qwen2-VL: P w embedding; blocks 4 w^2 + 2 w I (I = embed_dim * mlp_ratio, fc1/fc2); one
  merger; every block attends the whole frame. The config's ``hidden_size`` is o, ``embed_dim``
  is w.
- Qwen2.5-VL: blocks 4 w^2 + 3 w I (gated MLP); one merger; the blocks in
  ``fullatt_block_indexes`` attend the whole frame, the others windows of
  (window_size // m // patch_size) merged tokens a side, i.e. that times m patches.
- Qwen3-VL, Qwen3-VL-MoE: blocks 4 w^2 + 2 w I; one merger plus one per deepstack index;
  full attention everywhere. Qwen3.5 (dense and MoE): the same tower without deepstack.
- GLM-4V (glm4v, glm4v_moe, glm46v): blocks 4 w^2 + 3 w o (the block MLP is gated with width
  ``out_hidden_size``); a 2-d convolution of m x m patches to o (w o per patch) and a merger
  o^2 + 3 o I per merged token; full attention everywhere.
"""

from __future__ import annotations

from math import prod

from cpvlm.vision.cost import VisionCost, block_linear_macs


def _values_per_patch(vc) -> int:
    patch = vc.patch_size if isinstance(vc.patch_size, (list, tuple)) else [vc.patch_size] * 2
    temporal = vc.temporal_patch_size
    temporal = prod(temporal) if isinstance(temporal, (list, tuple)) else temporal
    return vc.in_channels * temporal * prod(patch)


def _qwen_merger(width: int, merge: int, out: int) -> int:
    return merge * merge * width * width + width * out


def qwen2_vl_vision_cost(vc) -> VisionCost:
    w, m = vc.embed_dim, vc.spatial_merge_size
    linear = (
        _values_per_patch(vc) * w
        + vc.depth * block_linear_macs(w, int(w * vc.mlp_ratio), gated=False)
        + _qwen_merger(w, m, vc.hidden_size)
    )
    return VisionCost(linear_per_patch=linear, pair=2 * w, full_blocks=vc.depth)


def qwen2_5_vl_vision_cost(vc) -> VisionCost:
    w, m = vc.hidden_size, vc.spatial_merge_size
    full = sorted(set(vc.fullatt_block_indexes))
    if any(not 0 <= i < vc.depth for i in full):
        raise ValueError(
            f"vision_config.fullatt_block_indexes {full} must lie in [0, depth={vc.depth})"
        )
    linear = (
        _values_per_patch(vc) * w
        + vc.depth * block_linear_macs(w, vc.intermediate_size, gated=True)
        + _qwen_merger(w, m, vc.out_hidden_size)
    )
    windowed = vc.depth - len(full)
    window = vc.window_size // m // vc.patch_size * m
    if windowed and window < 1:
        raise ValueError(
            f"vision_config.window_size {vc.window_size} is smaller than one merged token "
            f"(spatial_merge_size {m} x patch_size {vc.patch_size}) but {windowed} blocks are windowed"
        )
    return VisionCost(
        linear_per_patch=linear,
        pair=2 * w,
        full_blocks=len(full),
        windowed_blocks=windowed,
        window=window if windowed else 0,
    )


def qwen3_vl_vision_cost(vc) -> VisionCost:
    w, m = vc.hidden_size, vc.spatial_merge_size
    mergers = 1 + len(getattr(vc, "deepstack_visual_indexes", None) or ())
    linear = (
        _values_per_patch(vc) * w
        + vc.depth * block_linear_macs(w, vc.intermediate_size, gated=False)
        + mergers * _qwen_merger(w, m, vc.out_hidden_size)
    )
    return VisionCost(linear_per_patch=linear, pair=2 * w, full_blocks=vc.depth)


def glm4v_vision_cost(vc) -> VisionCost:
    w, m, o = vc.hidden_size, vc.spatial_merge_size, vc.out_hidden_size
    merger_per_token = o * o + 3 * o * vc.intermediate_size
    if merger_per_token % (m * m):
        raise ValueError(
            f"GLM-4V merger MACs {merger_per_token} are not divisible by m^2 = {m * m}"
        )
    linear = (
        _values_per_patch(vc) * w
        + vc.depth * block_linear_macs(w, o, gated=True)
        + w * o
        + merger_per_token // (m * m)
    )
    return VisionCost(linear_per_patch=linear, pair=2 * w, full_blocks=vc.depth)


VISION_COSTS = {
    "qwen2_vl": qwen2_vl_vision_cost,
    "qwen2_5_vl": qwen2_5_vl_vision_cost,
    "qwen3_vl": qwen3_vl_vision_cost,
    "qwen3_vl_moe": qwen3_vl_vision_cost,
    "qwen3_5": qwen3_vl_vision_cost,
    "qwen3_5_moe": qwen3_vl_vision_cost,
    "glm4v": glm4v_vision_cost,
    "glm4v_moe": glm4v_vision_cost,
    "glm46v": glm4v_vision_cost,
}
"""Top-level ``model_type`` -> the function that reads its ``vision_config``."""


def vision_cost(model_or_config) -> VisionCost:
    """The vision tower's cost model for a transformers VLM or its (top-level) config."""
    config = getattr(model_or_config, "config", model_or_config)
    model_type = getattr(config, "model_type", None)
    if model_type not in VISION_COSTS:
        raise ValueError(
            f"no vision cost model for model_type {model_type!r}; known: {sorted(VISION_COSTS)}"
        )
    return VISION_COSTS[model_type](config.vision_config)
