"""EncoderDataParallel: each encoder unit encoded once, on one CP rank, results moved where needed.

Legend: U units, R rows of all units (t*h*w/m**2 each), m merge size, W ranks, D feature width.

A unit is what an encoder encodes independently of everything else in the batch: an image, a
video frame, an audio clip. The same class serves each modality's encoder (the CP step builds one
for the vision tower and one for an audio tower); an audio clip of n feature frames is a unit of
grid (1, 1, n) with merge size 1, its feature frames its "pixel rows" (``cpvlm.encoders.units``).

Every rank holds the same pixel_values and grid_thw (replicated inputs). Each rank splits them
into units (images, video frames, clips), takes its share from ``assign_units`` (balanced by
the tower's modelled cost, ``EncoderCost``), encodes only those, and then either
- ``mode="allgather"``: all-gathers every unit's rows; every rank gets all R rows in the
  unwrapped tower's order (backward: reduce-scatter), or
- ``mode="route"``: sends each row only to the rank owning its sequence position; every rank
  gets the rows of its own visual positions (backward: the transposed all-to-all), or
- ``mode="split"``: as route, but units that cost more than a rank's share are sharded across
  ranks at merge-group granularity and the tower runs sequence-parallel on them
  (``cpvlm.encoders.split``; the encoder must implement the split protocol below).

A rank with no units still joins both collectives with ``[0, D]`` placeholders. By default it
learns their dtype and widths by running the tower on one m x m dummy frame, in the caller's
autocast and grad mode, so they match what the other ranks send (never a hard-coded dtype), and
the slice ``[:0]`` of that output gives the tower's parameters zero gradients rather than none:
every rank calls the tower once per step (an FSDP-sharded tower's parameter all-gathers match) and
ends the step with the same set of gradients, as DDP and FSDP expect.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace

import torch
import torch.distributed as dist
from torch import nn

from cpvlm.constants import VISION_DP_MODES
from cpvlm.distributed.collectives import StepAgreement, agree
from cpvlm.distributed.shard_plan import ShardPlan
from cpvlm.encoders.assign import assign_units
from cpvlm.encoders.cost import EncoderCost
from cpvlm.encoders.gather import gather_embeddings
from cpvlm.encoders.pieces import Groups, piece_groups, pixel_rows_read
from cpvlm.encoders.route import route_plan, route_to_owners
from cpvlm.encoders.split import LocalSplit, Piece, SplitAttention, check_orders, local_split
from cpvlm.encoders.split_assign import SplitAssignment, split_assignment
from cpvlm.encoders.units import EncoderUnits, UnitSizes, check_merge_size, vision_units
from cpvlm.options import AttentionOptions, CPOptions


def _split_output(out: object) -> tuple[list[torch.Tensor], bool]:
    """``(tensors, has_deepstack)`` from a tower output: a tensor or (tensor, [deepstack...])."""
    if isinstance(out, torch.Tensor):
        return [out], False
    if (
        isinstance(out, (tuple, list))
        and len(out) == 2
        and isinstance(out[0], torch.Tensor)
        and isinstance(out[1], (tuple, list))
        and all(isinstance(t, torch.Tensor) for t in out[1])
    ):
        return [out[0], *out[1]], True
    raise ValueError(
        "EncoderDataParallel: the encoder must return a tensor or (tensor, [deepstack tensors]); "
        f"got {type(out).__name__} (wrap HF towers to return pooler_output / deepstack_features)"
    )


def _rows_within(units: EncoderUnits, mine: list[int], index: torch.Tensor) -> torch.Tensor:
    """Where the batch's pixel rows ``index`` (rows of units ``mine``) lie in the rows of the
    units ``mine`` (ascending) one after another: in ``local_pixels``."""
    offsets = torch.tensor(units.pixel_offsets)
    unit = torch.searchsorted(offsets, index, right=True) - 1
    counts = torch.tensor([units.pixel_counts[u] for u in mine], dtype=torch.long)
    starts = torch.zeros(units.num_units, dtype=torch.long)
    starts[mine] = torch.cumsum(counts, 0) - counts
    return starts[unit] + index - offsets[unit]


def _join_output(tensors: list[torch.Tensor], has_deepstack: bool):
    return (tensors[0], list(tensors[1:])) if has_deepstack else tensors[0]


def _cost_model(encoder: nn.Module, cost: EncoderCost | None) -> EncoderCost:
    if cost is None:
        supplied = getattr(encoder, "vision_cost", None)
        cost = supplied() if callable(supplied) else EncoderCost.patches()
    if not isinstance(cost, EncoderCost):
        raise ValueError(
            f"EncoderDataParallel: cost must be an EncoderCost (or encoder.vision_cost() return "
            f"one), got {type(cost).__name__}"
        )
    return cost


class EncoderDataParallel(nn.Module):
    """Wrap an encoder ``encoder(pixel_values, grid_thw)`` (a vision tower, an audio tower) for
    data parallelism over CP ranks.

    Args:
        encoder: returns ``[R, D]`` or ``([R, D], [[R, D_i], ...])`` with t*h*w/m**2 rows per
            grid row, in the Qwen-VL pixel layout (a unit's pixel rows contiguous, frame-major).
        group: the CP group (every rank passes the same inputs).
        mode: ``"route"`` (scalable) or ``"allgather"`` (every rank gets every row).
        merge_size: m, the tower's spatial merge size.
        split_frames: encode each temporal frame of a video as its own unit. Exact only for
            towers that treat frames independently (the Qwen2.5-VL and Qwen3-VL towers do).
        out_dims: the output widths ``D`` (int, plain output) or ``(D, D_1, ...)`` (with
            deepstack), with ``dtype``: skips the dummy frame on empty ranks. Then the tower's
            parameters get no gradient (None) on a rank without units, and the tower runs on
            some ranks only: do not use it when the tower is FSDP-sharded over a mesh that
            includes the CP ranks (its parameter all-gathers would not match). With the dummy
            frame every rank calls the tower exactly once per step.
        dtype: the tower's output dtype; required with ``out_dims``.
        cost: the tower's cost model, by which units are balanced over ranks. Default: what
            ``encoder.vision_cost()`` returns if the encoder has that method, else the patch
            count (``EncoderCost.patches()``). Every rank must pass the same one.
        unit_sizes: ``(grid, kind) -> (pixel rows, output rows)`` of a unit, for a tower whose
            layout is not t*h*w pixel rows and t*h*w/m**2 output rows (see ``vision_units``); it
            also sizes the dummy frame (1, m, m), an image, of a rank without units.
        attention: ``mode="split"``: the ``cp_attention`` options (``AttentionOptions``: impl and
            Ulysses size) of the tower's attention over the sharded units; default ring.
        dummy_unit: ``(grid, kind)`` of the unit a rank without units encodes (and keeps none
            of); default one m x m image frame, ``((1, m, m), "image")``. An audio encoder's is a
            short clip, ``((1, 1, n), "audio")``.

    Kinds: ``forward(..., kinds=)`` gives each item's kind (``"image"`` or ``"video"``); the
    encoder is then called as ``encoder(pixel_values, grid_thw, kinds=)`` with its units' kinds
    (without, every item is an image and the encoder gets no ``kinds``).

    Split protocol (``mode="split"``): ``encoder.unit_order(grid) -> UnitOrder`` (the tower's
    order of a unit's merge groups and its windows) and ``encoder.encode_local(pixel_rows,
    pieces, attention)``: run the tower on the local pixel rows (the ``Piece`` s one after another,
    each in the tower's order) with position embeddings for exactly those patches and attention
    through ``attention.attend``; return one row per local group, in the same order.
    """

    def __init__(
        self,
        encoder: nn.Module,
        group: dist.ProcessGroup | None,
        *,
        mode: str = "route",
        merge_size: int = 2,
        split_frames: bool = True,
        out_dims: int | Sequence[int] | None = None,
        dtype: torch.dtype | None = None,
        cost: EncoderCost | None = None,
        unit_sizes: UnitSizes | None = None,
        attention: AttentionOptions | None = None,
        dummy_unit: tuple[tuple[int, int, int], str] | None = None,
    ):
        super().__init__()
        if mode not in VISION_DP_MODES:
            raise ValueError(
                f"EncoderDataParallel: mode must be one of {VISION_DP_MODES}, got {mode!r}"
            )
        if (out_dims is None) != (dtype is None):
            raise ValueError("EncoderDataParallel: pass out_dims and dtype together, or neither")
        self.encoder = encoder
        self.group = group
        self.mode = mode
        self.merge_size = check_merge_size(merge_size)
        self.split_frames = split_frames
        self.out_dims = out_dims
        self.dtype = dtype
        self.cost = _cost_model(encoder, cost)
        self.unit_sizes = unit_sizes
        self.attention = AttentionOptions() if attention is None else attention
        m = self.merge_size
        self.dummy_unit = ((1, m, m), "image") if dummy_unit is None else dummy_unit
        if mode == "split":
            missing = [a for a in ("unit_order", "encode_local") if not hasattr(encoder, a)]
            if missing or out_dims is not None or unit_sizes is not None:
                raise ValueError(
                    f"EncoderDataParallel: mode='split' needs an encoder with unit_order and "
                    f"encode_local (missing: {missing}) and no out_dims or unit_sizes; other modes: route, "
                    "allgather"
                )
            a, cp_size = self.attention, dist.get_world_size(group)
            try:  # the tower's cp_attention: the rules of the text model's (cpvlm.options)
                CPOptions(attn=a.impl, ulysses_size=a.ulysses_size, cp_size=cp_size)
            except ValueError as err:
                raise ValueError(f"EncoderDataParallel: {err}") from None

    def units(self, grid_thw: torch.Tensor, kinds=None) -> EncoderUnits:
        return vision_units(
            grid_thw,
            self.merge_size,
            split_frames=self.split_frames,
            sizes=self.unit_sizes,
            kinds=kinds,
        )

    def assignment(self, units: EncoderUnits, base_loads=None) -> list[list[int]]:
        """Whole units per rank (modes route and allgather), balanced around ``base_loads``
        (each rank's cost already given to it by another encoder; default none)."""
        world = dist.get_world_size(self.group)
        return assign_units(self.cost.unit_costs(units), world, base_loads)

    def rank_loads(self, units: EncoderUnits) -> list[int]:
        """Each rank's modelled cost of its units (modes route and allgather): what another
        encoder's units balance around (``base_loads``)."""
        costs = self.cost.unit_costs(units)
        return [sum(costs[u] for u in mine) for mine in self.assignment(units)]

    def split_assignment(self, units: EncoderUnits) -> SplitAssignment:
        """Whole units per rank and the sharded units' cuts (mode split)."""
        return split_assignment(
            self.cost.unit_costs(units), units.row_counts, dist.get_world_size(self.group)
        )

    def pixel_assignment(self, units: EncoderUnits) -> list[list[int]]:
        """The units whose pixel rows each rank reads, ascending: what ``local_pixels`` holds.
        Modes route and allgather: the units it encodes (``assignment``); split: its whole units
        and the sharded units it holds pieces of (a piece needs its unit decoded, as a frame
        decodes whole; the rank encodes only the piece's patches)."""
        if self.mode != "split":
            return [sorted(a) for a in self.assignment(units)]
        sa = self.split_assignment(units)
        return [sa.units_of(r) for r in range(sa.cp_size)]

    def pixel_pieces(self, units: EncoderUnits) -> list[dict[int, Groups]]:
        """Per rank, ``{unit: merge groups in pixel order}`` of the sharded units it holds a
        piece of (mode split; else none): with ``local_pixels`` a rank may pass only those
        groups' rows of such a unit (``cpvlm.encoders.pieces``)."""
        world = dist.get_world_size(self.group)
        if self.mode != "split":
            return [{} for _ in range(world)]
        orders = [self.encoder.unit_order(g) for g in units.grids]
        sa = self.split_assignment(units)
        return [piece_groups(orders, sa, r) for r in range(world)]

    def forward(
        self,
        pixel_values: torch.Tensor,
        grid_thw: torch.Tensor,
        *,
        kinds=None,
        plan: ShardPlan | None = None,
        row_positions: torch.Tensor | None = None,
        local_pixels: bool = False,
        step: StepAgreement | None = None,
        with_unit_count: bool = False,
        base_loads=None,
    ):
        """Encode this rank's units and return what the unwrapped tower would.

        ``local_pixels``: ``pixel_values`` holds only the pixel rows of this rank's units
        (``pixel_assignment``; split mode: with the units it holds pieces of, whole or only the
        piece's groups, ``pixel_pieces``), in unit order (what a data loader that decodes only
        these gives); ``grid_thw`` is still every item's. ``kinds``: every item's kind (see
        the class docstring).

        allgather mode: all R rows in the tower's order (``plan``/``row_positions`` unused).
        route mode: ``plan`` is the batch's ShardPlan and ``row_positions[g]`` the position of
        output row g in the padded batch, ``b * plan.padded_len + p`` (see ``cpvlm.encoders.route``);
        the result holds this rank's visual rows sorted by local index in its ``[B, S_loc]`` shard.
        ``step``: the CP step this belongs to (see ``cpvlm.distributed.collectives.StepAgreement``).
        ``with_unit_count``: return ``(result, units this rank encoded)`` (split mode: whole units
        plus pieces of sharded ones). ``base_loads``: see ``assignment`` (modes route and
        allgather). split mode: as route mode (``plan``, ``row_positions``).

        A problem found on one rank only (its tower returned the wrong number of rows) is raised
        on every rank, through the agreement that precedes the rows' collective.
        """
        if step is None:
            step = StepAgreement()
        if self.mode == "split":
            out, encoded = self._forward_split(
                pixel_values, grid_thw, kinds, plan, row_positions, local_pixels, step
            )
            return (out, encoded) if with_unit_count else out
        try:
            units, assignment, rp, tensors, has_deepstack = self._encode_local(
                pixel_values, grid_thw, kinds, plan, row_positions, local_pixels, base_loads
            )
        except ValueError as err:
            # Found by this rank alone (a tower that returned too few rows, inputs that differ
            # from the other ranks'): the other ranks are entering the rows' collective, whose
            # agreement this joins, so that every rank raises it.
            agree("EncoderDataParallel", self.group, {}, error=str(err), step=step)
            raise
        if self.mode == "route":
            moved = route_to_owners(tensors, rp, self.group, step=step)
        else:
            counts = [sum(units.row_counts[u] for u in units_r) for units_r in assignment]
            gathered = gather_embeddings(tensors, counts, self.group, step=step)
            # Rank order -> unit order (= the tower's order): rank-order row g is unit row
            # gathered_rows[g], so its inverse permutation puts every row back.
            gathered_rows = torch.cat([units.row_index(a) for a in assignment])
            back = torch.argsort(gathered_rows).to(gathered[0].device)
            moved = [t.index_select(0, back) for t in gathered]
        out = _join_output(moved, has_deepstack)
        return (out, len(assignment[dist.get_rank(self.group)])) if with_unit_count else out

    def _encode_local(
        self, pixel_values, grid_thw, kinds, plan, row_positions, local_pixels, base_loads
    ):
        """``(units, assignment, route plan or None, this rank's rows, has_deepstack)``."""
        world, rank = dist.get_world_size(self.group), dist.get_rank(self.group)
        units = self.units(grid_thw, kinds)
        assignment = self.assignment(units, base_loads)
        self._check_pixels(pixel_values, units, assignment[rank] if local_pixels else None)
        rp = None
        if self.mode == "route":
            rp = self._route_plan(units, assignment, plan, row_positions, world, rank)
        elif plan is not None or row_positions is not None:
            raise ValueError("EncoderDataParallel: plan/row_positions are for mode='route' only")

        mine = assignment[rank]
        if mine:
            pix = pixel_values
            if not local_pixels:
                pix = pix.index_select(0, units.pixel_index(mine).to(pixel_values.device))
            grid = units.grid_thw(mine).to(grid_thw.device)
            with_kinds = {} if kinds is None else {"kinds": units.kinds_of(mine)}
            tensors, has_deepstack = _split_output(self.encoder(pix, grid, **with_kinds))
            self._check_output(tensors, has_deepstack, sum(units.row_counts[u] for u in mine))
        else:
            tensors, has_deepstack = self._placeholders(pixel_values, grid_thw.device, kinds)
        return units, assignment, rp, tensors, has_deepstack

    def _forward_split(
        self, pixel_values, grid_thw, kinds, plan, row_positions, local_pixels, step
    ):
        """Mode split: ``(this rank's visual rows, units and pieces it encoded)``. Its towers
        treat an image and a video frame alike (the default item sizes): pieces have no kind."""
        rank = dist.get_rank(self.group)
        facts, error = {}, None
        try:
            units = self.units(grid_thw, kinds)
            orders = [self.encoder.unit_order(g) for g in units.grids]
            check_orders(units, orders)
            sa = self.split_assignment(units)
            mine = sa.units_of(rank) if local_pixels else None
            local = local_split(units, orders, sa, rank)
            read = None
            if local_pixels:  # only its pieces' groups of a sharded unit, or the whole unit
                read = pixel_rows_read(units, mine, piece_groups(orders, sa, rank))
            if read is not None and pixel_values.dim() == 2 and len(pixel_values) == len(read):
                index = torch.searchsorted(read, local.pixel_index)
                local = replace(local, pixel_index=index)
            else:
                self._check_pixels(pixel_values, units, mine, pieces=read)
                if local_pixels:  # the batch's row indices -> rows of this rank's units
                    index = _rows_within(units, mine, local.pixel_index)
                    local = replace(local, pixel_index=index)
            if not isinstance(plan, ShardPlan) or row_positions is None:
                raise ValueError("EncoderDataParallel: mode='split' needs plan= and row_positions=")
            rp = route_plan(local.row_ranks, row_positions, plan, rank)
            facts = {"split units": sa.split, "cuts": sa.cuts, "dtype": pixel_values.dtype}
        except ValueError as err:
            error = str(err)
        # Before the tower: its attention runs collectives over the sharded units' plan.
        agree("EncoderDataParallel split", self.group, facts, error=error, step=step)
        tensors, has_deepstack = self._encode_split(pixel_values, local, step)
        moved = route_to_owners(tensors, rp, self.group, step=step)
        encoded = len(local.pieces) if local.row_ids.numel() else 0
        return _join_output(moved, has_deepstack), encoded

    def _encode_split(self, pixel_values, local: LocalSplit, step):
        """The tower on this rank's patches; rows in ascending global row (route's order)."""
        m2 = self.merge_size**2
        attention = SplitAttention(
            whole_lens=local.whole_lens,
            whole_windows=local.whole_windows,
            plan=local.plan,
            window_plan=local.window_plan,
            line_len=local.line_len,
            group=self.group,
            attention=self.attention,
            step=step,
        )
        empty = local.row_ids.numel() == 0
        if empty:
            # Nothing here: one m x m dummy frame as a whole unit, so that this rank calls the
            # tower (and its attention collectives) as the others do; none of its rows is kept.
            attention.whole_lens = (m2,)
            attention.whole_windows = None if local.whole_windows is None else (m2,)
            pix = pixel_values.new_zeros(m2, pixel_values.shape[1])
            pieces = (Piece(-1, (1, self.merge_size, self.merge_size), torch.arange(m2)),)
        else:
            pix = pixel_values.index_select(0, local.pixel_index.to(pixel_values.device))
            pieces = local.pieces
        tensors, has_deepstack = _split_output(self.encoder.encode_local(pix, pieces, attention))
        if any(t.dim() != 2 or t.shape[0] != max(1, local.row_ids.numel()) for t in tensors):
            return tensors, has_deepstack  # route_to_owners raises it on every rank
        if empty:
            return [t[:0] for t in tensors], has_deepstack
        order = torch.argsort(local.row_ids).to(tensors[0].device)
        return [t.index_select(0, order) for t in tensors], has_deepstack

    # ---- pieces -------------------------------------------------------------------------------

    def _check_pixels(
        self, pixel_values: torch.Tensor, units: EncoderUnits, mine, pieces=None
    ) -> None:
        if not isinstance(pixel_values, torch.Tensor) or pixel_values.dim() != 2:
            raise ValueError("EncoderDataParallel: pixel_values must be a 2-d tensor [patches, C]")
        if mine is None:
            expected, what = units.pixel_offsets[-1], "the grids have"
        else:
            expected = sum(units.pixel_counts[u] for u in mine)
            what = f"with local_pixels this rank's units {mine} have"
        if pixel_values.shape[0] != expected:
            raise ValueError(
                f"EncoderDataParallel: pixel_values has {pixel_values.shape[0]} rows but {what} "
                f"{expected} patches (sum of t*h*w)"
                + (f", or {len(pieces)} of its pieces' groups only" if pieces is not None else "")
            )

    def _route_plan(self, units, assignment, plan, row_positions, world, rank):
        if not isinstance(plan, ShardPlan) or row_positions is None:
            raise ValueError("EncoderDataParallel: mode='route' needs plan= and row_positions=")
        if plan.cp_size != world:
            raise ValueError(
                f"EncoderDataParallel: the plan has cp_size {plan.cp_size}, the group {world} ranks"
            )
        owner_of_unit = torch.empty(units.num_units, dtype=torch.long)
        for r, units_r in enumerate(assignment):
            owner_of_unit[units_r] = r
        row_ranks = torch.repeat_interleave(
            owner_of_unit, torch.tensor(units.row_counts, dtype=torch.long)
        )
        return route_plan(row_ranks, row_positions, plan, rank)

    def _check_output(self, tensors, has_deepstack, rows) -> None:
        for i, t in enumerate(tensors):
            if t.dim() != 2 or t.shape[0] != rows:
                raise ValueError(
                    f"EncoderDataParallel: encoder output {i} has shape {tuple(t.shape)}, expected "
                    f"{rows} rows (t*h*w/{self.merge_size}**2 per unit); is merge_size right?"
                )
        if self.out_dims is not None:
            declared = self._declared()
            actual = [(t.shape[1], t.dtype) for t in tensors]
            if actual != declared or has_deepstack == isinstance(self.out_dims, int):
                raise ValueError(
                    f"EncoderDataParallel: the encoder returned (width, dtype) {actual} but "
                    f"out_dims/dtype declare {declared}; empty ranks would send the declared ones"
                )

    def _declared(self) -> list[tuple[int, torch.dtype]]:
        dims = [self.out_dims] if isinstance(self.out_dims, int) else list(self.out_dims)
        return [(d, self.dtype) for d in dims]

    def _placeholders(self, pixel_values: torch.Tensor, device: torch.device, kinds):
        if self.out_dims is not None:
            tensors = [
                torch.zeros(0, d, dtype=dt, device=pixel_values.device)
                for d, dt in self._declared()
            ]
            return tensors, not isinstance(self.out_dims, int)
        grid, kind = self.dummy_unit
        sizes, m2 = self.unit_sizes, self.merge_size**2
        pixels, rows = (
            (math.prod(grid), math.prod(grid) // m2) if sizes is None else sizes(grid, kind)
        )
        dummy_pix = pixel_values.new_zeros(pixels, pixel_values.shape[1])
        dummy_grid = torch.tensor([grid], dtype=torch.long, device=device)
        with_kinds = {} if kinds is None else {"kinds": (kind,)}
        tensors, has_deepstack = _split_output(self.encoder(dummy_pix, dummy_grid, **with_kinds))
        # One m x m frame is one merged row: this catches a wrong merge_size on empty ranks too.
        self._check_output(tensors, has_deepstack, rows)
        return [t[:0] for t in tensors], has_deepstack
