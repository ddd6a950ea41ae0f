"""LLaVA-OneVision (``LlavaOnevisionForConditionalGeneration``): a Qwen2 decoder with 1D RoPE, a
SigLIP tower on square crops, an MLP projector and the anyres packing of an image's crops.

Legend: S crop side in pixels (vision image_size), s = S // patch_size its side in patches,
(H, W) an image's original size in pixels, t its crops.

The processor resizes an image to the best of ``image_grid_pinpoints`` for its aspect ratio and
cuts it into crops of S pixels, after a base crop of the whole image (t = 1 + crops); in a sample
of several images each image is its base crop only (t = 1). The model encodes every crop alone
(SigLIP, the feature layer, the projector: s*s rows each), then packs an image
(``pack_image_features``): the base crop's rows, then the other crops laid out as their grid,
unpadded to the original aspect ratio, bilinearly downsampled when larger than
``vision_aspect_ratio`` (anyres_max_N) allows, with an ``image_newline`` row after every row of
the grid; a base-only image gets one newline row. The processor writes one ``<image>`` token per
packed row.

The unit is one image with all its crops. The crops go through the ViT alone, but the packing
needs all of them: unpadding keeps rows by their place in the whole grid, and the downsampling
interpolates across crop borders, so no crop's share of the packed rows is a function of that
crop alone. (InternVL's tile is finer: its pixel shuffle and projector act on one tile.) In cpvlm's
batch an image has the grid (t, H, W) (the original size, from which the processor's token count
and the unpadding follow) and t*s*s pixel rows of C*p*p values, each crop's values viewed as s*s
rows (``to_model_batch`` gives the model its ``[images, crops, C, S, S]``, ``image_sizes`` and
``batch_num_images`` back; ``from_model_batch`` takes the processor's output, so the CP step takes
either); ``item_sizes`` gives its pixel and packed rows.

A video (``pixel_values_videos`` ``[videos, F, C, S, S]``, frames resized to one crop each) is
one unit: every frame through the tower alone, the projector, a 2 x 2 bilinear pooling of the
frame's s x s rows to ceil(s/2)**2 (``apply_pooling``), then one ``image_newline`` row for the
whole video (``get_video_features``); the processor writes F * ceil(s/2)**2 + 1 ``<video>``
tokens. A video's grid is ``(F, S, S)``: F frames of one S x S crop (``image_sizes_videos``).
The core carries every unit's kind beside its grid (which grid tensor it came from), and
``item_sizes`` and ``encode`` read it from there: a grid alone cannot say it (a 3-crop image of
S x S pixels has the grid of a 3-frame video), and never has to.

Positions are 1D (the model has no ``get_rope_index``: the core's per-document positions).

The data path (``LlavaOnevisionMedia``, ``cpvlm.hf.chat_media``): anyres images, and
base-only ones in a sample of several images.

Legend: S crop side in pixels, s = S / patch its side in patches, (H, W) an image's size, t crops.

``LlavaOnevisionImageProcessor`` cuts the one image of a sample into its best
``image_grid_pinpoints`` resolution's crops after a base crop of the whole image (t = 1 + crops),
and pads each image of a sample of several to a square base crop only (t = 1); the processor
writes ``<image>`` once per packed row (``_get_number_of_features``, or s*s + 1 for a base-only
image). The planned grid is (t, H, W) as the adapter takes it, from the header; the image is
decoded by the image processor itself, alone (``[[image]]``) or, base-only, beside a one-pixel
image (``[[image, dot]]``: the processor's multi-image path, the dot's crop dropped). Its pixel
rows are the crops' ``[C, S, S]`` values viewed as t*s*s rows (the adapter's layout).

A video is one item of kind "video" and grid (F, S, S) (the adapter's video grid): its frames
resized to one S x S crop each and rescaled and normalised as ``LlavaOnevisionVideoProcessor``
does (``frame_pixels``; that class needs torchvision), each frame's ``[C, S, S]`` viewed as s*s
rows; ``replace_video_token`` reads only its frame count (F * ceil(s/2)**2 + 1 tokens).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import torch
from transformers import LlavaOnevisionConfig
from transformers.image_processing_utils import select_best_resolution

from cpvlm.data.errors import DataError
from cpvlm.data.sample import VisionItem
from cpvlm.encoders.cost import EncoderCost, block_linear_macs
from cpvlm.hf.adapter import ModulePaths, VLMAdapter
from cpvlm.hf.chat_media import (
    OPENAI_CLIP_MEAN,
    OPENAI_CLIP_STD,
    ChatMedia,
    frame_pixels,
    frames_of,
)
from cpvlm.hf.kit import FamilyKit, TinyProcessor
from cpvlm.hf.registration import register
from cpvlm.hf.tiny import (
    IMAGE_TOKEN_ID,
    TEXT,
    VIDEO_TOKEN_ID,
    VISION,
    split_overrides,
    with_overrides,
)

CROP = 32
"""Crop side of the tiny config in pixels: 4 x 4 patches of 8, 16 rows per crop."""

TINY_PINPOINTS = [[32, 32], [32, 64], [64, 32], [64, 64], [32, 96], [96, 32]]


def tiny_llava_onevision_config(**overrides) -> LlavaOnevisionConfig:
    """A LLaVA-OneVision config small enough for float64 CPU tests (~150k parameters): SigLIP of
    2 layers on 32-pixel crops, a Qwen2 decoder with GQA, resolutions up to 3 crops a side, and
    ``anyres_max_2``, so that a 2 x 2 grid is downsampled (a 1 x 2 grid is not)."""
    vision, text, top = split_overrides(overrides)
    vision = with_overrides(
        {
            "model_type": "siglip_vision_model",
            "hidden_size": VISION["hidden_size"],
            "intermediate_size": VISION["intermediate_size"],
            "num_hidden_layers": VISION["depth"],
            "num_attention_heads": VISION["num_heads"],
            "image_size": CROP,
            "patch_size": VISION["patch_size"],
            "vision_use_head": False,
        },
        vision,
    )
    text = with_overrides(
        {**TEXT, "model_type": "qwen2", "bos_token_id": 1, "eos_token_id": 2}, text
    )
    top = with_overrides(
        {
            "image_token_index": IMAGE_TOKEN_ID,
            "video_token_index": VIDEO_TOKEN_ID,
            "image_grid_pinpoints": TINY_PINPOINTS,
            "vision_aspect_ratio": "anyres_max_2",
            "attn_implementation": "sdpa",
        },
        top,
    )
    return LlavaOnevisionConfig(text_config=text, vision_config=vision, **top)


@dataclass(frozen=True)
class CropCost(EncoderCost):
    """A unit of grid (t, H, W) is t crops of ``crop`` x ``crop`` patches (H, W: the original
    image size, which does not change the tower's work)."""

    crop: int = 1

    def unit_cost(self, grid) -> int:
        t = int(grid[0])
        return t * super().unit_cost((1, self.crop, self.crop))


def llava_onevision_vision_cost(config) -> CropCost:
    """Per patch of a crop: SigLIP's patch embedding (C p^2 w), blocks 4 w^2 + 2 w I with full
    attention over the crop, the projector w D + D^2 (one row per patch, for each feature layer's
    w). The packing (gathers, the downsampling) is elementwise work."""
    vc, d = config.vision_config, config.text_config.hidden_size
    w = vc.hidden_size
    layers = config.vision_feature_layer
    feature_w = w * (1 if isinstance(layers, int) else len(layers))
    linear = (
        vc.num_channels * vc.patch_size**2 * w
        + vc.num_hidden_layers * block_linear_macs(w, vc.intermediate_size, gated=False)
        + feature_w * d
        + d * d
    )
    side = vc.image_size // vc.patch_size
    return CropCost(
        linear_per_patch=linear, pair=2 * w, full_blocks=vc.num_hidden_layers, crop=side
    )


# ---- a tiny processor (LLaVA-OneVision's tokens and template, its anyres image processor) --------

_SPECIAL = {"image_token": "<image>", "video_token": "<video>"}
# LLaVA-OneVision's published template without its generation markers: a turn is its role and a
# space, its images, its videos, then each text after a newline, and <|im_end|>.
_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + ' ' }}"
    "{% if message['content'] is string %}{{ '\\n' + message['content'] }}{% else %}"
    "{% for item in message['content'] | selectattr('type', 'equalto', 'image') %}"
    "{{ '<image>' }}{% endfor %}"
    "{% for item in message['content'] | selectattr('type', 'equalto', 'video') %}"
    "{{ '<video>' }}{% endfor %}"
    "{% for item in message['content'] | selectattr('type', 'equalto', 'text') %}"
    "{{ '\\n' + item['text'] }}{% endfor %}{% endif %}{{ '<|im_end|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def _config_ids(tokenizer) -> dict:
    t = tokenizer.convert_tokens_to_ids
    return {"image_token_index": t("<image>"), "video_token_index": t("<video>")}


def _image_processor(config):
    from transformers.models.llava_onevision.image_processing_pil_llava_onevision import (
        LlavaOnevisionImageProcessorPil,
    )

    side = config.vision_config.image_size
    return LlavaOnevisionImageProcessorPil(
        size={"height": side, "width": side}, image_grid_pinpoints=config.image_grid_pinpoints
    )


def _video_processor(config) -> dict:
    side = config.vision_config.image_size
    return {"video_processor_type": "LlavaOnevisionVideoProcessor",
            "size": {"height": side, "width": side}}  # fmt: skip


def _processor_settings(config) -> dict:
    vc = config.vision_config
    return {
        "num_image_tokens": (vc.image_size // vc.patch_size) ** 2,
        "vision_feature_select_strategy": config.vision_feature_select_strategy,
        "vision_aspect_ratio": config.vision_aspect_ratio,
    }


class LlavaOnevisionKit(FamilyKit):
    tiny_configs = {"llava-onevision-tiny": tiny_llava_onevision_config}
    traits = frozenset({"tiled"})
    tiny_processor = TinyProcessor(
        special_tokens=("<|endoftext|>", "<|im_start|>", "<|im_end|>", *_SPECIAL.values()),
        tokenizer_kwargs={
            "eos_token": "<|im_end|>",
            "pad_token": "<|endoftext|>",
            "extra_special_tokens": _SPECIAL,
        },
        chat_template=_TEMPLATE,
        processor_class="LlavaOnevisionProcessor",
        config_ids=_config_ids,
        image_processor=_image_processor,
        video_processor=_video_processor,
        processor_settings=_processor_settings,
        frame_size=(CROP, CROP),  # one crop
    )
    zero_gradients = (r"model\.vision_tower\..*self_attn\.k_proj\.bias",)
    unused_parameters = r"model\.vision_tower\.post_layernorm\."  # SigLIP's, at feature layer -1

    def synthetic_items(self, kind, grid, *, images_in_sample: int = 1):
        a = self.adapter
        t, h, w = grid
        if kind == "video":
            return [("video", (t, a.crop, a.crop))]
        height, width = h * a.patch, w * a.patch
        if images_in_sample > 1:
            return [("image", (1, height, width))]
        rows, cols = a.crop_grid(height, width)
        return [("image", (1 + rows * cols, height, width))]

    def item_tokens(self, kind, grid, text):
        a = self.adapter
        token = a.image_token_id if kind == "image" else a.video_token_id
        return [token] * a.item_sizes(grid, kind)[1]

    def module_groups(self):
        v = r"model\.vision_tower\."
        return (
            ("vision patch embed", (v + r"embeddings\.",)),
            ("vision blocks", (v + r"(encoder|post_layernorm)\.",)),
            ("vision merger", (r"model\.(multi_modal_projector\.|image_newline)",)),
            *super().module_groups()[3:],
        )


# ---- the data path (the processor) --------------------------------------------------------------

VIDEO_DEFAULTS = {  # LlavaOnevisionVideoProcessor's class defaults (its config overrides them)
    "size": {"height": 384, "width": 384},
    "do_rescale": True,
    "rescale_factor": 1 / 255,
    "do_normalize": True,
    "image_mean": OPENAI_CLIP_MEAN,
    "image_std": OPENAI_CLIP_STD,
}


class LlavaOnevisionMedia(ChatMedia):
    def __init__(self, adapter, image_processor, video_config, **bounds):
        super().__init__(adapter, image_processor, video_config, **bounds)
        config = adapter.config
        size = image_processor.size
        if (size["height"], size["width"]) != (adapter.crop, adapter.crop):
            raise ValueError(
                f"the image processor makes crops of {size['height']}x{size['width']}, the tower "
                f"takes {adapter.crop} a side"
            )
        video = video_config.get("size") or VIDEO_DEFAULTS["size"]
        if (video["height"], video["width"]) != (adapter.crop, adapter.crop):
            raise ValueError(
                f"the video processor resizes frames to {video['height']}x{video['width']}, the "
                f"tower takes {adapter.crop} a side"
            )
        pinpoints = [list(p) for p in image_processor.image_grid_pinpoints]
        if pinpoints != [list(p) for p in config.image_grid_pinpoints]:
            raise ValueError(
                "the image processor's image_grid_pinpoints differ from the model config's"
            )

    def bind(self, processor):
        super().bind(processor)
        s, config = self.adapter.side, self.adapter.config
        for name, want in (
            ("num_image_tokens", s * s),
            ("vision_feature_select_strategy", config.vision_feature_select_strategy),
            ("vision_aspect_ratio", config.vision_aspect_ratio),
        ):
            if getattr(processor, name) != want:
                raise ValueError(
                    f"the processor's {name} is {getattr(processor, name)!r}, the model's {want!r}"
                )

    def image_items(self, refs):
        items = []
        for ref in refs:
            height, width = ref.size()
            rows, cols = self.adapter.crop_grid(height, width)
            t = 1 if len(refs) > 1 else 1 + rows * cols
            items.append(VisionItem("image", (t, height, width), image=ref))
        return items

    def video_item(self, frames, fps):
        side = self.adapter.crop
        return VisionItem("video", (len(frames), side, side), frames=frames, fps=fps)

    def video_inputs(self, items, i):
        return {"pixel_values_videos": [[None] * items[i].grid[0]]}, 0  # only its length is read

    def image_inputs(self, items, i):
        t, height, width = items[i].grid
        if t == 1:  # a base-only image: the processor's multi-image count (s*s + 1)
            return {"batch_num_images": [2]}, 0
        crop = torch.empty(3, self.adapter.crop, self.adapter.crop)  # only its shape is read
        inputs = {
            "batch_num_images": [1],
            "image_sizes": [[height, width]],
            "pixel_values": [[crop]],
        }
        return inputs, 0

    def decode(self, item, temporal):
        if item.kind == "video":
            side = self.adapter.crop
            x = frame_pixels(frames_of(item, temporal), (side, side), self.video_config,
                             VIDEO_DEFAULTS)  # fmt: skip
            return x.reshape(-1, self.adapter.pixel_width)  # [F, C, S, S] as the adapter's rows
        from PIL import Image

        t = item.grid[0]
        images = [item.image.load()] + ([Image.new("RGB", (1, 1))] if t == 1 else [])
        out = self.image_processor(images=[images], return_tensors="pt")
        crops = out["pixel_values"][0]
        if crops.shape[0] != t:
            raise DataError(
                "vision_token_mismatch",
                f"{item.image.name}: the image processor made {crops.shape[0]} crops, the image "
                f"header gave {t}",
            )
        s = self.adapter.side
        return crops.reshape(t * s * s, -1)


@register
class LlavaOnevisionAdapter(VLMAdapter):
    family = "llava_onevision"
    model_classes = ("LlavaOnevisionForConditionalGeneration",)
    model_types = ("llava_onevision",)
    # encode runs the tower, then the projector and pack_image_features of LlavaOnevisionModel
    # (the projector and image_newline are beside the tower). FSDP units are the tower's layers,
    # not the tower: encode reads the feature layer's output, not the tower's, and FSDP2
    # re-gathers a unit's parameters for the backward from the gradient of the unit's outputs
    # (the embeddings and post_layernorm stay with the root).
    modules = ModulePaths(
        vision_tower="model.vision_tower",
        tower_units=("encoder.layers",),
        extra_units=("model.multi_modal_projector",),
    )
    kit = LlavaOnevisionKit
    chat_media = LlavaOnevisionMedia  # the data path's processor hooks
    split_frames = False
    model_batch_keys = ("image_sizes", "batch_num_images", "image_sizes_videos")

    def __init__(self, config):
        self.config = config
        self.merge_size = 1  # the grid's h, w are the original size in pixels
        vc = config.vision_config
        if config.vision_feature_select_strategy != "full":
            raise ValueError(
                "LLaVA-OneVision: vision_feature_select_strategy must be 'full' (SigLIP has no "
                f"CLS token; 'default' drops a patch of every crop), got "
                f"{config.vision_feature_select_strategy!r}"
            )
        if vc.image_size % vc.patch_size:
            raise ValueError(
                f"LLaVA-OneVision: vision image_size {vc.image_size} is not a multiple of "
                f"patch_size {vc.patch_size}"
            )
        self.crop, self.patch = vc.image_size, vc.patch_size
        self.side = vc.image_size // vc.patch_size
        self.max_crops = int(config.vision_aspect_ratio.removeprefix("anyres_max_"))

    # ---- tokens ---------------------------------------------------------------------------------

    @property
    def special_token_ids(self):
        return (self.image_token_id, self.video_token_id)

    @property
    def pixel_width(self) -> int:
        return self.config.vision_config.num_channels * self.patch**2

    def crop_grid(self, height: int, width: int) -> tuple[int, int]:
        """(rows, columns) of crops the processor cuts an image of height x width pixels into:
        the best of ``image_grid_pinpoints`` (``select_best_resolution``) in crops."""
        best_h, best_w = select_best_resolution((height, width), self.config.image_grid_pinpoints)
        return best_h // self.crop, best_w // self.crop

    @property
    def pooled_side(self) -> int:
        """A video frame's side in rows after ``apply_pooling``: ceil(s / 2)."""
        return -(-self.side // 2)

    def item_sizes(self, grid, kind):
        t, height, width = grid
        s = self.side
        if kind == "video":  # F frames of one crop; pooled rows, one newline per video
            if (height, width) != (self.crop, self.crop):
                raise ValueError(
                    f"LLaVA-OneVision: a video of grid {list(grid)}; its frames are one crop, "
                    f"(F, {self.crop}, {self.crop})"
                )
            return t * s * s, t * self.pooled_side**2 + 1
        if t == 1:  # base crop only (an image of a multi-image sample)
            return s * s, s * s + 1
        rows, cols = self.crop_grid(height, width)
        if t != 1 + rows * cols:
            raise ValueError(
                f"LLaVA-OneVision: an image of {height} x {width} pixels has 1 + {rows} x {cols} "
                f"crops (or 1 in a multi-image sample), not t = {t}"
            )
        # The processor's _get_unpadded_features, on the grid of crops' features.
        cur_h, cur_w = rows * s, cols * s
        if width / height > cur_w / cur_h:
            new_h = int(round(height * (cur_w / width), 7))
            cur_h -= (cur_h - new_h) // 2 * 2
        else:
            new_w = int(round(width * (cur_h / height), 7))
            cur_w -= (cur_w - new_w) // 2 * 2
        ratio = math.sqrt(cur_h * cur_w / (self.max_crops * s * s))
        if ratio > 1.1:
            cur_h, cur_w = int(cur_h // ratio), int(cur_w // ratio)
        return t * s * s, s * s + cur_h * (cur_w + 1)

    def mm_token_type_ids(self, input_ids, attention_mask=None):
        types = (input_ids == self.image_token_id).long()
        types += 2 * (input_ids == self.video_token_id).long()
        return types if attention_mask is None else types * attention_mask.bool()

    def from_model_batch(self, batch):
        """The processor's output in the core's layout: images (``_images_from_model``) and
        videos, ``pixel_values_videos`` ``[videos, F, C, S, S]`` as F*s*s pixel rows each with
        the grid ``(F, S, S)`` (``image_sizes_videos``, each frame's S x S, is that grid's h, w).
        Given the core's layout, it returns it unchanged."""
        batch = self._images_from_model(batch)
        videos = batch.get("pixel_values_videos")
        sizes = batch.pop("image_sizes_videos", None)
        if videos is None or videos.dim() == 2:  # none, or the core's layout already
            if sizes is not None and videos is None:
                raise ValueError(
                    "LLaVA-OneVision: image_sizes_videos were given without pixel_values_videos"
                )
            return batch
        c, side = self.config.vision_config.num_channels, self.crop
        if videos.dim() != 5 or tuple(videos.shape[-3:]) != (c, side, side):
            raise ValueError(
                f"LLaVA-OneVision: pixel_values_videos of shape {tuple(videos.shape)}; the model "
                f"takes [videos, frames, {c}, {side}, {side}]"
            )
        if batch.get("video_grid_thw") is not None:
            raise ValueError(
                "LLaVA-OneVision: pixel_values_videos [videos, frames, C, S, S] come without "
                "video_grid_thw (the core's layout has pixel rows)"
            )
        n, frames = videos.shape[:2]
        batch["pixel_values_videos"] = videos.reshape(-1, self.pixel_width)
        grid = (frames, side, side)
        batch["video_grid_thw"] = torch.tensor([grid] * n, dtype=torch.long).reshape(-1, 3)
        return batch

    def _images_from_model(self, batch):
        """The processor's ``[images, crops, C, S, S]`` pixels (crops padded to the most of any
        image; or ``[crops, C, S, S]``, the images' crops one after another), ``image_sizes``
        ``[images, 2]`` and ``batch_num_images`` ``[B]`` as pixel rows and ``(t, H, W)`` grids:
        t = 1 + the crops of ``image_sizes`` for an image alone in its sample, 1 in a
        multi-image sample (``get_image_features``' rule; without ``batch_num_images``, every
        image alone)."""
        pixels = batch.get("pixel_values")
        if pixels is None or pixels.dim() == 2:  # text only, or the core's layout already
            if batch.get("image_sizes") is not None and batch.get("image_grid_thw") is None:
                raise ValueError("LLaVA-OneVision: image_sizes were given without pixel_values")
            return {k: v for k, v in batch.items() if k not in ("image_sizes", "batch_num_images")}
        batch = dict(batch)
        sizes, per_sample = batch.pop("image_sizes", None), batch.pop("batch_num_images", None)
        c, side = self.config.vision_config.num_channels, self.crop
        if pixels.dim() not in (4, 5) or tuple(pixels.shape[-3:]) != (c, side, side):
            raise ValueError(
                f"LLaVA-OneVision: pixel_values of shape {tuple(pixels.shape)}; the model takes "
                f"[images, crops, {c}, {side}, {side}] or [crops, {c}, {side}, {side}]"
            )
        if sizes is None:
            raise ValueError(
                "LLaVA-OneVision: pixel_values need image_sizes [images, 2] (the processor "
                "returns them)"
            )
        sizes = [tuple(int(v) for v in s) for s in sizes.tolist()]
        alone = [True] * len(sizes)
        if per_sample is not None:
            counts = [int(n) for n in torch.as_tensor(per_sample).reshape(-1).tolist()]
            if sum(counts) != len(sizes):
                raise ValueError(
                    f"LLaVA-OneVision: batch_num_images {counts} counts {sum(counts)} images, "
                    f"image_sizes {len(sizes)}"
                )
            alone = [n == 1 for n in counts for _ in range(n)]
        grids = []
        for (h, w), single in zip(sizes, alone, strict=True):
            rows, cols = self.crop_grid(h, w)
            grids.append((1 + rows * cols if single else 1, h, w))
        crops_per_image = [t for t, _, _ in grids]
        if pixels.dim() == 5:
            if pixels.shape[0] != len(grids) or pixels.shape[1] < max(crops_per_image):
                raise ValueError(
                    f"LLaVA-OneVision: pixel_values of shape {tuple(pixels.shape)} for "
                    f"{len(grids)} images of {crops_per_image} crops"
                )
            crops = torch.cat([p[:t] for p, t in zip(pixels, crops_per_image, strict=True)])
        else:
            if pixels.shape[0] != sum(crops_per_image):
                raise ValueError(
                    f"LLaVA-OneVision: pixel_values hold {pixels.shape[0]} crops; the images "
                    f"need {crops_per_image}"
                )
            crops = pixels
        batch["pixel_values"] = crops.reshape(-1, self.pixel_width)  # the view _crops undoes
        batch["image_grid_thw"] = torch.tensor(grids, dtype=torch.long)
        return batch

    def to_model_batch(self, batch):
        out = {
            k: v
            for k, v in batch.items()
            if k not in ("image_grid_thw", "video_grid_thw", "mm_token_type_ids")
        }
        if batch.get("image_grid_thw") is not None:
            out.update(self._images_to_model(batch["pixel_values"], batch["image_grid_thw"]))
        if batch.get("video_grid_thw") is not None:
            grids = [tuple(int(v) for v in g) for g in batch["video_grid_thw"].tolist()]
            frames = {t for t, _, _ in grids}
            side = self.crop
            if len(frames) > 1 or any((h, w) != (side, side) for _, h, w in grids):
                raise ValueError(
                    f"LLaVA-OneVision: video grids {grids}; the model's forward takes videos of "
                    f"one frame count, each (frames, {side}, {side})"
                )
            c = self.config.vision_config.num_channels
            shape = (len(grids), frames.pop(), c, self.crop, self.crop)
            out["pixel_values_videos"] = batch["pixel_values_videos"].reshape(shape)
        return out

    def _images_to_model(self, pixel_values, grid_thw) -> dict:
        grids = [tuple(int(v) for v in g) for g in grid_thw.tolist()]
        crops = self._crops(pixel_values, [t for t, _, _ in grids])
        most = max(c.shape[0] for c in crops)
        padded = crops[0].new_zeros(len(crops), most, *crops[0].shape[1:])
        for i, c in enumerate(crops):
            padded[i, : c.shape[0]] = c
        return {
            "pixel_values": padded,
            "image_sizes": torch.tensor([[h, w] for _, h, w in grids], dtype=torch.long),
            "batch_num_images": torch.tensor(_samples_of(grids), dtype=torch.long),
        }

    # ---- vision ---------------------------------------------------------------------------------

    def _crops(self, rows: torch.Tensor, crops_per_item: list[int]) -> list[torch.Tensor]:
        """``[t, C, S, S]`` per item from pixel rows (views)."""
        c = self.config.vision_config.num_channels
        per_crop = rows.reshape(-1, c, self.crop, self.crop)
        return list(torch.split(per_crop, crops_per_item))

    def encode(self, model, pixel_values, grid_thw, kinds=None):
        # get_image_features (modeling_llava_onevision.py) with the crops of each image as grid_thw
        # says, not as image_sizes and batch_num_images would infer them, and get_video_features
        # for the units of kind "video": the tower on every crop and frame at once, the
        # feature layer(s) (the "full" strategy), the projector, then the model's own
        # pack_image_features for the images, and its apply_pooling and one image_newline row
        # for each video.
        config, inner = self.config, model.model
        grids = [tuple(int(v) for v in g) for g in grid_thw.tolist()]
        counts = [t for t, _, _ in grids]
        crops = torch.cat(self._crops(pixel_values, counts)) if grids else pixel_values
        feats = self._feature_layers(inner.vision_tower, crops)
        feats = torch.split(inner.multi_modal_projector(feats), counts)
        videos = [k == "video" for k in (kinds or ("image",) * len(grids))]
        # The dummy frame of a rank without units is grid (1, 1, 1): one base crop, packed alike.
        images = [f for f, video in zip(feats, videos, strict=True) if not video]
        if images:
            sizes = [[h, w] for (_, h, w), video in zip(grids, videos, strict=True) if not video]
            images, _ = inner.pack_image_features(
                images,
                torch.tensor(sizes, dtype=torch.long),
                image_newline=inner.image_newline,
                vision_aspect_ratio=config.vision_aspect_ratio,
            )
        images, out = iter(images), []
        for f, video in zip(feats, videos, strict=True):
            if video:
                pooled = inner.apply_pooling(f).reshape(-1, f.shape[-1])
                out += [pooled, inner.image_newline[None].to(pooled.dtype)]
            else:
                out.append(next(images))
        return torch.cat(out)

    def _feature_layers(self, vision, crops: torch.Tensor) -> torch.Tensor:
        """The hidden states of ``vision_feature_layer`` (concatenated, for a list), caught by
        forward hooks on the embeddings and encoder layers: transformers' own
        ``output_hidden_states`` returns None once FSDP2 has wrapped the tower (checked in
        tests/hf/test_tiled_families.py), and the hidden states it returns are these outputs."""
        layer = self.config.vision_feature_layer
        wanted = [layer] if isinstance(layer, int) else list(layer)
        modules = [vision.embeddings, *vision.encoder.layers]
        caught, hooks = {}, []
        for i in {k % len(modules) for k in wanted}:

            def keep(module, args, out, i=i):
                caught[i] = out[0] if isinstance(out, tuple) else out

            hooks.append(modules[i].register_forward_hook(keep))
        try:
            vision(crops, return_dict=True)
        finally:
            for hook in hooks:
                hook.remove()
        return torch.cat([caught[k % len(modules)] for k in wanted], dim=-1)

    def vision_cost(self) -> EncoderCost:
        return llava_onevision_vision_cost(self.config)


def _samples_of(grids) -> list[int]:
    """``batch_num_images`` for the model's forward: 1 per anyres image (t > 1), and the length
    of each run of base-only images (t = 1), which the model reads as one multi-image sample."""
    counts = []
    for base, run in itertools.groupby(grids, key=lambda g: g[0] == 1):
        n = len(list(run))
        if base and n == 1:
            raise ValueError(
                "LLaVA-OneVision's forward reads a lone base-only image as an anyres one; "
                "base-only images come in multi-image samples of two or more"
            )
        counts += [n] if base else [1] * n
    return counts
