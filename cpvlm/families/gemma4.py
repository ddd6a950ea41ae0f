"""Gemma 4 (gemma4): 1D RoPE, sliding-window layers, per-layer embeddings, variable-size images.

The processor writes an image as ``<boi>``, one image token per pooled patch block, ``<eoi>``,
and a video as, per sampled frame, its timestamp (text) then ``<boi>`` video tokens ``<eoi>``.
The tower takes each image or frame as its own sequence of patches (``[N, max_patches,
3 * p * p]``, padded, with ``(x, y)`` patch positions, -1 for padding) and pools k x k patches
(``pooling_kernel_size``) into one token, so **a vision unit is one image or one video frame**.
The CP core takes them in the Qwen-VL layout: pixel rows = the real patches, a grid ``(1, h, w)``
per image and ``(frames, h, w)`` per video in patches, merge size k
(``from_model_batch`` / ``to_model_batch`` convert; the rows are the processor's patches as
they are, row-major, so the conversion only drops or adds the padding).

Text: the embedding scales by sqrt(hidden_size) inside its module; placeholders of images,
videos (and audio) are embedded as the pad token before their features replace them, and the
per-layer embeddings (PLE) look up the same pad-substituted ids: ``decoder_inputs`` computes
them from this rank's ids exactly as ``Gemma4Model.forward`` does (its context part is computed
by the text model from the shard's ``inputs_embeds``). Positions are 1D per document. KV-shared
layers reuse the shard's keys and values of an earlier layer: under CP that is the same
attention over the same global K/V. The logits are soft-capped by ``final_logit_softcapping``.
Masks (``create_masks_for_vision_model`` in transformers' ``models/gemma4/modeling_gemma4.py``,
with ``use_bidirectional_attention="vision"``): global layers causal only; sliding layers
``sliding_window_overlay`` AND (causal OR same run of image/video tokens,
``get_block_sequence_ids_for_mask``: types 1 and 2). Without it (None) every layer is causal.

The data path (``Gemma4Media``, ``cpvlm.hf.chat_media``): variable-size images, videos of
frames and audio clips (end of "Audio").

Legend: p patch side, k pooling kernel, (h, w) an image's or frame's size in patches, F frames.

``Gemma4ImageProcessor`` resizes an image (aspect ratio kept) to the largest size of at most
``max_soft_tokens * k**2`` patches with sides multiple of k*p (``get_aspect_ratio_preserving_size``,
computed from the header here), patchifies it and pads to that many patches; the processor
writes ``<boi>``, h*w/k**2 image tokens, ``<eoi>``. A video's frames are resized alike (the video
processor's own ``max_soft_tokens``), and written as ``mm:ss <boi> video tokens <eoi>`` per frame.
Planned grids: ``(1, h, w)`` per image, ``(F, h, w)`` per video; pixel rows are the real patches
(the adapter's layout; padding dropped by its ``from_model_batch``), each frame a unit.

Audio (a config with ``audio_config``; ``gemma4-audio-tiny``). The processor writes a clip as
``<boa>``, one audio token per output row, ``<eoa>`` (``boa_token_id``, ``eoa_token_index``), and
gives its mel features as ``input_features`` [clips, T, F] zero-padded with
``input_features_mask`` [clips, T] (True: a real frame). The tower (``model.audio_tower``,
``Gemma4AudioModel``) subsamples by two stride-2 convolutions over the masked frames, so a clip of
n frames has ``audio_rows`` ceil(ceil(n / 2) / 2) rows (the processor's ``replace_audio_token``
counts them so), then runs conformer blocks (chunked local attention over a fixed left context,
a causal depthwise convolution); ``model.embed_audio`` (an RMSNorm without scale and a linear
map) projects the rows to the text width. A clip's rows depend on that clip alone (the mask
zeroes its padding before each convolution and hides it from the attention; the convolution is
causal), so each clip is a unit of the audio ``EncoderDataParallel``: ``encode_audio`` calls
``get_audio_features`` on this rank's clips, padded to the longest, and keeps the rows of the
mask it returns, as the forward does. The core's ``audio_features`` [frames, F] are the valid
frames of the processor's ``input_features``, clip after clip, and ``audio_lengths`` each clip's
frames (``from_model_batch`` / ``to_model_batch`` convert). Audio tokens are causal in the
decoder (transformers' image blocks are types 1 and 2 only) and are embedded as the pad token
for the per-layer embeddings. The audio tower has only an eager attention: a config's
``attn_implementation`` gives it ``"eager"``. Its attention computes in float32 whatever the
model's dtype (``.float()``, a float32 softmax): a float32 island (the kit's).

Audio on the data path (``Gemma4Media``, a checkpoint with a feature extractor): a clip is decoded
to mono at the extractor's rate (``cpvlm.data.audio``); ``Gemma4AudioFeatureExtractor`` on the
clip alone, with the processor's keywords (the extractor's defaults: samples padded to a multiple
of 128, truncated at 30 s), gives its valid frames (a frame is valid where its whole 20 ms window
is real samples, so padding changes none of them); the processor's own ``replace_audio_token``
expands the template's audio token from a mask of those frames.
"""

from __future__ import annotations

import math

import torch
from transformers import Gemma4Config
from transformers.models.gemma4.image_processing_pil_gemma4 import (
    get_aspect_ratio_preserving_size,
)
from transformers.video_utils import VideoMetadata

from cpvlm.data.audio import load_audio
from cpvlm.data.errors import DataError
from cpvlm.data.sample import AudioItem, VisionItem
from cpvlm.encoders.cost import EncoderCost
from cpvlm.hf.adapter import ModulePaths, VLMAdapter
from cpvlm.hf.chat_media import ChatMedia, frame_pixels, frames_of, video_option
from cpvlm.hf.kit import FamilyKit, TinyProcessor
from cpvlm.hf.registration import register
from cpvlm.hf.tiny import IMAGE_TOKEN_ID, TEXT, VIDEO_TOKEN_ID, split_overrides, with_overrides

from .gemma3 import untied_lm_head

BOI_TOKEN_ID = 500
EOI_TOKEN_ID = 501
AUDIO_TOKEN_ID = 506
BOA_TOKEN_ID = 507
EOA_TOKEN_ID = 508
AUDIO_KEYS = ("input_features", "input_features_mask")
"""The model's audio inputs (padded mel features of its clips and their frame mask)."""
SUBSAMPLING_CONVS = 2
"""The audio tower's stride-2 convolutions (transformers' constant): a row per 4 feature frames."""
TIMESTAMP_TOKENS = 3
"""Text tokens of the ``mm:ss`` timestamp the processor writes before every video frame."""

_TEXT = {
    **TEXT,
    "num_hidden_layers": 6,
    # sliding, full, sliding, full, then two KV-shared layers (sliding, full) that reuse layers
    # 2 and 3. A full layer must feed a later layer's keys: the image spans' absence on full
    # layers then shows in the loss (a shared layer's keys are an earlier layer's).
    "layer_types": ["sliding_attention", "full_attention"] * 3,
    "num_kv_shared_layers": 2,
    "sliding_window": 6,  # shorter than the test rows and than an image of 8 x 4 patches
    "head_dim": 16,
    "global_head_dim": 32,  # full layers: wider heads (per_layer_config), as in Gemma 4
    "hidden_size_per_layer_input": 8,  # per-layer embeddings on
    "vocab_size_per_layer_input": TEXT["vocab_size"],
    "use_bidirectional_attention": "vision",
    "final_logit_softcapping": 30.0,
    "rope_parameters": {
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "full_attention": {
            "rope_type": "proportional",
            "partial_rotary_factor": 0.25,
            "rope_theta": 1e6,
        },
    },
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
_VISION = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "patch_size": 8,
    "pooling_kernel_size": 2,
    "position_embedding_size": 64,
}


def tiny_gemma4_config(**overrides) -> Gemma4Config:
    """A Gemma 4 config small enough for float64 CPU tests (no audio tower)."""
    vision, text, top = split_overrides(overrides)
    top = with_overrides(
        {
            "boi_token_id": BOI_TOKEN_ID,
            "eoi_token_id": EOI_TOKEN_ID,
            "image_token_id": IMAGE_TOKEN_ID,
            "video_token_id": VIDEO_TOKEN_ID,
            "audio_token_id": AUDIO_TOKEN_ID,
            "boa_token_id": BOA_TOKEN_ID,
            "eoa_token_index": EOA_TOKEN_ID,
            "audio_config": None,
            "attn_implementation": "sdpa",
        },
        top,
    )
    return Gemma4Config(
        text_config=with_overrides(_TEXT, text),
        vision_config=with_overrides(_VISION, vision),
        **top,
    )


TINY_AUDIO = {
    "hidden_size": 16,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    # 16 mel bins: transformers sizes the subsampling's input projection for F = channels[0]
    "subsampling_conv_channels": [16, 4],
    "conv_kernel_size": 3,
    "attention_chunk_size": 4,  # rows: a clip of 150 frames (38 rows) crosses ten chunks
    "attention_context_left": 5,
    "attention_context_right": 0,
    "output_proj_dims": 24,
}
"""A two-block audio tower: chunks of 4 rows (16 frames) attending 4 rows back."""


def tiny_gemma4_audio_config(**overrides) -> Gemma4Config:
    """``tiny_gemma4_config`` with a tiny audio tower (``TINY_AUDIO``; ``audio_config`` overrides
    merge into it). The tower has only an eager attention, so ``attn_implementation`` (the text
    and vision towers') gives it ``"eager"``."""
    audio = with_overrides(TINY_AUDIO, overrides.pop("audio_config", None))
    attn = overrides.pop("attn_implementation", "sdpa")
    if isinstance(attn, str):
        attn = {"": attn, "text_config": attn, "vision_config": attn, "audio_config": "eager"}
    return tiny_gemma4_config(audio_config=audio, attn_implementation=attn, **overrides)


def gemma4_vision_cost(vc) -> EncoderCost:
    """Patch embedding P w; blocks w d (2 Hq + 2 Hkv) (q, o and k, v projections) + 3 w I (gated
    MLP); full attention within the image or frame (pooling and projection are small)."""
    w, d = vc.hidden_size, vc.head_dim
    attn = w * d * (2 * vc.num_attention_heads + 2 * vc.num_key_value_heads)
    mlp = 3 * w * vc.intermediate_size
    linear = 3 * vc.patch_size**2 * w + vc.num_hidden_layers * (attn + mlp)
    return EncoderCost(
        linear_per_patch=linear,
        pair=2 * vc.num_attention_heads * d,
        full_blocks=vc.num_hidden_layers,
    )


def gemma4_audio_cost(ac, text_width: int) -> EncoderCost:
    """A clip of grid (1, 1, frames), in forward MACs per feature frame: the two subsampling
    convolutions (3 x 3 kernels; c0 and c0 x c1 per output, at F/2 x T/2 and F/4 x T/4 outputs),
    and per output row (one per 4 frames) the input projection, each block's
    matrices (two feed-forward modules of 4w, q, k, v, output, the light convolution's 3 w^2 and
    its depthwise kernel) and attention (each row attends a fixed context of chunk + left - 1 +
    right rows: q.k and the weighted sum of v, 2 w per key, and the relative-position logits, w
    per relative position), the output projection and ``embed_audio``. The attention is local
    with a fixed context per row, so it is linear in frames too: all of it is ``linear_per_patch``
    (EncoderCost's windowed blocks are square windows attending themselves, which these chunks are
    not), rounded up to whole MACs per frame."""
    w, (c0, c1), f = ac.hidden_size, ac.subsampling_conv_channels, _mel_bins(ac)
    context = ac.attention_chunk_size + ac.attention_context_left - 1 + ac.attention_context_right
    block = (2 * 8 + 4 + 3) * w * w + ac.conv_kernel_size * w
    block += 2 * w * context + w * (context // 2 + 1)
    per_row = (f // 4) * c1 * w + ac.num_hidden_layers * block
    per_row += w * ac.output_proj_dims + ac.output_proj_dims * text_width
    convs = 9 * c0 * (f // 2) / 2 + 9 * c0 * c1 * (f // 4) / 4
    return EncoderCost(linear_per_patch=math.ceil(convs + per_row / 2**SUBSAMPLING_CONVS))


def _mel_bins(ac) -> int:
    """Mel bins the tower takes: transformers sizes its input projection for ``channels[0]``
    (128 in the published configs, the feature extractor's)."""
    return int(ac.subsampling_conv_channels[0])


# ---- a tiny processor (Gemma 4's tokens, a reduced template, its patch image processor) ----------

_SPECIAL = {
    "boi_token": "<start_of_image>",
    "eoi_token": "<end_of_image>",
    "image_token": "<image_soft_token>",
    "audio_token": "<audio_soft_token>",
    "boa_token": "<start_of_audio>",
    "eoa_token": "<end_of_audio>",
}
_VIDEO_TOKEN = "<|video|>"  # Gemma4Processor adds it to the tokenizer itself
# Gemma's template, reduced to what matters here: turns, the image token per image, the video
# token per video and the audio token per clip (the processor expands them, a video into
# timestamped frames).
_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<start_of_turn>"
    "{{ 'model' if message['role'] == 'assistant' else message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for item in message['content'] %}{% if item['type'] == 'image' %}<image_soft_token>"
    "{% elif item['type'] == 'video' %}<|video|>"
    "{% elif item['type'] == 'audio' %}<audio_soft_token>"
    "{% elif item['type'] == 'text' %}{{ item['text'] }}{% endif %}{% endfor %}{% endif %}"
    "<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
TINY_SOFT_TOKENS = 70
"""The processor's ``max_soft_tokens`` of the tiny checkpoint (the smallest it allows)."""


def _config_ids(tokenizer) -> dict:
    t = tokenizer.convert_tokens_to_ids
    return {
        "boi_token_id": t(_SPECIAL["boi_token"]),
        "eoi_token_id": t(_SPECIAL["eoi_token"]),
        "image_token_id": t(_SPECIAL["image_token"]),
        "video_token_id": t(_VIDEO_TOKEN),
        "audio_token_id": t(_SPECIAL["audio_token"]),
        "boa_token_id": t(_SPECIAL["boa_token"]),
        "eoa_token_index": t(_SPECIAL["eoa_token"]),
        "text_config": {
            "pad_token_id": t("<pad>"),
            "bos_token_id": t("<bos>"),
            "eos_token_id": t("<eos>"),
        },
    }


def _image_processor(config):
    from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil

    vc = config.vision_config
    return Gemma4ImageProcessorPil(
        patch_size=vc.patch_size,
        pooling_kernel_size=vc.pooling_kernel_size,
        max_soft_tokens=TINY_SOFT_TOKENS,
    )


def _feature_extractor(config):
    """Gemma 4's feature extractor at the tower's mel bins (None: a config without audio)."""
    from transformers.models.gemma4.feature_extraction_gemma4 import Gemma4AudioFeatureExtractor

    if config.audio_config is None:
        return None
    return Gemma4AudioFeatureExtractor(feature_size=_mel_bins(config.audio_config))


def _video_processor(config) -> dict:
    vc = config.vision_config
    return {
        "video_processor_type": "Gemma4VideoProcessor",
        "patch_size": vc.patch_size,
        "pooling_kernel_size": vc.pooling_kernel_size,
        "max_soft_tokens": TINY_SOFT_TOKENS,
        "do_sample_frames": False,  # cpvlm samples a video file's frames itself
    }


class Gemma4Kit(FamilyKit):
    tiny_configs = {
        "gemma4-tiny": tiny_gemma4_config,
        "gemma4-audio-tiny": tiny_gemma4_audio_config,
    }
    traits = frozenset({"image_spans"})
    tiny_processor = TinyProcessor(
        special_tokens=("<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>")
        + (*_SPECIAL.values(), _VIDEO_TOKEN),
        tokenizer_kwargs={
            "bos_token": "<bos>",
            "eos_token": "<eos>",
            "pad_token": "<pad>",
            "extra_special_tokens": _SPECIAL,
        },
        chat_template=_TEMPLATE,
        processor_class="Gemma4Processor",
        config_ids=_config_ids,
        image_processor=_image_processor,
        video_processor=_video_processor,
        feature_extractor=_feature_extractor,
        processor_settings=lambda config: {"image_seq_length": TINY_SOFT_TOKENS},
        end_of_turn="<end_of_turn>",
        frame_size=(96, 160),  # 12 x 20 patches of 8, at most TINY_SOFT_TOKENS pooled
    )

    audio_clips = (150, 37)  # 38 rows (ten chunks of 4, the last part) and 10 rows

    def item_tokens(self, kind, grid, text):
        t, h, w = grid
        c = self.config
        if kind == "audio":
            pads = [c.audio_token_id] * self.adapter.audio_rows(w)
            return [c.boa_token_id, *pads, c.eoa_token_index]
        pad = c.image_token_id if kind == "image" else c.video_token_id
        frame = [c.boi_token_id] + [pad] * (h * w // self.adapter.merge_size**2) + [c.eoi_token_id]
        if kind == "image":
            return frame
        tokens = []
        for _ in range(t):
            tokens += text(TIMESTAMP_TOKENS) + frame
        return tokens

    def module_groups(self):
        v = r"model\.vision_tower\."
        audio = ()
        if self.config.audio_config is not None:
            audio = (
                ("audio tower", (r"model\.audio_tower\.",)),
                ("audio embedder", (r"model\.embed_audio\.",)),
            )
        return (
            ("vision patch embed", (v + r"patch_embedder\.",)),
            ("vision blocks", (v + r"encoder\.",)),
            ("vision projector", (r"model\.embed_vision\.",)),
            *audio,
            ("token embeddings", (r"model\.language_model\.embed_tokens(_per_layer)?\.",)),
            ("decoder layers", (r"model\.language_model\.",)),
            *untied_lm_head(self.config),
        )

    def init_tiny(self, model):
        # The patch embedder's position table starts at ones (every position alike).
        with torch.no_grad():
            table = model.model.vision_tower.patch_embedder.position_embedding_table
            table.normal_(0.0, 0.1)

    # Gemma4RMSNorm, the vision pooler and the audio attention compute in float32 whatever the
    # model dtype; the norm weights' gradients are float32 sums over the tokens of one call (the
    # audio attention fails outright in a float64 model: float32 keys, float64 queries).
    float32_islands = ("Gemma4RMSNorm", "Gemma4VisionPooler", "Gemma4AudioAttention")


# ---- the data path (the processor) --------------------------------------------------------------

VIDEO_DEFAULTS = {  # Gemma4VideoProcessor's class defaults (its config overrides them)
    "patch_size": 16,
    "pooling_kernel_size": 3,
    "max_soft_tokens": 70,
    "do_rescale": True,
    "rescale_factor": 1 / 255,
    "do_normalize": True,
    "image_mean": [0.0, 0.0, 0.0],
    "image_std": [1.0, 1.0, 1.0],
}


def _target_grid(height, width, patch, kernel, soft_tokens, name) -> tuple[int, int]:
    try:
        h, w = get_aspect_ratio_preserving_size(
            height, width, patch, soft_tokens * kernel**2, kernel
        )
    except ValueError as err:
        raise DataError("unreadable_media", f"{name}: {err}") from None
    return h // patch, w // patch


class Gemma4Media(ChatMedia):
    processor_parts = {"feature_extractor": None}  # the checkpoint's, where it has one

    def __init__(self, adapter, image_processor, video_config, **bounds):
        super().__init__(adapter, image_processor, video_config, **bounds)
        vc = adapter.config.vision_config
        opt = lambda key: video_option(video_config, key, VIDEO_DEFAULTS[key])  # noqa: E731
        for who, patch, kernel in (
            ("image", image_processor.patch_size, image_processor.pooling_kernel_size),
            ("video", opt("patch_size"), opt("pooling_kernel_size")),
        ):
            if (patch, kernel) != (vc.patch_size, vc.pooling_kernel_size):
                raise ValueError(
                    f"the {who} processor's patch_size {patch} and pooling_kernel_size {kernel} "
                    f"differ from the tower's {vc.patch_size} and {vc.pooling_kernel_size}"
                )
        self.patch, self.kernel = vc.patch_size, vc.pooling_kernel_size
        self.video_tokens = opt("max_soft_tokens")

    def processor_kwargs(self, settings):
        # None: a checkpoint without one (its audio items are refused)
        return {**super().processor_kwargs(settings), "feature_extractor": self.feature_extractor}

    def video_stand_in(self):
        stand_in = super().video_stand_in()
        stand_in.patch_size, stand_in.pooling_kernel_size = self.patch, self.kernel
        stand_in.max_soft_tokens = self.video_tokens
        return stand_in

    def image_items(self, refs):
        items = []
        for ref in refs:
            height, width = ref.size()
            tokens = self.image_processor.max_soft_tokens
            h, w = _target_grid(height, width, self.patch, self.kernel, tokens, ref.name)
            items.append(VisionItem("image", (1, h, w), image=ref))
        return items

    def video_item(self, frames, fps):
        height, width = frames[0].size()
        name = f"video {frames[0].name}"
        h, w = _target_grid(height, width, self.patch, self.kernel, self.video_tokens, name)
        return VisionItem("video", (len(frames), h, w), frames=frames, fps=fps)

    def _tokens(self, item) -> int:
        return item.grid[1] * item.grid[2] // self.kernel**2

    def image_inputs(self, items, i):
        return {"num_soft_tokens_per_image": [self._tokens(it) for it in items]}, i

    def video_inputs(self, items, i):
        item = items[i]
        metadata = VideoMetadata(
            total_num_frames=len(item.frames),
            fps=item.fps,
            frames_indices=list(range(len(item.frames))),
        )
        return {"num_soft_tokens_per_video": [self._tokens(item)], "video_metadata": [metadata]}, 0

    def audio_item(self, ref):
        fe = self.feature_extractor
        if fe is None:
            return super().audio_item(ref)
        features = clip_frames(fe, load_audio(ref, fe.sampling_rate))
        if not len(features):
            raise DataError(
                "unreadable_media",
                f"{ref.name}: shorter than one feature frame ({fe.frame_length // 2 + 1} samples)",
            )
        return AudioItem(features, ref.name)

    def audio_inputs(self, items, i):
        # replace_audio_token counts the rows of the clip's frame mask
        return {"input_features_mask": [torch.ones(items[i].frames, dtype=torch.bool)]}, 0

    def decode(self, item, temporal):
        p = self.patch
        if item.kind == "image":
            out = self.image_processor(images=[item.image.load()], return_tensors="pt")
            core = self.adapter.from_model_batch(dict(out))
            grid = tuple(int(v) for v in core["image_grid_thw"][0])
            if grid != item.grid:
                raise DataError(
                    "vision_token_mismatch",
                    f"{item.image.name}: the image processor made a grid {list(grid)}, the image "
                    f"header gave {list(item.grid)}",
                )
            return core["pixel_values"]
        _, h, w = item.grid
        x = frame_pixels(frames_of(item, temporal), (h * p, w * p), self.video_config,
                         VIDEO_DEFAULTS)  # fmt: skip
        # convert_video_to_patches: rows (frame, h, w), values (p, p, C)
        T, C = x.shape[:2]
        x = x.reshape(T, C, h, p, w, p).permute(0, 2, 4, 3, 5, 1)
        return x.reshape(T * h * w, p * p * C)


def clip_frames(feature_extractor, samples) -> torch.Tensor:
    """``[frames, F]`` float32: ``Gemma4AudioFeatureExtractor`` on one clip's ``samples`` (mono,
    at its sampling rate) with the processor's keywords (its defaults), the valid frames."""
    out = feature_extractor([samples], return_tensors="pt")
    return out["input_features"][0][out["input_features_mask"][0]].contiguous()


@register
class Gemma4Adapter(VLMAdapter):
    family = "gemma4"
    model_classes = ("Gemma4ForConditionalGeneration",)
    model_types = ("gemma4",)
    modules = ModulePaths(vision_tower="model.vision_tower", audio_tower="model.audio_tower")
    kit = Gemma4Kit
    chat_media = Gemma4Media  # the data path's processor hooks
    model_batch_keys = (
        "image_position_ids",
        "video_position_ids",
        "num_frames_per_video",
        *AUDIO_KEYS,
    )
    span_layers = "sliding"

    def __init__(self, config):
        self.config = config
        self.merge_size = int(config.vision_config.pooling_kernel_size)
        text = config.text_config
        if text.use_bidirectional_attention == "all":
            raise ValueError(
                "Gemma 4 with use_bidirectional_attention='all' (an encoder) is not supported "
                "under context parallelism: its windows are two-sided"
            )
        if text.enable_moe_block:
            raise ValueError("Gemma 4 MoE blocks (enable_moe_block) are not supported yet")

    @property
    def span_token_types(self):
        vision = self.config.text_config.use_bidirectional_attention == "vision"
        return (1, 2) if vision else ()

    @property
    def special_token_ids(self):
        c = self.config
        ids = (c.image_token_id, c.video_token_id, c.boi_token_id, c.eoi_token_id)
        return (*ids, c.audio_token_id, c.boa_token_id, c.eoa_token_index)

    @property
    def pixel_width(self) -> int:
        return 3 * self.config.vision_config.patch_size**2

    # ---- the model's own batch <-> the core's -------------------------------------------------

    def from_model_batch(self, batch):
        batch = dict(batch)
        features, mask = (batch.pop(k, None) for k in AUDIO_KEYS)
        if features is not None or mask is not None:
            batch.update(_core_audio(features, mask))
        for kind, pix, pos, grid in (
            ("image", "pixel_values", "image_position_ids", "image_grid_thw"),
            ("video", "pixel_values_videos", "video_position_ids", "video_grid_thw"),
        ):
            positions = batch.pop(pos, None)
            frames = batch.pop("num_frames_per_video", None) if kind == "video" else None
            pixels = batch.get(pix)
            if positions is None or pixels is None or pixels.dim() != 3:
                continue
            real = (positions != -1).all(-1)  # [N, max_patches]
            hw = positions.clamp(min=0).amax(1) + 1  # [N, (w, h)]
            frame_grids = torch.stack([torch.ones_like(hw[:, 0]), hw[:, 1], hw[:, 0]], -1)
            if kind == "video":
                counts = frames.tolist() if frames is not None else [len(frame_grids)]
                firsts = torch.tensor([0, *counts[:-1]]).cumsum(0)
                frame_grids = frame_grids[firsts].clone()
                frame_grids[:, 0] = torch.tensor(counts)
            batch[pix] = pixels[real]
            batch.setdefault(grid, frame_grids)
        return batch

    def to_model_batch(self, batch):
        batch = dict(batch)
        features, lengths = batch.pop("audio_features", None), batch.pop("audio_lengths", None)
        if features is not None:
            batch.update(_model_audio(features, lengths))
        for pix, pos, grid in (
            ("pixel_values", "image_position_ids", "image_grid_thw"),
            ("pixel_values_videos", "video_position_ids", "video_grid_thw"),
        ):
            grids = batch.pop(grid, None)
            if grids is None:
                continue
            batch[pix], batch[pos] = self._padded(batch[pix], grids)
            if pix == "pixel_values_videos":
                batch["num_frames_per_video"] = grids[:, 0].clone()
        return batch

    def _padded(self, rows: torch.Tensor, grid_thw: torch.Tensor):
        """``([frames, max_patches, C], [frames, max_patches, 2])`` of pixel rows in the grids'
        order, every frame padded to the longest (position -1), as the processor pads."""
        hw = torch.repeat_interleave(grid_thw[:, 1:], grid_thw[:, 0], dim=0).tolist()
        longest = max(h * w for h, w in hw)
        pixels = rows.new_zeros(len(hw), longest, rows.shape[1])
        positions = torch.full((len(hw), longest, 2), -1, dtype=torch.long)
        start = 0
        for f, (h, w) in enumerate(hw):
            pixels[f, : h * w] = rows[start : start + h * w]
            y, x = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
            positions[f, : h * w] = torch.stack([x, y], -1).reshape(-1, 2)
            start += h * w
        return pixels, positions

    # ---- vision ------------------------------------------------------------------------------

    def encode(self, model, pixel_values, grid_thw, kinds=None):
        # get_image_features: the tower, then embed_vision beside it
        pixels, positions = self._padded(pixel_values, grid_thw)
        out = model.model.get_image_features(pixels, positions.to(pixels.device), return_dict=True)
        return torch.cat(out.pooler_output)

    def vision_cost(self) -> EncoderCost:
        return gemma4_vision_cost(self.config.vision_config)

    # ---- audio (module docstring, "Audio") ---------------------------------------------------

    @property
    def audio_token_id(self):
        return None if self.config.audio_config is None else self.config.audio_token_id

    @property
    def audio_feature_width(self):
        return _mel_bins(self.config.audio_config)

    def audio_rows(self, frames):
        for _ in range(SUBSAMPLING_CONVS):  # each keeps mask[::2] (replace_audio_token's rule)
            frames = (frames + 1) // 2
        return int(frames)

    def encode_audio(self, model, features, lengths, batch_lengths):
        """``get_audio_features`` on these clips, the rows its mask keeps, as the forward keeps
        them (padding changes no clip's rows: ``batch_lengths`` is not needed)."""
        audio = _model_audio(features, lengths)
        out = model.model.get_audio_features(*(audio[k] for k in AUDIO_KEYS), return_dict=True)
        return out.pooler_output[out.attention_mask]

    def audio_cost(self) -> EncoderCost:
        return gemma4_audio_cost(self.config.audio_config, self.config.text_config.hidden_size)

    # ---- positions, decoder, loss ------------------------------------------------------------

    def decoder_inputs(self, model, input_ids, visual_mask, deepstack):
        """The per-layer embeddings' token part of this rank's ids, as ``Gemma4Model.forward``
        computes it (placeholders looked up as the pad token)."""
        text = self.config.text_config
        if not text.hidden_size_per_layer_input:
            return {}
        c = self.config
        placeholders = torch.isin(
            input_ids,
            torch.tensor([c.image_token_id, c.video_token_id, c.audio_token_id]).to(input_ids),
        )
        ids = torch.where(placeholders, text.pad_token_id, input_ids)
        return {"per_layer_inputs": model.model.language_model.get_per_layer_inputs(ids, None)}

    @property
    def logit_softcap(self) -> float | None:
        return self.config.text_config.final_logit_softcapping


def _core_audio(features, mask) -> dict:
    """The processor's ``input_features`` [clips, T, F] and ``input_features_mask`` [clips, T] as
    the core's ``audio_features`` [frames, F] (each clip's valid frames, in order) and
    ``audio_lengths``."""
    if features is None or mask is None or features.dim() != 3 or mask.shape != features.shape[:2]:
        raise ValueError(
            "gemma4: audio needs input_features [clips, frames, mel bins] with its "
            "input_features_mask [clips, frames] (the processor's output)"
        )
    keep = mask.bool()
    lengths = keep.sum(1)
    if not torch.equal(keep, torch.arange(keep.shape[1], device=keep.device) < lengths[:, None]):
        raise ValueError(
            "gemma4: input_features_mask must mark each clip's leading frames (right padding, "
            "as the processor pads); a clip's rows are counted from its leading frames"
        )
    return {"audio_features": features[keep], "audio_lengths": lengths}


def _model_audio(features, lengths) -> dict:
    """The core's audio as the model's ``input_features`` (zero-padded to the longest clip, as
    the feature extractor pads) and boolean ``input_features_mask``; ``_core_audio``'s inverse."""
    lengths = torch.as_tensor(lengths).to(features.device)
    mask = torch.arange(int(lengths.max()), device=features.device) < lengths[:, None]
    padded = features.new_zeros(*mask.shape, features.shape[1])
    padded[mask] = features
    return {"input_features": padded, "input_features_mask": mask}
