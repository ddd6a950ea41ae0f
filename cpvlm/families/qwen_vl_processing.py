"""How a Hugging Face processor sizes images and videos, and its video pixel pipeline.

Legend: H, W pixels; a grid (t, h, w) in patches of p pixels, m the spatial merge size, tp the
temporal patch size, C = 3 * tp * p * p the width of a pixel row.

The grids (and so the token counts) of every image are computed on every rank from the image
header and the processor's own resize rule, before any pixel is decoded; the rank that encodes
an image then runs the processor and checks that it made that grid. Images go through the
model's image processor itself. Video processors need torchvision, which is often missing or
broken on CPU machines, so their pipeline is written out here as transformers 5.x runs it:
resize every frame to the video's size (bicubic with antialias on uint8, as torchvision's
``resize``), rescale and normalise in one step (float32), patchify with frames padded to a
multiple of tp by repeating the last. Where torchvision works, tests compare it with the real
video processor.

Rules are keyed by the processor class (``Pil``/``Fast`` suffixes dropped); a family whose
processor differs gives its own ``processor_image_grid`` and ``video_processing``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize
from transformers.models.qwen3_vl.video_processing_qwen3_vl import (
    smart_resize as smart_resize_video,
)

from cpvlm.hf.kit import TinyProcessor

OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)

IMAGE_RULES = ("Qwen2VLImageProcessor",)
VIDEO_DEFAULTS = {
    # The class defaults of transformers' video processors (their configs override them).
    "Qwen2VLVideoProcessor": {
        "size": {"shortest_edge": 128 * 28 * 28, "longest_edge": 28 * 28 * 768},
        "patch_size": 14,
        "temporal_patch_size": 2,
        "merge_size": 2,
        "image_mean": list(OPENAI_CLIP_MEAN),
        "image_std": list(OPENAI_CLIP_STD),
        "rescale_factor": 1 / 255,
        "cap_pixels_per_frame": None,
        "max_video_tokens": 128000,
    },
    "Qwen3VLVideoProcessor": {
        "size": {"shortest_edge": 128 * 32 * 32, "longest_edge": 32 * 32 * 768},
        "patch_size": 16,
        "temporal_patch_size": 2,
        "merge_size": 2,
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
        "rescale_factor": 1 / 255,
        "cap_pixels_per_frame": None,
        "max_video_tokens": 768,
    },
}


def base_class_name(name: str) -> str:
    for suffix in ("Pil", "Fast"):
        name = name.removesuffix(suffix)
    return name


def image_grid(image_processor, height: int, width: int) -> tuple[int, int, int]:
    """``(1, h, w)``: the grid the image processor gives an image of ``height x width``."""
    name = base_class_name(type(image_processor).__name__)
    if name not in IMAGE_RULES:
        raise ValueError(
            f"no resize rule for the image processor {type(image_processor).__name__}; "
            f"cpvlm knows {', '.join(IMAGE_RULES)} (an adapter's processor_image_grid)"
        )
    p, m = image_processor.patch_size, image_processor.merge_size
    size = image_processor.size
    h, w = smart_resize(
        height, width, p * m, min_pixels=size["shortest_edge"], max_pixels=size["longest_edge"]
    )
    return 1, h // p, w // p


class QwenVLProcessing:
    """Adapter mixin: the data path's image grid and video pipeline of a Qwen-VL processor
    (``video_processor``: the video processor class a checkpoint that names none has)."""

    video_processor: str = "Qwen2VLVideoProcessor"

    def processor_image_grid(self, image_processor, height: int, width: int):
        return image_grid(image_processor, height, width)

    def video_processing(self, config: dict) -> VideoSettings:
        return VideoSettings.from_config(config, self.video_processor)


@dataclass(frozen=True)
class VideoSettings:
    """A video processor's settings (its config over its class defaults)."""

    processor: str  # the class name, e.g. "Qwen3VLVideoProcessor"
    min_pixels: int
    max_pixels: int
    patch_size: int
    temporal_patch_size: int
    merge_size: int
    image_mean: tuple[float, ...]
    image_std: tuple[float, ...]
    rescale_factor: float
    cap_pixels_per_frame: bool
    max_video_tokens: int

    @classmethod
    def from_config(cls, config: dict, default_class: str) -> VideoSettings:
        name = base_class_name(config.get("video_processor_type") or default_class)
        if name not in VIDEO_DEFAULTS:
            raise ValueError(
                f"no video rule for {name}; cpvlm knows {', '.join(VIDEO_DEFAULTS)} (an adapter's "
                "video_processing)"
            )
        merged = {**VIDEO_DEFAULTS[name], **{k: v for k, v in config.items() if v is not None}}
        size = dict(merged["size"])
        size["shortest_edge"] = merged.get("min_pixels", size["shortest_edge"])
        size["longest_edge"] = merged.get("max_pixels", size["longest_edge"])
        return cls(
            processor=name,
            min_pixels=int(size["shortest_edge"]),
            max_pixels=int(size["longest_edge"]),
            patch_size=int(merged["patch_size"]),
            temporal_patch_size=int(merged["temporal_patch_size"]),
            merge_size=int(merged["merge_size"]),
            image_mean=tuple(merged["image_mean"]),
            image_std=tuple(merged["image_std"]),
            rescale_factor=float(merged["rescale_factor"]),
            cap_pixels_per_frame=bool(merged["cap_pixels_per_frame"]),
            max_video_tokens=int(merged["max_video_tokens"]),
        )

    def grid(self, num_frames: int, height: int, width: int) -> tuple[int, int, int]:
        """``(t, h, w)`` of a video of ``num_frames`` frames of ``height x width``."""
        p, tp = self.patch_size, self.temporal_patch_size
        factor = p * self.merge_size
        max_pixels = self.max_pixels
        if self.processor == "Qwen3VLVideoProcessor":
            if self.cap_pixels_per_frame:
                frame_cap = self.max_video_tokens * factor * factor
                per_frame = max(
                    min(frame_cap, self.max_pixels // num_frames), int(self.min_pixels * 1.05)
                )
                max_pixels = per_frame * num_frames
            h, w = smart_resize_video(
                num_frames, height, width, tp, factor, self.min_pixels, max_pixels
            )
        else:
            if self.cap_pixels_per_frame:
                total = int(self.max_video_tokens * factor * factor * 0.9)
                max_pixels = max(
                    min(max_pixels, total * tp // num_frames), int(self.min_pixels * 1.05)
                )
            h, w = smart_resize(height, width, factor, self.min_pixels, max_pixels)
        return math.ceil(num_frames / tp), h // p, w // p

    def pixels(self, frames_THWC: torch.Tensor, grid_hw: tuple[int, int]) -> torch.Tensor:
        """Pixel rows ``[T/tp * h * w, C]`` of uint8 frames (T a multiple of tp)."""
        return self.rows(self.resized(frames_THWC, grid_hw))

    def resized(self, frames_THWC: torch.Tensor, grid_hw: tuple[int, int]) -> torch.Tensor:
        """``[T, C, h*p, w*p]`` uint8: the frames at the grid's size."""
        p = self.patch_size
        gh, gw = grid_hw
        x = frames_THWC.permute(0, 3, 1, 2).contiguous()
        if tuple(x.shape[-2:]) != (gh * p, gw * p):
            x = F.interpolate(x, size=(gh * p, gw * p), mode="bicubic", antialias=True)
        return x

    def rows(self, x_TCHW: torch.Tensor) -> torch.Tensor:
        """Pixel rows of resized frames (or of a band of their merged rows): per pixel rescale
        and normalise, then patchify."""
        mean = torch.tensor(self.image_mean) * (1.0 / self.rescale_factor)
        std = torch.tensor(self.image_std) * (1.0 / self.rescale_factor)
        x = x_TCHW.to(torch.float32).sub(mean.view(-1, 1, 1)).div(std.view(-1, 1, 1))
        return patchify_video(x, self.patch_size, self.merge_size, self.temporal_patch_size)


def patchify_video(x_TCHW: torch.Tensor, p: int, m: int, tp: int) -> torch.Tensor:
    """The Qwen-VL video patch layout: rows (t, h/m, w/m, m, m), features (C, tp, p, p)."""
    T, C, H, W = x_TCHW.shape
    gt, gh, gw = T // tp, H // p, W // p
    x = x_TCHW.view(gt, tp, C, gh // m, m, p, gw // m, m, p)
    x = x.permute(0, 3, 6, 4, 7, 2, 1, 5, 8)
    return x.reshape(gt * gh * gw, C * tp * p * p)


# ---- a tiny Qwen-VL processor (the kits' tiny checkpoints) ---------------------------------------

SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
)
_TEMPLATE = """{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}{% for message in messages %}{SYSTEM}<|im_start|>{{ message['role'] }}
{% if message['content'] is string %}{{ message['content'] }}<|im_end|>
{% else %}{% for content in message['content'] %}{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}{% set image_count.value = image_count.value + 1 %}{% if add_vision_id %}Picture {{ image_count.value }}: {% endif %}<|vision_start|><|image_pad|><|vision_end|>{% elif content['type'] == 'video' or 'video' in content %}{% set video_count.value = video_count.value + 1 %}{% if add_vision_id %}Video {{ video_count.value }}: {% endif %}<|vision_start|><|video_pad|><|vision_end|>{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>
{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""  # noqa: E501
_DEFAULT_SYSTEM = """{% if loop.first and message['role'] != 'system' %}<|im_start|>system
You are a helpful assistant.<|im_end|>
{% endif %}"""
IMAGE_MIN_PIXELS = 16 * 16 * 4  # 4 x 4 patches of 8 pixels: 4 merged tokens
IMAGE_MAX_PIXELS = 16 * 16 * 16  # 8 x 8 patches: 16 merged tokens
VIDEO_MIN_PIXELS = 16 * 16 * 4
VIDEO_MAX_PIXELS = 16 * 16 * 4 * 8


def _config_ids(tokenizer) -> dict:
    t = tokenizer.convert_tokens_to_ids
    return {
        "image_token_id": t("<|image_pad|>"),
        "video_token_id": t("<|video_pad|>"),
        "vision_start_token_id": t("<|vision_start|>"),
        "vision_end_token_id": t("<|vision_end|>"),
    }


def _image_processor(config):
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    v = config.vision_config
    return Qwen2VLImageProcessorPil(
        patch_size=v.patch_size,
        merge_size=v.spatial_merge_size,
        temporal_patch_size=v.temporal_patch_size,
        min_pixels=IMAGE_MIN_PIXELS,
        max_pixels=IMAGE_MAX_PIXELS,
    )


def tiny_qwen_vl_processor(
    processor_class: str, video_processor: str, *, system_prompt: bool
) -> TinyProcessor:
    """A Qwen-VL processor at toy size: the Qwen-VL chat template (with Qwen2-VL's default
    system prompt, or without, as Qwen3-VL's), a ``Qwen2VLImageProcessor`` and a video processor
    with the model's patch / merge sizes."""

    def video(config) -> dict:
        v = config.vision_config
        return {
            "video_processor_type": video_processor,
            "patch_size": v.patch_size,
            "merge_size": v.spatial_merge_size,
            "temporal_patch_size": v.temporal_patch_size,
            "size": {"shortest_edge": VIDEO_MIN_PIXELS, "longest_edge": VIDEO_MAX_PIXELS},
        }

    return TinyProcessor(
        special_tokens=SPECIAL_TOKENS,
        tokenizer_kwargs={"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"},
        chat_template=_TEMPLATE.replace("{SYSTEM}", _DEFAULT_SYSTEM if system_prompt else ""),
        processor_class=processor_class,
        config_ids=_config_ids,
        image_processor=_image_processor,
        video_processor=video,
    )
