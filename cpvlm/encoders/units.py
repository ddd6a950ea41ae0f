"""Encoder units: the images, video frames and audio clips that ranks encode, and where their rows live.

Legend: N items (images or videos, rows of ``grid_thw``), U units, m = spatial merge size.
A grid (t, h, w) is in patch units; an item has t*h*w pixel rows (one per patch, C*tp*p*p values)
and t*h*w/m**2 output rows (one per merged token). Every item and unit has a kind, ``"image"`` or
``"video"`` (``KINDS``), carried beside its grid: a tower whose layout differs by kind
(LLaVA-OneVision pools a video's frames, packs an image's crops) sizes and encodes a unit by both.

An audio clip is an item of kind ``"audio"`` and grid (1, 1, n) (``clip_grid``): n feature
frames (its "pixel rows", one mel vector each), one unit (a clip is never split), sized by the
audio encoder's own rule (``sizes``) under merge size 1. Its encoder is another ``EncoderDataParallel`` than the
vision tower's, so a batch's units of one encoder are all vision or all audio.

In the Qwen-VL layout the pixel rows of a video are frame-major, and so are its output rows. A
video of grid (t, h, w) is therefore the contiguous concatenation of t frame units of grid
(1, h, w), in pixel rows and in output rows alike: splitting into frames and concatenating the
frames' outputs in unit order gives back the item order with no permutation. Splitting is exact
only for towers that treat frames independently (attention, positions and windows per frame);
see tests/vision/test_vision_qwen_frames.py for the Qwen2.5-VL and Qwen3-VL towers.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from itertools import accumulate

import torch

KINDS = ("image", "video", "audio")
"""The kinds of an item, in the order the towers take them (images, then videos; audio clips go
to their own encoder)."""


def check_kinds(kinds, n: int) -> tuple[str, ...]:
    """``kinds`` (one per item; None: every item an image) as a tuple, validated."""
    if kinds is None:
        return ("image",) * n
    kinds = tuple(kinds)
    if len(kinds) != n or any(k not in KINDS for k in kinds):
        raise ValueError(f"kinds must be {n} of {KINDS} (one per grid_thw row), got {kinds!r}")
    return kinds


def check_merge_size(merge_size: object) -> int:
    if isinstance(merge_size, bool) or not isinstance(merge_size, int) or merge_size < 1:
        raise ValueError(f"merge_size must be a positive int, got {merge_size!r}")
    return merge_size


def grid_list(grid_thw: torch.Tensor, merge_size: int) -> list[tuple[int, int, int]]:
    """Validate ``grid_thw`` [N, 3] and return it as Python ints."""
    if not isinstance(grid_thw, torch.Tensor):
        raise ValueError(
            f"grid_thw must be a tensor of shape [N, 3], got {type(grid_thw).__name__}"
        )
    if grid_thw.dim() != 2 or grid_thw.shape[1] != 3:
        raise ValueError(f"grid_thw must have shape [N, 3], got {tuple(grid_thw.shape)}")
    if grid_thw.is_floating_point() or grid_thw.is_complex() or grid_thw.dtype == torch.bool:
        raise ValueError(f"grid_thw must be an integer tensor, got {grid_thw.dtype}")
    grids = [tuple(int(v) for v in row) for row in grid_thw.tolist()]
    for i, (t, h, w) in enumerate(grids):
        if min(t, h, w) < 1:
            raise ValueError(f"grid_thw[{i}] = {[t, h, w]}: every dimension must be >= 1")
        if h % merge_size or w % merge_size:
            raise ValueError(
                f"grid_thw[{i}] = {[t, h, w]}: h and w must be divisible by the merge size "
                f"{merge_size} (the tower merges {merge_size}x{merge_size} patches per token)"
            )
    return grids


@dataclass(frozen=True)
class EncoderUnits:
    """The units of a batch of one encoder's items (images and videos, or audio clips),
    identical on every rank (a function of the grids).

    ``grids[u]`` is unit u's (t, h, w), ``kinds[u]`` its kind (its item's), ``items[u]`` the
    item it comes from. Units are in item order (frames of a video consecutive), so unit-order
    row concatenation equals item order.
    """

    grids: tuple[tuple[int, int, int], ...]
    kinds: tuple[str, ...]
    items: tuple[int, ...]
    merge_size: int
    num_items: int
    sizes: tuple[tuple[int, int], ...] | None = None
    """(pixel rows, output rows) of each unit where the tower's layout is not t*h*w and
    t*h*w/m**2 (``vision_units(..., sizes=)``); None: those."""

    @property
    def num_units(self) -> int:
        return len(self.grids)

    @property
    def pixel_counts(self) -> list[int]:
        """Pixel rows (patches) of each unit: t*h*w."""
        if self.sizes is not None:
            return [p for p, _ in self.sizes]
        return [t * h * w for t, h, w in self.grids]

    @property
    def row_counts(self) -> list[int]:
        """Output rows (merged tokens) of each unit: t*h*w / m**2."""
        if self.sizes is not None:
            return [r for _, r in self.sizes]
        m2 = self.merge_size**2
        return [t * h * w // m2 for t, h, w in self.grids]

    @property
    def pixel_offsets(self) -> list[int]:
        return [0, *accumulate(self.pixel_counts)]

    @property
    def row_offsets(self) -> list[int]:
        return [0, *accumulate(self.row_counts)]

    def grid_thw(self, units: list[int] | None = None) -> torch.Tensor:
        """``[len(units), 3]`` grids of the given units (all by default), as the tower takes them."""
        chosen = self.grids if units is None else [self.grids[u] for u in units]
        return torch.tensor(chosen, dtype=torch.long).reshape(-1, 3)

    def kinds_of(self, units: list[int] | None = None) -> tuple[str, ...]:
        """The kinds of the given units (all by default), beside ``grid_thw(units)``."""
        return self.kinds if units is None else tuple(self.kinds[u] for u in units)

    def pixel_index(self, units: list[int]) -> torch.Tensor:
        """Indices of the given units' pixel rows, in the order of ``units``."""
        return _ranges(self.pixel_offsets, units)

    def row_index(self, units: list[int]) -> torch.Tensor:
        """Indices of the given units' output rows (in item order), in the order of ``units``."""
        return _ranges(self.row_offsets, units)

    def item_row_counts(self) -> list[int]:
        """Output rows of each item, to split unit-order rows back into items."""
        counts = [0] * self.num_items
        for item, n in zip(self.items, self.row_counts):
            counts[item] += n
        return counts

    def split_by_item(self, rows: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Split rows in unit order (= item order) into one tensor per item."""
        return torch.split(rows, self.item_row_counts())


def _ranges(offsets: list[int], units: list[int]) -> torch.Tensor:
    parts = [torch.arange(offsets[u], offsets[u + 1]) for u in units]
    return torch.cat(parts) if parts else torch.empty(0, dtype=torch.long)


UnitSizes = Callable[[tuple[int, int, int], str], tuple[int, int]]
"""``sizes(grid, kind) -> (pixel rows, output rows)`` of a unit of ``grid`` and ``kind`` in a
tower's own layout."""


def clip_grid(frames) -> torch.Tensor:
    """``[clips, 3]``: the ``grid_thw`` of audio clips of ``frames`` feature frames each, one
    unit of grid (1, 1, n) per clip (the rows an audio ``EncoderDataParallel`` takes)."""
    return torch.tensor([(1, 1, int(n)) for n in frames], dtype=torch.long).reshape(-1, 3)


def vision_units(
    grid_thw: torch.Tensor,
    merge_size: int = 2,
    *,
    split_frames: bool = True,
    sizes: UnitSizes | None = None,
    kinds=None,
) -> EncoderUnits:
    """Units of the items of ``grid_thw``: one per image, one per temporal frame of a video.

    With ``split_frames=False`` a video stays one unit (for towers that attend across frames).
    ``sizes``: the pixel and output rows of a unit of a grid, for a tower whose layout is not the
    Qwen-VL one (LLaVA-OneVision: an image's crops and its packed rows); default t*h*w and
    t*h*w/m**2. ``kinds``: each item's kind (``KINDS``; None: every item an image). Audio clips
    (``clip_grid``, kind ``"audio"``) are units of it too under merge size 1 and
    ``split_frames=False``: what ``EncoderDataParallel.units`` builds for an audio encoder.
    Raises ValueError for a malformed grid or one whose h, w are not multiples of ``merge_size``.
    """
    merge_size = check_merge_size(merge_size)
    item_grids = grid_list(grid_thw, merge_size)
    item_kinds = check_kinds(kinds, len(item_grids))
    grids, unit_kinds, items = [], [], []
    for i, ((t, h, w), kind) in enumerate(zip(item_grids, item_kinds, strict=True)):
        n = t if split_frames else 1
        grids.extend([(1, h, w)] * t if split_frames else [(t, h, w)])
        unit_kinds.extend([kind] * n)
        items.extend([i] * n)
    return EncoderUnits(
        grids=tuple(grids),
        kinds=tuple(unit_kinds),
        items=tuple(items),
        merge_size=merge_size,
        num_items=int(grid_thw.shape[0]),
        sizes=None if sizes is None else tuple(map(sizes, grids, unit_kinds)),
    )
