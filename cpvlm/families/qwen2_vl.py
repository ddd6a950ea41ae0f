"""Qwen2-VL: the base layout (M-RoPE from get_rope_index, merger inside the tower, no deepstack).

Its vision config's ``hidden_size`` is the tower's output (the text width) and ``embed_dim`` the
tower's own width. Cost model (w width, I = embed_dim * mlp_ratio, m merge size, P values per
patch, o output width): P w embedding; blocks 4 w^2 + 2 w I (fc1/fc2); one merger; every block
attends the whole frame.

The Qwen-VL processors, shared by the Qwen families built on this one: the data path's media
(``QwenVLMedia``; legend: H, W pixels; a grid (t, h, w) in patches of p pixels, m the spatial
merge size, tp the temporal patch size, C = 3 * tp * p * p the width of a pixel row). The grids
(and so the token counts) of every image are computed on every rank from the image header and
the processor's own resize rule, before any pixel is decoded; the rank that encodes an image then
runs the processor and checks that it made that grid. Images go through the model's image
processor itself. Video processors need torchvision, which is often missing or broken on CPU
machines, so their pipeline is written out here as transformers 5.x runs it: resize every frame
to the video's size (bicubic with antialias on uint8, as torchvision's ``resize``), rescale and
normalise in one step (float32), patchify with frames padded to a multiple of tp by repeating the
last. Where torchvision works, tests compare it with the real video processor. Rules are keyed by
the processor class (``Pil``/``Fast`` suffixes dropped). Also the tiny Qwen-VL processor of the
kits' tiny checkpoints.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from transformers import Qwen2VLConfig
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize
from transformers.models.qwen3_vl.video_processing_qwen3_vl import (
    smart_resize as smart_resize_video,
)

from cpvlm.data.errors import DataError
from cpvlm.data.sample import VisionItem
from cpvlm.encoders.cost import EncoderCost, block_linear_macs
from cpvlm.encoders.pieces import Groups, band_rows, group_band
from cpvlm.hf.adapter import VLMAdapter
from cpvlm.hf.chat_media import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD, ChatMedia, frames_of
from cpvlm.hf.kit import FamilyKit, TinyProcessor
from cpvlm.hf.registration import register
from cpvlm.hf.tiny import TEXT, VISION, VISION_TOKEN_IDS, split_overrides, with_overrides
from cpvlm.hf.tower_cost import patch_merger_macs, values_per_patch

# ---- the Qwen-VL processors' rules (the data path) -----------------------------------------------

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
            f"cpvlm knows {', '.join(IMAGE_RULES)} (a chat_media's image_grid)"
        )
    p, m = image_processor.patch_size, image_processor.merge_size
    size = image_processor.size
    h, w = smart_resize(
        height, width, p * m, min_pixels=size["shortest_edge"], max_pixels=size["longest_edge"]
    )
    return 1, h // p, w // p


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
                f"no video rule for {name}; cpvlm knows {', '.join(VIDEO_DEFAULTS)} (a "
                "chat_media's video pipeline)"
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


def image_piece_rows(
    image_processor, image, grid: tuple[int, int, int], groups: Groups
) -> torch.Tensor | None:
    """Pixel rows of merge groups ``groups`` of a PIL ``image`` as ``image_processor`` would make
    them for the whole image; None where this processor has no band path (not a Qwen-VL image
    processor on the PIL backend), or its resize gives another grid than ``grid`` (the
    whole-image path then reports it).

    A resize reads neighbouring pixels, so the whole image is resized as the processor does it;
    the steps after it (rescale and normalise, per pixel; patchify, a permutation) then run, in
    the processor's own ``_preprocess`` with the resize done, on the band of merged rows that
    holds the piece (``cpvlm.encoders.pieces.group_band``), and the piece's rows are taken from
    the band's: equal to the whole image's rows at those groups, bit for bit."""
    try:
        from transformers.image_processing_backends import PilBackend
    except ImportError:
        return None
    ip = image_processor
    if not isinstance(ip, PilBackend) or base_class_name(type(ip).__name__) not in IMAGE_RULES:
        return None
    # transformers' own preprocess: the call's options from the processor, then its inputs
    kwargs = {n: getattr(ip, n, None) for n in ip._valid_kwargs_names}
    kwargs = ip._standardize_kwargs(**kwargs)
    (x,) = ip._prepare_image_like_inputs([image], **kwargs)
    side = kwargs["patch_size"] * kwargs["merge_size"]
    if kwargs["do_resize"]:  # as Qwen2VLImageProcessorPil._preprocess resizes
        x = ip.resize(x, size=kwargs["size"], resample=kwargs["resample"], factor=side)
    p = kwargs["patch_size"]
    if tuple(x.shape[-2:]) != (grid[1] * p, grid[2] * p):
        return None
    wg = x.shape[-1] // side
    first, stop = group_band(groups, wg)
    band = x[..., first * side : stop * side, :]
    out = ip._preprocess([band], **{**kwargs, "do_resize": False, "return_tensors": "pt"})
    return out["pixel_values"][band_rows(groups, wg, kwargs["merge_size"])]


def video_piece_rows(
    video: VideoSettings, frames_THWC: torch.Tensor, grid_hw: tuple[int, int], groups: Groups
) -> torch.Tensor:
    """Pixel rows of merge groups ``groups`` of tp frames, as ``video.pixels`` makes them for
    the whole frames (the resize on the whole frames, the rest on the band of the piece)."""
    p, m = video.patch_size, video.merge_size
    x = video.resized(frames_THWC, grid_hw)
    wg = grid_hw[1] // m
    first, stop = group_band(groups, wg)
    rows = video.rows(x[..., first * m * p : stop * m * p, :])
    return rows[band_rows(groups, wg, m)]


class QwenVLMedia(ChatMedia):
    """The data path of a Qwen-VL processor (``cpvlm.hf.chat_media``): image grids by the image
    processor's resize rule (within the pixel bounds asked for), ``image_grid_thw`` /
    ``video_grid_thw`` and video metadata for the replacement code, images through the image
    processor itself, videos through ``VideoSettings`` (``video_processor``: the video processor
    class a checkpoint that names none has); ``vision="split"`` pieces by their band."""

    video_processor: str = "Qwen2VLVideoProcessor"

    def __init__(
        self,
        adapter,
        image_processor,
        video_config: dict,
        *,
        min_pixels: int | None = None,
        max_pixels: int | None = None,
        video_min_pixels: int | None = None,
        video_max_pixels: int | None = None,
    ):
        super().__init__(adapter, image_processor, video_config)
        size = image_processor.size
        image_processor.size = type(size)(
            shortest_edge=min_pixels or size["shortest_edge"],
            longest_edge=max_pixels or size["longest_edge"],
        )
        # the video processor's config over the class defaults; patch, merge and temporal sizes
        # default to the image processor's
        config = dict(video_config)
        for key in ("patch_size", "merge_size", "temporal_patch_size"):
            config.setdefault(key, getattr(image_processor, key))
        self.video = VideoSettings.from_config(config, self.video_processor)
        if video_min_pixels or video_max_pixels:
            self.video = dataclasses.replace(
                self.video,
                min_pixels=video_min_pixels or self.video.min_pixels,
                max_pixels=video_max_pixels or self.video.max_pixels,
            )
        merge = image_processor.merge_size
        if merge != adapter.merge_size:
            m = adapter.merge_size
            raise ValueError(
                f"the image processor merges {merge}x{merge} patches, the model {m}x{m}"
            )
        self.seconds = False

    @property
    def temporal_patch_size(self) -> int:
        return self.video.temporal_patch_size

    def video_stand_in(self):
        v = self.video
        return SimpleNamespace(
            merge_size=v.merge_size,
            temporal_patch_size=v.temporal_patch_size,
            patch_size=v.patch_size,
            model_input_names=["pixel_values_videos", "video_grid_thw"],
        )

    def processor_kwargs(self, settings):
        return {"video_processor": self.video_stand_in()}

    def bind(self, processor):
        super().bind(processor)
        self.seconds = "second_per_grid_ts" in processor.model_input_names

    def image_grid(self, height, width):
        return image_grid(self.image_processor, height, width)

    def video_item(self, frames, fps):
        height, width = frames[0].size()
        try:
            grid = self.video.grid(len(frames), height, width)
        except ValueError as err:
            raise DataError("unreadable_media", f"video {frames[0].name}: {err}") from None
        seconds = self.video.temporal_patch_size / (fps or 24.0) if self.seconds else None
        return VisionItem("video", grid, frames=frames, fps=fps, second_per_grid=seconds)

    def video_inputs(self, items, i):
        from transformers.video_utils import VideoMetadata

        inputs = {
            "video_grid_thw": torch.tensor([it.grid for it in items]).reshape(-1, 3),
            "video_metadata": [
                VideoMetadata(
                    total_num_frames=len(it.frames),
                    fps=it.fps,
                    frames_indices=list(range(len(it.frames))),
                )
                for it in items
            ],
        }
        return inputs, i

    def decode(self, item, temporal):
        if item.kind == "image":
            return super().decode(item, temporal)
        frames = frames_of(item, temporal, self.video.temporal_patch_size)
        return self.video.pixels(frames, item.grid[1:])

    def piece_rows(self, item, temporal, groups):
        if item.kind == "image":
            rows = image_piece_rows(self.image_processor, item.image.load(), item.grid, groups[0])
            if rows is not None:
                return rows
            return super().piece_rows(item, temporal, groups)
        tp = self.video.temporal_patch_size
        frames = frames_of(item, temporal, tp)
        return torch.cat(
            [
                video_piece_rows(
                    self.video, frames[i * tp : (i + 1) * tp], item.grid[1:], groups[j]
                )
                if j in groups
                else self.video.pixels(frames[i * tp : (i + 1) * tp], item.grid[1:])
                for i, j in enumerate(temporal)
            ]
        )


class Qwen3VLMedia(QwenVLMedia):
    """Qwen3-VL's processors: a checkpoint that names no video processor has Qwen3-VL's."""

    video_processor = "Qwen3VLVideoProcessor"


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


# ---- the family ------------------------------------------------------------------------------


def tiny_qwen2_vl_config(**overrides) -> Qwen2VLConfig:
    """A Qwen2-VL config small enough for float64 CPU tests (~190k parameters)."""
    vision, text, top = split_overrides(overrides)
    tower = {k: VISION[k] for k in ("depth", "num_heads", "in_channels", "patch_size")}
    tower |= {"temporal_patch_size": 2, "spatial_merge_size": 2}
    vision = with_overrides(
        {
            **tower,
            "embed_dim": VISION["hidden_size"],
            "hidden_size": TEXT["hidden_size"],
            "mlp_ratio": 2,
        },
        vision,
    )
    text = with_overrides(
        {
            **TEXT,  # head_dim = 64 / 4 = 16: 8 frequencies in contiguous T, H, W sections
            "bos_token_id": 1,
            "eos_token_id": 2,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 1e6,
                "mrope_section": [2, 3, 3],
            },
        },
        text,
    )
    top = with_overrides({**VISION_TOKEN_IDS, "attn_implementation": "sdpa"}, top)
    return Qwen2VLConfig(text_config=text, vision_config=vision, **top)


def qwen2_vl_vision_cost(vc) -> EncoderCost:
    w, m = vc.embed_dim, vc.spatial_merge_size
    linear = (
        values_per_patch(vc) * w
        + vc.depth * block_linear_macs(w, int(w * vc.mlp_ratio), gated=False)
        + patch_merger_macs(w, m, vc.hidden_size)
    )
    return EncoderCost(linear_per_patch=linear, pair=2 * w, full_blocks=vc.depth)


class Qwen2VLKit(FamilyKit):
    tiny_configs = {"qwen2-vl-tiny": tiny_qwen2_vl_config}
    # hidden_size is the tower's output width; embed_dim is the tower's.
    published_towers = {
        "Qwen2-VL-7B": {"depth": 32, "embed_dim": 1280, "mlp_ratio": 4, "num_heads": 16,
         "hidden_size": 3584, "patch_size": 14, "temporal_patch_size": 2,
         "spatial_merge_size": 2, "in_channels": 3},
    }  # fmt: skip


@register
class Qwen2VLAdapter(VLMAdapter):
    family = "qwen2_vl"
    model_classes = ("Qwen2VLForConditionalGeneration",)
    model_types = ("qwen2_vl",)
    kit = Qwen2VLKit
    chat_media = QwenVLMedia
    split_vision = True  # positions and cu_seqlens precomputable, everything else per patch

    def vision_cost(self):
        return qwen2_vl_vision_cost(self.config.vision_config)
