"""InternVL's processor on the data path: tiles of images, video frames as one-tile images.

Legend: s tile side in patches, S = s * p in pixels, k tiles of an image, F frames of a video.

``InternVLProcessor`` cuts an image into k tiles (``GotOcr2ImageProcessor`` with
``crop_to_patches``: the tile grid from the aspect ratio, a thumbnail when more than one) and
writes ``<img>``, k * image_seq_length context tokens, ``</img>``; a video's frames are resized to
S x S by its video processor and written as ``Frame1: <img>...</img>\\nFrame2: ...``, and the
processor puts every tile and frame into one ``pixel_values`` in the order of the placeholders.
So the planned items are an image ``(k, s, s)`` and a video ``(F, s, s)``, and the model's items
are all images in text order (the video with its frames as the "tiles"); pixel rows are each
tile's ``[C, S, S]`` values viewed as s*s rows (the adapter's layout). The tile count comes from
the header through the image processor's own ``get_number_of_image_patches``.
"""

from __future__ import annotations

import dataclasses
import re

import torch

from cpvlm.data.errors import DataError
from cpvlm.data.sample import VisionItem

from .chat_media import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD, ChatMedia, frame_pixels, frames_of

VIDEO_DEFAULTS = {  # InternVLVideoProcessor's class defaults (its config overrides them)
    "size": {"height": 384, "width": 384},
    "do_rescale": True,
    "rescale_factor": 1 / 255,
    "do_normalize": True,
    "image_mean": list(OPENAI_CLIP_MEAN),
    "image_std": list(OPENAI_CLIP_STD),
}


class InternVLMedia(ChatMedia):
    def __init__(self, adapter, image_processor, video_config):
        super().__init__(adapter, image_processor, video_config)
        self.side = adapter.tile_side
        pixels = self.side * adapter.patch
        size = image_processor.size
        if (size["height"], size["width"]) != (pixels, pixels):
            raise ValueError(
                f"the image processor makes tiles of {size['height']}x{size['width']}, the tower "
                f"takes {pixels} a side"
            )
        video = video_config.get("size") or VIDEO_DEFAULTS["size"]
        if (video["height"], video["width"]) != (pixels, pixels):
            raise ValueError(
                f"the video processor resizes frames to {video['height']}x{video['width']}, the "
                f"tower takes {pixels} a side"
            )
        self.images_kwargs = {}

    def bind(self, processor):
        super().bind(processor)
        merged = processor._merge_kwargs(tokenizer_init_kwargs=processor.tokenizer.init_kwargs)
        self.images_kwargs = {
            k: v for k, v in merged["images_kwargs"].items() if k != "return_tensors"
        }
        self.pattern = re.compile(
            f"({re.escape(processor.image_token)})|({re.escape(processor.video_token)})"
        )

    def image_items(self, refs):
        items = []
        for ref in refs:
            height, width = ref.size()
            k = self.image_processor.get_number_of_image_patches(height, width, self.images_kwargs)
            items.append(VisionItem("image", (k, self.side, self.side), image=ref))
        return items

    def video_item(self, frames, fps):
        return VisionItem("video", (len(frames), self.side, self.side), frames=frames, fps=fps)

    def image_inputs(self, items, i):
        return {"num_patches": [it.grid[0] for it in items]}, i

    def video_inputs(self, items, i):
        return {"pixel_values_videos": [torch.empty(it.grid[0], 0) for it in items]}, i

    def model_items(self, images, videos, text):
        images, videos = list(images), list(videos)
        order = []
        for match in self.pattern.finditer(text):
            if match.group(1):
                order.append(images.pop(0))
            else:  # a video's frames are one-tile images, its frames the item's "tiles"
                order.append(dataclasses.replace(videos.pop(0), kind="image"))
        return tuple(order), ()

    def decode(self, item, temporal):
        s = self.side
        if item.frames:  # a video: every frame resized to one tile
            frames = frames_of(item, temporal)
            tiles = frame_pixels(frames, (s * self.adapter.patch,) * 2, self.video_config,
                                 VIDEO_DEFAULTS)  # fmt: skip
            return tiles.reshape(tiles.shape[0] * s * s, -1)
        out = self.image_processor(
            images=[item.image.load()], **self.images_kwargs, return_tensors="pt"
        )
        tiles = out["pixel_values"]
        if tiles.shape[0] != item.grid[0]:
            raise DataError(
                "vision_token_mismatch",
                f"{item.image.name}: the image processor made {tiles.shape[0]} tiles, the image "
                f"header gave {item.grid[0]}",
            )
        if temporal is not None:
            tiles = tiles[list(temporal)]
        return tiles.reshape(tiles.shape[0] * s * s, -1)
