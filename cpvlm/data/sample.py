"""One planned sample: its token ids and labels, its images and videos as grids, its audio clips.

Legend: L tokens of the sample, a grid (t, h, w) in patches, m spatial merge size, C the width of
a pixel row (channels * temporal patch * patch**2).

A ``SamplePlan`` holds everything every rank needs (ids, labels, grids) and, per vision item,
how to get its pixels: a reference to decode (conversations) or the pixel rows themselves
(tokenized samples). It is built identically on every rank; pixels are made later, only for the
units a rank encodes. An audio clip's feature frames are made while planning (its token count
needs its length) and travel with the plan; every rank passes every clip's frames.

Tokenized samples are dicts laid out as a processor of the base layout writes one sample (the
adapter's defaults, ``cpvlm.hf.adapter``; a leading batch dim of 1 is dropped): ``input_ids``
[L]; optional ``labels`` [L] (unshifted; default: the ids with image/video tokens set to -100),
``attention_mask`` (right padding, cut off); ``pixel_values`` [patches, C] + ``image_grid_thw``
[n, 3]; ``pixel_values_videos`` + ``video_grid_thw``; ``second_per_grid_ts`` [n_videos];
``mm_token_type_ids`` (ignored: derived).
A pixel entry may be a ``LazyPixels`` instead of a tensor: its rows are then made only where a
rank encodes them (the synthetic source's random pixels), not by every rank while planning.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace

import torch

from cpvlm.constants import IGNORE_INDEX
from cpvlm.data.errors import DataError
from cpvlm.data.media import ImageRef, VideoFrameRef

TOKENIZED_KEYS = (
    "input_ids",
    "labels",
    "attention_mask",
    "pixel_values",
    "image_grid_thw",
    "pixel_values_videos",
    "video_grid_thw",
    "second_per_grid_ts",
    "mm_token_type_ids",
)


@dataclass(frozen=True)
class TokenIds:
    """The ids and sizes the data path needs from a model config (read, not imported), and the
    family's token-type rule where placeholder ids alone do not say it (a family that writes video
    frames with image tokens: its rule looks at the enclosing video markers)."""

    image: int
    video: int
    merge: int
    vocab_size: int | None = None
    pixel_width: int = 0  # C of a pixel row: channels * temporal patch * patch**2
    types: Callable[[torch.Tensor], torch.Tensor] | None = field(
        default=None, compare=False, repr=False
    )
    sizes: Callable[[tuple[int, int, int], str], tuple[int, int]] | None = field(
        default=None, compare=False, repr=False
    )
    """``(grid, kind) -> (pixel rows, tokens)`` of an item (None: t*h*w and t*h*w/m**2)."""
    split_frames: bool = True
    """A video's temporal frames (a tiled image's tiles) are vision units of their own; else
    every item is one unit (the tower needs all of it at once)."""
    audio: int | None = None  # the audio placeholder id (None: the model takes no audio)
    audio_rows: Callable[[int], int] | None = field(default=None, compare=False, repr=False)
    """Placeholders of an audio clip of so many feature frames (the adapter's ``audio_rows``)."""

    def item_sizes(self, grid: tuple[int, int, int], kind: str) -> tuple[int, int]:
        if self.sizes is not None:
            return self.sizes(grid, kind)
        t, h, w = grid
        return t * h * w, t * h * w // self.merge**2

    @classmethod
    def from_config(cls, model_config, types=None) -> TokenIds:
        """``types``: ``input_ids -> mm_token_type_ids``, the family's rule (default: 1 at the
        image token, 2 at the video token)."""
        text = getattr(model_config, "text_config", model_config)
        vision = model_config.vision_config
        return cls(
            image=model_config.image_token_id,
            video=model_config.video_token_id,
            merge=vision.spatial_merge_size,
            vocab_size=getattr(text, "vocab_size", None),
            pixel_width=vision.in_channels * vision.temporal_patch_size * vision.patch_size**2,
            types=types,
        )

    def mm_token_type_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """1 at image placeholders, 2 at video placeholders, 0 elsewhere (same shape)."""
        if self.types is not None:
            return self.types(input_ids)
        return (input_ids == self.image).long() + 2 * (input_ids == self.video).long()


@dataclass(frozen=True)
class LazyPixels:
    """Rows ``[offset, offset + num_rows)`` of a virtual ``[*, width]`` pixel tensor, made on demand.

    ``make(start, stop)`` returns rows ``[start, stop)``: a pure function of the range (the same
    rows whichever ranges are asked for) and picklable, since DataLoader workers call it.
    """

    make: Callable[[int, int], torch.Tensor]
    num_rows: int
    width: int
    offset: int = 0

    @property
    def shape(self) -> tuple[int, int]:
        return (self.num_rows, self.width)

    def window(self, start: int, n: int) -> LazyPixels:
        """Rows ``[start, start + n)`` of these, still lazy."""
        return replace(self, num_rows=n, offset=self.offset + start)

    def rows(self, start: int = 0, stop: int | None = None) -> torch.Tensor:
        stop = self.num_rows if stop is None else stop
        return self.make(self.offset + start, self.offset + stop)


@dataclass(frozen=True)
class VisionItem:
    """One image or video of a sample, in patches, and how to get its pixel rows."""

    kind: str  # "image" or "video"
    grid: tuple[int, int, int]  # (t, h, w) in patches
    image: ImageRef | None = None  # an image to decode
    frames: tuple[ImageRef | VideoFrameRef, ...] = ()  # a video's frames to decode
    fps: float | None = None  # frames per second of ``frames`` (None: unknown)
    second_per_grid: float | None = None  # seconds per temporal patch (a positions input)
    pixels: torch.Tensor | LazyPixels | None = None  # [t*h*w, C] of tokenized samples

    @property
    def patches_per_frame(self) -> int:
        return self.grid[1] * self.grid[2]


@dataclass(frozen=True)
class AudioItem:
    """One audio clip of a sample: its feature frames, as the model's feature extractor made them
    for the clip alone (only its valid frames)."""

    features: torch.Tensor  # [frames, F]
    name: str = ""  # the file, for reports

    @property
    def frames(self) -> int:
        return int(self.features.shape[0])


@dataclass
class SamplePlan:
    """A sample as every rank plans it; ``len`` is its token count."""

    index: int
    where: str
    input_ids: torch.Tensor  # [L] long
    labels: torch.Tensor  # [L] long, unshifted, -100 = not learned
    images: tuple[VisionItem, ...] = ()
    videos: tuple[VisionItem, ...] = ()
    truncated: bool = False
    audios: tuple[AudioItem, ...] = ()
    extra: dict = field(default_factory=dict)

    def __len__(self) -> int:
        return int(self.input_ids.numel())

    @property
    def has_vision(self) -> bool:
        return bool(self.images or self.videos)

    @property
    def has_media(self) -> bool:
        return self.has_vision or bool(self.audios)

    def truncate(self, n: int) -> SamplePlan:
        """The first ``n`` tokens (text-only samples only: an image or a clip is never cut)."""
        assert not self.has_media
        return SamplePlan(
            self.index, self.where, self.input_ids[:n], self.labels[:n], truncated=True
        )


def check_tokens(plan: SamplePlan, ids: TokenIds) -> None:
    """Placeholder counts against the grids, and ids inside the vocabulary."""
    types = ids.mm_token_type_ids(plan.input_ids)
    for kind, type_id, token, items in (
        ("image", 1, ids.image, plan.images),
        ("video", 2, ids.video, plan.videos),
    ):
        have = int((types == type_id).sum())
        need = sum(ids.item_sizes(it.grid, kind)[1] for it in items)
        if have != need:
            grids = [list(it.grid) for it in items]
            rule = "the family's rule" if ids.sizes else f"t*h*w/{ids.merge}**2 each"
            raise DataError(
                "vision_token_mismatch",
                f"{have} {kind} tokens (id {token}) but the {kind} grids {grids} need {need} "
                f"({rule})",
            )
    if plan.audios or ids.audio is not None:
        have = int((plan.input_ids == ids.audio).sum()) if ids.audio is not None else 0
        need = sum(ids.audio_rows(a.frames) for a in plan.audios) if plan.audios else 0
        if have != need:
            frames = [a.frames for a in plan.audios]
            raise DataError(
                "vision_token_mismatch",
                f"{have} audio tokens (id {ids.audio}) but audio clips of {frames} feature frames "
                f"need {need}",
            )
    if ids.vocab_size is not None and len(plan):
        lo, hi = int(plan.input_ids.min()), int(plan.input_ids.max())
        if lo < 0 or hi >= ids.vocab_size:
            bad = lo if lo < 0 else hi
            raise DataError(
                "out_of_vocab",
                f"token id {bad} is outside the model's vocabulary (0..{ids.vocab_size - 1}); "
                "the tokenizer and the model do not match",
            )


def _as_1d_long(name: str, value) -> torch.Tensor:
    t = torch.as_tensor(value)
    if t.dim() == 2 and t.shape[0] == 1:
        t = t[0]
    if t.dim() != 1 or t.is_floating_point() or t.is_complex():
        raise DataError(
            "bad_record",
            f"{name} must be a 1-d integer sequence (or [1, L]), got shape {tuple(t.shape)} "
            f"dtype {t.dtype}",
        )
    return t.long()


def _tokenized_items(raw, kind, pix_key, grid_key, ids) -> tuple[VisionItem, ...]:
    grid, pixels = raw.get(grid_key), raw.get(pix_key)
    if grid is None and pixels is None:
        return ()
    if grid is None or pixels is None:
        raise DataError("vision_token_mismatch", f"{pix_key} and {grid_key} come together")
    grids = [tuple(int(v) for v in g) for g in torch.as_tensor(grid).long().reshape(-1, 3)]
    if not isinstance(pixels, LazyPixels):
        pixels = torch.as_tensor(pixels)
    patches = sum(ids.item_sizes(g, kind)[0] for g in grids)
    if len(pixels.shape) != 2 or pixels.shape[0] != patches:
        raise DataError(
            "vision_token_mismatch",
            f"{grid_key} {[list(g) for g in grids]} needs {patches} rows of {pix_key}, got shape "
            f"{tuple(pixels.shape)}",
        )
    seconds = raw.get("second_per_grid_ts") if kind == "video" else None
    seconds = None if seconds is None else torch.as_tensor(seconds).reshape(-1).tolist()
    items, start = [], 0
    for i, g in enumerate(grids):
        n = ids.item_sizes(g, kind)[0]
        sec = None if seconds is None else float(seconds[i])
        rows = (
            pixels.window(start, n) if isinstance(pixels, LazyPixels) else pixels[start : start + n]
        )
        items.append(VisionItem(kind, g, pixels=rows, second_per_grid=sec))
        start += n
    return tuple(items)


def plan_tokenized(raw: Mapping, ids: TokenIds, index: int, where: str) -> SamplePlan:
    """A tokenized sample dict (the layout above) as a checked ``SamplePlan``."""
    unknown = set(raw) - set(TOKENIZED_KEYS)
    if unknown:
        raise DataError("bad_record", f"unknown keys {sorted(unknown)}; known: {TOKENIZED_KEYS}")
    input_ids = _as_1d_long("input_ids", raw["input_ids"])
    placeholder = ids.mm_token_type_ids(input_ids) != 0
    if raw.get("labels") is None:
        labels = input_ids.masked_fill(placeholder, IGNORE_INDEX)
    else:
        labels = _as_1d_long("labels", raw["labels"])
    if labels.shape != input_ids.shape:
        raise DataError(
            "bad_record", f"labels have {labels.numel()} tokens, input_ids {input_ids.numel()}"
        )
    if raw.get("attention_mask") is not None:
        keep = _as_1d_long("attention_mask", raw["attention_mask"]).bool()
        n = int(keep.sum())
        if keep.shape != input_ids.shape or not bool(keep[:n].all()):
            raise DataError("bad_record", "attention_mask must be right padding (1s then 0s)")
        input_ids, labels = input_ids[:n], labels[:n]
    if input_ids.numel() == 0:
        raise DataError("bad_record", "no tokens")
    plan = SamplePlan(
        index,
        where,
        input_ids,
        labels,
        images=_tokenized_items(raw, "image", "pixel_values", "image_grid_thw", ids),
        videos=_tokenized_items(raw, "video", "pixel_values_videos", "video_grid_thw", ids),
    )
    check_tokens(plan, ids)
    return plan
