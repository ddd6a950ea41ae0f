"""Gemma 4's processor on the data path: variable-size images and videos of frames.

Legend: p patch side, k pooling kernel, (h, w) an image's or frame's size in patches, F frames.

``Gemma4ImageProcessor`` resizes an image (aspect ratio kept) to the largest size of at most
``max_soft_tokens * k**2`` patches with sides multiple of k*p (``get_aspect_ratio_preserving_size``,
computed from the header here), patchifies it and pads to that many patches; the processor
writes ``<boi>``, h*w/k**2 image tokens, ``<eoi>``. A video's frames are resized alike (the video
processor's own ``max_soft_tokens``), and written as ``mm:ss <boi> video tokens <eoi>`` per frame.
Planned grids: ``(1, h, w)`` per image, ``(F, h, w)`` per video; pixel rows are the real patches
(the adapter's layout; padding dropped by its ``from_model_batch``), each frame a unit.
"""

from __future__ import annotations

from transformers.models.gemma4.image_processing_pil_gemma4 import (
    get_aspect_ratio_preserving_size,
)
from transformers.video_utils import VideoMetadata

from cpvlm.data.errors import DataError
from cpvlm.data.sample import VisionItem

from .chat_media import ChatMedia, frame_pixels, frames_of, video_option

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
    processor_parts = {"feature_extractor": None}  # no audio

    def __init__(self, adapter, image_processor, video_config):
        super().__init__(adapter, image_processor, video_config)
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
