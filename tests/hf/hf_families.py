"""The families every shared HF test runs on, and the per-family facts those tests need.

Adding a family: put its tiny name in FAMILIES (and, where it differs, in the dicts below).

Float32 islands. Two families compute a part of a float64 model in float32 (docs/hf_internals.md
section 8): GLM-4V resamples its vision position table with a float32 bicubic grid_sample, and
GLM-4.5V's sigmoid router casts its input and weight to float32. A CP run groups the sums in those
parts differently (per rank, per tower call), so their float32 round-off (~1e-7) shows: in the
position table's gradient (GLM-4V), and through the router's backward in every gradient upstream
of an MoE layer (GLM-4.5V). The exactness tests therefore run these families with the same math in
float64 (``float64_islands``: the same functions, computed in the model's dtype, in both runs) and
hold every gradient to 1e-10; the unchanged models are checked at FLOAT32_TOL.
"""

import types

import torch
import torch.nn.functional as F

from cpvlm.integrations.hf import adapter_for, build_model
from cpvlm.verify import gradient_errors

FAMILIES = [
    "qwen2-vl-tiny",
    "qwen2.5-vl-tiny",
    "qwen3-vl-tiny",
    "qwen3-vl-moe-tiny",
    "glm4v-tiny",
    "glm46v-tiny",
    "glm4v-moe-tiny",
    "qwen3.5-tiny",
    "internvl-tiny",
    "llava-onevision-tiny",
    "gemma3-tiny",
    "gemma4-tiny",
]
FAMILY_OF = {
    "qwen2-vl-tiny": "qwen2_vl",
    "qwen2.5-vl-tiny": "qwen2_5_vl",
    "qwen3-vl-tiny": "qwen3_vl",
    "qwen3-vl-moe-tiny": "qwen3_vl_moe",
    "glm4v-tiny": "glm4v",
    "glm46v-tiny": "glm4v",
    "glm4v-moe-tiny": "glm4v_moe",
    "qwen3.5-tiny": "qwen3_5",
    "qwen3.5-moe-tiny": "qwen3_5_moe",
    "internvl-tiny": "internvl",
    "llava-onevision-tiny": "llava_onevision",
    "gemma3-tiny": "gemma3",
    "gemma4-tiny": "gemma4",
}
# Tiling families: tiles or crops of square images through a ViT, 1D RoPE, image tokens only.
TILED = {"internvl-tiny", "llava-onevision-tiny"}
# Parameters the forward never uses (zero gradient): SigLIP's post_layernorm at feature layer -1.
UNUSED = {"llava-onevision-tiny": r"model\.vision_tower\.post_layernorm\."}
# Parameters whose gradient is zero in exact arithmetic and round-off in floats (the adapter's
# ``zero_gradients``: SigLIP's key bias, which softmax cancels): a relative error of round-off means
# nothing, so they are held to the tolerance times the largest gradient of their module group.


def grad_errors(name: str, grads, ref_grads) -> dict[str, float]:
    """``cpvlm verify``'s error of every reference gradient (``cpvlm.verify.gradient_errors``,
    with the adapter's module groups and ``zero_gradients``)."""
    adapter = adapter_for(cached_model(name).config)
    return gradient_errors(grads, ref_grads, adapter.module_groups(), adapter.zero_gradients)


DEEPSTACK = {"qwen3-vl-tiny", "qwen3-vl-moe-tiny"}
GLM = {"glm4v-tiny", "glm46v-tiny", "glm4v-moe-tiny"}
LINEAR_ATTENTION = {"qwen3.5-tiny", "qwen3.5-moe-tiny"}
GEMMA = {"gemma3-tiny", "gemma4-tiny"}  # sliding windows, image spans, their own image inputs
# Parameters whose float64 gradients carry float32 round-off in the unchanged models, and the
# tolerance for them: float32 round-off (6e-8) of sums grouped differently; measured <= 2e-7.
FLOAT32_IN_FLOAT64 = {
    "glm4v-tiny": r"model\.visual\.embeddings\.position_embedding\.",
    "glm46v-tiny": r"model\.visual\.embeddings\.position_embedding\.",
    "glm4v-moe-tiny": r".",  # every gradient upstream of the float32 router
}
FLOAT32_TOL = 1e-6

_models: dict = {}


def cached_model(name: str, dtype: torch.dtype = torch.float64, *, islands: bool = True):
    """One model per (name, dtype) and process; callers that train it deep-copy it. In float64
    the float32 islands are computed in float64 (``float64_islands``) unless ``islands=False``."""
    key = (name, dtype, islands and dtype == torch.float64)
    if key not in _models:
        model = build_model(name, dtype=dtype, seed=0)
        if key[2]:
            float64_islands(model)
        _models[key] = model
    return _models[key]


def float64_islands(model) -> None:
    """GLM-4V's position-table resampling and GLM-4.5V's router, with the same math as
    transformers but in the model's dtype (transformers casts both to float32), and the
    adapter's own islands (Qwen3.5: the delta rule, the decay, RMSNorm)."""
    adapter_for(model).float64_islands(model)
    for module in model.modules():
        kind = type(module).__name__
        if kind.endswith("VisionEmbeddings") and kind.startswith("Glm4v"):
            module.forward = types.MethodType(_position_table_forward, module)
        elif kind == "Glm4vMoeTextTopkRouter":
            module.forward = types.MethodType(_router_forward, module)


def _position_table_forward(self, embeddings, lengths, image_shapes, h_coords, w_coords):
    weight = self.position_embedding.weight
    side = int(weight.shape[0] ** 0.5)
    table = weight.view(side, side, -1).permute(2, 0, 1).unsqueeze(0)
    lengths = torch.as_tensor(lengths, device=weight.device)
    seq_ids = (torch.arange(embeddings.shape[0])[None] >= lengths.cumsum(0)[:, None]).sum(0)
    norm_w = ((w_coords + 0.5) / image_shapes[seq_ids, 2].to(weight.dtype)) * 2 - 1
    norm_h = ((h_coords + 0.5) / image_shapes[seq_ids, 1].to(weight.dtype)) * 2 - 1
    grid = torch.stack((norm_w, norm_h), dim=-1).unsqueeze(0).unsqueeze(2)
    out = F.grid_sample(table, grid, mode="bicubic", align_corners=False, padding_mode="border")
    return embeddings + out.squeeze(0).squeeze(-1).permute(1, 0)


def _router_forward(self, hidden_states):
    hidden_states = hidden_states.view(-1, self.hidden_dim)
    router_logits = F.linear(hidden_states, self.weight)
    scores = router_logits.sigmoid()
    scores_for_choice = scores + self.e_score_correction_bias
    per_group = self.num_experts // self.num_group
    group_scores = scores_for_choice.view(-1, self.num_group, per_group).topk(2, dim=-1)[0].sum(-1)
    group_idx = torch.topk(group_scores, k=self.topk_group, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
    score_mask = (
        group_mask.unsqueeze(-1).expand(-1, self.num_group, per_group).reshape(-1, self.num_experts)
    )
    scores_for_choice = scores_for_choice.masked_fill(~score_mask.bool(), float("-inf"))
    topk_indices = torch.topk(scores_for_choice, k=self.top_k, dim=-1, sorted=False)[1]
    topk_weights = scores.gather(1, topk_indices)
    if self.norm_topk_prob:
        topk_weights = topk_weights / (topk_weights.sum(dim=-1, keepdim=True) + 1e-20)
    return router_logits, topk_weights * self.routed_scaling_factor, topk_indices


def reset_text_attention() -> None:
    for model in _models.values():
        model.set_attn_implementation({"text_config": "sdpa"})


def mixes(name_or_model) -> bool:
    """The model's own forward takes images and videos in one call (GLM-4V's does not)."""
    config = name_or_model.config if hasattr(name_or_model, "config") else None
    if config is None:
        config = cached_model(name_or_model).config
    return adapter_for(config).mixes_images_and_videos
