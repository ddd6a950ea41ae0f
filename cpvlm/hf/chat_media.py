"""A family's processor as the data path runs it: the one processor protocol of every family.

Legend: F frames, T frames asked of a video, (H, W) pixels, C channels.

``ChatEncoder`` (``cpvlm.hf.data.processor``) renders the template, expands the
placeholders with the processor's own ``replace_image_token`` / ``replace_video_token``,
tokenizes and labels. What differs between families is asked of the adapter's ``chat_media``
class, whose hooks are declared here: how the processor class is built around the parts, the
planned items of a sample's images and videos (grids from the headers, before any pixel is
decoded), what ``replace_*_token`` reads for each of them, the items in the model's order, and
the pixel rows of one item (or of a piece of it, ``vision="split"``) in cpvlm's layout (the
adapter's ``from_model_batch`` layout). The defaults are the base layout: ``(1, h, w)`` image
grids from a per-image resize rule (``image_grid``, none known by default), ``image_grid_thw``
for the replacement code, the image processor itself for pixels, no videos. Images go through
the checkpoint's image processor itself; video processors need torchvision, so
``frame_pixels`` writes out what transformers 5's ``BaseVideoProcessor`` does to frames (resize
bicubic with antialias on uint8, as torchvision's ``resize``, then rescale and normalise in one
step in float32). Audio (a family with an audio encoder): ``ChatEncoder`` sets the checkpoint's
feature extractor as ``feature_extractor`` before the processor is built; ``audio_item`` makes a
clip's feature frames (default: no audio) and ``audio_inputs`` is what ``replace_audio_token``
reads.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.nn.functional as F

from cpvlm.data.errors import DataError
from cpvlm.data.media import load_frames
from cpvlm.data.sample import AudioItem, VisionItem

OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


class ChatMedia:
    """The data path's hooks for one family's processor; the defaults are the base layout (see
    the module docstring). Built by ``ChatEncoder`` with the adapter, the checkpoint's image
    processor, its video processor config (file entries, ``{}`` when none) and the pixel bounds
    the user asked for (``None``: the processor's; a family without such bounds ignores them)."""

    temporal_patch_size = 1
    """Frames per temporal unit of a video (the loader names the frames a unit decodes)."""
    processor_parts: dict = {}
    """Further parts the processor class requires (``feature_extractor=None``)."""
    feature_extractor = None
    """The checkpoint's audio feature extractor (set by ``ChatEncoder`` where the model takes
    audio; None: none)."""

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
        if adapter.takes_videos and type(self).video_item is ChatMedia.video_item:
            raise ValueError(f"the data path has no video pipeline for {adapter.family}")
        self.adapter = adapter
        self.image_processor = image_processor
        self.video_config = video_config
        self.processor = None

    @classmethod
    def load_image_processor(cls, model_dir):
        """The checkpoint's image processor (default: ``AutoImageProcessor``; a family whose class
        needs torchvision gives its steps written out)."""
        from transformers import AutoImageProcessor

        return AutoImageProcessor.from_pretrained(model_dir, local_files_only=True)

    def video_stand_in(self):
        """What the processor's ``__init__`` and replacement code read of its video processor."""
        return SimpleNamespace(model_input_names=["pixel_values_videos"], **self.video_config)

    def processor_kwargs(self, settings: dict) -> dict:
        """The keywords of the processor class besides the tokenizer, image processor and chat
        template, given its ``settings`` from ``processor_config.json`` (``image_seq_length``,
        ...): the video stand-in (none for a family without videos), the parts, the settings."""
        if not self.adapter.takes_videos:
            return dict(settings)
        return {"video_processor": self.video_stand_in(), **self.processor_parts, **settings}

    def bind(self, processor) -> None:
        """Called once the processor is built around the parts."""
        self.processor = processor

    def image_grid(self, height: int, width: int) -> tuple[int, int, int]:
        """``(1, h, w)``: the grid the checkpoint's image processor gives an image of ``height x
        width`` pixels, computed from the header before any pixel is decoded (a ValueError: an
        image the processor refuses). Default: none known (the data path reports the family)."""
        raise ValueError(
            f"the data path has no resize rule for {self.adapter.family}'s image processor "
            f"{type(self.image_processor).__name__} (its chat_media's image_grid)"
        )

    def image_items(self, refs) -> list[VisionItem]:
        """The planned items of a sample's images, in order (all of them: a family may size an
        image by the number of images of its sample). Default: each by ``image_grid``."""
        items = []
        for ref in refs:
            height, width = ref.size()
            try:
                grid = self.image_grid(height, width)
            except ValueError as err:  # e.g. an aspect ratio the processor refuses
                raise DataError("unreadable_media", f"{ref.name}: {err}") from None
            items.append(VisionItem("image", grid, image=ref))
        return items

    def video_item(self, frames, fps) -> VisionItem:
        """The planned item of a video of ``frames`` (frame references) at ``fps`` (or None).
        Default: none (a family that takes videos and keeps this default has no data path: the
        media refuses to be built)."""
        raise DataError("bad_record", f"cpvlm takes no videos for {self.adapter.family}")

    def audio_item(self, ref) -> AudioItem:
        """The planned item of the audio clip ``ref`` (an ``AudioRef``): its feature frames.
        Default: none (the family's data path takes no audio)."""
        raise DataError("bad_record", f"cpvlm takes no audio for {self.adapter.family}")

    def audio_inputs(self, items, i) -> tuple[dict, int]:
        """``(audio_inputs, audio_idx)`` for ``replace_audio_token`` of ``items[i]``."""
        raise NotImplementedError

    def image_inputs(self, items, i) -> tuple[dict, int]:
        """``(image_inputs, image_idx)`` for ``replace_image_token`` of ``items[i]``. Default:
        the grids as ``image_grid_thw``."""
        grids = [it.grid for it in items]
        return {"image_grid_thw": torch.tensor(grids, dtype=torch.long).reshape(-1, 3)}, i

    def video_inputs(self, items, i) -> tuple[dict, int]:
        """``(video_inputs, video_idx)`` for ``replace_video_token`` of ``items[i]``."""
        raise NotImplementedError

    def model_items(self, images, videos, text: str):
        """``(images, videos)`` as the model takes them, from the processor's items and the
        rendered ``text`` (default: as they are)."""
        return tuple(images), tuple(videos)

    def decode(self, item: VisionItem, temporal) -> torch.Tensor:
        """Pixel rows of ``item`` (of its temporal units ``temporal``; None: all). Default: an
        image through the image processor itself, in the core's layout (the adapter's
        ``from_model_batch``), its grid checked against the planned one."""
        if item.kind != "image":
            raise DataError("bad_record", f"cpvlm takes no videos for {self.adapter.family}")
        out = self.image_processor(images=[item.image.load()], return_tensors="pt")
        out = self.adapter.from_model_batch(dict(out))  # the core's pixel rows and grid
        grid = tuple(int(v) for v in out["image_grid_thw"][0])
        if grid != item.grid:
            raise DataError(
                "vision_token_mismatch",
                f"{item.image.name}: the image processor made a grid {list(grid)}, the image "
                f"header gave {list(item.grid)}",
            )
        return out["pixel_values"]

    def piece_rows(self, item: VisionItem, temporal, groups) -> torch.Tensor:
        """``vision="split"``: the pixel rows of ``item``'s temporal units ``temporal``, of a
        unit j in ``groups`` only the rows of its merge groups ``groups[j]``; equal to the whole
        unit's rows at those groups. Default: the whole units decoded, the pieces' rows kept."""
        from cpvlm.data.loader import select_groups

        return select_groups(self.decode(item, temporal), temporal, groups, self.adapter.merge_size)


def frames_of(item: VisionItem, temporal, tp: int = 1) -> torch.Tensor:
    """``[T, H, W, C]`` uint8 frames of the temporal units ``temporal`` of a video item (past the
    end: the last frame again); a video file is decoded once for all its frames."""
    import numpy as np

    temporal = range(item.grid[0]) if temporal is None else temporal
    last = len(item.frames) - 1
    refs = [item.frames[min(f, last)] for j in temporal for f in range(j * tp, (j + 1) * tp)]
    frames = [torch.from_numpy(np.array(pil)) for pil in load_frames(refs)]
    sizes = {tuple(f.shape) for f in frames}
    if len(sizes) > 1:
        raise DataError("unreadable_media", f"video frames of different sizes {sorted(sizes)}")
    return torch.stack(frames)


def video_option(config: dict, key: str, default):
    value = config.get(key)
    return default if value is None else value


def frame_pixels(frames_THWC: torch.Tensor, size_hw, config: dict, defaults: dict) -> torch.Tensor:
    """``[T, C, h, w]`` float32: ``BaseVideoProcessor``'s resize to ``size_hw`` and its fused
    rescale and normalise, with the video processor ``config`` over the class ``defaults``."""
    x = frames_THWC.permute(0, 3, 1, 2).contiguous()
    if tuple(x.shape[-2:]) != tuple(size_hw):
        x = F.interpolate(x, size=tuple(size_hw), mode="bicubic", antialias=True)
    opt = lambda key: video_option(config, key, defaults[key])  # noqa: E731
    rescale, normalize = opt("do_rescale"), opt("do_normalize")
    factor = float(opt("rescale_factor"))
    x = x.to(torch.float32)
    if normalize:
        mean, std = torch.tensor(opt("image_mean")), torch.tensor(opt("image_std"))
        if rescale:  # fused: (x - mean / r) / (std / r)
            mean, std = mean * (1.0 / factor), std * (1.0 / factor)
        return x.sub(mean.view(-1, 1, 1)).div(std.view(-1, 1, 1))
    return x * factor if rescale else x


def clip_features(feature_extractor, samples) -> torch.Tensor:
    """``[frames, F]`` float32: the feature extractor on one clip's ``samples`` (mono, at its
    sampling rate), its valid frames (the attention mask). One clip per call: Whisper's
    extractor pads a batch to its longest clip, which changes a shorter clip's last frame and
    even its frame count."""
    out = feature_extractor(
        samples,
        sampling_rate=feature_extractor.sampling_rate,
        padding=True,
        truncation=False,
        return_attention_mask=True,
        return_tensors="pt",
    )
    features, mask = out["input_features"][0], out["attention_mask"][0].bool()
    return features.transpose(0, 1)[mask].contiguous()
