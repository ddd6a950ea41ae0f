"""LLaVA-OneVision's processor on the data path: anyres images, and base-only ones in a sample of
several images.

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

import torch

from cpvlm.data.errors import DataError
from cpvlm.data.sample import VisionItem

from .chat_media import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD, ChatMedia, frame_pixels, frames_of

VIDEO_DEFAULTS = {  # LlavaOnevisionVideoProcessor's class defaults (its config overrides them)
    "size": {"height": 384, "width": 384},
    "do_rescale": True,
    "rescale_factor": 1 / 255,
    "do_normalize": True,
    "image_mean": OPENAI_CLIP_MEAN,
    "image_std": OPENAI_CLIP_STD,
}


class LlavaOnevisionMedia(ChatMedia):
    def __init__(self, adapter, image_processor, video_config):
        super().__init__(adapter, image_processor, video_config)
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
