"""Tiny Qwen2.5-VL / Qwen3-VL models, synthetic batches, and the one-process reference step.

Legend: B batch, S padded sequence length, V vocab size; a grid (t, h, w) is in patch units
(h, w divisible by the spatial merge size m), and one merged vision token covers m*m patches.
See docs/hf_internals.md for how transformers 5.x runs these models.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import AutoModelForImageTextToText, Qwen2_5_VLConfig, Qwen3VLConfig

from cpvlm.loss import IGNORE_INDEX

# Token ids of the tiny configs (vocab 512): specials at the top, text ids drawn below them.
TINY_VOCAB_SIZE = 512
TINY_PAD_TOKEN_ID = 0
TINY_VISION_START_TOKEN_ID = 500
TINY_VISION_END_TOKEN_ID = 501
TINY_IMAGE_TOKEN_ID = 502
TINY_VIDEO_TOKEN_ID = 503
# Qwen3-VL prompts write a timestamp ("<0.5 seconds>") before every temporal patch-frame.
QWEN3_TIMESTAMP_TOKENS = 3

_SPECIAL_TOKEN_IDS = {
    "image_token_id": TINY_IMAGE_TOKEN_ID,
    "video_token_id": TINY_VIDEO_TOKEN_ID,
    "vision_start_token_id": TINY_VISION_START_TOKEN_ID,
    "vision_end_token_id": TINY_VISION_END_TOKEN_ID,
}
_TINY_TEXT = {
    "vocab_size": TINY_VOCAB_SIZE,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 4096,
}
_TINY_VISION = {
    "depth": 2,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_heads": 2,
    "in_channels": 3,
    "patch_size": 8,
    "temporal_patch_size": 2,
    "spatial_merge_size": 2,
    "out_hidden_size": 64,
}
_FAMILIES = {"qwen3_vl": "qwen3_vl", "qwen2_5_vl": "qwen2_5_vl"}


def _with_overrides(defaults: dict, overrides: Mapping | None) -> dict:
    merged = dict(defaults)
    merged.update(overrides or {})
    return merged


def tiny_qwen3_vl_config(**overrides) -> Qwen3VLConfig:
    """A Qwen3-VL config small enough for float64 CPU tests (~250k parameters).

    ``vision_config`` / ``text_config`` dicts are merged into the tiny defaults; other keys go to
    ``Qwen3VLConfig``. Deepstack taps the first and last vision block unless
    ``deepstack_visual_indexes`` is given.
    """
    vision = _with_overrides(
        {**_TINY_VISION, "num_position_embeddings": 64}, overrides.pop("vision_config", None)
    )
    vision.setdefault("deepstack_visual_indexes", sorted({0, vision["depth"] - 1}))
    bad = [i for i in vision["deepstack_visual_indexes"] if not 0 <= i < vision["depth"]]
    if bad:
        raise ValueError(
            f"vision_config.deepstack_visual_indexes {bad} are outside the vision depth "
            f"{vision['depth']}; pass indexes in [0, depth)"
        )
    text = _with_overrides(
        {
            **_TINY_TEXT,
            "head_dim": 16,
            # head_dim/2 = 8 frequencies, interleaved T,H,W as in the real checkpoints.
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 5_000_000.0,
                "mrope_section": [4, 2, 2],
                "mrope_interleaved": True,
            },
        },
        overrides.pop("text_config", None),
    )
    top = _with_overrides({**_SPECIAL_TOKEN_IDS, "attn_implementation": "sdpa"}, overrides)
    return Qwen3VLConfig(text_config=text, vision_config=vision, **top)


def tiny_qwen2_5_vl_config(**overrides) -> Qwen2_5_VLConfig:
    """A Qwen2.5-VL config small enough for float64 CPU tests (~200k parameters).

    Window attention is on (window of 2x2 merged tokens) in block 0, full attention in the last
    block, as in the real checkpoints. Overrides as for ``tiny_qwen3_vl_config``.
    """
    vision = _with_overrides(
        {
            **_TINY_VISION,
            "window_size": 32,  # pixels: 32 // merge 2 // patch 8 = 2 merged tokens per side
            "tokens_per_second": 2,
        },
        overrides.pop("vision_config", None),
    )
    vision.setdefault("fullatt_block_indexes", [vision["depth"] - 1])
    text = _with_overrides(
        {
            **_TINY_TEXT,  # head_dim = hidden_size / num_attention_heads = 16
            "bos_token_id": 1,
            "eos_token_id": 2,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 1_000_000.0,
                "mrope_section": [2, 3, 3],
            },
        },
        overrides.pop("text_config", None),
    )
    top = _with_overrides({**_SPECIAL_TOKEN_IDS, "attn_implementation": "sdpa"}, overrides)
    return Qwen2_5_VLConfig(text_config=text, vision_config=vision, **top)


TINY_MODELS = {"qwen3-vl-tiny": tiny_qwen3_vl_config, "qwen2.5-vl-tiny": tiny_qwen2_5_vl_config}


def model_family(model_or_config) -> str:
    """``"qwen3_vl"`` or ``"qwen2_5_vl"`` for a model or its config; raises for anything else."""
    config = getattr(model_or_config, "config", model_or_config)
    model_type = getattr(config, "model_type", None)
    if model_type not in _FAMILIES:
        raise ValueError(
            f"unsupported model_type {model_type!r}: cpvlm supports {sorted(_FAMILIES)} "
            "(Qwen3-VL and Qwen2.5-VL image-text-to-text models)"
        )
    return _FAMILIES[model_type]


def build_model(
    name_or_path: str | Path,
    *,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    attn_implementation: str = "sdpa",
) -> torch.nn.Module:
    """A ``*ForConditionalGeneration`` model in train mode.

    ``"qwen3-vl-tiny"`` / ``"qwen2.5-vl-tiny"`` are initialised in float32 from ``seed`` (without
    touching the global RNG) and then cast, so every dtype holds the same weights. Anything else
    is a local checkpoint directory (``save_pretrained`` layout), loaded without network access.
    """
    if isinstance(name_or_path, str) and name_or_path in TINY_MODELS:
        config = TINY_MODELS[name_or_path](attn_implementation=attn_implementation)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = AutoModelForImageTextToText.from_config(config)
        model = model.to(dtype)
    else:
        path = Path(name_or_path)
        if not path.is_dir():
            raise FileNotFoundError(
                f"{str(name_or_path)!r} is neither a tiny model ({', '.join(TINY_MODELS)}) nor an "
                "existing local checkpoint directory (hub downloads are not supported)"
            )
        model = AutoModelForImageTextToText.from_pretrained(
            path, dtype=dtype, local_files_only=True, attn_implementation=attn_implementation
        )
    model_family(model)
    return model.train()


@dataclass(frozen=True)
class SampleSpec:
    """One sample of a synthetic batch: ``text_len`` free text tokens spread around the images
    (grids (h, w)) and then the videos (grids (t, h, w)), all in patch units."""

    images: tuple[tuple[int, int], ...] = ()
    videos: tuple[tuple[int, int, int], ...] = ()
    text_len: int = 16


def _vision_tokens(family: str, kind: str, grid: tuple[int, int, int], ids: dict, text) -> list:
    t, h, w = grid
    merge = ids["merge"]
    pad_id = ids["image"] if kind == "image" else ids["video"]
    frame = h * w // (merge * merge)
    if kind == "video" and family == "qwen3_vl":
        # Qwen3-VL: one <timestamp><start>pads<end> group per frame; get_rope_index splits
        # video grids per frame and needs text between the groups.
        out = []
        for _ in range(t):
            out += text(QWEN3_TIMESTAMP_TOKENS) + [ids["start"]] + [pad_id] * frame + [ids["end"]]
        return out
    return [ids["start"]] + [pad_id] * (t * frame) + [ids["end"]]


def synthetic_batch(
    config,
    samples: Sequence[SampleSpec | Mapping] | None = None,
    *,
    images: Sequence[tuple[int, int]] = (),
    videos: Sequence[tuple[int, int, int]] = (),
    text_len: int = 16,
    seed: int = 0,
    pad_token_id: int | None = None,
    pad_to_multiple_of: int = 1,
    dtype: torch.dtype = torch.float32,
) -> dict[str, torch.Tensor]:
    """A valid training batch for a Qwen2.5-VL / Qwen3-VL model, laid out like processor output.

    ``samples`` lists one ``SampleSpec`` (or dict of its fields) per batch row; without it, one
    sample is built from ``images``, ``videos``, ``text_len``. Rows are right-padded with
    ``pad_token_id`` (default: the text config's, else 0) to the longest row, rounded up to
    ``pad_to_multiple_of``. Returns ``input_ids``, ``attention_mask``, ``mm_token_type_ids``
    (0 text, 1 image, 2 video: required by the 5.x models), ``labels`` (unshifted, -100 on vision
    placeholders and padding), and when present ``pixel_values`` / ``image_grid_thw``,
    ``pixel_values_videos`` / ``video_grid_thw`` (+ ``second_per_grid_ts`` for Qwen2.5-VL).
    Pixel rows are random, ``t*h*w`` per grid, each ``channels*temporal_patch*patch*patch`` wide.
    Qwen3-VL videos get one timestamp+start+pads+end group per frame, as its processor writes.
    """
    family = model_family(config)
    vision, text_config = config.vision_config, config.text_config
    if samples is not None and (images or videos):
        raise ValueError("pass images/videos inside samples, or samples=None; not both")
    if pad_to_multiple_of < 1:
        raise ValueError(f"pad_to_multiple_of must be >= 1, got {pad_to_multiple_of}")
    if samples is None:
        samples = [SampleSpec(tuple(images), tuple(videos), text_len)]
    samples = [s if isinstance(s, SampleSpec) else SampleSpec(**s) for s in samples]
    if not samples:
        raise ValueError("samples is empty; pass at least one SampleSpec")
    merge = vision.spatial_merge_size
    ids = {
        "merge": merge,
        "image": config.image_token_id,
        "video": config.video_token_id,
        "start": config.vision_start_token_id,
        "end": config.vision_end_token_id,
    }
    if pad_token_id is None:
        pad_token_id = getattr(text_config, "pad_token_id", None)
        pad_token_id = 0 if pad_token_id is None else pad_token_id
    text_hi = min(ids["image"], ids["video"], ids["start"], ids["end"], text_config.vocab_size)
    gen = torch.Generator().manual_seed(seed)

    def text(n: int) -> list:
        return torch.randint(1, text_hi, (n,), generator=gen).tolist()

    rows, image_grids, video_grids = [], [], []
    for i, sample in enumerate(samples):
        grids = [("image", (1, h, w)) for h, w in sample.images]
        grids += [("video", tuple(g)) for g in sample.videos]
        for kind, (t, h, w) in grids:
            if t < 1 or h % merge or w % merge or h < merge or w < merge:
                raise ValueError(
                    f"sample {i}: {kind} grid {(t, h, w)} must have t >= 1 and h, w positive "
                    f"multiples of the spatial merge size {merge}"
                )
        if sample.text_len < 0 or (sample.text_len == 0 and not grids):
            raise ValueError(f"sample {i}: text_len must be >= 0 and the sample non-empty")
        chunks = [sample.text_len // (len(grids) + 1)] * (len(grids) + 1)
        for j in range(sample.text_len % (len(grids) + 1)):
            chunks[j] += 1
        tokens = []
        for chunk, (kind, grid) in zip(chunks, grids):
            tokens += text(chunk) + _vision_tokens(family, kind, grid, ids, text)
            (image_grids if kind == "image" else video_grids).append(grid)
        rows.append(tokens + text(chunks[-1]))

    seq_len = max(len(r) for r in rows)
    seq_len = -(-seq_len // pad_to_multiple_of) * pad_to_multiple_of
    input_ids = torch.full((len(rows), seq_len), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((len(rows), seq_len), dtype=torch.long)
    for b, r in enumerate(rows):
        input_ids[b, : len(r)] = torch.tensor(r, dtype=torch.long)
        attention_mask[b, : len(r)] = 1
    mm_token_type_ids = torch.zeros_like(input_ids)
    mm_token_type_ids[(input_ids == ids["image"]) & (attention_mask == 1)] = 1
    mm_token_type_ids[(input_ids == ids["video"]) & (attention_mask == 1)] = 2
    labels = input_ids.masked_fill((mm_token_type_ids != 0) | (attention_mask == 0), IGNORE_INDEX)
    batch = {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "mm_token_type_ids": mm_token_type_ids,
        "labels": labels,
    }
    row_width = vision.in_channels * vision.temporal_patch_size * vision.patch_size**2

    def pixels(grids: list) -> torch.Tensor:
        n_rows = sum(t * h * w for t, h, w in grids)
        return torch.randn(n_rows, row_width, generator=gen, dtype=torch.float64).to(dtype)

    if image_grids:
        batch["pixel_values"] = pixels(image_grids)
        batch["image_grid_thw"] = torch.tensor(image_grids, dtype=torch.long)
    if video_grids:
        batch["pixel_values_videos"] = pixels(video_grids)
        batch["video_grid_thw"] = torch.tensor(video_grids, dtype=torch.long)
        if family == "qwen2_5_vl":
            # processor: temporal_patch_size / fps, with its default fps of 2
            batch["second_per_grid_ts"] = torch.full(
                (len(video_grids),), vision.temporal_patch_size / 2.0
            )
    return batch


def mrope_position_ids(model, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """The ``[3, B, S]`` M-RoPE position ids the model's own forward computes for ``batch``
    (``get_rope_index`` leaves padding positions at 0)."""
    family = model_family(model)
    base = model.model
    kwargs = {
        "mm_token_type_ids": batch["mm_token_type_ids"],
        "image_grid_thw": batch.get("image_grid_thw"),
        "video_grid_thw": batch.get("video_grid_thw"),
        "attention_mask": batch.get("attention_mask"),
    }
    if family == "qwen2_5_vl":
        kwargs["second_per_grid_ts"] = batch.get("second_per_grid_ts")
    position_ids, _ = base.get_rope_index(batch["input_ids"], **kwargs)
    return position_ids


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over valid labels (labels[..., 1:] vs logits[..., :-1]), in
    the logits' dtype (float32 at least); 0 when no label is valid."""
    if logits.dtype not in (torch.float32, torch.float64):
        logits = logits.float()
    logits_flat = logits[..., :-1, :].reshape(-1, logits.shape[-1])
    labels_flat = labels[..., 1:].reshape(-1).to(logits.device)
    total = F.cross_entropy(logits_flat, labels_flat, ignore_index=IGNORE_INDEX, reduction="sum")
    return total / (labels_flat != IGNORE_INDEX).sum().clamp(min=1)


def reference_loss_and_grads(
    model: torch.nn.Module, batch: Mapping[str, torch.Tensor]
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One-process reference step: the model's own forward (its own attention), the loss of
    ``causal_lm_loss`` in the model's dtype, backward. Returns the detached loss and a clone of
    every trainable parameter's gradient (zeros where a parameter got none); leaves ``.grad``
    cleared and the model's cached ``rope_deltas`` reset."""
    model.zero_grad(set_to_none=True)
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    try:
        logits = model(**inputs, use_cache=False).logits
        loss = causal_lm_loss(logits, batch["labels"])
        loss.backward()
        grads = {
            name: (p.grad if p.grad is not None else torch.zeros_like(p)).detach().clone()
            for name, p in model.named_parameters()
            if p.requires_grad
        }
    finally:
        model.zero_grad(set_to_none=True)
        model.model.rope_deltas = None
    return loss.detach(), grads
