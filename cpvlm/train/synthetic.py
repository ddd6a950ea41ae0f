"""Deterministic synthetic multimodal samples that a tiny model can learn from.

Sample ``i`` is a pure function of ``(seed, i)``, so any rank can produce any sample without
communication and a resumed run reads exactly the samples an uninterrupted run would.

Each sample is one document in the layout the model family's processor writes (built with
``cpvlm.hf.synthetic_batch`` from the family's adapter): text-only (2 in 5), one or
two images (9 in 20) (grids from 2x2 to 8x8 patches: sides spread 4x, areas 16x), or a video (3 in
20; 2 to 4 temporal patch-frames; some layouts write a group with a timestamp per frame).
Pixels are random and lazy (``cpvlm.data.LazyPixels``): a rank makes, in its DataLoader workers,
only the rows of the units it encodes; planning a sample costs its ids alone.

The text is learnable: the text tokens of a document count upwards through a small vocabulary,
``TEXT_BASE + (start + j * stride) % TEXT_VOCAB`` with a per-document start and a stride of 1, 2
or 3, continuing across the images. After two tokens of a document the next one is determined by
the last two, so the loss of a tiny model falls from ln(vocab) towards the cost of the first tokens
and of the vision-start tokens, whose place is random.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from itertools import count

import torch

from cpvlm.data.sample import LazyPixels
from cpvlm.hf import adapter_for, kit_for
from cpvlm.hf.data.synthetic import SampleSpec, sample_items, sample_tokens

TEXT_BASE = 16  # above the tiny configs' pad/bos/eos ids
TEXT_VOCAB = 64
STRIDES = (1, 2, 3)
TEXT_LEN = (24, 96)  # text tokens per document, inclusive
IMAGE_GRIDS = ((2, 2), (2, 4), (4, 4), (4, 8), (8, 8))  # (h, w) in patches
VIDEO_FRAMES = (2, 4)  # temporal patch-frames per video, inclusive
VIDEO_HW = (4, 4)
MAX_IMAGES = 2
KIND_WEIGHTS = {"text": 0.40, "image": 0.45, "video": 0.15}
PIXEL_BLOCK = 64  # pixel rows drawn per seeded generator: any row range gives the same rows


def _seed32(*key) -> int:
    # torch's CPU generator keeps only 32 bits of a seed, so the key is hashed into 32.
    digest = hashlib.blake2b(":".join(map(str, key)).encode(), digest_size=4).digest()
    return int.from_bytes(digest, "little")


@dataclass(frozen=True)
class RandomRows:
    """``make(start, stop)`` of ``LazyPixels``: rows of standard normal noise, drawn block by block
    from generators seeded by ``(seed, block)``, so a row's values do not depend on the range."""

    seed: int
    width: int

    def __call__(self, start: int, stop: int) -> torch.Tensor:
        first, last = start // PIXEL_BLOCK, -(-stop // PIXEL_BLOCK)
        blocks = [
            torch.randn(
                PIXEL_BLOCK,
                self.width,
                generator=torch.Generator().manual_seed(_seed32(self.seed, b)),
            )
            for b in range(first, last)
        ]
        rows = torch.cat(blocks) if blocks else torch.zeros(0, self.width)
        return rows[start - first * PIXEL_BLOCK : stop - first * PIXEL_BLOCK]


class SyntheticVLMData:
    """An infinite map-style source of sample dicts (see ``cpvlm.data.sample``): ``data[i]``."""

    def __init__(self, model_config, *, seed: int = 0):
        self.config = model_config
        self.adapter = adapter_for(model_config)
        self.kit = kit_for(model_config)
        self.seed = seed
        vocab = model_config.text_config.vocab_size
        specials = self.adapter.special_token_ids
        if vocab < TEXT_BASE + TEXT_VOCAB or any(
            TEXT_BASE <= s < TEXT_BASE + TEXT_VOCAB for s in specials
        ):
            raise ValueError(
                f"synthetic data uses text ids {TEXT_BASE}..{TEXT_BASE + TEXT_VOCAB - 1}, which do "
                f"not fit the model (vocab {vocab}, special ids {specials})"
            )

    def spec(self, index: int) -> tuple[SampleSpec, int, int]:
        """``(SampleSpec, start, stride)`` of sample ``index``."""
        g = self._generator(index)
        text_len = int(torch.randint(TEXT_LEN[0], TEXT_LEN[1] + 1, (1,), generator=g))
        kinds = list(KIND_WEIGHTS)
        kind = kinds[
            int(torch.multinomial(torch.tensor(list(KIND_WEIGHTS.values())), 1, generator=g))
        ]
        images, videos = (), ()
        if kind == "image":
            n = int(torch.randint(1, MAX_IMAGES + 1, (1,), generator=g))
            picks = torch.randint(len(IMAGE_GRIDS), (n,), generator=g).tolist()
            images = tuple(IMAGE_GRIDS[p] for p in picks)
        elif kind == "video" and not self.adapter.takes_videos:  # an image instead
            images = (IMAGE_GRIDS[0],)
        elif kind == "video":
            t = int(torch.randint(VIDEO_FRAMES[0], VIDEO_FRAMES[1] + 1, (1,), generator=g))
            videos = ((t, *VIDEO_HW),)
        start = int(torch.randint(TEXT_VOCAB, (1,), generator=g))
        stride = STRIDES[int(torch.randint(len(STRIDES), (1,), generator=g))]
        return SampleSpec(images=images, videos=videos, text_len=text_len), start, stride

    def __getitem__(self, index: int) -> dict:
        if isinstance(index, bool) or not isinstance(index, int) or index < 0:
            raise IndexError(f"synthetic sample index must be an int >= 0, got {index!r}")
        spec, start, stride = self.spec(index)
        items = sample_items(spec, index, self.adapter)
        j = count()

        def text(n: int) -> list[int]:  # the counting text, in sequence order
            return [TEXT_BASE + (start + next(j) * stride) % TEXT_VOCAB for _ in range(n)]

        ids = sample_tokens(self.adapter, items, spec.text_len, text)
        sample = {"input_ids": torch.tensor(ids, dtype=torch.long)}
        for kind, pix_key, grid_key in (
            ("image", "pixel_values", "image_grid_thw"),
            ("video", "pixel_values_videos", "video_grid_thw"),
        ):
            grids = [grid for k, grid in items if k == kind]
            if not grids:
                continue
            rows = sum(self.adapter.item_sizes(g, kind)[0] for g in grids)
            width = self.adapter.pixel_width
            make = RandomRows(self._sample_seed(index, pix_key), width)
            sample[pix_key] = LazyPixels(make, rows, width)
            sample[grid_key] = torch.tensor(grids, dtype=torch.long)
            if kind == "video" and "second_per_grid_ts" in self.adapter.video_keys:
                # the processor's temporal_patch_size / fps, with its default fps of 2
                tps = self.config.vision_config.temporal_patch_size
                sample["second_per_grid_ts"] = torch.full((len(grids),), tps / 2.0)
        return sample

    def max_sample_len(self) -> int:
        """The longest sample this source can produce, in tokens."""

        def tokens(kind, grid) -> int:
            items = self.kit.synthetic_items(kind, grid)
            return sum(len(self.kit.item_tokens(k, g, lambda n: [0] * n)) for k, g in items)

        def image(n: int) -> int:  # one of n images of a sample (its items may depend on n)
            return max(
                sum(
                    len(self.kit.item_tokens(k, g, lambda n: [0] * n))
                    for k, g in self.kit.synthetic_items("image", (1, h, w), images_in_sample=n)
                )
                for h, w in IMAGE_GRIDS
            )

        images = max(image(1), MAX_IMAGES * image(MAX_IMAGES))
        if not self.adapter.takes_videos:
            return TEXT_LEN[1] + images
        video = tokens("video", (VIDEO_FRAMES[1], *VIDEO_HW))
        return TEXT_LEN[1] + max(images, video)

    def _sample_seed(self, index: int, stream: str) -> int:
        return _seed32(self.seed, index, stream)

    def _generator(self, index: int) -> torch.Generator:
        return torch.Generator().manual_seed(self._sample_seed(index, "spec"))
