"""What encoding a unit costs: linear work per patch plus attention work per attended pair.

Legend: a frame of grid (h, w) has p = h*w patches; a unit of grid (t, h, w) is t such frames;
W is the side of an attention window in patches; MAC = one multiply-accumulate.

A ViT-style tower spends, on one frame,

    linear_per_patch * p                       patch embedding, qkv/proj, MLPs, mergers
  + pair * (full_blocks * p**2                 blocks attending within the whole frame
            + windowed_blocks * sum_w n_w**2)  blocks attending within windows of n_w patches

MACs in its forward pass. The linear part is what balancing by patch count sees; the attention
part grows with p**2 and makes one large image cost more than many small ones of the same
patches (Qwen3-VL at 4096 patches: attention ~0.56x the linear work; at 1024: ~0.14x). Backward
costs about twice the forward in both parts, so forward MACs rank units as fwd+bwd time does.
Elementwise work (norms, activations, softmax, rotary) is left out: a few ops per value against
hundreds to thousands of MACs per value in the matrix products.

Costs are Python ints, so every sum and comparison is exact and every rank that computes the
cost of the same grids gets the same numbers, and from them the same assignment, without
communicating. Attention is per temporal frame (the Qwen-VL and GLM-4V towers), so a video's
cost is the sum of its frames' costs whether or not it is split into frame units.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from cpvlm.encoders.units import EncoderUnits


def _check_int(name: str, value: object, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"EncoderCost.{name} must be an int >= {minimum}, got {value!r}")


def _tile_squares(n: int, window: int) -> int:
    """Sum of squared tile lengths when n patches are cut into tiles of ``window`` from 0."""
    full, rest = divmod(n, window)
    return full * window * window + rest * rest


def block_linear_macs(width: int, mlp_width: int, *, gated: bool) -> int:
    """MACs per patch of one transformer block's matrices: qkv and output projections (4 w^2)
    and an MLP of two matrices, or three when gated (gate, up, down)."""
    return 4 * width * width + (3 if gated else 2) * width * mlp_width


@dataclass(frozen=True)
class EncoderCost:
    """The cost model of an encoder (a vision tower; an audio encoder per feature frame), in
    forward MACs; built from the encoder's shape.

    Args:
        linear_per_patch: MACs per patch of everything linear in patches, all blocks included.
        pair: MACs per attended (query, key) pair in one block: 2 * width (q.k and the
            weighted sum of v, over all heads).
        full_blocks: blocks that attend within the whole frame.
        windowed_blocks: blocks that attend within square windows of ``window`` x ``window``
            patches, tiled from the frame's top-left corner (edge windows are smaller).
        window: the window side in patches (Qwen2.5-VL: window_size // patch_size).
    """

    linear_per_patch: int
    pair: int = 0
    full_blocks: int = 0
    windowed_blocks: int = 0
    window: int = 0

    def __post_init__(self):
        _check_int("linear_per_patch", self.linear_per_patch, 0)
        for name in ("pair", "full_blocks", "windowed_blocks", "window"):
            _check_int(name, getattr(self, name), 0)
        if self.windowed_blocks and self.window < 1:
            raise ValueError(
                f"EncoderCost: windowed_blocks={self.windowed_blocks} needs window >= 1 (the "
                f"window side in patches), got window={self.window}"
            )
        if self.linear_per_patch == 0 and (
            self.pair == 0 or self.full_blocks + self.windowed_blocks == 0
        ):
            raise ValueError(
                "EncoderCost: every unit would cost 0; give linear_per_patch > 0 or attention "
                "(pair > 0 with full_blocks or windowed_blocks)"
            )

    @classmethod
    def patches(cls) -> EncoderCost:
        """The cost of a unit is its patch count (what balancing by patches assumes)."""
        return cls(linear_per_patch=1)

    def frame_pairs(self, h: int, w: int) -> int:
        """Attended (query, key) pairs of one h x w frame, summed over the blocks."""
        p = h * w
        pairs = self.full_blocks * p * p
        if self.windowed_blocks:
            # A window of a x b patches attends (a*b)**2 pairs; over the tiling of the frame this
            # sum factors into (sum of a**2 over row tiles) * (sum of b**2 over column tiles).
            windows = _tile_squares(h, self.window) * _tile_squares(w, self.window)
            pairs += self.windowed_blocks * windows
        return pairs

    def unit_cost(self, grid: Sequence[int]) -> int:
        """Forward MACs of a unit of grid (t, h, w): t frames encoded independently."""
        t, h, w = (int(v) for v in grid)
        return t * (self.linear_per_patch * h * w + self.pair * self.frame_pairs(h, w))

    def part_cost(self, grid: Sequence[int], patches: int) -> int:
        """Forward MACs of ``patches`` of a unit's patches whose queries attend the whole unit.

        This is a rank's work when one unit is sharded over ranks (keys shared, queries split):
        linear work is per patch and attention work per query, so the part costs its share of
        the unit, exactly for full-attention blocks; for windowed blocks it assumes the part's
        patches fall in windows as the unit's do on average (exact for whole windows of the
        same size). Rounded down; parts that cover the unit sum to at most ``unit_cost``.
        """
        t, h, w = (int(v) for v in grid)
        total = t * h * w
        if isinstance(patches, bool) or not isinstance(patches, int) or not 0 <= patches <= total:
            raise ValueError(
                f"patches must be an int in [0, {total}] for grid {grid}, got {patches!r}"
            )
        return self.unit_cost(grid) * patches // total

    def unit_costs(self, units: EncoderUnits) -> list[int]:
        """The cost of every unit of ``units``, in unit order (what ``assign_units`` takes)."""
        return [self.unit_cost(g) for g in units.grids]
