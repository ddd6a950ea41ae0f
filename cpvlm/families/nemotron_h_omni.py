"""Nemotron 3 Nano Omni (``NemotronH_Omni_Reasoning_V3``): a NemotronH decoder of Mamba-2, attention
and MoE blocks, a RADIO tower with pixel shuffle and an MLP projector beside it; images and text.

Legend: B batch, L local length, D hidden size, w tower width, m = 1 / downsample_ratio, p patch
side, P the tower's prefix tokens (cls + registers) per image.

The model is not a ``*ForConditionalGeneration`` with a ``.model``: its ``language_model`` is a
``NemotronHForCausalLM`` (decoder ``language_model.model``, head ``language_model.lm_head``), its
tower is ``vision_model`` (a ``RadioModel``), and ``vision_final_layernorm`` (checkpoints whose
decoder has MTP layers) and ``multi_modal_projector`` sit beside it (``ModulePaths``).

Decoder. ``config.text_config.layers_block_type`` lists each layer's mixer: ``linear_attention``
(Mamba-2, "M"), ``full_attention`` ("*", no rotary embedding at all: positions come from the Mamba
layers), ``moe`` ("E") and ``mlp`` ("-"). Attention goes through transformers' AttentionInterface
as in every family. The Mamba-2 mixer (a causal conv over x|B|C, then the SSD scan, whose state runs
from a document's first token to its last) is neither; ``install_context_parallel`` gives each
``NemotronHMamba2Mixer`` the class ``ContextParallelNemotronHMamba2Mixer`` (a subclass, as FSDP2's
``fully_shard`` does: the same module, parameters and state_dict keys), whose forward with the
``cpvlm_cp`` keyword is ``cpvlm.attention.linear.cp_mamba2_mixer`` (conv halo exchange, SSD state
passing, both restarting at every document start of the plan, 0 at padding) and without it is
transformers' own. The MoE blocks are per token. NemotronH computes no router load-balancing loss
(``NemotronHForCausalLM`` returns the router logits and adds nothing to the loss), so the adapter
declares none.

Vision. The processor writes ``<img>``, h*w/m**2 ``<image>`` tokens, ``</img>`` per image, and its
``pixel_values`` are already cpvlm's pixel rows (``[patches, C*p*p]``, row-major patches) with
``image_grid_hw`` [images, 2]: ``from_model_batch`` / ``to_model_batch`` only turn the grids into
``image_grid_thw`` (t = 1) and back. An image is one vision unit: RADIO attends within the image
(with its P prefix tokens) and pixel shuffle acts on the whole image's grid, so ``encode`` calls
the model's own ``get_image_features`` (tower, final norm, pixel shuffle, projector) on the unit's
rows. Positions are 1D (no ``get_rope_index``); the decoder ignores them anyway. The tower is the
FSDP unit ``vision_model`` and the projector one of its own; ``vision_final_layernorm`` stays with
the root (and trainable under ``freeze_vision_encoder``, like the projector).

Not in this step: videos (tubelets of 2 frames through the video patch projection, with
Efficient Video Sampling) and audio (the Parakeet encoder): ``takes_videos`` is False, and a batch
with audio inputs, or a model with an audio tower given audio, raises a ValueError naming the
limitation. The data path has no ``chat_media`` for this family yet: transformers' image processor
for it needs torchvision (``TorchvisionBackend``), which cpvlm's data path does not require; the kit
declares no tiny processor.

Precision (``float32_islands``): transformers computes in float32 whatever the model's dtype in
the Mamba-2 scan (``A_log.float()``, x/B/C/dt ``.float()``), its gated norm
``NemotronHRMSNormGated``, ``NemotronHRMSNorm`` (weight times the normalised input in float32: the
weight gradient is summed in float32), the router ``NemotronHTopkRouter`` (logits and sigmoid scores
in float32), the projector's ``NemotronH_Omni_RMSNorm``, RADIO's position-table interpolation
(``RadioPatchEmbeddings``) and the logits (``NemotronHForCausalLM`` returns ``lm_head(h).float()``).
Under CP a float64 model runs the mixer in float64 (``cp_mamba2_mixer``); the checks run
transformers' own code for the rest with its float32 casts kept in float64 (``KeepFloat64``).
"""

from __future__ import annotations

import torch
from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHMamba2Mixer
from transformers.models.nemotron_h_omni import NemotronH_Omni_Reasoning_V3_Config

from cpvlm.attention.linear.mamba2 import cp_mamba2_mixer
from cpvlm.hf.adapter import ModulePaths, VLMAdapter
from cpvlm.hf.kit import FamilyKit
from cpvlm.hf.registration import register
from cpvlm.hf.tiny import (
    IMAGE_TOKEN_ID,
    TEXT,
    VISION,
    VISION_END_TOKEN_ID,
    VISION_START_TOKEN_ID,
    split_overrides,
    with_overrides,
)
from cpvlm.vision.cost import VisionCost, block_linear_macs

AUDIO_KEYS = ("input_features", "input_features_mask")
"""The model's audio inputs (mel features of the Parakeet encoder), refused in this step."""

# ---- the CP Mamba-2 layer ------------------------------------------------------------------------


class ContextParallelNemotronHMamba2Mixer(NemotronHMamba2Mixer):
    """``NemotronHMamba2Mixer`` on a CP shard with ``cpvlm_cp``; transformers' own without it."""

    def forward(self, hidden_states, cache=None, attention_mask=None, cpvlm_cp=None, **kwargs):
        if cpvlm_cp is None:
            return super().forward(
                hidden_states, cache=cache, attention_mask=attention_mask, **kwargs
            )
        if cache is not None:
            raise ValueError(
                "Nemotron-H Mamba-2 layers under context parallelism keep no cache: pass "
                "use_cache=False"
            )
        # The plan's documents and padding replace attention_mask (ContextParallelVLM passes
        # None): the CP mixer restarts its conv and state at every document start, 0 at padding.
        return cp_mamba2_mixer(self, hidden_states, plan=cpvlm_cp.plan, group=cpvlm_cp.group)


# ---- tiny config ---------------------------------------------------------------------------------

TINY_LAYERS = ["linear_attention", "moe", "full_attention", "linear_attention", "moe"]
""""ME*ME": Mamba-2 layers before and after the attention layer, two MoE layers (the real
checkpoint interleaves the same three kinds, mostly M and E, with a few *)."""

TINY_TEXT = {
    **{k: TEXT[k] for k in ("vocab_size", "hidden_size", "intermediate_size")},
    **{k: TEXT[k] for k in ("num_attention_heads", "num_key_value_heads")},
    "max_position_embeddings": TEXT["max_position_embeddings"],
    "layers_block_type": TINY_LAYERS,
    "head_dim": 16,
    # Mamba-2: 4 heads of 8 in 2 groups (the real 64 heads of 64 in 8 groups), a state of 8, the
    # real conv kernel of 4, kernel chunks of 8 rows (the real 128) so that documents span several
    "mamba_num_heads": 4,
    "mamba_head_dim": 8,
    "n_groups": 2,
    "ssm_state_size": 8,
    "conv_kernel": 4,
    "chunk_size": 8,
    # MoE: 4 routed experts, top 2, a shared expert (the real: 128, top 6, one shared)
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "moe_shared_expert_intermediate_size": 32,
    # MTP layers (not built by transformers) make the model build vision_final_layernorm
    "num_nextn_predict_layers": 1,
}
TINY_VISION = {
    "hidden_size": VISION["hidden_size"],
    "num_hidden_layers": VISION["depth"],
    "num_attention_heads": VISION["num_heads"],
    "mlp_ratio": 2.0,
    "patch_size": VISION["patch_size"],
    "max_img_size": 128,  # a 16 x 16 position table
    "num_cls_tokens": 2,
    "num_registers": 2,
    "video_temporal_patch_size": 2,
}


def tiny_nemotron_h_omni_config(**overrides) -> NemotronH_Omni_Reasoning_V3_Config:
    """A Nemotron 3 Nano Omni config small enough for float64 CPU tests: Mamba-2, MoE and
    attention layers ("ME*ME"), a RADIO tower of 2 layers, no audio tower."""
    vision, text, top = split_overrides(overrides)
    vision = with_overrides(TINY_VISION, vision)
    top = with_overrides(
        {
            "audio_config": None,
            "vision_hidden_size": vision["hidden_size"],
            "projector_hidden_size": 48,
            "downsample_ratio": 0.5,
            "image_token_id": IMAGE_TOKEN_ID,
            # <img> and </img>: the tokenizer's ids, kept in the config for the adapter
            "image_start_token_id": VISION_START_TOKEN_ID,
            "image_end_token_id": VISION_END_TOKEN_ID,
            "attn_implementation": "sdpa",
        },
        top,
    )
    return NemotronH_Omni_Reasoning_V3_Config(
        text_config=with_overrides(TINY_TEXT, text), vision_config=vision, **top
    )


# ---- the vision cost model -----------------------------------------------------------------------


def radio_vision_cost(config) -> VisionCost:
    """Per patch: the patch projection (C p^2 w), each block's matrices (4 w^2 and the MLP:
    fc1/fc2 of w * mlp_ratio, or SwiGLU's three), the projector on pixel-shuffled tokens (m^2 w
    -> H -> D per token, i.e. w H + H D / m^2 per patch); full attention within the image. The P
    prefix tokens per image (cls and registers: P/(h*w) of the linear work, 2P/(h*w) of the
    attention) are left out."""
    vc, d = config.vision_config, config.text_config.hidden_size
    w, m, h = vc.hidden_size, round(1 / config.downsample_ratio), config.projector_hidden_size
    mlp = int(w * vc.mlp_ratio)
    if vc.use_swiglu_ffn:
        mlp = (int(mlp * 2 / 3) + 7) // 8 * 8
    blocks = vc.num_hidden_layers * block_linear_macs(w, mlp, gated=vc.use_swiglu_ffn)
    linear = vc.patch_dim * w + blocks + w * h + h * d // (m * m)
    return VisionCost(linear_per_patch=linear, pair=2 * w, full_blocks=vc.num_hidden_layers)


# ---- published configs ---------------------------------------------------------------------------


def nemotron_3_nano_omni_config() -> NemotronH_Omni_Reasoning_V3_Config:
    """Nemotron-3-Nano-Omni-30B-A3B-Reasoning, images and text, written out: the decoder as
    Megatron-Bridge's ``Nemotron3NanoProvider`` gives it, ``vit_hidden_size`` 1280 and
    ``projector_hidden_size`` 20480 as a published config.json copy gives them, the tower
    C-RADIOv4-H with ``RadioConfig``'s defaults for the rest. Not yet checked against the
    checkpoint's own config.json (no download here); ``num_nextn_predict_layers`` is left at 0.
    Its Parakeet audio encoder is left out (no audio in this step)."""
    pattern = "MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME"
    kinds = {"M": "linear_attention", "E": "moe", "*": "full_attention"}
    return NemotronH_Omni_Reasoning_V3_Config(
        text_config={
            "vocab_size": 131072,
            "hidden_size": 2688,
            "layers_block_type": [kinds[c] for c in pattern],
            "max_position_embeddings": 262144,
            "num_attention_heads": 32,
            "num_key_value_heads": 2,
            "head_dim": 128,
            "layer_norm_epsilon": 1e-5,
            "mamba_num_heads": 64,
            "mamba_head_dim": 64,
            "ssm_state_size": 128,
            "n_groups": 8,
            "conv_kernel": 4,
            "n_routed_experts": 128,
            "n_shared_experts": 1,
            "num_experts_per_tok": 6,
            "moe_intermediate_size": 1856,
            "moe_shared_expert_intermediate_size": 3712,
            "routed_scaling_factor": 2.5,
            "norm_topk_prob": True,
            "n_group": 1,
            "topk_group": 1,
        },
        vision_config={
            "hidden_size": 1280,
            "num_hidden_layers": 32,
            "num_attention_heads": 16,
            "mlp_ratio": 4.0,
            "patch_size": 16,
            "num_cls_tokens": 3,
            "num_registers": 7,
            "video_temporal_patch_size": 2,
        },
        audio_config=None,
        vision_hidden_size=1280,
        projector_hidden_size=20480,
        downsample_ratio=0.5,
        image_token_id=18,
        video_token_id=131081,
        image_start_token_id=21,
        image_end_token_id=22,
    )


# ---- the kit -------------------------------------------------------------------------------------


class NemotronHOmniKit(FamilyKit):
    tiny_configs = {"nemotron-omni-tiny": tiny_nemotron_h_omni_config}
    published_configs = {"nemotron-3-nano-omni-30b-a3b": nemotron_3_nano_omni_config}
    traits = frozenset({"linear_attention", "own_layout"})
    float64_load_kwargs = {"experts_implementation": "eager"}  # grouped_mm rejects float64
    # The video patch projection: images never use it (videos are not in this step).
    unused_parameters = r"vision_model\.embeddings\.video_patch_projection\."
    mixes_images_and_videos = False
    # RADIO's key bias adds q.b to every logit of a query, which softmax cancels
    zero_gradients = (r"vision_model\.encoder\.layer\.\d+\.attention\.k_proj\.bias",)
    tiny_processor = None  # the image processor needs torchvision (module docstring)

    float32_islands = (
        "NemotronHMamba2Mixer",
        "NemotronHRMSNormGated",
        "NemotronHRMSNorm",
        "NemotronHTopkRouter",
        "NemotronHForCausalLM",
        "NemotronH_Omni_RMSNorm",
        "RadioPatchEmbeddings",
    )
    """Where a float64 Nemotron Omni rounds to float32 (the module docstring, "Precision"):
    the Mamba-2 scan and its gated norm, the RMSNorms' weight product, the router's logits and
    scores, the projector's norm, RADIO's position-table interpolation, and the float32 logits of
    ``NemotronHForCausalLM``."""

    def module_groups(self):
        v, layer = r"vision_model\.", r"language_model\.model\.layers\.\d+\.mixer\."
        return (
            ("vision patch embed", (v + r"embeddings\.",)),
            ("vision blocks", (v + r"encoder\.",)),
            ("vision merger", (r"vision_final_layernorm\.", r"multi_modal_projector\.")),
            ("token embeddings", (r"language_model\.model\.embeddings\.",)),
            ("router", (layer + r"gate\.",)),
            ("experts", (layer + r"experts\.",)),
            ("mamba-2", (layer + r"(in_proj|conv1d|dt_bias|A_log|D|norm|out_proj)\b",)),
            ("decoder layers", (r"language_model\.model\.(layers|norm_f)\.",)),
            ("lm head", (r"language_model\.lm_head\.",)),
        )

    def item_tokens(self, kind, grid, text):
        if kind != "image":
            raise ValueError("nemotron_h_omni: videos are not supported yet (images and text)")
        a = self.adapter
        rows = a.item_sizes(grid, kind)[1]
        return [a.image_start_token_id] + [a.image_token_id] * rows + [a.image_end_token_id]


# ---- the adapter ---------------------------------------------------------------------------------


@register
class NemotronHOmniAdapter(VLMAdapter):
    family = "nemotron_h_omni"
    model_classes = ("NemotronH_Omni_Reasoning_V3",)
    model_types = ("nemotron_h_omni",)
    kit = NemotronHOmniKit
    modules = ModulePaths(
        text_model="language_model.model",
        lm_head="language_model.lm_head",
        vision_tower="vision_model",
        projector=(),
        tower_units=("",),
        extra_units=("multi_modal_projector",),
    )  # no get_rope_index: 1D positions (which the decoder, without rotary, does not read)
    takes_videos = False
    # image_grid_hw: the processor's grids; the audio keys are accepted to be refused by name
    model_batch_keys = ("image_grid_hw", *AUDIO_KEYS)

    def __init__(self, config):
        self.config = config
        m = 1 / config.downsample_ratio
        if abs(m - round(m)) > 1e-9:
            raise ValueError(
                f"nemotron_h_omni: downsample_ratio {config.downsample_ratio} is not 1/integer; "
                "pixel shuffle then has no whole merge size"
            )
        self.merge_size = round(m)

    # ---- tokens ---------------------------------------------------------------------------------

    @property
    def video_token_id(self) -> int:
        return -1  # videos (written with image tokens) are not in this step

    @property
    def image_start_token_id(self) -> int | None:
        return getattr(self.config, "image_start_token_id", None)

    @property
    def image_end_token_id(self) -> int | None:
        return getattr(self.config, "image_end_token_id", None)

    @property
    def special_token_ids(self):
        ids = (self.image_token_id, self.image_start_token_id, self.image_end_token_id)
        return tuple(i for i in ids if i is not None)

    @property
    def pixel_width(self) -> int:
        v = self.config.vision_config
        return v.num_channels * v.patch_size**2

    def mm_token_type_ids(self, input_ids, attention_mask=None):
        types = (input_ids == self.image_token_id).long()
        return types if attention_mask is None else types * attention_mask.bool()

    def from_model_batch(self, batch):
        """The processor's ``image_grid_hw`` [images, 2] as ``image_grid_thw`` (t = 1); its
        ``pixel_values`` are already pixel rows. Audio inputs are refused."""
        _refuse_audio(batch)
        if batch.get("image_grid_hw") is None:
            return batch
        batch = dict(batch)
        hw = batch.pop("image_grid_hw")
        if batch.get("image_grid_thw") is None:
            batch["image_grid_thw"] = torch.cat([torch.ones_like(hw[:, :1]), hw], dim=1)
        return batch

    def to_model_batch(self, batch):
        _refuse_audio(batch)
        out = {k: v for k, v in batch.items() if k not in ("image_grid_thw", "mm_token_type_ids")}
        grids = batch.get("image_grid_thw")
        if grids is not None:
            if bool((grids[:, 0] != 1).any()):
                raise ValueError(f"nemotron_h_omni: image grids {grids.tolist()} have t != 1")
            out["image_grid_hw"] = grids[:, 1:]
        return out

    # ---- decoder --------------------------------------------------------------------------------

    def install_context_parallel(self, model) -> None:
        for module in self.text_model(model).modules():
            if type(module) is NemotronHMamba2Mixer:
                module.__class__ = ContextParallelNemotronHMamba2Mixer

    # ---- vision ---------------------------------------------------------------------------------

    def encode(self, model, pixel_values, grid_thw, kinds=None):
        # The model's own get_image_features: RADIO on the packed images (each attends within
        # itself), the final norm, pixel shuffle per image, the projector.
        if kinds is not None and any(k != "image" for k in kinds):
            raise ValueError("nemotron_h_omni: videos are not supported yet (images and text)")
        out = model.get_image_features(
            pixel_values=pixel_values, image_grid_hw=grid_thw[:, 1:], return_dict=True
        )
        return torch.cat(out.pooler_output)

    def vision_cost(self) -> VisionCost:
        return radio_vision_cost(self.config)


def _refuse_audio(batch) -> None:
    given = [k for k in AUDIO_KEYS if batch.get(k) is not None]
    if given:
        raise ValueError(
            f"nemotron_h_omni: audio inputs ({', '.join(given)}) are not supported yet: cpvlm "
            "trains this family on images and text (the Parakeet audio encoder comes later)"
        )
