"""Nemotron 3 Nano Omni (``NemotronH_Omni_Reasoning_V3``): a NemotronH decoder of Mamba-2, attention
and MoE blocks, a RADIO tower with pixel shuffle and an MLP projector beside it, a Parakeet audio
encoder with its own projector; images, audio and text.

Legend: B batch, L local length, D hidden size, w tower width, m = 1 / downsample_ratio, p patch
side, P the tower's prefix tokens (cls + registers) per image; n a clip's valid mel frames, F mel
bins, f(x) the encoder's subsampled length (three rounds of (x - 1) // 2 + 1, i.e. ceil(x / 8)).

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

Audio. ``audio_tower`` is a ``ParakeetEncoder`` (subsampling convolutions by 8, then Conformer
blocks: relative-position attention over the whole clip and a convolution module with
BatchNorm1d), ``embed_audio`` its projector (RMSNorm, Linear, relu^2, Linear); the tower is an FSDP
unit (``modules.audio_tower``), the projector one of its own. The processor writes ``<so_start>``,
f(n + 1) ``<so_embedding>`` (``audio_token_id``), ``<so_end>`` per clip, and its
``input_features`` [clips, T, F] hold n + 1 frames per clip (the extractor's n = L // 160 valid
ones, marked in ``input_features_mask``, and one more, zero), zero-padded to T = the longest
clip's n + 1; ``get_audio_features`` keeps f(n + 1) rows of each clip (the mask's count plus one).
A clip's frames in the core (``audio_features`` [frames, F], ``audio_lengths``) are its n valid
ones: ``from_model_batch`` takes them (and refuses a batch whose masked frames are not zeros, or
whose T is not the longest n + 1: the core could not give the model that batch back),
``to_model_batch`` writes the processor's layout back, and ``audio_rows(n)`` is f(n + 1), the
model's rule. Each clip is a unit of the audio ``EncoderDataParallel``; ``encode_audio`` calls the
model's own ``get_audio_features`` on this rank's clips, laid out as ``to_model_batch`` lays out
the forward batch. Two things make a clip's rows depend on more than its own frames:

- BatchNorm. In train mode ``BatchNorm1d`` normalises by statistics over every clip of the call,
  padding included, so no per-clip encoding equals transformers' batched train-mode forward.
  cpvlm's choice: the audio tower's BatchNorm layers normalise by their running statistics in
  train mode too, and leave them as they are (as fine-tuning with a pretrained audio encoder
  does): ``freeze_audio_batch_norm`` gives each the class ``RunningStatsBatchNorm1d`` (a subclass:
  the same parameters, buffers and state_dict keys). ``install_context_parallel`` applies it on
  the CP side, and the kit to the models of checks (``init_tiny`` for tiny models,
  ``float64_islands`` for float64 checks of any checkpoint), so that the reference is the same
  function. A one-process run that keeps transformers' train-mode BatchNorm computes another one.
- The "+1" row. When n % 8 == 0, f(n + 1) = f(n) + 1: the extra row is outside the encoder's
  subsampled mask, its query fully masked, so it attends uniformly over all f(T) rows of the
  padded clip, padding included: its value depends on the batch's T. Where one of this rank's
  clips has such a row, ``encode_audio`` pads them to the forward batch's longest
  (``batch_lengths``), with the mask of their own n, as the model's batched call does; else to
  their own longest. Valid rows attend to valid rows only, and the convolution module zeroes the
  padded rows before its depthwise convolution, so they do not depend on T. A packed
  document alone (the reference of a packed row) is the model's call on that document's clips: the
  same rows where its clips with n % 8 == 0 share their document with the batch's longest clip.

Cost (``parakeet_audio_cost``): a clip's own frames, as an encoder without padding spends them.
``encode_audio`` pads every clip of its call to its longest, or to the batch's longest where one
has a "+1" row, so a rank's real work is its clip count times that length's; the cost model
balances the clips' own work. A rank without
clips encodes a dummy clip of one frame (``audio_dummy_frames``) and keeps none of its rows.

Not in this step: videos (tubelets of 2 frames through the video patch projection, with Efficient
Video Sampling): ``takes_videos`` is False.

Data path (``NemotronOmniMedia``, ``nemotron_h_omni_media``): images by the image processor's
steps written out in PIL and torch (transformers' class needs torchvision), audio clips through
the checkpoint's ``ParakeetFeatureExtractor`` one clip at a time, the placeholders expanded by
the processor class's own code; the kit's tiny processor writes a checkpoint directory of them.

Precision (``float32_islands``): transformers computes in float32 whatever the model's dtype in
the Mamba-2 scan (``A_log.float()``, x/B/C/dt ``.float()``), its gated norm
``NemotronHRMSNormGated``, ``NemotronHRMSNorm`` (weight times the normalised input in float32: the
weight gradient is summed in float32), the router ``NemotronHTopkRouter`` (logits and sigmoid scores
in float32), the projectors' ``NemotronH_Omni_RMSNorm``, RADIO's position-table interpolation
(``RadioPatchEmbeddings``), Parakeet's relative position table
(``ParakeetEncoderRelPositionalEncoding``: sin and cos in float32) and the logits
(``NemotronHForCausalLM`` returns ``lm_head(h).float()``).
Under CP a float64 model runs the mixer in float64 (``cp_mamba2_mixer``); the checks run
transformers' own code for the rest with its float32 casts kept in float64 (``KeepFloat64``).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHMamba2Mixer
from transformers.models.nemotron_h_omni import NemotronH_Omni_Reasoning_V3_Config

from cpvlm.attention.linear.mamba2 import cp_mamba2_mixer
from cpvlm.encoders.cost import EncoderCost, block_linear_macs
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

from .nemotron_h_omni_media import NemotronOmniMedia, tiny_nemotron_omni_processor

AUDIO_KEYS = ("input_features", "input_features_mask")
"""The model's audio inputs: the clips' mel features [clips, T, F] and their valid frames."""

AUDIO_TOKEN_ID = 506  # <so_embedding>; the tiny vocab's ids beside the vision ones
AUDIO_START_TOKEN_ID = 507  # <so_start>
AUDIO_END_TOKEN_ID = 508  # <so_end>

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


# ---- the audio tower's BatchNorm -----------------------------------------------------------------


class RunningStatsBatchNorm1d(nn.BatchNorm1d):
    """``BatchNorm1d`` that normalises by its running statistics in train mode too and never
    updates them: a function of each row alone (module docstring, "Audio")."""

    def forward(self, x):
        return F.batch_norm(
            x, self.running_mean, self.running_var, self.weight, self.bias, False, 0.0, self.eps
        )


def freeze_audio_batch_norm(model) -> None:
    """Give every ``BatchNorm1d`` of the audio tower (``model.audio_tower``) the class
    ``RunningStatsBatchNorm1d``, in place; idempotent; nothing without an audio tower."""
    tower = getattr(model, "audio_tower", None)
    for module in () if tower is None else tower.modules():
        if type(module) is nn.BatchNorm1d:
            module.__class__ = RunningStatsBatchNorm1d


def subsampled_length(audio_config, frames: int) -> int:
    """Rows of ``frames`` mel frames after Parakeet's subsampling convolutions (the model's
    ``_get_subsampling_output_length``, in integers): ceil(frames / 8) for the real encoder."""
    kernel, stride = audio_config.subsampling_conv_kernel_size, audio_config.subsampling_conv_stride
    add_pad = (kernel - 1) // 2 * 2 - kernel
    for _ in range(int(math.log2(audio_config.subsampling_factor))):
        frames = (frames + add_pad) // stride + 1
    return frames


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
TINY_AUDIO = {
    "hidden_size": 16,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "intermediate_size": 32,
    "num_mel_bins": 16,
    "subsampling_conv_channels": 4,
    "conv_kernel_size": 9,  # the real kernel: a row's convolution reaches 4 rows each way
    "projection_hidden_size": 24,
    "projection_bias": False,
    # no dropout (a check compares two runs), no layer drop (it skips layers at random)
    "dropout": 0.0,
    "dropout_positions": 0.0,
    "layerdrop": 0.0,
    "activation_dropout": 0.0,
    "attention_dropout": 0.0,
}
"""A Parakeet encoder of 2 Conformer blocks of width 16 over 16 mel bins (the real: 24 blocks of
1024 over 128), its subsampling by 8 as the real one's."""


def tiny_nemotron_h_omni_config(**overrides) -> NemotronH_Omni_Reasoning_V3_Config:
    """A Nemotron 3 Nano Omni config small enough for float64 CPU tests: Mamba-2, MoE and
    attention layers ("ME*ME"), a RADIO tower of 2 layers, a Parakeet audio encoder of 2 blocks
    (``audio_config`` overrides merge into it; ``audio_config=None``: no audio tower)."""
    vision, text, top = split_overrides(overrides)
    vision = with_overrides(TINY_VISION, vision)
    audio = top.pop("audio_config", {})
    top = with_overrides(
        {
            "audio_config": None if audio is None else with_overrides(TINY_AUDIO, audio),
            "audio_token_id": AUDIO_TOKEN_ID,
            # <so_start> and <so_end>: the tokenizer's ids, kept in the config for the adapter
            "audio_start_token_id": AUDIO_START_TOKEN_ID,
            "audio_end_token_id": AUDIO_END_TOKEN_ID,
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


def radio_vision_cost(config) -> EncoderCost:
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
    return EncoderCost(linear_per_patch=linear, pair=2 * w, full_blocks=vc.num_hidden_layers)


def parakeet_audio_cost(config) -> EncoderCost:
    """Per clip of n mel frames (grid (1, 1, n)), in 1/64 MAC (costs only rank audio clips against
    each other), with r = n / 8 subsampled rows of width a, C conv channels, M mel bins, I the FFN
    width, k the conv kernel, H the projector width: the subsampling (a 3x3 conv to C channels at
    stride 2, then twice a depthwise 3x3 at stride 2 and a pointwise C x C, then the linear map of
    C M / 8 values per row to a), each block's matrices per row (two FFNs 4 a I, q/k/v/o 4 a^2, the
    relative-position keys of 2r - 1 offsets 2 a^2, the conv module's pointwise maps 3 a^2 and
    depthwise k a) and the projector (a H + H D); attention over the whole clip per block: q.k,
    the weighted sum of v and q against the 2r - 1 relative keys, 4a per pair of rows, i.e.
    4a / 64 per pair of frames. Elementwise work, and the padding of a call to its longest clip
    (module docstring, "Audio"), are left out."""
    ac, d = config.audio_config, config.text_config.hidden_size
    a, c, mel, ffn = (
        ac.hidden_size,
        ac.subsampling_conv_channels,
        ac.num_mel_bins,
        ac.intermediate_size,
    )
    convs = (
        189 * mel * c + 5 * mel * c * c
    )  # 64 x (9C M/4 + 9C M/16 + C^2 M/16 + 9C M/64 + C^2 M/64)
    block = 4 * a * ffn + 9 * a * a + ac.conv_kernel_size * a
    per_row = c * mel // 8 * a + ac.num_hidden_layers * block + a * ac.projection_hidden_size
    per_row += ac.projection_hidden_size * d
    return EncoderCost(
        linear_per_patch=convs + 8 * per_row, pair=4 * a, full_blocks=ac.num_hidden_layers
    )


# ---- published configs ---------------------------------------------------------------------------


PUBLISHED_AUDIO = {
    "hidden_size": 1024,
    "num_hidden_layers": 24,
    "num_attention_heads": 8,
    "intermediate_size": 4096,
    "conv_kernel_size": 9,
    "subsampling_factor": 8,
    "subsampling_conv_channels": 256,
    "subsampling_conv_kernel_size": 3,
    "subsampling_conv_stride": 2,
    "num_mel_bins": 128,
    "projection_hidden_size": 4096,
    "projection_bias": False,
}
"""The checkpoint's ``sound_config`` (Parakeet-TDT-0.6B's encoder, 24 Conformer blocks of 1024
over 128 mel bins, subsampling by 8, and the projector 1024 -> 4096 -> 2688) as public copies of
its config.json give it: a test fixture of the whole config.json in a Swift port (its
``llm_config`` equal to the decoder below), TokenSpeed's ``ParakeetAudioConfig`` defaults and
fairseq2's ``SoundProjection`` docstring agree on every value here. ``projection_bias`` is not
in that copy: False assumed (TokenSpeed's default; NeMo AutoModel's ``SoundProjection`` builds
it without bias by default). ``attention_bias`` and ``scale_input`` are False by
``NemotronH_Omni_Reasoning_V3_Config``'s own defaults for released checkpoints; everything else
(dropout, ``convolution_bias``) is ``ParakeetEncoderConfig``'s default, as the checkpoint gives
none."""


def nemotron_3_nano_omni_config() -> NemotronH_Omni_Reasoning_V3_Config:
    """Nemotron-3-Nano-Omni-30B-A3B-Reasoning, images and text, written out: the decoder as
    Megatron-Bridge's ``Nemotron3NanoProvider`` gives it, ``vit_hidden_size`` 1280 and
    ``projector_hidden_size`` 20480 as a published config.json copy gives them, the tower
    C-RADIOv4-H with ``RadioConfig``'s defaults for the rest. Not yet checked against the
    checkpoint's own config.json (no download here); ``num_nextn_predict_layers`` is left at 0.
    The audio encoder is ``PUBLISHED_AUDIO`` (its sources there), ``audio_token_id`` the
    config.json's ``sound_context_token_id``."""
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
        audio_config=PUBLISHED_AUDIO,
        audio_token_id=27,  # <so_embedding>
        # <so_start> and <so_end>: not in config.json (the tokenizer's; none at hand). Assumed:
        # a plan only needs ids in the vocabulary, apart from the placeholders (docs/plan.md).
        audio_start_token_id=28,
        audio_end_token_id=29,
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
    tiny_processor = tiny_nemotron_omni_processor  # images in PIL and torch (module docstring)
    audio_clips = (75, 48)
    """Valid mel frames: 75 (odd: its last row reads the extractor's zero frame) and 48 (48 % 8 ==
    0: the "+1" row, which sees the padding to the longer clip; module docstring, "Audio")."""

    float32_islands = (
        "NemotronHMamba2Mixer",
        "NemotronHRMSNormGated",
        "NemotronHRMSNorm",
        "NemotronHTopkRouter",
        "NemotronHForCausalLM",
        "NemotronH_Omni_RMSNorm",
        "RadioPatchEmbeddings",
        "ParakeetEncoderRelPositionalEncoding",
    )
    """Where a float64 Nemotron Omni rounds to float32 (the module docstring, "Precision"):
    the Mamba-2 scan and its gated norm, the RMSNorms' weight product, the router's logits and
    scores, the projectors' norm, RADIO's position-table interpolation, Parakeet's relative position
    table, and the float32 logits of ``NemotronHForCausalLM``."""

    def float64_islands(self, model):
        """The float32 islands in float64, and the audio tower's BatchNorm on its running
        statistics, as the CP side has it (module docstring, "Audio")."""
        super().float64_islands(model)
        freeze_audio_batch_norm(model)

    def init_tiny(self, model):
        # The audio tower's matrices at std 1/sqrt(fan in), not transformers' 0.02: at 0.02 the
        # subsampling convolutions shrink the mel features to ~1e-8 and the attention of the tiny
        # blocks is uniform, its q/k gradients round-off. Running statistics away from (0, 1), so
        # that the BatchNorm is no identity; and the BatchNorm the CP side computes (module
        # docstring, "Audio").
        freeze_audio_batch_norm(model)
        tower = getattr(model, "audio_tower", None)
        with torch.no_grad():
            for module in () if tower is None else tower.modules():
                if isinstance(module, (nn.Linear, nn.Conv1d, nn.Conv2d)):
                    fan_in = module.weight[0].numel()
                    module.weight.normal_(0.0, fan_in**-0.5)
                elif isinstance(module, nn.BatchNorm1d):
                    module.running_mean.normal_(0.0, 0.3)
                    module.running_var.uniform_(0.5, 2.0)

    def module_groups(self):
        v, layer = r"vision_model\.", r"language_model\.model\.layers\.\d+\.mixer\."
        return (
            ("vision patch embed", (v + r"embeddings\.",)),
            ("vision blocks", (v + r"encoder\.",)),
            ("vision merger", (r"vision_final_layernorm\.", r"multi_modal_projector\.")),
            ("audio tower", (r"audio_tower\.",)),
            ("audio projector", (r"embed_audio\.",)),
            ("token embeddings", (r"language_model\.model\.embeddings\.",)),
            ("router", (layer + r"gate\.",)),
            ("experts", (layer + r"experts\.",)),
            ("mamba-2", (layer + r"(in_proj|conv1d|dt_bias|A_log|D|norm|out_proj)\b",)),
            ("decoder layers", (r"language_model\.model\.(layers|norm_f)\.",)),
            ("lm head", (r"language_model\.lm_head\.",)),
        )

    def item_tokens(self, kind, grid, text):
        a = self.adapter
        if kind == "audio":  # <so_start> f(n + 1) <so_embedding> <so_end>
            rows = a.audio_rows(grid[2])
            return [a.audio_start_token_id, *[a.audio_token_id] * rows, a.audio_end_token_id]
        if kind != "image":
            raise ValueError("nemotron_h_omni: videos are not supported yet (images and audio)")
        rows = a.item_sizes(grid, kind)[1]
        return [a.image_start_token_id] + [a.image_token_id] * rows + [a.image_end_token_id]


# ---- the adapter ---------------------------------------------------------------------------------


@register
class NemotronHOmniAdapter(VLMAdapter):
    family = "nemotron_h_omni"
    model_classes = ("NemotronH_Omni_Reasoning_V3",)
    model_types = ("nemotron_h_omni",)
    kit = NemotronHOmniKit
    chat_media = NemotronOmniMedia  # the data path's processor hooks
    modules = ModulePaths(
        text_model="language_model.model",
        lm_head="language_model.lm_head",
        vision_tower="vision_model",
        projector=(),
        tower_units=("",),
        extra_units=("multi_modal_projector", "embed_audio"),
        audio_tower="audio_tower",
    )  # no get_rope_index: 1D positions (which the decoder, without rotary, does not read)
    takes_videos = False
    # the processor's grids and audio (from_model_batch makes the core's of them)
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
    def audio_start_token_id(self) -> int | None:
        return getattr(self.config, "audio_start_token_id", None)

    @property
    def audio_end_token_id(self) -> int | None:
        return getattr(self.config, "audio_end_token_id", None)

    @property
    def special_token_ids(self):
        ids = (self.image_token_id, self.image_start_token_id, self.image_end_token_id)
        if self.audio_token_id is not None:
            ids += (self.audio_token_id, self.audio_start_token_id, self.audio_end_token_id)
        return tuple(i for i in ids if i is not None)

    @property
    def pixel_width(self) -> int:
        v = self.config.vision_config
        return v.num_channels * v.patch_size**2

    def from_model_batch(self, batch):
        """The processor's ``image_grid_hw`` [images, 2] as ``image_grid_thw`` (t = 1) (its
        ``pixel_values`` are already pixel rows), its ``input_features`` and
        ``input_features_mask`` as the core's ``audio_features`` and ``audio_lengths``."""
        own_audio = any(batch.get(k) is not None for k in AUDIO_KEYS)
        if batch.get("image_grid_hw") is None and not own_audio:
            return batch
        batch = dict(batch)
        if own_audio:
            batch.update(
                _core_audio(batch.pop("input_features", None), batch.pop(AUDIO_KEYS[1], None))
            )
        hw = batch.pop("image_grid_hw", None)
        if hw is not None and batch.get("image_grid_thw") is None:
            batch["image_grid_thw"] = torch.cat([torch.ones_like(hw[:, :1]), hw], dim=1)
        return batch

    def to_model_batch(self, batch):
        core = ("image_grid_thw", "mm_token_type_ids", "audio_features", "audio_lengths")
        out = {k: v for k, v in batch.items() if k not in core}
        grids = batch.get("image_grid_thw")
        if grids is not None:
            if bool((grids[:, 0] != 1).any()):
                raise ValueError(f"nemotron_h_omni: image grids {grids.tolist()} have t != 1")
            out["image_grid_hw"] = grids[:, 1:]
        if batch.get("audio_features") is not None:
            lengths = torch.as_tensor(batch["audio_lengths"]).tolist()
            out.update(_model_audio(batch["audio_features"], lengths, max(lengths)))
        return out

    # ---- decoder --------------------------------------------------------------------------------

    def install_context_parallel(self, model) -> None:
        for module in self.text_model(model).modules():
            if type(module) is NemotronHMamba2Mixer:
                module.__class__ = ContextParallelNemotronHMamba2Mixer
        freeze_audio_batch_norm(model)  # a clip's rows a function of the clip (docstring, "Audio")

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

    def vision_cost(self) -> EncoderCost:
        return radio_vision_cost(self.config)

    # ---- audio ----------------------------------------------------------------------------------

    @property
    def audio_token_id(self) -> int | None:
        if getattr(self.config, "audio_config", None) is None:
            return None
        return self.config.audio_token_id

    @property
    def audio_feature_width(self) -> int:
        return self.config.audio_config.num_mel_bins

    def audio_rows(self, frames: int) -> int:
        # get_audio_features keeps f(mask.sum + 1) rows (the extractor's extra zero frame)
        return subsampled_length(self.config.audio_config, int(frames) + 1)

    def encode_audio(self, model, features, lengths, batch_lengths):
        """The model's own ``get_audio_features`` (tower and projector) on these clips, padded
        as ``to_model_batch`` pads the forward batch where one of them has a "+1" row, else to
        their own longest (module docstring, "Audio")."""
        lengths = torch.as_tensor(lengths).tolist()
        sub = self.config.audio_config
        plus_one = any(self.audio_rows(n) > subsampled_length(sub, n) for n in lengths)
        longest = max([*lengths, *map(int, batch_lengths)] if plus_one else lengths)
        inputs = _model_audio(features, lengths, longest)
        return model.get_audio_features(**inputs, return_dict=True).pooler_output

    def audio_cost(self) -> EncoderCost:
        return parakeet_audio_cost(self.config)


def _model_audio(features, lengths: list[int], longest: int) -> dict:
    """The core's clips (``features`` [frames, F], n = ``lengths`` each) as the processor lays them
    out: ``input_features`` [clips, longest + 1, F], each clip's n frames then zeros, and
    ``input_features_mask`` [clips, longest + 1] marking the n."""
    padded = features.new_zeros(len(lengths), longest + 1, features.shape[-1])
    mask = torch.zeros(len(lengths), longest + 1, dtype=torch.bool, device=features.device)
    for i, clip in enumerate(torch.split(features, lengths)):
        padded[i, : len(clip)] = clip
        mask[i, : len(clip)] = True
    return {"input_features": padded, "input_features_mask": mask}


def _core_audio(features, mask) -> dict:
    """The processor's ``input_features`` [clips, T, F] and ``input_features_mask`` [clips, T]
    as the core's ``audio_features`` (each clip's n valid frames, in order) and ``audio_lengths``
    (``_model_audio``'s inverse); refuses what ``_model_audio`` would not give back."""
    if features is None or mask is None or features.dim() != 3 or mask.shape != features.shape[:2]:
        raise ValueError(
            "nemotron_h_omni: audio needs input_features [clips, frames, mel bins] with its "
            "input_features_mask [clips, frames] (the processor's output)"
        )
    lengths = mask.long().sum(1)
    prefix = torch.arange(mask.shape[1], device=mask.device) < lengths[:, None]
    if not torch.equal(mask.bool(), prefix) or features.shape[1] != int(lengths.max()) + 1:
        raise ValueError(
            f"nemotron_h_omni: input_features_mask must mark each clip's first n frames and "
            f"input_features hold the longest n + 1 frames (the Parakeet extractor's layout); got "
            f"{features.shape[1]} frames for valid lengths {lengths.tolist()}"
        )
    if bool(features[~prefix].any()):
        raise ValueError(
            "nemotron_h_omni: input_features beyond each clip's valid frames must be 0 (the "
            "extractor's); the encoder reads them, and the core keeps only the valid frames"
        )
    return {"audio_features": features[prefix], "audio_lengths": lengths}
