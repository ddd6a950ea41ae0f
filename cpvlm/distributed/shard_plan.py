"""ShardPlan: the layout of a (packed) sequence over the ranks of a CP group.

Legend: S = seq_len (real tokens), P = padded_len, S_loc = P // cp, W = cp_size.

The default layout is head-tail (zigzag): each document (the whole sequence if there is one) is
padded at its end to a multiple of 2*W and cut into 2*W equal chunks; rank r holds chunks r and
2*W-1-r of every document, document by document. Under a causal mask every rank then attends the
same number of (q, k) pairs within each document. ``layout="balanced"`` keeps head-tail for the
documents long enough to need splitting and places the others whole, balanced by causal work
(the rule is in ``cpvlm/distributed/layout.py``). In both, every rank's positions are ascending.
The plan is a pure function of the lengths, so every rank builds the same one without
communicating. Every method is out of place and differentiable: sharding a tensor that requires
grad (an embedding output) keeps its graph, which in-place `resize_`/`copy_` sharding cannot.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from functools import cached_property

import numpy as np
import torch
import torch.distributed as dist

from cpvlm.constants import IGNORE_INDEX
from cpvlm.distributed.collectives import differentiable_all_gather_dim0
from cpvlm.distributed.layout import Layout, build_layout, contiguous_layout

PAD_DOC = -1
"""Document id of a padding position."""


def _check_positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"ShardPlan: {name} must be a positive int, got {value!r}")
    return value


class ShardPlan:
    """Layout of a (possibly packed) sequence of ``seq_len`` tokens over ``cp_size`` ranks.

    Args:
        seq_len: number of real tokens.
        cp_size: ranks in the CP group.
        doc_lens: lengths of the packed documents, summing to ``seq_len``; ``None`` means one.
        layout: ``"head_tail"`` (every document in 2*cp_size chunks) or ``"balanced"`` (long
            documents head-tail, short ones whole on one rank, balanced by causal work).
    """

    def __init__(
        self,
        seq_len: int,
        cp_size: int,
        *,
        doc_lens: Sequence[int] | None = None,
        layout: str = "head_tail",
    ):
        self.seq_len = _check_positive_int("seq_len", seq_len)
        self.cp_size = _check_positive_int("cp_size", cp_size)
        if doc_lens is None:
            doc_lens = (seq_len,)
        if isinstance(doc_lens, torch.Tensor):
            doc_lens = doc_lens.tolist()
        doc_lens = tuple(doc_lens)
        if not doc_lens:
            raise ValueError("ShardPlan: doc_lens is empty; pass None for a single document")
        for i, n in enumerate(doc_lens):
            if isinstance(n, bool) or not isinstance(n, int) or n < 1:
                raise ValueError(
                    f"ShardPlan: doc_lens[{i}] = {n!r}; every document needs >= 1 token"
                )
        if sum(doc_lens) != seq_len:
            raise ValueError(f"ShardPlan: doc_lens sum to {sum(doc_lens)} but seq_len is {seq_len}")
        self.doc_lens = doc_lens
        self.layout = layout
        self.cuts = None
        self._place(build_layout(doc_lens, cp_size, layout))

    @classmethod
    def contiguous(cls, doc_lens: Sequence[int], cuts: Sequence[int]) -> ShardPlan:
        """Rank r holds the real positions ``[cuts[r], cuts[r+1])`` of the documents ``doc_lens``
        (unpadded, in order; a range may begin or end inside a document), then padding up to the
        longest range, at the tail. ``len(cuts) - 1`` ranks. For bidirectional attention (a vision
        tower's images or windows), where contiguous ranges of balanced work are balanced."""
        doc_lens, cuts = tuple(doc_lens), tuple(cuts)
        if not doc_lens or len(cuts) < 2:
            raise ValueError(
                f"ShardPlan.contiguous: needs documents and one cut more than ranks, got "
                f"doc_lens={list(doc_lens)}, cuts={list(cuts)}"
            )
        placed = contiguous_layout(doc_lens, cuts)  # checks the cuts first
        plan = cls(sum(doc_lens), len(cuts) - 1, doc_lens=doc_lens)  # checks the documents
        plan.layout, plan.cuts = "contiguous", cuts
        plan._place(placed)
        return plan

    def _place(self, placed: Layout) -> None:
        self.padded_doc_lens = placed.padded_doc_lens
        self.whole_on = placed.whole_on
        """Per document, the rank that holds it whole, or -1 where it is split head-tail."""
        self.padded_len = placed.padded_len
        self.local_len = self.padded_len // self.cp_size
        self.merged = 1
        self._ranges = placed.ranges

    def merge_ranks(self, group_size: int) -> ShardPlan:
        """The same positions seen by ``cp_size // group_size`` ranks: rank j of the result holds
        the positions of ranks ``j * group_size .. (j + 1) * group_size - 1``, ascending.

        The layout that the ring of hybrid attention sees after a Ulysses all-to-all inside each
        group of ``group_size`` consecutive ranks. Padding stays where this plan put it.
        """
        if (
            isinstance(group_size, bool)
            or not isinstance(group_size, int)
            or group_size < 1
            or self.cp_size % group_size
        ):
            raise ValueError(
                f"merge_ranks: group_size must be a positive divisor of cp_size={self.cp_size}, "
                f"got {group_size!r}"
            )
        view = object.__new__(ShardPlan)
        view.__dict__.update(
            seq_len=self.seq_len,
            cp_size=self.cp_size // group_size,
            doc_lens=self.doc_lens,
            layout=self.layout,
            cuts=self.cuts,
            padded_doc_lens=self.padded_doc_lens,
            whole_on=tuple(r // group_size if r >= 0 else -1 for r in self.whole_on),
            padded_len=self.padded_len,
            local_len=self.local_len * group_size,
            merged=self.merged * group_size,
            _ranges=_regroup(self._ranges, group_size),
        )
        return view

    def __repr__(self) -> str:
        docs = "" if len(self.doc_lens) == 1 else f", doc_lens={list(self.doc_lens)}"
        layout = "" if self.layout == "head_tail" else f", layout={self.layout!r}"
        if self.cuts is not None:
            layout += f", cuts={list(self.cuts)}"
        merged = "" if self.merged == 1 else f" merged from cp_size={self.cp_size * self.merged}"
        return f"ShardPlan(seq_len={self.seq_len}, cp_size={self.cp_size}{docs}{layout}){merged}"

    def _key(self) -> tuple:
        return (self.cp_size, self.merged, self.layout, self.doc_lens, self.cuts)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ShardPlan) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    # ---- layout -------------------------------------------------------------------------------

    @cached_property
    def range_table(self) -> torch.Tensor:
        """``[R, 3]`` (rank, start, stop): every rank's ranges of padded positions, rank by rank,
        each rank's ascending (what ``indices`` concatenates)."""
        return self._ranges

    @cached_property
    def _doc_bounds(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(lengths, padded starts, unpadded starts) of the documents."""
        n, p = torch.tensor(self.doc_lens), torch.tensor(self.padded_doc_lens)
        return n, torch.cumsum(p, 0) - p, torch.cumsum(n, 0) - n

    @cached_property
    def _doc_starts(self) -> tuple[tuple[int, int], ...]:
        """(start in the padded sequence, start in the unpadded sequence) of every document."""
        _, padded, real = self._doc_bounds
        return tuple(zip(padded.tolist(), real.tolist()))

    @cached_property
    def _all_indices(self) -> torch.Tensor:
        """``[W, S_loc]``: row r is ``indices(r)``."""
        a, b = self._ranges[:, 1], self._ranges[:, 2]
        length = b - a
        offset = torch.repeat_interleave(a - (torch.cumsum(length, 0) - length), length)
        return (offset + torch.arange(self.padded_len)).view(self.cp_size, self.local_len)

    def indices(self, cp_rank: int) -> torch.Tensor:
        """Global positions (in the padded sequence) held by ``cp_rank``, in local order."""
        self._check_rank(cp_rank)
        if "_all_indices" in self.__dict__:
            return self._all_indices[cp_rank]
        cache = self.__dict__.setdefault("_rank_indices", {})
        if cp_rank not in cache:
            cache[cp_rank] = self._indices_of(cp_rank)
        return cache[cp_rank]

    def _indices_of(self, cp_rank: int) -> torch.Tensor:
        """``indices(cp_rank)`` from that rank's ranges alone (a step needs only its own)."""
        first = torch.searchsorted(
            self._ranges[:, 0].contiguous(), torch.tensor([cp_rank, cp_rank + 1])
        )
        mine = self._ranges[int(first[0]) : int(first[1])]
        a, length = mine[:, 1], mine[:, 2] - mine[:, 1]
        offset = torch.repeat_interleave(a - (torch.cumsum(length, 0) - length), length)
        return offset + torch.arange(self.local_len)

    @cached_property
    def owners(self) -> torch.Tensor:
        """``[P]`` CP rank that holds each padded position."""
        owners = torch.empty(self.padded_len, dtype=torch.long)
        ranks = torch.arange(self.cp_size).repeat_interleave(self.local_len)
        return owners.index_put_((self._all_indices.flatten(),), ranks)

    @cached_property
    def local_index(self) -> torch.Tensor:
        """``[P]`` index of each padded position within its owner's shard."""
        local = torch.empty(self.padded_len, dtype=torch.long)
        rows = torch.arange(self.local_len).repeat(self.cp_size)
        return local.index_put_((self._all_indices.flatten(),), rows)

    def locate(self, flat_positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(owner, local)`` of positions ``b * padded_len + p`` in a padded ``[B, P]`` batch.

        ``owner`` is the CP rank that holds each position, ``local`` its index ``b * local_len + i``
        in that rank's flattened ``[B, local_len]`` shard (``indices(owner)[i] == p``).
        """
        pos = flat_positions.to("cpu", torch.long)
        p = pos % self.padded_len
        return self.owners[p], (pos // self.padded_len) * self.local_len + self.local_index[p]

    @cached_property
    def doc_ids(self) -> torch.Tensor:
        """``[P]`` document index of each padded position; ``PAD_DOC`` (-1) for padding."""
        # numpy's repeat: ~4x cheaper than torch's repeat_interleave for a million positions.
        n, p = np.asarray(self.doc_lens), np.asarray(self.padded_doc_lens)
        ids = np.stack([np.arange(len(n)), np.full_like(n, PAD_DOC)], 1).ravel()
        counts = np.stack([n, p - n], 1).ravel()
        tail = self.padded_len - int(p.sum())
        ids = np.repeat(np.append(ids, PAD_DOC), np.append(counts, tail))
        return torch.from_numpy(ids.astype(np.int64, copy=False))

    @cached_property
    def is_padding(self) -> torch.Tensor:
        """``[P]`` True at padding positions."""
        return self.doc_ids == PAD_DOC

    @cached_property
    def source_index(self) -> torch.Tensor:
        """``[P]`` position in the unpadded sequence of each padded position; -1 for padding."""
        src = torch.full((self.padded_len,), -1, dtype=torch.long)
        return src.index_put_((self.padded_index,), torch.arange(self.seq_len))

    @cached_property
    def padded_index(self) -> torch.Tensor:
        """``[S]`` position in the padded sequence of each real token (inverse of source_index)."""
        n, padded_start, real_start = (t.numpy() for t in self._doc_bounds)
        shift = np.repeat(padded_start - real_start, n)
        return torch.from_numpy(np.add(shift, np.arange(self.seq_len), out=shift))

    @cached_property
    def _gather_order_inverse(self) -> torch.Tensor:
        """Permutation taking the rank-order concatenation of all shards to padded order."""
        inverse = torch.empty(self.padded_len, dtype=torch.long)
        return inverse.index_put_((self._all_indices.flatten(),), torch.arange(self.padded_len))

    # ---- tensors ------------------------------------------------------------------------------

    def pad(self, x: torch.Tensor, seq_dim: int = 1, value: float | bool = 0) -> torch.Tensor:
        """Insert ``value`` after each document so that ``x`` has the padded length along seq_dim."""
        dim = self._check_len(x, seq_dim, self.seq_len, "pad", "seq_len")
        if self.padded_len == self.seq_len:
            return x
        shape = list(x.shape)
        shape[dim] = 1
        fill = torch.full(shape, value, dtype=x.dtype, device=x.device)
        # One gather from [x, fill]: its backward is a single index_add, whatever the doc count.
        src = self.source_index.to(x.device)
        src = torch.where(src < 0, self.seq_len, src)
        return torch.cat([x, fill], dim=dim).index_select(dim, src)

    def unpad(self, x: torch.Tensor, seq_dim: int = 1) -> torch.Tensor:
        """Drop the padding positions of a padded tensor."""
        dim = self._check_len(x, seq_dim, self.padded_len, "unpad", "padded_len")
        if self.padded_len == self.seq_len:
            return x
        return x.index_select(dim, self.padded_index.to(x.device))

    def shard(self, x: torch.Tensor, cp_rank: int, seq_dim: int = 1) -> torch.Tensor:
        """This rank's positions of a padded tensor, out of place.

        Differentiable: the backward puts the gradient at exactly this rank's global positions
        and zeros elsewhere, so summing over ranks gives the full gradient.
        """
        dim = self._check_len(x, seq_dim, self.padded_len, "shard", "padded_len")
        return x.index_select(dim, self.indices(cp_rank).to(x.device))

    def unshard(
        self, x_loc: torch.Tensor, group: dist.ProcessGroup | None, seq_dim: int = 1
    ) -> torch.Tensor:
        """The full padded tensor on every rank, from every rank's shard.

        An all-gather in rank order followed by a permutation to padded order. Its backward is
        the matching reduce-scatter: each rank's shard receives the sum over ranks of the
        gradient at its positions, because every rank used the whole gathered tensor.
        """
        group_size = dist.get_world_size(group)
        if group_size != self.cp_size:
            raise ValueError(
                f"unshard: the group has {group_size} ranks but the plan has {self.cp_size}"
            )
        dim = self._check_len(x_loc, seq_dim, self.local_len, "unshard", "local_len")
        gathered = differentiable_all_gather_dim0(x_loc.movedim(dim, 0), group)
        full = gathered.index_select(0, self._gather_order_inverse.to(gathered.device))
        return full.movedim(0, dim)

    # ---- checks -------------------------------------------------------------------------------

    def _check_rank(self, cp_rank: int) -> None:
        if (
            isinstance(cp_rank, bool)
            or not isinstance(cp_rank, int)
            or not 0 <= cp_rank < self.cp_size
        ):
            raise ValueError(f"cp_rank {cp_rank!r} is outside the CP group of {self.cp_size} ranks")

    def _check_len(self, x: torch.Tensor, seq_dim: int, expected: int, op: str, what: str) -> int:
        if not -x.dim() <= seq_dim < x.dim():
            raise ValueError(f"{op}: seq_dim {seq_dim} is out of range for a {x.dim()}-d tensor")
        dim = seq_dim % x.dim()
        if x.shape[dim] != expected:
            raise ValueError(
                f"{op}: tensor of shape {tuple(x.shape)} has length {x.shape[dim]} along "
                f"seq_dim {seq_dim}, expected the plan's {what} {expected} ({self!r})"
            )
        return dim


def _regroup(ranges: torch.Tensor, group_size: int) -> torch.Tensor:
    """The range table with rank r renamed r // group_size, re-sorted by rank, then start."""
    ranks = ranges[:, 0] // group_size
    order = torch.argsort(ranks * (int(ranges[:, 2].max()) + 1) + ranges[:, 1])
    return torch.stack([ranks[order], ranges[order, 1], ranges[order, 2]], 1)


# ---- batches ----------------------------------------------------------------------------------

PAD_VALUES: Mapping[str, float | bool] = {
    "labels": IGNORE_INDEX,
    "padding_mask": True,
    "attention_mask": False,
}
"""Pad value per batch key; every other sequence key pads with 0."""

SEQ_KEYS: frozenset[str] = frozenset(
    {
        "input_ids",
        "labels",
        "attention_mask",
        "padding_mask",
        "position_ids",
        "inputs_embeds",
        "token_type_ids",
        "mm_token_type_ids",
        "loss_mask",
    }
)
"""Batch keys that are sequence tensors ``[B, S, ...]`` (``position_ids`` may be ``[3|4, B, S]``)."""

PASS_KEYS: frozenset[str] = frozenset(
    {
        "pixel_values",
        "pixel_values_videos",
        "image_grid_thw",
        "video_grid_thw",
        "second_per_grid_ts",
        "doc_lens",
        "num_valid",
        "rope_deltas",
    }
)
"""Batch keys that are never sequence tensors (vision inputs, grids, counts): passed through."""


def _default_seq_dim(key: str, x: torch.Tensor) -> int:
    if key == "position_ids" and x.dim() == 3:
        return -1  # M-RoPE [3|4, B, S]
    if x.dim() < 2:
        raise ValueError(f"pad_and_shard: {key!r} has shape {tuple(x.shape)}; expected [B, S, ...]")
    return 1


def pad_and_shard(
    batch: Mapping[str, object],
    plan: ShardPlan,
    cp_rank: int,
    *,
    seq_dims: Mapping[str, int | None] | None = None,
) -> dict[str, object]:
    """Pad and shard every sequence tensor of ``batch`` for ``cp_rank``; pass the rest through.

    Known sequence keys (``SEQ_KEYS``) get their pad value from ``PAD_VALUES`` (0 otherwise) and
    their sequence dim by layout (``position_ids`` with 3 dims: -1; else 1). ``seq_dims`` names
    the sequence dim of other keys, or ``None`` to pass a key through untouched. An unknown
    tensor with a dim of length ``seq_len`` is an error, since silently passing a sequence tensor
    through unsharded is a wrong-result bug.
    """
    seq_dims = dict(seq_dims or {})
    plan._check_rank(cp_rank)
    out: dict[str, object] = {}
    for key, value in batch.items():
        if key in seq_dims:
            dim = seq_dims[key]
        elif key in SEQ_KEYS and isinstance(value, torch.Tensor):
            dim = _default_seq_dim(key, value)
        elif key in PASS_KEYS:
            dim = None
        else:
            if isinstance(value, torch.Tensor) and plan.seq_len in value.shape:
                raise ValueError(
                    f"pad_and_shard: unknown key {key!r} of shape {tuple(value.shape)} has a dim "
                    f"of length seq_len={plan.seq_len}; pass seq_dims={{{key!r}: dim}} to shard "
                    f"it or seq_dims={{{key!r}: None}} to pass it through"
                )
            dim = None
        if dim is None:
            out[key] = value
            continue
        if not isinstance(value, torch.Tensor):
            raise ValueError(f"pad_and_shard: {key!r} is a {type(value).__name__}, not a tensor")
        padded = plan.pad(value, seq_dim=dim, value=PAD_VALUES.get(key, 0))
        out[key] = plan.shard(padded, cp_rank, seq_dim=dim)
    return out
