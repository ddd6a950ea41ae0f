"""Synthetic training batches for any supported VLM family, laid out as its processor writes them.

Legend: B batch, S padded sequence length; a grid (t, h, w) is in patch units (h, w divisible by
the spatial merge size m), and one merged vision token covers m*m patches.

Used by the tests, ``cpvlm verify`` and the trainer's synthetic data. The layout of each image or
video (placeholders, start/end tokens, timestamps) and the token types come from the family's
adapter, so every family gets batches its own forward accepts.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from cpvlm.constants import IGNORE_INDEX
from cpvlm.hf.registry import adapter_for

VISION_KEYS = (
    "pixel_values",
    "image_grid_thw",
    "pixel_values_videos",
    "video_grid_thw",
    "second_per_grid_ts",
    "audio_features",
    "audio_lengths",
)


@dataclass(frozen=True)
class SampleSpec:
    """One sample of a synthetic batch: ``text_len`` free text tokens spread around the images
    (grids (h, w)), then the videos (grids (t, h, w)), all in patch units, then the audio clips
    (feature frames each; families with an audio encoder)."""

    images: tuple[tuple[int, int], ...] = ()
    videos: tuple[tuple[int, int, int], ...] = ()
    text_len: int = 16
    audios: tuple[int, ...] = ()


def _samples(samples, images, videos, text_len, audios=()) -> list[SampleSpec]:
    if samples is not None and (images or videos or audios):
        raise ValueError("pass images/videos/audios inside samples, or samples=None; not both")
    if samples is None:
        samples = [SampleSpec(tuple(images), tuple(videos), text_len, tuple(audios))]
    samples = [s if isinstance(s, SampleSpec) else SampleSpec(**s) for s in samples]
    if not samples:
        raise ValueError("samples is empty; pass at least one SampleSpec")
    return samples


def sample_items(sample: SampleSpec, i: int, adapter) -> list[tuple[str, tuple[int, int, int]]]:
    """``[(kind, (t, h, w)), ...]``: the sample's images, then its videos, checked, as the
    family's processor makes items of them (the kit's ``synthetic_items``: tiles, crops), then
    its audio clips as ``("audio", (1, 1, frames))``."""
    kit = adapter.kit(adapter)
    merge = adapter.merge_size
    items = [("image", (1, h, w)) for h, w in sample.images]
    items += [("video", tuple(g)) for g in sample.videos]
    for kind, (t, h, w) in items:
        if t < 1 or h % merge or w % merge or h < merge or w < merge:
            raise ValueError(
                f"sample {i}: {kind} grid {(t, h, w)} must have t >= 1 and h, w positive "
                f"multiples of the spatial merge size {merge}"
            )
    if sample.text_len < 0 or (sample.text_len == 0 and not items and not sample.audios):
        raise ValueError(f"sample {i}: text_len must be >= 0 and the sample non-empty")
    if sample.audios and adapter.audio_token_id is None:
        raise ValueError(f"sample {i}: audio clips, but {adapter.family} has no audio encoder")
    if any(n < 1 for n in sample.audios):
        raise ValueError(f"sample {i}: audio clips need >= 1 feature frame, got {sample.audios}")
    n = len(sample.images)
    made = [
        made for kind, grid in items for made in kit.synthetic_items(kind, grid, images_in_sample=n)
    ]
    return made + [("audio", (1, 1, int(n))) for n in sample.audios]


def sample_tokens(adapter, items, text_len: int, text) -> list[int]:
    """The sample's ids: text chunks around the items, as evenly as possible (earlier chunks get
    the remainder); ``text(n)`` gives n text ids, called in sequence order."""
    kit = adapter.kit(adapter)
    chunks = [text_len // (len(items) + 1)] * (len(items) + 1)
    for j in range(text_len % (len(items) + 1)):
        chunks[j] += 1
    tokens = []
    for chunk, (kind, grid) in zip(chunks, items):
        tokens += text(chunk) + kit.item_tokens(kind, grid, text)
    return tokens + text(chunks[-1])


def _pad(rows: list[list[int]], pad_token_id: int, multiple: int):
    seq_len = max(len(r) for r in rows)
    seq_len = -(-seq_len // multiple) * multiple
    input_ids = torch.full((len(rows), seq_len), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((len(rows), seq_len), dtype=torch.long)
    for b, r in enumerate(rows):
        input_ids[b, : len(r)] = torch.tensor(r, dtype=torch.long)
        attention_mask[b, : len(r)] = 1
    return input_ids, attention_mask


def synthetic_batch(
    config,
    samples: Sequence[SampleSpec | Mapping] | None = None,
    *,
    images: Sequence[tuple[int, int]] = (),
    videos: Sequence[tuple[int, int, int]] = (),
    text_len: int = 16,
    audios: Sequence[int] = (),
    seed: int = 0,
    pad_token_id: int | None = None,
    pad_to_multiple_of: int = 1,
    dtype: torch.dtype = torch.float32,
) -> dict[str, torch.Tensor]:
    """A valid training batch for a model of ``config``'s family, laid out like processor output.

    ``samples`` lists one ``SampleSpec`` (or dict of its fields) per batch row; without it, one
    sample is built from ``images``, ``videos``, ``text_len``. Rows are right-padded with
    ``pad_token_id`` (default: the text config's, else 0) to the longest row, rounded up to
    ``pad_to_multiple_of``. Returns ``input_ids``, ``attention_mask``, ``mm_token_type_ids``
    (0 text, 1 image, 2 video), ``labels`` (unshifted, -100 on vision placeholders and padding),
    and when present ``pixel_values`` / ``image_grid_thw``, ``pixel_values_videos`` /
    ``video_grid_thw`` (+ ``second_per_grid_ts`` for families that take it), ``audio_features``
    / ``audio_lengths``. Pixel rows and feature frames are random, ``t*h*w`` per grid.
    """
    adapter = adapter_for(config)
    if pad_to_multiple_of < 1:
        raise ValueError(f"pad_to_multiple_of must be >= 1, got {pad_to_multiple_of}")
    samples = _samples(samples, images, videos, text_len, audios)
    text_config = config.text_config
    if pad_token_id is None:
        pad_token_id = getattr(text_config, "pad_token_id", None)
        pad_token_id = 0 if pad_token_id is None else pad_token_id
    text_hi = min(*adapter.special_token_ids, text_config.vocab_size)
    gen = torch.Generator().manual_seed(seed)

    def text(n: int) -> list:
        return torch.randint(1, text_hi, (n,), generator=gen).tolist()

    rows, grids = [], {"image": [], "video": [], "audio": []}
    for i, sample in enumerate(samples):
        items = sample_items(sample, i, adapter)
        rows.append(sample_tokens(adapter, items, sample.text_len, text))
        for kind, grid in items:
            grids[kind].append(grid)
    input_ids, attention_mask = _pad(rows, pad_token_id, pad_to_multiple_of)
    mm_token_type_ids = adapter.mm_token_type_ids(input_ids, attention_mask)
    labels = input_ids.masked_fill((mm_token_type_ids != 0) | (attention_mask == 0), IGNORE_INDEX)
    batch = {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "mm_token_type_ids": mm_token_type_ids,
        "labels": labels,
    }
    batch.update(_vision_inputs(adapter, grids, gen, dtype))
    return batch


def _vision_inputs(adapter, grids: dict, gen: torch.Generator, dtype: torch.dtype) -> dict:
    def pixels(kind_grids: list, kind: str) -> torch.Tensor:
        n_rows = sum(adapter.item_sizes(g, kind)[0] for g in kind_grids)
        return torch.randn(n_rows, adapter.pixel_width, generator=gen, dtype=torch.float64).to(
            dtype
        )

    out = {}
    if grids["audio"]:
        frames = [g[2] for g in grids["audio"]]
        width = adapter.audio_feature_width
        features = torch.randn(sum(frames), width, generator=gen, dtype=torch.float64)
        out["audio_features"] = features.to(dtype)
        out["audio_lengths"] = torch.tensor(frames, dtype=torch.long)
    if grids["image"]:
        out["pixel_values"] = pixels(grids["image"], "image")
        out["image_grid_thw"] = torch.tensor(grids["image"], dtype=torch.long)
    if grids["video"]:
        out["pixel_values_videos"] = pixels(grids["video"], "video")
        out["video_grid_thw"] = torch.tensor(grids["video"], dtype=torch.long)
        if "second_per_grid_ts" in adapter.video_keys:
            # the processor's temporal_patch_size / fps, with its default fps of 2
            tps = adapter.config.vision_config.temporal_patch_size
            # From a list, not torch.full: under a simulation's fake mode a list's tensor stays
            # real (compat.HostIntegers), and get_rope_index reads these values as numbers.
            out["second_per_grid_ts"] = torch.tensor([tps / 2.0] * len(grids["video"]))
    return out


def pack_documents(parts: Sequence[Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """One packed row (no attention_mask) from single-row, unpadded batches, in order; pair it
    with ``doc_lens = [p["input_ids"].shape[1] for p in parts]``."""
    packed = {}
    for key in ("input_ids", "labels", "mm_token_type_ids"):
        if key in parts[0]:
            packed[key] = torch.cat([p[key] for p in parts], dim=1)
    for key in VISION_KEYS:
        present = [p[key] for p in parts if key in p]
        if present:
            packed[key] = torch.cat(present)
    return packed


def split_documents(
    config, batch: Mapping[str, torch.Tensor], doc_lens: Sequence[int]
) -> list[dict]:
    """The single-document batches of a packed row (``pack_documents``' inverse): each document's
    tokens with its own images, videos and per-video keys."""
    adapter = adapter_for(config)
    types = adapter.mm_token_type_ids(batch["input_ids"])
    kinds = (
        ("image", 1, "pixel_values", "image_grid_thw"),
        ("video", 2, "pixel_values_videos", "video_grid_thw"),
    )
    seen = {"image": 0, "video": 0, "audio": 0}
    docs, start = [], 0
    for n in doc_lens:
        a, b = start, start + n
        start = b
        doc = {
            k: batch[k][:, a:b] for k in ("input_ids", "labels", "mm_token_type_ids") if k in batch
        }
        for kind, type_id, pix_key, grid_key in kinds:
            need = int((types[0, a:b] == type_id).sum())
            if not need:
                continue
            grids, first = batch[grid_key], seen[kind]
            sizes = [adapter.item_sizes(tuple(int(v) for v in g), kind) for g in grids]
            last, got = first, 0
            while got < need:
                got += sizes[last][1]
                last += 1
            rows_before = sum(p for p, _ in sizes[:first])
            doc[grid_key] = grids[first:last]
            doc[pix_key] = batch[pix_key][
                rows_before : rows_before + sum(p for p, _ in sizes[first:last])
            ]
            if kind == "video":
                doc.update({k: batch[k][first:last] for k in adapter.video_keys if k in batch})
            seen[kind] = last
        need = int((types[0, a:b] == 3).sum())
        if need:
            lengths, first = batch["audio_lengths"].tolist(), seen["audio"]
            last, got = first, 0
            while got < need:
                got += adapter.audio_rows(lengths[last])
                last += 1
            before = sum(lengths[:first])
            doc["audio_lengths"] = batch["audio_lengths"][first:last]
            doc["audio_features"] = batch["audio_features"][
                before : before + sum(lengths[first:last])
            ]
            seen["audio"] = last
        docs.append(doc)
    return docs
