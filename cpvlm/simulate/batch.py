"""The sequence a simulated step trains on: its length, documents, images, videos and audio.

Sizes are given in pixels (images ``(height, width)``, videos ``(frames, height, width)``) and
turned into the family's patch grids, audio clips in seconds and turned into mel frames
(``MEL_FRAMES_PER_SECOND``); text fills the rest of the length. Under a fake-tensor
mode the batch's integers are real and its pixels fake (nothing of their size is allocated).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

MEL_FRAMES_PER_SECOND = 100
"""Mel frames per second of audio: 16 kHz with a hop of 160 samples, the feature extractors of
every supported audio encoder (Whisper's for Qwen3-Omni, Parakeet's, Gemma 4's)."""


@dataclass(frozen=True)
class SequenceSpec:
    """One training row: ``seq_len`` tokens in ``docs`` packed documents; the images, videos and
    audio clips (seconds) are dealt round-robin over the documents, text fills each document to
    its share."""

    seq_len: int
    images: tuple[tuple[int, int], ...] = ()
    videos: tuple[tuple[int, int, int], ...] = ()
    docs: int = 1
    audios: tuple[float, ...] = ()

    def __post_init__(self):
        if self.seq_len < 2 or self.docs < 1 or self.docs > self.seq_len // 2:
            raise ValueError(
                f"SequenceSpec: seq_len must be >= 2 and docs in 1..seq_len/2, got "
                f"seq_len={self.seq_len}, docs={self.docs}"
            )

    def with_len(self, seq_len: int) -> SequenceSpec:
        """The same mix of text and vision at another length (items scaled in number)."""
        f = seq_len / self.seq_len
        images = self.images[: max(round(len(self.images) * f), 1 if self.images else 0)]
        if f > 1:
            images = tuple(
                self.images[i % len(self.images)] for i in range(round(len(self.images) * f))
            )
        videos = tuple(
            self.videos[i % len(self.videos)] for i in range(round(len(self.videos) * f))
        )
        audios = tuple(
            self.audios[i % len(self.audios)] for i in range(round(len(self.audios) * f))
        )
        return SequenceSpec(seq_len, images, videos, self.docs, audios)

    def describe(self) -> str:
        parts = [f"{self.seq_len} tokens"]
        if self.images:
            parts.append(f"{len(self.images)} images")
        if self.videos:
            parts.append(f"{len(self.videos)} videos")
        if self.audios:
            parts.append(f"{len(self.audios)} audio clips ({sum(self.audios):g} s)")
        if self.docs > 1:
            parts.append(f"{self.docs} documents")
        return ", ".join(parts)


def _grid(adapter, config, h: int, w: int) -> tuple[int, int]:
    vision = config.vision_config
    patch, merge = vision.patch_size, adapter.merge_size
    gh = max(round(h / patch / merge), 1) * merge
    gw = max(round(w / patch / merge), 1) * merge
    return gh, gw


def build_batch(config, spec: SequenceSpec) -> tuple[dict[str, torch.Tensor], list[int]]:
    """``(batch, doc_lens)``: one packed row of exactly ``spec.seq_len`` tokens."""
    from cpvlm.hf import SampleSpec, adapter_for, pack_documents, synthetic_batch

    adapter = adapter_for(config)
    tps = getattr(config.vision_config, "temporal_patch_size", 1)
    per_doc = [([], [], []) for _ in range(spec.docs)]
    for i, (h, w) in enumerate(spec.images):
        per_doc[i % spec.docs][0].append(_grid(adapter, config, h, w))
    for i, (f, h, w) in enumerate(spec.videos):
        per_doc[i % spec.docs][1].append((max(f // tps, 1), *_grid(adapter, config, h, w)))
    for i, seconds in enumerate(spec.audios):
        per_doc[i % spec.docs][2].append(max(round(seconds * MEL_FRAMES_PER_SECOND), 1))
    lens = [spec.seq_len // spec.docs + (d < spec.seq_len % spec.docs) for d in range(spec.docs)]
    parts = []
    for d, ((images, videos, audios), n) in enumerate(zip(per_doc, lens)):
        sample = SampleSpec(tuple(images), tuple(videos), 0, tuple(audios))
        fixed = 0
        if images or videos or audios:
            fixed = synthetic_batch(config, [sample], seed=d, dtype=torch.bfloat16)["input_ids"]
            fixed = fixed.shape[1]
        if fixed + (0 if fixed else 1) > n:
            raise ValueError(
                f"document {d} of {spec.describe()}: its media alone take {fixed} "
                f"tokens, more than its {n}; give a longer --seq-len or fewer/smaller items"
            )
        sample = SampleSpec(tuple(images), tuple(videos), n - fixed, tuple(audios))
        parts.append(synthetic_batch(config, [sample], seed=d, dtype=torch.bfloat16))
    batch = pack_documents(parts)
    return batch, [p["input_ids"].shape[1] for p in parts]
