"""Samples in, packed rows out: the data protocol of ``cpvlm train``.

Legend: L tokens of one sample (one document), S tokens of a packed row (<= seq_len), m spatial
merge size.

Sample protocol. A data source yields dicts, one per document, laid out as a Qwen-VL processor
writes one sample (a leading batch dim of 1 is accepted and dropped):

    input_ids            [L] int   text ids with each image written as <vision_start>, t*h*w/m**2
                                   image tokens, <vision_end> (videos likewise; Qwen3-VL writes a
                                   timestamp + start + pads + end group per temporal frame)
    labels               [L] int   optional; -100 where nothing is learned. Default: input_ids
                                   with the image / video tokens set to -100. Unshifted: position t
                                   holds the label of token t (the trainer shifts per document).
    attention_mask       [L]       optional; right padding is cut off
    pixel_values         [patches, C*T*P*P] and image_grid_thw [n_images, 3]    (images)
    pixel_values_videos  [patches, C*T*P*P] and video_grid_thw [n_videos, 3]    (videos)
    second_per_grid_ts   [n_videos]  Qwen2.5-VL videos

A source is any of: a map-style object without ``__len__`` (infinite, ``source[i]``, like
``SyntheticVLMData``), a sequence (``len`` + ``source[i]``, cycled), or an iterable that restarts
on every ``iter()`` (a list, a dataset object; not a one-shot generator), cycled. ``cpvlm train
--data pkg.module:function`` calls ``function(model_config=<the model's HF config>, seed=<--seed>)``
on every rank and uses what it returns.

Packing: samples, in order, are concatenated into rows of at most seq_len tokens, one document
each. A text-only sample that does not fit is split (its head fills the row, the rest starts the
next row); a sample with images or videos moves whole to the next row, and one longer than
seq_len is an error.

One global stream. Every rank packs the same rows from all samples, so the order of the data is
a fact about samples, not about ranks: a step takes the next ``rows_per_step`` rows of the
stream (the global batch), and DP rank d of dp trains on rows ``d * R .. d * R + R - 1`` of them
(R = rows_per_step / dp; the CP ranks of a DP replica share its rows; see ``step_rows``). The
stream position (next sample index, tokens of it already used) is the whole data state: it is
the same on every rank, checkpoints save it once, and a run resumed with another dp or cp
continues the same sequence of global batches.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

import torch

from cpvlm.loss import IGNORE_INDEX

VISION_KEYS = (
    "pixel_values",
    "image_grid_thw",
    "pixel_values_videos",
    "video_grid_thw",
    "second_per_grid_ts",
)
SAMPLE_KEYS = ("input_ids", "labels", "attention_mask", *VISION_KEYS, "mm_token_type_ids")


@dataclass(frozen=True)
class TokenIds:
    """The ids and sizes the packer needs from a model config."""

    image: int
    video: int
    merge: int

    @classmethod
    def from_config(cls, model_config) -> TokenIds:
        return cls(
            image=model_config.image_token_id,
            video=model_config.video_token_id,
            merge=model_config.vision_config.spatial_merge_size,
        )


@dataclass
class Sample:
    """One validated document."""

    input_ids: torch.Tensor  # [L] long
    labels: torch.Tensor  # [L] long, unshifted
    vision: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def has_vision(self) -> bool:
        return bool(self.vision)

    def __len__(self) -> int:
        return self.input_ids.numel()


@dataclass
class PackedRow:
    """One packed row: the documents of one CP forward."""

    input_ids: torch.Tensor  # [S]
    labels: torch.Tensor  # [S] unshifted
    doc_lens: list[int]
    vision: dict[str, torch.Tensor]
    ids: TokenIds

    @property
    def num_tokens(self) -> int:
        return self.input_ids.numel()

    @property
    def has_vision(self) -> bool:
        return bool(self.vision)

    def batch(self, device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
        """The keyword arguments of ``ContextParallelVLM`` for this row (without ``doc_lens``)."""
        ids = self.input_ids.view(1, -1)
        mm_types = (ids == self.ids.image).long() + 2 * (ids == self.ids.video).long()
        out = {"input_ids": ids, "labels": self.labels.view(1, -1), "mm_token_type_ids": mm_types}
        out.update(self.vision)
        return {k: v.to(device) for k, v in out.items()}


def _as_1d_long(name: str, value, index: int) -> torch.Tensor:
    t = torch.as_tensor(value)
    if t.dim() == 2 and t.shape[0] == 1:
        t = t[0]
    if t.dim() != 1 or t.is_floating_point() or t.is_complex():
        raise ValueError(
            f"sample {index}: {name} must be a 1-d integer sequence (or [1, L]), got shape "
            f"{tuple(t.shape)} dtype {t.dtype}"
        )
    return t.long()


def normalize_sample(raw: Mapping, ids: TokenIds, index: int) -> Sample:
    """Validate one sample dict of the protocol above and return it as a ``Sample``."""
    if not isinstance(raw, Mapping):
        raise ValueError(f"sample {index}: expected a dict, got {type(raw).__name__}")
    unknown = set(raw) - set(SAMPLE_KEYS)
    if unknown:
        raise ValueError(f"sample {index}: unknown keys {sorted(unknown)}; known: {SAMPLE_KEYS}")
    if "input_ids" not in raw:
        raise ValueError(f"sample {index}: input_ids is missing")
    input_ids = _as_1d_long("input_ids", raw["input_ids"], index)
    placeholder = (input_ids == ids.image) | (input_ids == ids.video)
    if raw.get("labels") is None:
        labels = input_ids.masked_fill(placeholder, IGNORE_INDEX)
    else:
        labels = _as_1d_long("labels", raw["labels"], index)
    if labels.shape != input_ids.shape:
        raise ValueError(
            f"sample {index}: labels have {labels.numel()} tokens, input_ids {input_ids.numel()}"
        )
    if raw.get("attention_mask") is not None:
        keep = _as_1d_long("attention_mask", raw["attention_mask"], index).bool()
        n = int(keep.sum())
        if keep.shape != input_ids.shape or not bool(keep[:n].all()):
            raise ValueError(f"sample {index}: attention_mask must be right padding (1s then 0s)")
        input_ids, labels = input_ids[:n], labels[:n]
    if input_ids.numel() == 0:
        raise ValueError(f"sample {index}: no tokens")
    vision = {}
    for kind, token, pix_key, grid_key in (
        ("image", ids.image, "pixel_values", "image_grid_thw"),
        ("video", ids.video, "pixel_values_videos", "video_grid_thw"),
    ):
        n_tokens = int((input_ids == token).sum())
        grid, pixels = raw.get(grid_key), raw.get(pix_key)
        if grid is None and pixels is None and n_tokens == 0:
            continue
        if grid is None or pixels is None:
            raise ValueError(
                f"sample {index}: {n_tokens} {kind} tokens (id {token}) need both {pix_key} and "
                f"{grid_key}"
            )
        grid = torch.as_tensor(grid).long().reshape(-1, 3)
        pixels = torch.as_tensor(pixels)
        need = int((grid.prod(-1) // ids.merge**2).sum())
        if n_tokens != need or pixels.dim() != 2 or pixels.shape[0] != int(grid.prod(-1).sum()):
            raise ValueError(
                f"sample {index}: {grid_key} {grid.tolist()} needs {need} {kind} tokens and "
                f"{int(grid.prod(-1).sum())} rows of {pix_key}; got {n_tokens} tokens and "
                f"{pix_key} of shape {tuple(pixels.shape)}"
            )
        vision[grid_key], vision[pix_key] = grid, pixels
    if "video_grid_thw" in vision and raw.get("second_per_grid_ts") is not None:
        vision["second_per_grid_ts"] = torch.as_tensor(raw["second_per_grid_ts"]).reshape(-1)
    return Sample(input_ids, labels, vision)


def _stream(source, start: int) -> Iterator[tuple[int, object]]:
    """``(global index, raw sample)`` for the indices >= start, cycling finite sources."""
    if hasattr(source, "__getitem__") and not hasattr(source, "__len__"):
        i = start
        while True:
            yield i, source[i]
            i += 1
    if hasattr(source, "__getitem__") and hasattr(source, "__len__"):
        n = len(source)
        if n == 0:
            raise ValueError("the data source is empty")
        i = start
        while True:
            yield i, source[i % n]
            i += 1
    i = 0
    while True:
        seen = False
        for raw in source:
            seen = True
            if i >= start:
                yield i, raw
            i += 1
        if not seen:
            raise ValueError(
                "the data source yielded no samples (a one-shot generator cannot be cycled; "
                "return a list or an object whose __iter__ restarts)"
            )


class RowPacker:
    """Packs the samples of a source into rows of at most ``seq_len`` tokens, deterministically.

    ``state_dict()`` / the ``state`` argument: ``{"next_index", "offset"}``, the global index of
    the next sample to use and how many of its tokens earlier rows already took.
    """

    def __init__(
        self,
        source,
        seq_len: int,
        ids: TokenIds,
        *,
        state: Mapping[str, int] | None = None,
    ):
        self.seq_len, self.ids = seq_len, ids
        state = dict(state or {"next_index": 0, "offset": 0})
        self._next_index, self._offset = int(state["next_index"]), int(state["offset"])
        self._stream = _stream(source, self._next_index)
        self._pending: Sample | None = None

    def state_dict(self) -> dict[str, int]:
        return {"next_index": self._next_index, "offset": self._offset}

    def _peek(self) -> Sample:
        if self._pending is None:
            index, raw = next(self._stream)
            if index != self._next_index:
                raise RuntimeError(f"data stream at sample {index}, expected {self._next_index}")
            self._pending = normalize_sample(raw, self.ids, index)
        return self._pending

    def _advance(self) -> None:
        self._pending, self._offset = None, 0
        self._next_index += 1

    def next_row(self) -> PackedRow:
        ids_parts, label_parts, doc_lens, vision_parts = [], [], [], []
        used = 0
        while used < self.seq_len:
            sample = self._peek()
            left, space = len(sample) - self._offset, self.seq_len - used
            if sample.has_vision and len(sample) > self.seq_len:
                raise ValueError(
                    f"sample {self._next_index} has {len(sample)} tokens with images or videos, "
                    f"more than --seq-len {self.seq_len}; raise --seq-len to at least "
                    f"{len(sample)} (a sample with images cannot be split across rows)"
                )
            if sample.has_vision and left > space:
                break  # the whole sample moves to the next row
            take = min(left, space)
            span = slice(self._offset, self._offset + take)
            ids_parts.append(sample.input_ids[span])
            label_parts.append(sample.labels[span])
            doc_lens.append(take)
            if sample.has_vision:
                vision_parts.append(sample.vision)
            used += take
            if take == left:
                self._advance()
            else:
                self._offset += take
        vision = {}
        for key in VISION_KEYS:
            parts = [v[key] for v in vision_parts if key in v]
            if parts:
                vision[key] = torch.cat(parts)
        return PackedRow(torch.cat(ids_parts), torch.cat(label_parts), doc_lens, vision, self.ids)


def step_rows(packer: RowPacker, rows_per_step: int, dp_rank: int, dp_size: int) -> list[PackedRow]:
    """The rows DP rank ``dp_rank`` trains on in the next step: its contiguous share of the step.

    Every rank packs all ``rows_per_step`` rows of the step (the packer advances alike on every
    rank) and keeps rows ``dp_rank * R`` to ``dp_rank * R + R - 1``, R = rows_per_step / dp_size.
    """
    if rows_per_step % dp_size:
        raise ValueError(f"{rows_per_step} rows per step do not split over {dp_size} DP ranks")
    rows = [packer.next_row() for _ in range(rows_per_step)]
    share = rows_per_step // dp_size
    return rows[dp_rank * share : (dp_rank + 1) * share]


def load_source(spec: str, model_config, seed: int):
    """The sample source named by ``--data``: ``"synthetic"`` or ``"pkg.module:function"``."""
    if spec == "synthetic":
        from cpvlm.train.synthetic import SyntheticVLMData

        return SyntheticVLMData(model_config, seed=seed)
    module_name, _, func_name = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ValueError(f"--data {spec}: cannot import {module_name!r} ({err})") from None
    func = getattr(module, func_name, None)
    if not callable(func):
        raise ValueError(f"--data {spec}: {module_name} has no function {func_name!r}")
    return func(model_config=model_config, seed=seed)


def check_data_fits(source, seq_len: int) -> None:
    """Reject a ``seq_len`` shorter than the source's longest sample, if the source knows it."""
    longest = getattr(source, "max_sample_len", None)
    if longest is not None and longest() > seq_len:
        raise ValueError(
            f"data.seq_len = {seq_len} (--seq-len): too short for the images: the data's longest "
            f"sample with images or videos has {longest()} tokens and cannot be split; use "
            f"--seq-len {longest()} or more"
        )
