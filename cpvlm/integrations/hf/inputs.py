"""Full-sequence integer inputs of a Qwen-VL training batch, prepared identically on every CP rank.

Legend: B batch, S sequence length, P padded length (ShardPlan), R visual rows (merged tokens of all
images, then all videos), m spatial merge size.

Everything here is a pure function of the replicated batch: the M-RoPE position ids (the model's
own ``get_rope_index``, per packed document), the shifted labels and their global count, the plan,
and the padded-batch position ``b * P + p`` of every visual row. Bad input is rejected here, on
every rank, before any collective runs.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from cpvlm.distributed.shard_plan import ShardPlan
from cpvlm.loss import count_valid_labels, shift_labels
from cpvlm.vision.units import grid_list

from .models import model_family

OPTIONAL_KEYS = (
    "attention_mask",
    "mm_token_type_ids",
    "pixel_values",
    "image_grid_thw",
    "pixel_values_videos",
    "video_grid_thw",
    "second_per_grid_ts",
)
"""Batch keys a training step takes besides ``input_ids`` and ``labels``."""


@dataclass(frozen=True)
class PreparedBatch:
    """What every CP rank derives from the full batch before it shards anything."""

    plan: ShardPlan
    input_ids: torch.Tensor  # [B, S]
    position_ids: torch.Tensor  # [3, B, S]
    labels: torch.Tensor  # [B, S] shifted (label of token t+1 at t), -100 = no loss
    num_valid: int  # global valid-label count the loss divides by
    visual_mask: torch.Tensor  # [B, S] image or video placeholder
    pixel_parts: tuple[torch.Tensor, ...]  # [patches, C] images, then videos (none: text only)
    grid_thw: torch.Tensor  # [items, 3] images then videos ([0, 3] for text only)
    row_positions: torch.Tensor  # [R] b * P + p of each visual row, tower order
    pixel_width: int  # C of a pixel row
    local_pixels: bool = False  # pixel_parts hold only this CP rank's units (see prepare_batch)

    def pixel_values(self, dtype: torch.dtype) -> torch.Tensor:
        """``[patches, C]`` images then videos in ``dtype``. Build it only where it is used: it
        is a full copy of the batch's pixels on every rank (one tensor is passed through)."""
        if not self.pixel_parts:
            return torch.zeros(0, self.pixel_width, dtype=dtype)
        parts = [p.to(dtype) for p in self.pixel_parts]
        return parts[0] if len(parts) == 1 else torch.cat(parts)


def _tokens_per_item(grids: list[tuple[int, int, int]], merge: int) -> list[int]:
    return [t * h * w // merge**2 for t, h, w in grids]


def _check_vision(
    kind: str, ids, token_id, pixels, grid_thw, merge, local: bool
) -> list[tuple[int, int, int]]:
    n_tokens = int((ids == token_id).sum())
    if grid_thw is None:
        if pixels is not None:
            raise ValueError(f"pixel values for {kind}s were given without {kind}_grid_thw")
        if n_tokens:
            raise ValueError(
                f"input_ids hold {n_tokens} {kind} tokens (id {token_id}) but no {kind}_grid_thw"
            )
        return []
    try:
        grids = grid_list(grid_thw, merge)
    except ValueError as err:
        raise ValueError(f"{kind}_grid_thw: {err}") from None
    if pixels is None:
        raise ValueError(f"{kind}_grid_thw was given without its pixel values")
    patches = sum(t * h * w for t, h, w in grids)
    if pixels.dim() != 2 or (pixels.shape[0] != patches and not local):
        raise ValueError(
            f"{kind} pixel values have shape {tuple(pixels.shape)} but {kind}_grid_thw needs "
            f"{patches} patch rows (sum of t*h*w)"
        )
    n_features = sum(_tokens_per_item(grids, merge))
    if n_tokens != n_features:
        raise ValueError(
            f"{kind} tokens and features do not match: input_ids hold {n_tokens} {kind} tokens "
            f"(id {token_id}) but {kind}_grid_thw gives {n_features} features (t*h*w/{merge}**2)"
        )
    return grids


def _check_attention_mask(attention_mask: torch.Tensor | None, shape) -> None:
    if attention_mask is None:
        return
    if tuple(attention_mask.shape) != tuple(shape):
        raise ValueError(
            f"attention_mask has shape {tuple(attention_mask.shape)}, input_ids {tuple(shape)}"
        )
    keep = attention_mask.bool()
    # Right padding only: then causality alone keeps real tokens off the padding.
    if bool((keep[:, 1:] & ~keep[:, :-1]).any()):
        raise ValueError(
            "attention_mask must be right-padded (ones, then zeros, per row); left or inner "
            "padding is not supported under context parallelism"
        )


def _split_by_document(grids, tokens_in_doc, merge, kind) -> list[list[tuple[int, int, int]]]:
    """Grids of each document, in order, from the number of tokens each document holds."""
    per_doc, it = [], iter(zip(grids, _tokens_per_item(grids, merge), strict=True))
    for d, need in enumerate(tokens_in_doc):
        mine, got = [], 0
        while got < need:
            grid, n = next(it)
            mine.append(grid)
            got += n
        if got != need:
            raise ValueError(f"a {kind} straddles the boundary of packed document {d}")
        per_doc.append(mine)
    return per_doc


def _rope_positions(model, ids, mm_types, attention_mask, image_grids, video_grids, seconds):
    """``[3, B, S]`` positions from the model's own ``get_rope_index`` (text-only: arange)."""
    if not image_grids and not video_grids:
        pos = torch.arange(ids.shape[1], device=ids.device)
        return pos.view(1, 1, -1).expand(3, ids.shape[0], -1).clone()
    kwargs = {
        "mm_token_type_ids": mm_types,
        "image_grid_thw": torch.tensor(image_grids, dtype=torch.long) if image_grids else None,
        "video_grid_thw": torch.tensor(video_grids, dtype=torch.long) if video_grids else None,
        "attention_mask": attention_mask,
    }
    if model_family(model) == "qwen2_5_vl":
        kwargs["second_per_grid_ts"] = seconds
    position_ids, _ = model.model.get_rope_index(ids, **kwargs)
    return position_ids


def prepare_batch(
    model,
    batch: Mapping[str, object],
    cp_size: int,
    *,
    doc_lens: Sequence[int] | torch.Tensor | None = None,
    num_valid: int | None = None,
    local_pixels: bool = False,
) -> PreparedBatch:
    """Validate a full training batch and derive the replicated inputs of a CP step.

    ``batch`` holds what a transformers Qwen-VL model takes for training: ``input_ids``,
    ``labels`` (unshifted), optional ``attention_mask`` (right padding), ``mm_token_type_ids``,
    ``pixel_values``/``image_grid_thw``, ``pixel_values_videos``/``video_grid_thw`` (and
    ``second_per_grid_ts`` for Qwen2.5-VL videos). ``doc_lens`` packs one row into documents
    (positions restart, no attention across documents, labels shifted per document).
    ``local_pixels``: the pixel values hold only the rows of the units this CP rank encodes
    (``VisionDataParallel`` checks their count).
    """
    config = model.config
    merge = config.vision_config.spatial_merge_size
    ids = batch.get("input_ids")
    labels = batch.get("labels")
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.is_floating_point():
        raise ValueError("input_ids must be an integer tensor of shape [B, S]")
    if not isinstance(labels, torch.Tensor) or labels.shape != ids.shape:
        shape = tuple(labels.shape) if isinstance(labels, torch.Tensor) else None
        raise ValueError(f"labels must have the shape of input_ids {tuple(ids.shape)}, got {shape}")
    attention_mask = batch.get("attention_mask")
    _check_attention_mask(attention_mask, ids.shape)
    text_config = config.text_config
    if getattr(text_config, "use_sliding_window", False):
        raise ValueError(
            "sliding-window attention (text_config.use_sliding_window) is not supported"
        )

    image_grids = _check_vision(
        "image", ids, config.image_token_id, batch.get("pixel_values"),
        batch.get("image_grid_thw"), merge, local_pixels,
    )  # fmt: skip
    video_grids = _check_vision(
        "video", ids, config.video_token_id, batch.get("pixel_values_videos"),
        batch.get("video_grid_thw"), merge, local_pixels,
    )  # fmt: skip
    mm_types = batch.get("mm_token_type_ids")
    expected_types = (ids == config.image_token_id).long() + 2 * (
        ids == config.video_token_id
    ).long()
    if attention_mask is not None:
        expected_types = expected_types * attention_mask.bool()
    if mm_types is None:
        if image_grids or video_grids:
            raise ValueError(
                "mm_token_type_ids is missing: the model needs it to place images and videos in "
                "its M-RoPE positions (the processor returns it: 1 = image token, 2 = video token)"
            )
    elif tuple(mm_types.shape) != tuple(ids.shape) or not torch.equal(
        mm_types.long(), expected_types
    ):
        raise ValueError(
            "mm_token_type_ids does not match input_ids: it must be 1 at the image tokens "
            f"(id {config.image_token_id}), 2 at the video tokens (id {config.video_token_id}), "
            "0 elsewhere"
        )

    seq_len = ids.shape[1]
    if isinstance(doc_lens, torch.Tensor):
        doc_lens = doc_lens.tolist()
    if doc_lens is not None and ids.shape[0] != 1:
        raise ValueError(f"doc_lens packs one row; got a batch of {ids.shape[0]} rows")
    plan = ShardPlan(seq_len, cp_size, doc_lens=doc_lens)
    seconds = batch.get("second_per_grid_ts")

    if doc_lens is None:
        position_ids = _rope_positions(
            model, ids, mm_types, attention_mask, image_grids, video_grids, seconds
        )
    else:
        bounds = torch.tensor([0, *plan.doc_lens]).cumsum(0).tolist()
        spans = list(zip(bounds[:-1], bounds[1:], strict=True))
        img = _split_by_document(
            image_grids, [int((ids[0, a:b] == config.image_token_id).sum()) for a, b in spans],
            merge, "image",
        )  # fmt: skip
        vid = _split_by_document(
            video_grids, [int((ids[0, a:b] == config.video_token_id).sum()) for a, b in spans],
            merge, "video",
        )  # fmt: skip
        parts, v0 = [], 0
        for (a, b), img_d, vid_d in zip(spans, img, vid, strict=True):
            sec_d = None if seconds is None else seconds[v0 : v0 + len(vid_d)]
            v0 += len(vid_d)
            parts.append(
                _rope_positions(
                    model,
                    ids[:, a:b],
                    None if mm_types is None else mm_types[:, a:b],
                    None if attention_mask is None else attention_mask[:, a:b],
                    img_d,
                    vid_d,
                    sec_d,
                )  # fmt: skip
            )
        position_ids = torch.cat(parts, dim=-1)

    shifted = shift_labels(labels, doc_lens=doc_lens)
    if num_valid is None:
        num_valid = count_valid_labels(shifted)

    visual_mask = (ids == config.image_token_id) | (ids == config.video_token_id)
    vision = config.vision_config
    width = vision.in_channels * vision.temporal_patch_size * vision.patch_size**2
    pixels = tuple(
        batch[k] for k in ("pixel_values", "pixel_values_videos") if batch.get(k) is not None
    )
    grids = torch.tensor(image_grids + video_grids, dtype=torch.long).reshape(-1, 3)
    padded = plan.padded_index.to(ids.device)
    flat = []
    for token_id in (config.image_token_id, config.video_token_id):
        b, s = torch.nonzero(ids == token_id, as_tuple=True)  # row-major: the tower's order
        flat.append(b * plan.padded_len + padded[s])
    row_positions = torch.cat(flat)
    return PreparedBatch(
        plan=plan,
        input_ids=ids,
        position_ids=position_ids,
        labels=shifted,
        num_valid=int(num_valid),
        visual_mask=visual_mask,
        pixel_parts=pixels,
        grid_thw=grids,
        row_positions=row_positions,
        pixel_width=width,
        local_pixels=local_pixels,
    )
