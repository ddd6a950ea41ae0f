"""Full-sequence integer inputs of a VLM training batch, prepared identically on every CP rank.

Legend: B batch, S sequence length, P padded length (ShardPlan), R visual rows (merged tokens of all
images, then all videos), A audio rows (of all clips), F audio feature width, m spatial merge size.

Everything here is a pure function of the replicated batch: the token types, the position ids (the
model's own ``get_rope_index`` per packed document for M-RoPE families, per-document positions
for 1D ones), the shifted labels and their global count, the plan, and the padded-batch position
``b * P + p`` of every visual row. Bad input is rejected here, on every rank, before any
collective runs. What is particular to a family comes from its adapter.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from cpvlm.distributed.shard_plan import ShardPlan
from cpvlm.encoders.units import clip_grid, grid_list
from cpvlm.hf.adapter import VLMAdapter, module_at
from cpvlm.hf.registry import adapter_for
from cpvlm.loss import count_valid_labels, shift_labels

BASE_KEYS = (
    "attention_mask",
    "mm_token_type_ids",
    "pixel_values",
    "image_grid_thw",
    "pixel_values_videos",
    "video_grid_thw",
    "audio_features",
    "audio_lengths",
)
"""Batch keys of a training step besides ``input_ids``, ``labels`` and the family's video keys.
Audio, in the core's layout: ``audio_features`` [frames, F], the clips' feature frames one after
another, and ``audio_lengths`` [clips], each clip's frames (a family's ``from_model_batch`` makes
them of its processor's keys)."""

OPTIONAL_KEYS = (*BASE_KEYS, "second_per_grid_ts")
"""Every optional batch key of the supported families (kept for callers of the old name)."""


def batch_keys(adapter: VLMAdapter) -> tuple[str, ...]:
    """The batch keys a family's CP step takes besides ``input_ids`` and ``labels``: the core's,
    its per-video keys, and those of the model's own batch (its processor's output and its
    forward's keywords, which ``from_model_batch`` converts)."""
    return (*BASE_KEYS, *adapter.video_keys, *adapter.model_batch_keys)


_KINDS = (
    ("image", 1, "pixel_values", "image_grid_thw"),
    ("video", 2, "pixel_values_videos", "video_grid_thw"),
)
AUDIO_TYPE = 3
"""``mm_token_type_ids`` of an audio placeholder."""


@dataclass(frozen=True)
class PreparedBatch:
    """What every CP rank derives from the full batch before it shards anything."""

    plan: ShardPlan
    input_ids: torch.Tensor  # [B, S]
    position_ids: torch.Tensor  # [3, B, S] (M-RoPE) or [B, S]
    labels: torch.Tensor  # [B, S] shifted (label of token t+1 at t), -100 = no loss
    num_valid: int  # global valid-label count the loss divides by
    visual_mask: torch.Tensor  # [B, S] image or video placeholder (not audio)
    real_mask: torch.Tensor  # [B, S] a real token (attention_mask, or all True)
    pixel_parts: tuple[torch.Tensor, ...]  # [patches, C] images, then videos (none: text only)
    grid_thw: torch.Tensor  # [items, 3] images then videos ([0, 3] for text only)
    kinds: tuple[str, ...]  # per item of grid_thw: "image" or "video" (its grid tensor's)
    row_positions: torch.Tensor  # [R] b * P + p of each visual row, tower order
    pixel_width: int  # C of a pixel row
    local_pixels: bool = False  # pixel_parts hold only this CP rank's units (see prepare_batch)
    spans: tuple[tuple[tuple[int, int], ...], ...] = ()
    """Per batch row: the global padded ``[start, stop)`` of each run of the adapter's
    ``span_token_types`` within one document (tokens that attend bidirectionally)."""
    audio_features: torch.Tensor | None = None  # [frames, F] every clip's, in order (or None)
    audio_lengths: tuple[int, ...] = ()  # feature frames of each clip
    audio_mask: torch.Tensor | None = None  # [B, S] audio placeholder (None: no audio tokens)
    audio_row_positions: torch.Tensor | None = None  # [A] b * P + p of each audio row

    @property
    def audio_grid(self) -> torch.Tensor:
        """``[clips, 3]``: each clip as an encoder unit of grid (1, 1, frames)."""
        return clip_grid(self.audio_lengths)

    def pixel_values(self, dtype: torch.dtype) -> torch.Tensor:
        """``[patches, C]`` images then videos in ``dtype``. Build it only where it is used: it
        is a full copy of the batch's pixels on every rank (one tensor is passed through)."""
        if not self.pixel_parts:
            return torch.zeros(0, self.pixel_width, dtype=dtype)
        parts = [p.to(dtype) for p in self.pixel_parts]
        return parts[0] if len(parts) == 1 else torch.cat(parts)


def _tokens_per_item(items: list, kind: str, adapter: VLMAdapter) -> list[int]:
    """Placeholders of each item: grids of images or videos, feature frames of audio clips."""
    if kind == "audio":
        return [adapter.audio_rows(n) for n in items]
    return [adapter.item_sizes(g, kind)[1] for g in items]


def _check_text(batch: Mapping) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    ids, labels = batch.get("input_ids"), batch.get("labels")
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.is_floating_point():
        raise ValueError("input_ids must be an integer tensor of shape [B, S]")
    if not isinstance(labels, torch.Tensor) or labels.shape != ids.shape:
        shape = tuple(labels.shape) if isinstance(labels, torch.Tensor) else None
        raise ValueError(f"labels must have the shape of input_ids {tuple(ids.shape)}, got {shape}")
    attention_mask = batch.get("attention_mask")
    if attention_mask is None:
        return ids, labels, None
    if tuple(attention_mask.shape) != tuple(ids.shape):
        raise ValueError(
            f"attention_mask has shape {tuple(attention_mask.shape)}, input_ids {tuple(ids.shape)}"
        )
    keep = attention_mask.bool()
    # Right padding only: then causality alone keeps real tokens off the padding.
    if bool((keep[:, 1:] & ~keep[:, :-1]).any()):
        raise ValueError(
            "attention_mask must be right-padded (ones, then zeros, per row); left or inner "
            "padding is not supported under context parallelism"
        )
    return ids, labels, attention_mask


def _check_vision(
    kind: str, n_tokens: int, token_id: int, pixels, grid_thw, adapter: VLMAdapter, local: bool
) -> list[tuple[int, int, int]]:
    merge = adapter.merge_size
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
    patches = sum(adapter.item_sizes(g, kind)[0] for g in grids)
    rule = f" (the {adapter.family} adapter's item_sizes; by default t*h*w and t*h*w/{merge}**2)"
    if pixels.dim() != 2 or (pixels.shape[0] != patches and not local):
        raise ValueError(
            f"{kind} pixel values have shape {tuple(pixels.shape)} but {kind}_grid_thw needs "
            f"{patches} patch rows{rule}"
        )
    n_features = sum(_tokens_per_item(grids, kind, adapter))
    if n_tokens != n_features:
        raise ValueError(
            f"{kind} tokens and features do not match: input_ids hold {n_tokens} {kind} tokens "
            f"(id {token_id}) but {kind}_grid_thw gives {n_features} features{rule}"
        )
    return grids


def _check_token_types(adapter: VLMAdapter, ids, attention_mask, given) -> torch.Tensor:
    types = adapter.mm_token_type_ids(ids, attention_mask)
    if given is not None and (
        tuple(given.shape) != tuple(ids.shape) or not torch.equal(given.long(), types)
    ):
        raise ValueError(
            "mm_token_type_ids does not match input_ids: it must be 1 at the image tokens "
            f"(id {adapter.config.image_token_id}), 2 at the video tokens, 3 at the audio tokens, "
            f"0 elsewhere (the {adapter.family} processor's rule)"
        )
    return types


def _check_audio(batch: Mapping, n_tokens: int, adapter: VLMAdapter) -> list[int]:
    """Each clip's feature frames, validated against its features and its placeholders."""
    features, lengths = batch.get("audio_features"), batch.get("audio_lengths")
    if features is None and lengths is None:
        if n_tokens:
            raise ValueError(
                f"input_ids hold {n_tokens} audio tokens (id {adapter.audio_token_id}) but no "
                "audio_features / audio_lengths"
            )
        return []
    if adapter.audio_token_id is None:
        raise ValueError(
            f"{adapter.family}: this model has no audio encoder (its config has no audio); "
            "pass no audio_features"
        )
    if features is None or lengths is None:
        raise ValueError("audio_features and audio_lengths go together: pass both or neither")
    lengths = torch.as_tensor(lengths)
    if lengths.dim() != 1 or lengths.is_floating_point() or bool((lengths < 1).any()):
        raise ValueError(
            f"audio_lengths must be a 1-d integer tensor of lengths >= 1, got {lengths}"
        )
    frames = lengths.tolist()
    width = adapter.audio_feature_width
    if features.dim() != 2 or features.shape != (sum(frames), width):
        raise ValueError(
            f"audio_features has shape {tuple(features.shape)} but audio_lengths {frames} need "
            f"[{sum(frames)}, {width}] (each clip's feature frames, one after another)"
        )
    rows = sum(adapter.audio_rows(n) for n in frames)
    if n_tokens != rows:
        raise ValueError(
            f"audio tokens and features do not match: input_ids hold {n_tokens} audio tokens "
            f"(id {adapter.audio_token_id}) but clips of {frames} feature frames give {rows} "
            f"rows (the {adapter.family} adapter's audio_rows)"
        )
    return frames


def _split_by_document(grids, tokens_in_doc, adapter, kind) -> list[list[tuple[int, int, int]]]:
    """Grids of each document, in order, from the number of tokens each document holds."""
    per_doc, it = [], iter(zip(grids, _tokens_per_item(grids, kind, adapter), strict=True))
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


def rope_index(
    adapter: VLMAdapter,
    model: nn.Module,
    input_ids: torch.Tensor,
    mm_token_type_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    image_grid_thw: torch.Tensor | None,
    video_grid_thw: torch.Tensor | None,
    video_extras: dict[str, torch.Tensor],
    audio_lengths: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """``[3, B, S]`` M-RoPE positions of one document, from the model's own ``get_rope_index``
    (the adapter's ``modules.rope_index``; a document without vision items: ``arange`` in every
    row); None for a model without one (1D RoPE: the core then uses per-document positions
    ``[B, S]``). ``video_extras``: the adapter's ``video_keys``; ``audio_lengths``: each audio
    clip's feature frames (the keyword only where the document has audio)."""
    get_rope_index = module_at(model, adapter.modules.rope_index, default=None)
    if get_rope_index is None:
        return None
    if image_grid_thw is None and video_grid_thw is None and audio_lengths is None:
        arange = torch.arange(input_ids.shape[1], device=input_ids.device)
        return arange.expand(3, input_ids.shape[0], -1).clone()
    position_ids, _ = get_rope_index(
        input_ids,
        **adapter.rope_index_kwargs(
            input_ids,
            {
                "mm_token_type_ids": mm_token_type_ids,
                "image_grid_thw": image_grid_thw,
                "video_grid_thw": video_grid_thw,
                "attention_mask": attention_mask,
                **video_extras,
                **({} if audio_lengths is None else {"audio_lengths": audio_lengths}),
            },
        ),
    )
    return position_ids


def _document_positions(adapter, model, ids, types, attention_mask, grids, extras) -> torch.Tensor:
    """Positions of one document (or of a padded batch): ``[3, B, S]`` for M-RoPE families
    (``rope_index``), ``[B, S]`` arange for 1D families (``rope_index`` None)."""
    image_grids, video_grids, audio_frames = grids
    as_tensor = lambda g: torch.tensor(g, dtype=torch.long) if g else None  # noqa: E731
    pos = rope_index(
        adapter,
        model,
        ids,
        types,
        attention_mask,
        as_tensor(image_grids),
        as_tensor(video_grids),
        extras,
        as_tensor(audio_frames),
    )
    if pos is None:
        return torch.arange(ids.shape[1], device=ids.device).expand(ids.shape[0], -1).clone()
    return pos


def _positions(adapter, model, ids, types, attention_mask, grids, extras, plan, doc_lens):
    if doc_lens is None:
        return _document_positions(adapter, model, ids, types, attention_mask, grids, extras)
    bounds = torch.tensor([0, *plan.doc_lens]).cumsum(0).tolist()
    spans = list(zip(bounds[:-1], bounds[1:], strict=True))
    ends = torch.tensor(bounds)

    def tokens_per_doc(type_id: int) -> list[int]:
        # One cumulative count for the row, not one reduction per document (every rank does this
        # for every document of every step).
        seen = torch.cat([types.new_zeros(1), (types[0] == type_id).long().cumsum(0)])
        return (seen[ends[1:]] - seen[ends[:-1]]).tolist()

    kinds = [(k, t) for k, t, *_ in _KINDS] + [("audio", AUDIO_TYPE)]
    per_kind = [
        _split_by_document(g, tokens_per_doc(t), adapter, k)
        for g, (k, t) in zip(grids, kinds, strict=True)
    ]
    text = _text_positions(adapter, model, ids, plan)
    parts, v0, done = [], 0, 0
    for (a, b), img_d, vid_d, aud_d in zip(spans, *per_kind, strict=True):
        if not img_d and not vid_d and not aud_d:
            continue  # a text document: its slice of ``text``, joined with its neighbours
        if done < a:
            parts.append(text[..., done:a])
        extras_d = {k: v[v0 : v0 + len(vid_d)] for k, v in extras.items()}
        v0 += len(vid_d)
        mask_d = None if attention_mask is None else attention_mask[:, a:b]
        parts.append(
            _document_positions(
                adapter, model, ids[:, a:b], types[:, a:b], mask_d, (img_d, vid_d, aud_d), extras_d
            )
        )
        done = b
    if done == 0:
        return text
    if done < ids.shape[1]:
        parts.append(text[..., done:])
    return torch.cat(parts, dim=-1)


def _text_positions(adapter, model, ids, plan: ShardPlan) -> torch.Tensor:
    """Every document's positions as if it held no vision item (``arange`` from each document's
    start: ``[B, S]``, or ``[3, B, S]`` under M-RoPE, as ``rope_index`` gives a text document),
    in one array operation."""
    n = torch.tensor(plan.doc_lens)
    pos = torch.arange(ids.shape[1]) - torch.repeat_interleave(torch.cumsum(n, 0) - n, n)
    pos = pos.to(ids.device).expand(ids.shape[0], -1)
    if module_at(model, adapter.modules.rope_index, default=None) is not None:
        pos = pos.expand(3, *pos.shape)
    return pos.clone()


def _row_positions(types: torch.Tensor, plan: ShardPlan, type_ids=(1, 2)) -> torch.Tensor:
    """``b * P + p`` of every row of the ``type_ids`` tokens: image rows, then video rows (or
    audio rows), each row-major (the tower's order, the order the model's ``masked_scatter``
    fills them)."""
    padded = plan.padded_index.to(types.device)
    flat = []
    for type_id in type_ids:
        b, s = torch.nonzero(types == type_id, as_tuple=True)
        flat.append(b * plan.padded_len + padded[s])
    return torch.cat(flat)


def _mask_spans(adapter: VLMAdapter, types: torch.Tensor, plan: ShardPlan):
    """Runs of span token types, split at document ends, as global padded positions (a run lies
    in one document, whose padded positions are consecutive)."""
    if not adapter.span_token_types:
        return ()
    inside = torch.isin(types, torch.tensor(adapter.span_token_types, device=types.device))
    starts = torch.zeros_like(inside)
    starts[:, 0] = inside[:, 0]
    starts[:, 1:] = inside[:, 1:] & ~inside[:, :-1]
    doc_starts = torch.tensor([0, *plan.doc_lens]).cumsum(0)[:-1]
    starts[:, doc_starts] = inside[:, doc_starts]
    run = starts.long().cumsum(-1)
    padded = plan.padded_index.tolist()
    spans = []
    for b in range(types.shape[0]):
        idx = torch.nonzero(inside[b]).squeeze(1)
        ids = run[b, idx]
        row = []
        for r in torch.unique_consecutive(ids).tolist():
            pos = idx[ids == r]
            row.append((padded[int(pos[0])], padded[int(pos[-1])] + 1))
        spans.append(tuple(row))
    return tuple(spans)


def prepare_batch(
    model,
    batch: Mapping[str, object],
    cp_size: int,
    *,
    doc_lens: Sequence[int] | torch.Tensor | None = None,
    num_valid: int | None = None,
    adapter: VLMAdapter | None = None,
    layout: str = "head_tail",
    local_pixels: bool = False,
) -> PreparedBatch:
    """Validate a full training batch and derive the replicated inputs of a CP step.

    ``batch`` holds what the transformers model takes for training: ``input_ids``, ``labels``
    (unshifted), optional ``attention_mask`` (right padding), ``mm_token_type_ids``,
    ``pixel_values``/``image_grid_thw``, ``pixel_values_videos``/``video_grid_thw`` and the
    family's per-video keys (the adapter's ``video_keys``), ``audio_features`` / ``audio_lengths``
    (families with an audio encoder; see ``BASE_KEYS``). ``doc_lens`` packs one row into
    documents (positions restart, no attention across documents, labels shifted per document).
    ``layout`` is the ShardPlan layout ("head_tail" or "balanced").
    ``local_pixels``: the pixel values hold only the rows of the units this CP rank encodes
    (``EncoderDataParallel`` checks their count).
    """
    adapter = adapter or adapter_for(model)
    batch = adapter.from_model_batch(batch)
    ids, labels, attention_mask = _check_text(batch)
    text_config = model.config.text_config
    if getattr(text_config, "use_sliding_window", False):
        raise ValueError(
            "sliding-window attention (text_config.use_sliding_window) is not supported"
        )
    has_vision = any(batch.get(k) is not None for *_, pix, grid in _KINDS for k in (pix, grid))
    given_types = batch.get("mm_token_type_ids")
    types = _check_token_types(adapter, ids, attention_mask, given_types)
    token_ids = (adapter.config.image_token_id, adapter.video_token_id)
    grids = tuple(
        _check_vision(
            kind,
            int((types == t).sum()),
            tok,
            batch.get(pix),
            batch.get(grid),
            adapter,
            local_pixels,
        )
        for (kind, t, pix, grid), tok in zip(_KINDS, token_ids, strict=True)
    )
    audio_frames = _check_audio(batch, int((types == AUDIO_TYPE).sum()), adapter)
    grids = (*grids, audio_frames)
    extras = {k: batch[k] for k in adapter.video_keys if batch.get(k) is not None}

    if isinstance(doc_lens, torch.Tensor):
        doc_lens = doc_lens.tolist()
    if doc_lens is not None and ids.shape[0] != 1:
        raise ValueError(f"doc_lens packs one row; got a batch of {ids.shape[0]} rows")
    plan = ShardPlan(ids.shape[1], cp_size, doc_lens=doc_lens, layout=layout)
    position_ids = _positions(
        adapter, model, ids, types, attention_mask, grids, extras, plan, doc_lens
    )
    if given_types is None and has_vision and position_ids.dim() == 3:
        raise ValueError(
            "mm_token_type_ids is missing: the model needs it to place images and videos in "
            "its M-RoPE positions (the processor returns it: 1 = image token, 2 = video token)"
        )

    shifted = shift_labels(labels, doc_lens=doc_lens)
    if num_valid is None:
        num_valid = count_valid_labels(shifted)
    pixels = tuple(batch[pix] for *_, pix, _ in _KINDS if batch.get(pix) is not None)
    audio = types == AUDIO_TYPE
    return PreparedBatch(
        plan=plan,
        input_ids=ids,
        position_ids=position_ids,
        labels=shifted,
        num_valid=int(num_valid),
        visual_mask=(types != 0) & ~audio,
        real_mask=torch.ones_like(ids, dtype=torch.bool)
        if attention_mask is None
        else attention_mask.bool(),
        pixel_parts=pixels,
        grid_thw=torch.tensor(grids[0] + grids[1], dtype=torch.long).reshape(-1, 3),
        kinds=("image",) * len(grids[0]) + ("video",) * len(grids[1]),
        row_positions=_row_positions(types, plan),
        pixel_width=adapter.pixel_width,
        local_pixels=local_pixels,
        spans=_mask_spans(adapter, types, plan),
        audio_features=batch.get("audio_features") if audio_frames else None,
        audio_lengths=tuple(audio_frames),
        audio_mask=audio if audio_frames else None,
        audio_row_positions=_row_positions(types, plan, (AUDIO_TYPE,)) if audio_frames else None,
    )
