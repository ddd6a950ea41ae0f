"""What packing and dealing rows to DP ranks need to know of a sample, without planning it.

Legend: L tokens of a sample, (t, h, w) an item's grid in patches.

Planning a sample (chat template, tokenizer, image headers) is the expensive part of the data
path. Packing a window and dealing its rows to DP ranks needs much less: each sample's token
count and its images' and videos' grids. A source that knows these facts cheaply (a prepared
cache, ``cpvlm prepare``) exposes them as ``source.meta(index) -> SampleMeta``; the row stream
uses them when the source has them, so that a rank fully plans only the samples of its own rows.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SampleMeta:
    """A sample's size: its token count (before any cut to ``seq_len``) and its items' grids."""

    tokens: int  # L
    image_grids: tuple[tuple[int, int, int], ...] = ()  # (t, h, w) per image, in order
    video_grids: tuple[tuple[int, int, int], ...] = ()  # (t, h, w) per video, in order
    audio_frames: tuple[int, ...] = ()  # feature frames per audio clip, in order

    @property
    def has_vision(self) -> bool:
        return bool(self.image_grids or self.video_grids)

    @property
    def has_media(self) -> bool:
        """Images, videos or audio clips: the sample is never cut to ``seq_len``."""
        return self.has_vision or bool(self.audio_frames)
