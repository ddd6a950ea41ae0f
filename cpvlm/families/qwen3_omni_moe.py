"""Qwen3-Omni-MoE's thinker (``Qwen3OmniMoeThinkerForConditionalGeneration``): an audio encoder,
Qwen3-VL's vision tower with deepstack, and a sparse MoE decoder with M-RoPE; images, videos and
text and audio.

Legend: B batch, S length, m spatial merge size, D text width.

Layout. The thinker is Qwen3-VL-MoE's layout with an audio tower beside the vision tower:
``model.language_model`` (the decoder, layers ``layers``), ``model.visual`` (the tower, its final
``merger`` and one deepstack merger per ``vision_config.deepstack_visual_indexes`` in
``merger_list``), ``model.audio_tower`` and ``lm_head``; ``model.get_rope_index`` gives the M-RoPE
positions. So the default ``ModulePaths`` hold but for the projector prefixes (``merger``,
``merger_list``), and the adapter reuses Qwen3-VL's tower cost, ``encode`` (rows and deepstack
levels), ``vision="split"`` inputs and deepstack decoder inputs by inheritance.

Tokens. Each image is ``<vision_start> pads <vision_end>`` (the base layout), and so is each video,
whole: unlike Qwen3-VL the processor writes no timestamp between frames; a video's temporal
positions are ``t * second_per_grid * position_id_per_seconds`` (Qwen2.5-VL's rule, with the
config's ``position_id_per_seconds``). The processor's per-video seconds are
``video_second_per_grid`` (the forward's keyword); the core's key is ``second_per_grid_ts``
(``from_model_batch`` / ``to_model_batch`` rename it). Audio is ``<audio_start> pads
<audio_end>``; those ids are special tokens too (never drawn as text).

Positions. ``get_rope_index`` here takes ``(input_ids, image_grid_thw, video_grid_thw,
attention_mask, use_audio_in_video, audio_seqlens, second_per_grids)``: no
``mm_token_type_ids``, the seconds under another name, and an ``attention_mask`` it indexes (None
fails); ``rope_index_kwargs`` adapts the core's call (drops the token types, renames the seconds,
gives an all-ones mask where the core has none). Its positions are float32 (as the model's own);
the thinker's forward likewise computes no M-RoPE positions without an attention mask, so
``to_model_batch`` gives it an all-ones one.

Audio. Each clip is ``<audio_start> pads <audio_end>``, its pads the rows of the audio encoder
(``model.audio_tower``: three stride-2 convolutions over chunks of ``2 * n_window`` mel frames,
then blocks attending within windows of ``n_window_infer`` frames of the clip, then the
projection to the text width), ``audio_rows`` by the model's own
``_get_feat_extract_output_lengths``. A clip's rows depend on that clip alone, so each clip is a
unit of the audio ``EncoderDataParallel``: encoded once, on one rank, by ``encode_audio``, which
calls the tower as ``get_audio_features`` does (the mel frames of the clips one after another,
``[F, frames]``, with ``feature_lens``). The tower pads every chunk to the longest chunk of
the clips it is called with, and its convolution biases carry that padding into the last rows of
a shorter chunk: ``encode_audio`` pads this rank's chunks to the forward batch's longest chunk
(``batch_lengths``), through the tower's own ``padded_feature`` / ``chunk_lengths`` inputs, so
each clip's rows are those of the model's call on the whole batch (a packed document alone is
the same where its clips have the batch's longest chunk: a clip of ``2 * n_window`` frames or
more, 1 s of audio). The processor's ``input_features`` [clips, F, T] with
``feature_attention_mask`` [clips, T] are the core's ``audio_features`` [frames, F] (the valid
frames, as ``get_audio_features`` takes them) and ``audio_lengths``; ``from_model_batch`` /
``to_model_batch`` convert. ``get_rope_index`` takes the clips' frames as ``audio_seqlens``;
an audio clip inside a video (``use_audio_in_video``) is not supported.

Data path (``OmniMedia``): images and videos as Qwen2.5-VL's processor lays them out (no
timestamps between video frames; seconds per temporal patch ``tp / fps``), audio clips decoded
to mono at the feature extractor's rate (``cpvlm.data.audio``), each clip's feature frames from
the checkpoint's ``WhisperFeatureExtractor`` on the clip alone (its valid frames), the
placeholder expanded by the processor's own ``replace_audio_token`` (``<audio_start> pads
<audio_end>``, pads by the processor's ``_get_feat_extract_output_lengths``). The processor
class is ``Qwen3OmniMoeProcessor`` around the PIL image processor, a video processor stand-in and
the feature extractor (its video processor needs torchvision); the tiny checkpoint writes them
all (``tiny_omni_processor``).

Precision (``float32_islands``): the router ``Qwen3OmniMoeThinkerTextTopKRouter`` takes its
softmax in float32 whatever the model's dtype; the checks compute it in float64. The MoE experts'
default ``grouped_mm`` rejects float64, so float64 models load with eager experts (``MoeKit``);
the router load-balancing loss is cpvlm's, exact under CP (``MoeRouter``).
"""

from __future__ import annotations

from functools import partial

import torch
from transformers import Qwen3OmniMoeThinkerConfig

from cpvlm.data.audio import load_audio
from cpvlm.data.errors import DataError
from cpvlm.data.sample import AudioItem
from cpvlm.encoders.cost import EncoderCost, block_linear_macs
from cpvlm.hf.adapter import ModulePaths, MoeRouter
from cpvlm.hf.chat_media import clip_features
from cpvlm.hf.kit import FamilyKit, MoeKit, TinyProcessor
from cpvlm.hf.registration import register
from cpvlm.hf.tiny import VISION_TOKEN_IDS, split_overrides, with_overrides

from .qwen2_vl import _TEMPLATE, SPECIAL_TOKENS, QwenVLMedia, _config_ids, _image_processor
from .qwen3_vl import TINY_TEXT, Qwen3VLAdapter, Qwen3VLKit, tiny_vision

AUDIO_TOKEN_ID = 506
AUDIO_START_TOKEN_ID = 507
AUDIO_END_TOKEN_ID = 508

AUDIO_KEYS = ("input_features", "feature_attention_mask")
"""The thinker's audio inputs (padded mel features of its clips and their frame mask)."""

SECONDS_KEY = "video_second_per_grid"
"""The processor's and the forward's per-video seconds (the core's ``second_per_grid_ts``)."""

# ---- tiny config ---------------------------------------------------------------------------------

TINY_AUDIO = {
    "num_mel_bins": 16,
    "encoder_layers": 1,
    "encoder_attention_heads": 2,
    "encoder_ffn_dim": 32,
    "d_model": 16,
    "output_dim": TINY_TEXT["hidden_size"],
    "downsample_hidden_size": 8,
    "max_source_positions": 64,
}
"""A one-layer audio encoder (chunks of 2 * 50 frames, attention windows of 800 frames)."""


def tiny_qwen3_omni_moe_config(**overrides) -> Qwen3OmniMoeThinkerConfig:
    """A Qwen3-Omni-MoE thinker config small enough for float64 CPU tests: Qwen3-VL-MoE's tiny
    decoder (4 experts, top 2, both layers sparse, the router loss on), Qwen3-VL's tiny tower
    (deepstack at the first and last block), a one-layer audio encoder. ``audio_config``
    overrides merge into the tiny one."""
    vision, text, top = split_overrides(overrides)
    audio = with_overrides(TINY_AUDIO, top.pop("audio_config", None))
    text = with_overrides(
        {
            **TINY_TEXT,
            "moe_intermediate_size": 32,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "decoder_sparse_step": 1,
            "output_router_logits": True,
            "router_aux_loss_coef": 0.001,
        },
        text,
    )
    top = with_overrides(
        {
            **VISION_TOKEN_IDS,
            "audio_token_id": AUDIO_TOKEN_ID,
            "audio_start_token_id": AUDIO_START_TOKEN_ID,
            "audio_end_token_id": AUDIO_END_TOKEN_ID,
            "attn_implementation": "sdpa",
        },
        top,
    )
    return Qwen3OmniMoeThinkerConfig(
        text_config=text, vision_config=tiny_vision(vision), audio_config=audio, **top
    )


# ---- the audio encoder's cost ---------------------------------------------------------------------


def qwen3_omni_audio_cost(ac) -> EncoderCost:
    """The audio encoder's forward MACs per clip of grid (1, 1, frames), per mel frame.

    A chunk of ``2 * n_window`` frames (the last one padded to the batch's longest chunk) runs
    three stride-2 3x3 convolutions (1 -> C, C -> C, C -> C channels over the mel x time grid,
    halved each time), giving ``rows = 13`` tokens per 100 frames; each token then goes through
    ``conv_out`` (C * F/8 -> d), the blocks (qkv/out projections and a two-matrix MLP) and the
    output projections, and attends within windows of ``n_window_infer`` frames. Per frame:
    the convolutions' MACs over a full chunk divided by its frames, plus ``rows/frame`` times
    each token's linear MACs; attention pairs are counted in frames, with ``pair`` scaled by
    ``(rows/frame)**2`` (rounded). Elementwise work is left out, as for the towers.
    """
    c, f, d = ac.downsample_hidden_size, ac.num_mel_bins, ac.d_model
    chunk = 2 * ac.n_window
    t1, t2, t3 = (chunk + 1) // 2, (chunk + 3) // 4, (chunk + 7) // 8
    f1, f2, f3 = (f + 1) // 2, ((f + 1) // 2 + 1) // 2, (((f + 1) // 2 + 1) // 2 + 1) // 2
    convs = 9 * c * (f1 * t1) + 9 * c * c * (f2 * t2) + 9 * c * c * (f3 * t3)
    per_token = (
        c * f3 * d
        + ac.encoder_layers * block_linear_macs(d, ac.encoder_ffn_dim, gated=False)
        + d * d
        + d * ac.output_dim
    )
    tokens = t3  # rows of a full chunk (13 for 100 frames)
    return EncoderCost(
        linear_per_patch=(convs + per_token * tokens) // chunk,
        pair=max(1, round(2 * d * (tokens / chunk) ** 2)),
        windowed_blocks=ac.encoder_layers,
        window=ac.n_window_infer,
    )


# ---- published configs ---------------------------------------------------------------------------

OMNI_TOWER = {
    "depth": 27,
    "hidden_size": 1152,
    "intermediate_size": 4304,
    "num_heads": 16,
    "patch_size": 16,
    "temporal_patch_size": 2,
    "spatial_merge_size": 2,
    "in_channels": 3,
    "out_hidden_size": 2048,
    "num_position_embeddings": 2304,
    "deepstack_visual_indexes": [8, 16, 24],
}


def qwen3_omni_30b_a3b_config() -> Qwen3OmniMoeThinkerConfig:
    """Qwen3-Omni-30B-A3B (Instruct; the Thinking checkpoint's thinker has the same dimensions),
    its thinker written out from the checkpoint's ``thinker_config`` as public copies of its
    config.json give it (48 layers, 32 query and 4 key/value heads of 128, 128 experts of 768,
    top 8, vocab 152064, M-RoPE [24, 20, 20] interleaved, theta 1e6; the Qwen3-VL tower of 27
    blocks with deepstack at 8, 16, 24 and output width 2048; a 32-layer audio encoder of width
    1280). Not checked against the checkpoint itself (no download here), and transformers'
    config defaults are not these (their text defaults are another model's); the number of
    learned position embeddings (2304) is the config class's default, which the published copies
    leave out."""
    return Qwen3OmniMoeThinkerConfig(
        text_config={
            "vocab_size": 152064,
            "hidden_size": 2048,
            "num_hidden_layers": 48,
            "num_attention_heads": 32,
            "num_key_value_heads": 4,
            "head_dim": 128,
            "moe_intermediate_size": 768,
            "num_experts": 128,
            "num_experts_per_tok": 8,
            "norm_topk_prob": True,
            "decoder_sparse_step": 1,
            "max_position_embeddings": 65536,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 1_000_000.0,
                "mrope_section": [24, 20, 20],
                "interleaved": True,
            },
        },
        vision_config=OMNI_TOWER,
        audio_config={
            "num_mel_bins": 128,
            "d_model": 1280,
            "encoder_layers": 32,
            "encoder_attention_heads": 20,
            "encoder_ffn_dim": 5120,
            "downsample_hidden_size": 480,
            "output_dim": 2048,
            "n_window": 50,
            "n_window_infer": 800,
        },
        image_token_id=151655,
        video_token_id=151656,
        audio_token_id=151675,
        vision_start_token_id=151652,
        vision_end_token_id=151653,
        audio_start_token_id=151669,
        audio_end_token_id=151670,
        position_id_per_seconds=13,
        user_token_id=872,
    )


# ---- the data path -------------------------------------------------------------------------------


class OmniMedia(QwenVLMedia):
    """Qwen3-Omni's processor on the data path (module docstring, "Data path"): Qwen2.5-VL's
    images and videos, and audio clips through the checkpoint's feature extractor."""

    video_processor = "Qwen2VLVideoProcessor"

    def processor_kwargs(self, settings):
        if self.feature_extractor is None:
            raise ValueError("qwen3_omni_moe: the checkpoint has no audio feature extractor")
        return {
            "video_processor": self.video_stand_in(),
            "feature_extractor": self.feature_extractor,
        }

    def bind(self, processor):
        super().bind(processor)
        self.seconds = True  # the thinker's video positions need seconds per temporal patch
        # the processor reads this from the call's keywords (audio taken from videos: unsupported)
        processor.replace_video_token = partial(
            processor.replace_video_token, load_audio_from_video=False
        )

    def audio_item(self, ref):
        fe = self.feature_extractor
        features = clip_features(fe, load_audio(ref, fe.sampling_rate))
        if not len(features):
            raise DataError(
                "unreadable_media",
                f"{ref.name}: shorter than one feature frame ({fe.hop_length} samples)",
            )
        return AudioItem(features, ref.name)

    def audio_inputs(self, items, i):
        from transformers.models.qwen3_omni_moe import processing_qwen3_omni_moe as p

        frames = torch.tensor([it.frames for it in items], dtype=torch.long)
        return {
            "num_audio_tokens": p._get_feat_extract_output_lengths(frames, self.processor.n_window)
        }, i


OMNI_SPECIAL_TOKENS = (*SPECIAL_TOKENS, "<|audio_start|>", "<|audio_end|>", "<|audio_pad|>")
OMNI_TOKENS = {
    "image_token": "<|image_pad|>",
    "video_token": "<|video_pad|>",
    "audio_token": "<|audio_pad|>",
    "vision_bos_token": "<|vision_start|>",
    "vision_eos_token": "<|vision_end|>",
    "audio_bos_token": "<|audio_start|>",
    "audio_eos_token": "<|audio_end|>",
}
"""The tokenizer's named multimodal tokens the processor reads (as Qwen3-Omni's tokenizer_config)."""
_AUDIO_ITEM = (
    "{% elif content['type'] == 'audio' or 'audio' in content %}"
    "<|audio_start|><|audio_pad|><|audio_end|>"
)


def _omni_ids(tokenizer) -> dict:
    t = tokenizer.convert_tokens_to_ids
    return {
        **_config_ids(tokenizer),
        "audio_token_id": t("<|audio_pad|>"),
        "audio_start_token_id": t("<|audio_start|>"),
        "audio_end_token_id": t("<|audio_end|>"),
    }


def _feature_extractor(config):
    from transformers import WhisperFeatureExtractor

    return WhisperFeatureExtractor(feature_size=config.audio_config.num_mel_bins)


def _omni_video(config) -> dict:
    from .qwen2_vl import VIDEO_MAX_PIXELS, VIDEO_MIN_PIXELS

    v = config.vision_config
    return {
        "video_processor_type": "Qwen2VLVideoProcessor",
        "patch_size": v.patch_size,
        "merge_size": v.spatial_merge_size,
        "temporal_patch_size": v.temporal_patch_size,
        "size": {"shortest_edge": VIDEO_MIN_PIXELS, "longest_edge": VIDEO_MAX_PIXELS},
    }


tiny_omni_processor = TinyProcessor(
    special_tokens=OMNI_SPECIAL_TOKENS,
    tokenizer_kwargs={
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "extra_special_tokens": OMNI_TOKENS,
    },
    chat_template=_TEMPLATE.replace("{SYSTEM}", "").replace(
        "{% elif 'text' in content %}", _AUDIO_ITEM + "{% elif 'text' in content %}"
    ),
    processor_class="Qwen3OmniMoeProcessor",
    config_ids=_omni_ids,
    image_processor=_image_processor,
    video_processor=_omni_video,
    feature_extractor=_feature_extractor,
)
"""Qwen3-Omni's processor at toy size: the Qwen-VL template with audio items, the PIL image
processor, Qwen2-VL's video processor, Whisper's feature extractor at the model's mel bins."""

# ---- the kit -------------------------------------------------------------------------------------


class Qwen3OmniMoeKit(MoeKit, Qwen3VLKit):
    tiny_configs = {"qwen3-omni-moe-tiny": tiny_qwen3_omni_moe_config}
    published_configs = {"qwen3-omni-30b-a3b": qwen3_omni_30b_a3b_config}
    published_towers = {"Qwen3-Omni-30B-A3B": OMNI_TOWER}
    traits = frozenset({"deepstack"})  # not frame_timestamps: a video is one group
    tiny_processor = tiny_omni_processor
    zero_gradients = (r"model\.audio_tower\.layers\.\d+\.self_attn\.k_proj\.bias$",)
    """The audio blocks' key bias (softmax cancels it: its gradient is round-off)."""
    audio_clips = (230, 57)  # two full chunks of 100 frames and a part; less than one chunk
    float32_islands = ("Qwen3OmniMoeThinkerTextTopKRouter",)
    """The router's softmax, in float32 whatever the model's dtype (module docstring)."""

    def item_tokens(self, kind, grid, text):
        # one <vision_start> pads <vision_end> group per image and per video (no timestamps),
        # one <audio_start> pads <audio_end> group per audio clip
        if kind == "audio":
            c = self.config
            pads = [c.audio_token_id] * self.adapter.audio_rows(grid[2])
            return [c.audio_start_token_id, *pads, c.audio_end_token_id]
        return FamilyKit.item_tokens(self, kind, grid, text)

    def module_groups(self):
        """Qwen3-VL-MoE's groups (deepstack mergers at ``merger_list``) and the audio tower."""
        groups = [("audio tower", (r"model\.audio_tower\.",))]
        for label, patterns in super().module_groups():
            if label == "deepstack mergers":
                patterns = (r"model\.visual\.merger_list\.",)
            groups.append((label, patterns))
        return tuple(groups)


# ---- the adapter ---------------------------------------------------------------------------------


@register
class Qwen3OmniMoeAdapter(MoeRouter, Qwen3VLAdapter):
    family = "qwen3_omni_moe"
    model_classes = ("Qwen3OmniMoeThinkerForConditionalGeneration",)
    model_types = ("qwen3_omni_moe_thinker",)
    kit = Qwen3OmniMoeKit
    chat_media = OmniMedia  # the data path's processor hooks
    modules = ModulePaths(projector=("merger", "merger_list"), audio_tower="model.audio_tower")
    video_keys = ("second_per_grid_ts",)
    model_batch_keys = (SECONDS_KEY, *AUDIO_KEYS)  # the processor's seconds and audio

    # ---- tokens ---------------------------------------------------------------------------------

    @property
    def audio_token_ids(self) -> tuple[int, ...]:
        c = self.config
        ids = (c.audio_token_id, c.audio_start_token_id, getattr(c, "audio_end_token_id", None))
        return tuple(i for i in ids if i is not None)

    @property
    def special_token_ids(self):
        return (*super().special_token_ids, *self.audio_token_ids)

    # ---- audio ----------------------------------------------------------------------------------

    @property
    def audio_token_id(self):
        return self.config.audio_token_id

    @property
    def audio_feature_width(self):
        return self.config.audio_config.num_mel_bins

    def audio_rows(self, frames):
        from transformers.models.qwen3_omni_moe import modeling_qwen3_omni_moe as m

        n_window = self.config.audio_config.n_window
        return int(m._get_feat_extract_output_lengths(torch.tensor(frames), n_window))

    def audio_cost(self):
        return qwen3_omni_audio_cost(self.config.audio_config)

    def encode_audio(self, model, features, lengths, batch_lengths):
        """The tower on these clips, their chunks padded as in the forward batch (module
        docstring, "Audio")."""
        from transformers.models.qwen3_omni_moe import modeling_qwen3_omni_moe as m

        tower = self.audio_tower(model)
        x, n_window = features.T, self.config.audio_config.n_window
        chunks, chunk_lengths = m.chunk_and_pad_features(x, lengths, n_window)
        longest = min(max(batch_lengths, default=1), 2 * n_window)  # the batch's longest chunk
        if chunks.shape[-1] < longest:
            chunks = torch.nn.functional.pad(chunks, (0, longest - chunks.shape[-1]))
        out = tower(
            x,
            feature_lens=lengths,
            padded_feature=chunks,
            chunk_lengths=chunk_lengths,
            return_dict=True,
        )
        return out.last_hidden_state

    # ---- batch layout ---------------------------------------------------------------------------

    def from_model_batch(self, batch):
        """The processor's ``video_second_per_grid`` as the core's ``second_per_grid_ts``, its
        audio as the core's ``audio_features`` / ``audio_lengths``, and the token types from
        ``input_ids`` where the batch has none (the thinker takes none: its ``get_rope_index``
        places items by their ids)."""
        ids = batch.get("input_ids")
        missing_types = batch.get("mm_token_type_ids") is None and isinstance(ids, torch.Tensor)
        own_audio = any(batch.get(k) is not None for k in AUDIO_KEYS)
        if batch.get(SECONDS_KEY) is None and not missing_types and not own_audio:
            return batch
        batch = dict(batch)
        if own_audio:
            batch.update(
                _core_audio(
                    batch.pop("input_features", None), batch.pop("feature_attention_mask", None)
                )
            )
        seconds = batch.pop(SECONDS_KEY, None)
        if seconds is not None and batch.get("second_per_grid_ts") is None:
            batch["second_per_grid_ts"] = torch.as_tensor(seconds)
        if missing_types:
            batch["mm_token_type_ids"] = self.mm_token_type_ids(ids, batch.get("attention_mask"))
        return batch

    def to_model_batch(self, batch):
        """The thinker's forward keywords: the seconds as ``video_second_per_grid``, the audio
        as ``input_features`` / ``feature_attention_mask``, no ``mm_token_type_ids`` (it takes
        none), an all-ones attention mask where the batch has none (without one the thinker
        computes no M-RoPE positions)."""
        core = ("mm_token_type_ids", "second_per_grid_ts", "audio_features", "audio_lengths")
        out = {k: v for k, v in batch.items() if k not in core}
        if batch.get("audio_features") is not None:
            out.update(_model_audio(batch["audio_features"], batch["audio_lengths"]))
        if batch.get("second_per_grid_ts") is not None:
            out[SECONDS_KEY] = batch["second_per_grid_ts"]
        if out.get("attention_mask") is None and out.get("input_ids") is not None:
            out["attention_mask"] = torch.ones_like(out["input_ids"])
        return out

    # ---- positions ------------------------------------------------------------------------------

    def rope_index_kwargs(self, input_ids, kwargs):
        """The thinker's ``get_rope_index`` keywords (module docstring, "Positions")."""
        core = ("mm_token_type_ids", "second_per_grid_ts", "audio_lengths")
        out = {k: v for k, v in kwargs.items() if k not in core}
        if kwargs.get("audio_lengths") is not None:
            out["audio_seqlens"] = kwargs["audio_lengths"]
        if kwargs.get("video_grid_thw") is not None:
            seconds = kwargs.get("second_per_grid_ts")
            if seconds is None:
                raise ValueError(
                    "qwen3_omni_moe: a batch with videos needs second_per_grid_ts (the "
                    "processor's video_second_per_grid: seconds per temporal patch, one per "
                    "video); the video positions are t * seconds * position_id_per_seconds"
                )
            out["second_per_grids"] = seconds
        if out.get("attention_mask") is None:
            out["attention_mask"] = torch.ones_like(input_ids)
        return out


def _core_audio(features, mask) -> dict:
    """The processor's ``input_features`` [clips, F, T] and ``feature_attention_mask`` [clips, T]
    as the core's ``audio_features`` [frames, F] (each clip's valid frames, in order, as
    ``get_audio_features`` selects them) and ``audio_lengths``."""
    if (
        features is None
        or mask is None
        or features.dim() != 3
        or mask.shape
        != (
            features.shape[0],
            features.shape[2],
        )
    ):
        raise ValueError(
            "qwen3_omni_moe: audio needs input_features [clips, mel bins, frames] with its "
            "feature_attention_mask [clips, frames] (the processor's output)"
        )
    keep = mask.bool()
    return {"audio_features": features.transpose(1, 2)[keep], "audio_lengths": keep.sum(1)}


def _model_audio(features, lengths) -> dict:
    """The core's audio as the thinker's ``input_features`` (zero-padded to the longest clip) and
    ``feature_attention_mask``; ``_core_audio``'s inverse."""
    lengths = torch.as_tensor(lengths).tolist()
    longest = max(lengths)
    padded = features.new_zeros(len(lengths), longest, features.shape[1])
    mask = torch.zeros(len(lengths), longest, dtype=torch.long)
    for i, clip in enumerate(torch.split(features, lengths)):
        padded[i, : len(clip)] = clip
        mask[i, : len(clip)] = 1
    return {"input_features": padded.transpose(1, 2), "feature_attention_mask": mask}
