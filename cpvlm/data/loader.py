"""This rank's rows, step by step: the global stream split over DP, pixels only for its units.

Legend: R rows per DP rank per step (batch size x grad accumulation), U vision units of a row
(images, and video temporal patches), C pixel row width.

Per step every rank takes the next R * dp row slots of the global ``RowStream`` (rows as
sample positions and sizes), deals them to DP ranks (``balance``: by tokens, ``dp_split``, or by
modelled cost, ``dp_deal`` with a ``RowCost``), plans in full only its DP rank's R rows, and for
each row computes which units its CP rank encodes, with the same assignment as the model's
``EncoderDataParallel`` (``assign``, patch-balanced by default). Sizing a window needs every
sample's ``SampleMeta``: from the source where it has ``meta``; else, with an ``exchange``
(``DPExchange`` over the DP ranks of this CP rank), each DP rank plans a share of the window dealt
by estimated planning cost (``plan_split`` of ``RowStream.plan_costs``: the same on every rank, known
before planning), the metas are gathered, and after the deal each plan is sent to the rank whose
row holds it,
so every sample of a step is planned once per CP slice, not once per rank. Without either, every
rank plans every sample (one process that plays several ranks). That planning runs in the main
process, as the DataLoader's sampler (every DP rank advances it alike, so the exchanges pair up);
the decoding runs in DataLoader workers (``num_workers``, ``prefetch`` rows ahead each): a worker
decodes and processes only the images and video frames of this rank's units. ``decode="all"``
decodes every unit on every rank (the baseline, and what ``vision="replicate"`` needs). Audio
clips come with their plans (feature frames made while planning): every rank's row holds every
clip's ``audio_features`` / ``audio_lengths``, and the audio encoder's own data parallelism picks
the clips each rank encodes.

A unit that fails to decode does not raise in the worker (nor a sample of a source with metas
that fails to plan): the row comes back with ``error`` set, and the trainer agrees on it with
the other CP ranks (they decoded other units) before any of them runs the row. ``state_dict()`` is the stream position after the last step handed out.
"""

from __future__ import annotations

import atexit
import multiprocessing
import multiprocessing.util
import signal
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from cpvlm.constants import DECODE_MODES, DP_BALANCE, IGNORE_INDEX
from cpvlm.data.balance import RowCost, dp_deal, plan_split
from cpvlm.data.dynamic_cp import plan_dynamic_cp
from cpvlm.data.errors import DataError
from cpvlm.data.exchange import pack_plans, unpack_plans
from cpvlm.data.packing import dp_split
from cpvlm.data.rows import PackedPlan, RowSlot, RowStream
from cpvlm.data.sample import LazyPixels, SamplePlan, TokenIds, VisionItem
from cpvlm.distributed import compat
from cpvlm.encoders.assign import assign_units
from cpvlm.encoders.units import EncoderUnits, vision_units

BLANK_TOKENS = 16

Decoder = Callable[..., torch.Tensor]
"""``decode(item, temporal)``: pixel rows ``[len(temporal) * h * w, C]`` of the item's temporal
patches ``temporal`` (``None``: all of them), in the processor's layout; raises ``DataError``.
Under ``vision="split"`` also ``decode(item, temporal, groups)``: of a temporal patch j in
``groups`` only the rows of the merge groups ``groups[j]`` (``cpvlm.encoders.pieces``)."""

Assign = Callable[..., list[list[int]]]
"""``assign(units)``: the units each CP rank encodes; ``assign(units, c)``: each rank of a block
of ``c`` ranks (dynamic CP; ``ContextParallelVLM.vision_assignment``)."""
Pieces = Callable[[EncoderUnits], list[dict[int, tuple[int, ...]]]]
"""Per CP rank, ``{unit: merge groups}`` of the sharded units whose pieces alone it decodes
(``ContextParallelVLM.vision_pieces``)."""


def patch_balanced(cp_size: int) -> Assign:
    """The assignment ``EncoderDataParallel`` uses by default: balanced by patch counts (over
    ``cp_size`` ranks, or a dynamic-CP row's own size)."""
    return lambda units, size=cp_size: assign_units(units.pixel_counts, size)


@dataclass
class RowJob:
    """A row for this rank to finish: what to decode, and what to report with it."""

    step: int
    row: PackedPlan
    ids: TokenIds
    units: list[int] | None  # this rank's units, ascending; None: all
    state_after: dict  # the stream position after this row's step
    errors: list[DataError] = field(default_factory=list)
    truncated: int = 0
    error: DataError | None = None  # a sample of the row failed to plan (a source with metas)
    groups: dict[int, tuple[int, ...]] = field(default_factory=dict)  # units decoded in part


@dataclass
class LocalRow:
    """One packed row as this rank trains on it: all ids and grids, pixels of its units only."""

    step: int
    input_ids: torch.Tensor  # [S]
    labels: torch.Tensor  # [S] unshifted
    doc_lens: list[int]
    ids: TokenIds
    media: dict[str, torch.Tensor]  # grids (all items), pixel rows (this rank's units), seconds,
    # audio_features / audio_lengths (every clip)
    local: bool  # pixel rows are this rank's units only (else every unit's)
    units: list[int]
    state_after: dict
    errors: list[DataError] = field(default_factory=list)  # bad samples found while planning
    truncated: int = 0
    decoded: list[str] = field(default_factory=list)  # media decoded for this row on this rank
    error: DataError | None = None  # a unit of this rank failed to decode

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.numel())

    @property
    def vision(self) -> dict[str, torch.Tensor]:
        """The old name of ``media`` (deprecated: it holds the audio clips too)."""
        return self.media

    @property
    def has_vision(self) -> bool:
        return "image_grid_thw" in self.media or "video_grid_thw" in self.media

    @property
    def grid_thw(self) -> torch.Tensor:
        """``[items, 3]``: the images, then the videos (the order of the units)."""
        grids = [self.media[k] for k in ("image_grid_thw", "video_grid_thw") if k in self.media]
        return torch.cat(grids) if grids else torch.zeros(0, 3, dtype=torch.long)

    def batch(self, device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
        """Keyword arguments of ``ContextParallelVLM`` for this row (with ``doc_lens`` apart)."""
        ids = self.input_ids.view(1, -1)
        mm_types = self.ids.mm_token_type_ids(ids)
        out = {"input_ids": ids, "labels": self.labels.view(1, -1), "mm_token_type_ids": mm_types}
        out.update(self.media)
        out = {k: v.to(device) for k, v in out.items()}
        if self.local and self.has_vision:
            out["local_pixels"] = True
        return out

    def blank(self) -> LocalRow:
        """A row that trains nothing (no labels, no vision), in place of one that failed."""
        ids = torch.zeros(BLANK_TOKENS, dtype=torch.long)
        return LocalRow(
            self.step, ids, torch.full_like(ids, IGNORE_INDEX), [BLANK_TOKENS], self.ids, {},
            False, [], self.state_after, self.errors, self.truncated,
        )  # fmt: skip


def _unit_layout(ids, row) -> dict:
    """``vision_units`` keywords of the family's units of ``row``: frames or whole items, so
    sized, of their kinds (the units ``EncoderDataParallel`` assigns)."""
    return {"split_frames": ids.split_frames, "sizes": ids.sizes, "kinds": row.kinds()}


def select_groups(rows: torch.Tensor, temporal, groups, merge: int) -> torch.Tensor:
    """Of pixel rows of whole temporal patches ``temporal``, each patch's rows or, for a patch in
    ``groups``, only its merge groups' rows (what a decoder of pieces returns)."""
    per_frame, m2 = rows.shape[0] // len(temporal), merge * merge
    out = []
    for i, j in enumerate(temporal):
        frame = rows[i * per_frame : (i + 1) * per_frame]
        if j in groups:
            g = torch.tensor(groups[j], dtype=torch.long)
            frame = frame[(g.unsqueeze(1) * m2 + torch.arange(m2)).reshape(-1)]
        out.append(frame)
    return torch.cat(out)


def _item_rows(
    decode: Decoder,
    item: VisionItem,
    temporal: list[int] | None,
    ids: TokenIds | None = None,
    groups: dict[int, tuple[int, ...]] | None = None,
) -> torch.Tensor:
    if item.pixels is not None:  # tokenized samples: the rows are made (or LazyPixels)
        pixels, n = item.pixels, item.patches_per_frame
        if isinstance(pixels, LazyPixels):
            if temporal is None:
                return pixels.rows()
            rows = torch.cat([pixels.rows(j * n, (j + 1) * n) for j in temporal])
        elif temporal is None:
            return pixels
        else:
            rows = torch.cat([pixels[j * n : (j + 1) * n] for j in temporal])
        return select_groups(rows, temporal, groups, ids.merge) if groups else rows
    rows = decode(item, temporal, groups) if groups else decode(item, temporal)
    # the family's rows per item (a family's item may be t crops of s*s rows, whatever its h, w)
    sizes = ids.item_sizes if ids is not None else lambda g, _: (g[0] * g[1] * g[2], 0)
    if temporal is None:
        need = sizes(item.grid, item.kind)[0]
    else:
        frame = sizes((1, *item.grid[1:]), item.kind)[0]
        need = len(temporal) * frame
        if groups:
            need -= sum(frame - len(g) * ids.merge**2 for g in groups.values())
    if rows.dim() != 2 or rows.shape[0] != need:
        raise DataError(
            "vision_token_mismatch",
            f"the processor made pixel rows of shape {tuple(rows.shape)} for a {item.kind} whose "
            f"grid {list(item.grid)} needs {need} rows",
        )
    return rows


def _names(item: VisionItem, temporal: list[int] | None, temporal_patch: int) -> list[str]:
    if item.pixels is not None:
        return []
    if item.image is not None:
        return [item.image.name]
    frames = range(len(item.frames)) if temporal is None else [
        f for j in temporal for f in range(j * temporal_patch, (j + 1) * temporal_patch)
    ]  # fmt: skip
    return sorted({item.frames[min(f, len(item.frames) - 1)].name for f in frames})


def decode_row(job: RowJob, decode: Decoder, temporal_patch: int = 2) -> LocalRow:
    """Make the pixel rows of ``job``'s units (in unit order) and return the finished row."""
    row = job.row
    grids = row.grid_thw()
    images, videos = row.images, row.videos
    media: dict[str, torch.Tensor] = {}
    if images:
        media["image_grid_thw"] = grids[: len(images)]
    if videos:
        media["video_grid_thw"] = grids[len(images) :]
        seconds = [it.second_per_grid for _, it in videos]
        if any(s is not None for s in seconds):
            media["second_per_grid_ts"] = torch.tensor([s or 0.0 for s in seconds])
    if row.audios:
        clips = [a for _, a in row.audios]
        media["audio_features"] = torch.cat([a.features for a in clips])
        media["audio_lengths"] = torch.tensor([a.frames for a in clips], dtype=torch.long)
    units = vision_units(grids, job.ids.merge, **_unit_layout(job.ids, row))
    mine = list(range(units.num_units)) if job.units is None else job.units
    out = LocalRow(
        job.step, row.input_ids, row.labels, row.doc_lens, job.ids, media, job.units is not None,
        mine, job.state_after, job.errors, job.truncated,
    )  # fmt: skip
    if job.error is not None:
        out.error = job.error
        return out
    # Units of one item are consecutive: decode each item once, with the temporal patches asked.
    wanted: dict[int, list[int]] = {}
    pieces: dict[int, dict[int, tuple[int, ...]]] = {}  # item -> temporal patch -> groups
    first_unit = {}
    for u, item in enumerate(units.items):
        first_unit.setdefault(item, u)
    for u in mine:
        k, j = units.items[u], u - first_unit[units.items[u]]
        wanted.setdefault(k, []).append(j)
        if u in job.groups and job.ids.split_frames:
            pieces.setdefault(k, {})[j] = job.groups[u]
    parts: dict[str, list[torch.Tensor]] = {"pixel_values": [], "pixel_values_videos": []}
    for k, temporal in wanted.items():
        doc, item = (images + videos)[k]
        # a tiled image's tiles are its temporal units; a family whose units are whole items
        # decodes all of the item's rows
        if (not job.ids.split_frames or len(temporal) == item.grid[0]) and k not in pieces:
            temporal = None
        try:
            rows = _item_rows(decode, item, temporal, job.ids, pieces.get(k))
        except DataError as err:
            out.error = err.at(doc.where)
            return out
        except Exception as err:  # a processor failing on a strange image
            out.error = DataError("unreadable_media", f"{type(err).__name__}: {err}", doc.where)
            return out
        out.decoded += _names(item, temporal, temporal_patch)
        parts["pixel_values" if item.kind == "image" else "pixel_values_videos"].append(rows)
    for key, grid_key in (
        ("pixel_values", "image_grid_thw"),
        ("pixel_values_videos", "video_grid_thw"),
    ):
        if grid_key in media:
            tensors = parts[key]
            media[key] = torch.cat(tensors) if tensors else torch.zeros(0, job.ids.pixel_width)
    return out


class _DecodeRows(torch.utils.data.Dataset):
    """``dataset[job]`` -> ``LocalRow``: what a DataLoader worker runs."""

    def __init__(self, decode: Decoder, temporal_patch: int):
        self.decode, self.temporal_patch = decode, temporal_patch

    def __getitem__(self, job: RowJob) -> LocalRow:
        return decode_row(job, self.decode, self.temporal_patch)


class _Jobs:
    """The DataLoader's sampler: this rank's jobs, planned lazily in the main process."""

    def __init__(self, loader: RankLoader):
        self.loader = loader

    def __iter__(self) -> Iterator[RowJob]:
        return self.loader._jobs()


def _identity(x):
    return x


def _kill_workers() -> None:
    """At the rank's exit: the workers ignore SIGTERM, which is how multiprocessing's exit ends
    daemonic children before joining them (it would wait forever); SIGKILL them first."""
    for child in multiprocessing.active_children():
        child.kill()


def _worker_context():
    atexit.register(_kill_workers)
    # a multiprocessing child (a rank) skips atexit: its exit runs these before ending children
    multiprocessing.util.Finalize(None, _kill_workers, exitpriority=100)
    # fork: workers start in milliseconds, without importing torch and the processor again
    # (training ranks are often forkserver or spawn children, whose default they would inherit).
    methods = multiprocessing.get_all_start_methods()
    return multiprocessing.get_context("fork" if "fork" in methods else methods[0])


def _worker_init(_: int) -> None:
    torch.set_num_threads(1)  # decoding is per-image work; ranks already use the cores
    # A stop signal to the process group (Slurm, Ctrl-C) reaches the workers too: their rank
    # finishes its step and checkpoints, and ends them; torch's default handler would kill them.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)
    compat.die_with_parent()  # a killed rank's workers go too, without exit-time noise


@dataclass(frozen=True)
class LoaderConfig:
    """What one ``RankLoader`` loads, and how (plain values, checked when built).

    rows_per_step: rows per DP rank per step (batch size x grad accumulation).
    dp_rank, dp_size, cp_rank, cp_size: this rank's place in the dp x cp mesh.
    decode_mode: "local" (the units this CP rank encodes) or "all" (every unit).
    num_workers, prefetch: DataLoader workers decoding media, and rows each prepares ahead.
    temporal_patch: frames per video temporal patch (the names of the media decoded).
    balance: a step's rows dealt to DP ranks by "tokens", or by modelled "cost" (``row_cost``).
    dynamic_cp_tokens: dynamic CP's per-rank token budget (``cpvlm.data.dynamic_cp``): this rank
        decodes, of each row, the units it encodes in the job that runs the row on its block
        (none of a row it does not run); None: static CP.
    """

    rows_per_step: int = 1
    dp_rank: int = 0
    dp_size: int = 1
    cp_rank: int = 0
    cp_size: int = 1
    decode_mode: str = "local"
    num_workers: int = 0
    prefetch: int = 2
    temporal_patch: int = 2
    balance: str = "tokens"
    dynamic_cp_tokens: int | None = None

    def __post_init__(self):
        if self.decode_mode not in DECODE_MODES:
            raise ValueError(f"decode_mode must be one of {DECODE_MODES}, got {self.decode_mode!r}")
        if not (0 <= self.dp_rank < self.dp_size and 0 <= self.cp_rank < self.cp_size):
            raise ValueError(
                f"rank (dp {self.dp_rank}, cp {self.cp_rank}) outside dp {self.dp_size} x cp "
                f"{self.cp_size}"
            )
        if self.balance not in DP_BALANCE:
            raise ValueError(f"balance must be one of {DP_BALANCE}, got {self.balance!r}")


class RankLoader:
    """Rows for one (DP rank, CP rank), ``config.rows_per_step`` at a time (see the module
    docstring).

    ``assign``: the units each CP rank encodes (default: ``patch_balanced``); ``pieces``: the
    merge groups of the units it decodes in part (``vision="split"``); ``row_cost``: the cost
    model of ``balance="cost"``; ``exchange``: the DP ranks' planning exchange; ``state``: the
    stream position to start from (``state_dict()``).
    """

    def __init__(
        self,
        stream: RowStream,
        decode: Decoder,
        ids: TokenIds,
        config: LoaderConfig | None = None,
        *,
        assign: Assign | None = None,
        pieces: Pieces | None = None,
        row_cost: RowCost | None = None,
        exchange=None,
        state: dict | None = None,
    ):
        config = LoaderConfig() if config is None else config
        self.config = config
        balance, dp_size = config.balance, config.dp_size
        if balance == "cost" and row_cost is None:
            raise ValueError("balance='cost' needs row_cost (cpvlm.hf.data.row_cost)")
        if config.dynamic_cp_tokens is not None and row_cost is None:
            raise ValueError("dynamic CP needs row_cost (cpvlm.hf.data.row_cost)")
        if exchange is not None and exchange.size != dp_size:
            raise ValueError(f"the exchange has {exchange.size} ranks, dp is {dp_size}")
        self.balance, self.row_cost = balance, row_cost
        self.split = exchange is not None and dp_size > 1 and not stream.has_meta
        self.exchange = exchange
        self.stream, self.ids = stream, ids
        self.rows_per_step = config.rows_per_step
        self.dp_rank, self.dp_size, self.cp_rank = config.dp_rank, dp_size, config.cp_rank
        self.cp_size, self.dynamic_cp_tokens = config.cp_size, config.dynamic_cp_tokens
        self.assign = assign or patch_balanced(config.cp_size)
        self.pieces = pieces
        self.decode_mode = config.decode_mode
        num_workers, prefetch = config.num_workers, config.prefetch
        self._start = dict(state) if state else {"window": 0, "row": 0}
        self._state = dict(self._start)
        self._dataloader = torch.utils.data.DataLoader(
            _DecodeRows(decode, config.temporal_patch),
            batch_size=None,
            sampler=_Jobs(self),
            num_workers=num_workers,
            prefetch_factor=prefetch if num_workers else None,
            collate_fn=_identity,
            worker_init_fn=_worker_init if num_workers else None,
            multiprocessing_context=_worker_context() if num_workers else None,
            # Its own generator: each iterator draws its workers' base seed, which from torch's
            # global one would leave a resumed run's RNG one draw off the uninterrupted run's.
            generator=torch.Generator().manual_seed(0),
        )
        self._iter = None

    def _units(self, row: PackedPlan, job=False) -> tuple[list[int] | None, dict]:
        """This rank's units of ``row`` (None: all), and the merge groups of those it decodes
        in part (``pieces``). ``job``: under dynamic CP, ``(c, rank in the block)`` of the job
        that runs the row here, or None (no job here: no units)."""
        if self.decode_mode == "all":
            return None, {}
        grids = row.grid_thw()
        if not len(grids) or job is None:
            return [], {}
        units = vision_units(grids, self.ids.merge, **_unit_layout(self.ids, row))
        if job:
            return sorted(self.assign(units, job[0])[job[1]]), {}
        groups = self.pieces(units)[self.cp_rank] if self.pieces is not None else {}
        return sorted(self.assign(units)[self.cp_rank]), groups

    def _dynamic_jobs(self, rows: list[PackedPlan]) -> list:
        """Under dynamic CP, per row ``(c, rank in the block)`` of its job on this CP rank, or
        None; the trainer plans the same rows alike (``cpvlm.train.dynamic_cp``). Static: False."""
        if self.dynamic_cp_tokens is None:
            return [False] * len(rows)
        costs = [self.row_cost.row(r.doc_lens, r.grid_thw().tolist()) for r in rows]
        tokens = [r.num_tokens for r in rows]
        plan = plan_dynamic_cp(tokens, costs, self.cp_size, self.dynamic_cp_tokens)
        out = [None] * len(rows)
        for jobs in plan.rounds:
            for job in jobs:
                if self.cp_rank in job.ranks:
                    out[job.row] = (job.size, self.cp_rank - job.ranks.start)
        return out

    def deal(self, slots: list[RowSlot]) -> list[list[int]]:
        """Indices into ``slots`` (one step's) for every DP rank; the same on every rank."""
        if self.balance == "tokens":
            return dp_split([s.num_tokens for s in slots], self.dp_size)
        cost = self.row_cost
        costs = [
            sum(cost.sample(m, n) for m, n in zip(s.metas, s.lengths, strict=True)) for s in slots
        ]
        return dp_deal(costs, self.dp_size)

    def _measure(self, kept: dict[int, SamplePlan]):
        if not self.split:
            return lambda positions: self.stream.measure_here(positions, kept)

        def measure(positions):
            share = plan_split(self.stream.plan_costs(positions), self.dp_size)[self.dp_rank]
            mine = self.stream.measure_here([positions[i] for i in share], kept)
            return {p: m for part in self.exchange.gather(mine) for p, m in part.items()}

        return measure

    def _plan_mine(self, slots, shares, kept) -> list[tuple[PackedPlan, DataError | None]]:
        if self.split:  # each plan to the rank whose row holds it
            outgoing = [
                pack_plans({p: kept.pop(p) for i in share for p in slots[i].positions if p in kept})
                if d != self.dp_rank else None
                for d, share in enumerate(shares)
            ]  # fmt: skip
            for part in self.exchange.swap(outgoing):
                kept.update(unpack_plans(part) if part is not None else {})
        out = []
        for i in shares[self.dp_rank]:
            try:
                out.append((self.stream.plan_rows(slots[i], kept), None))
            except DataError as err:  # only a source's meta can promise what planning refuses
                blank = SamplePlan(-1, err.where, torch.zeros(BLANK_TOKENS, dtype=torch.long),
                                   torch.full((BLANK_TOKENS,), IGNORE_INDEX))  # fmt: skip
                out.append((PackedPlan([blank]), err))
        return out

    def _jobs(self) -> Iterator[RowJob]:
        kept: dict[int, SamplePlan] = {}  # plans made here, not yet in a row
        rows = self.stream.slots(self._start, self._measure(kept))
        step, per_step = 0, self.rows_per_step * self.dp_size
        window = self.stream.window
        while True:
            batch = [next(rows) for _ in range(per_step)]
            errors = [e for b in batch for e in b.errors]
            truncated = sum(b.truncated for b in batch)
            slots = [b.slot for b in batch]
            shares = self.deal(slots)
            planned = self._plan_mine(slots, shares, kept)
            done = batch[-1].slot.positions[0] // window * window  # earlier windows: all dealt
            for p in [p for p in kept if p < done]:
                del kept[p]  # plans of rows before a resumed position
            jobs = self._dynamic_jobs([row for row, _ in planned])
            for n, (row, error) in enumerate(planned):
                units, groups = self._units(row, jobs[n])
                yield RowJob(
                    step, row, self.ids, units, batch[-1].state_after,
                    errors if n == 0 else [], truncated if n == 0 else 0, error, groups,
                )  # fmt: skip
            step += 1

    def next_step(self) -> list[LocalRow]:
        """This rank's ``rows_per_step`` rows of the next step."""
        if self._iter is None:
            self._iter = iter(self._dataloader)
        rows = [next(self._iter) for _ in range(self.rows_per_step)]
        self._state = dict(rows[-1].state_after)
        return rows

    def state_dict(self) -> dict[str, int]:
        return dict(self._state)

    def close(self) -> None:
        self._iter = None  # shuts the workers down
