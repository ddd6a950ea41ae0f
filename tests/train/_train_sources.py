"""Data sources for the trainer tests, used as ``--data _train_sources:<function>``.

pytest puts this directory on sys.path; subprocess tests pass it in PYTHONPATH.
"""

import torch
import torch.distributed as dist

from cpvlm.hf import SampleSpec, synthetic_batch


def _sample(model_config, spec: SampleSpec, seed: int) -> dict:
    # Processor layout with the batch dim of 1 kept, labels and mm_token_type_ids included.
    return synthetic_batch(model_config, [spec], seed=seed)


def text_rows_on_dp0(model_config, seed):
    """128-token samples, text-only and with one image in turn: with --seq-len 128 every packed
    row is one sample, so with dp 2 (one row per DP rank and step) DP rank 0's rows are all
    text-only and DP rank 1's all have an image (4x4 patches: 4 tokens + start + end)."""
    return [
        _sample(
            model_config,
            SampleSpec(text_len=128) if i % 2 == 0 else SampleSpec(images=((4, 4),), text_len=122),
            seed * 100 + i,
        )
        for i in range(16)
    ]


class _UnreadableOnOneRank:
    """60-token text samples; sample 5 cannot be read on global rank 2 (as if a file were
    missing on one node's disk), so that rank alone fails."""

    def __init__(self, model_config, seed):
        self.config, self.seed = model_config, seed

    def __getitem__(self, i):
        if i == 5 and dist.get_rank() == 2:
            raise OSError(f"sample {i}: cannot read shard-00005 on this node")
        return _sample(self.config, SampleSpec(text_len=60), self.seed * 100 + i)


def unreadable_on_rank2(model_config, seed):
    return _UnreadableOnOneRank(model_config, seed)


def nan_pixels(model_config, seed):
    """Image samples whose third has a NaN pixel (the first step that packs it is non-finite)."""
    samples = [
        _sample(model_config, SampleSpec(images=((4, 4),), text_len=40), seed * 100 + i)
        for i in range(8)
    ]
    samples[2]["pixel_values"][0, 0] = torch.nan
    return samples


def text_only(model_config, seed):
    return [_sample(model_config, SampleSpec(text_len=30), seed * 100 + i) for i in range(4)]


# (images, videos, text tokens) per sample, in patch units: one row per sample under
# --pack-window 1, from 16 to ~590 tokens. At --seq-len 600 --cp 4 (a rank's budget 150 tokens)
# every 4-row step has rows of CP size 1, 2 and 4; at --cp 2 of sizes 1 and 2.
LONG_TAILED = [
    ((), ((4, 8, 8),), 500),
    (((8, 8),), (), 220),
    (((4, 4),), (), 100),
    ((), (), 16),
    ((), (), 40),
    ((), ((2, 4, 8),), 350),
    (((8, 4),), (), 120),
    ((), (), 260),
    (((4, 8),), ((2, 4, 4),), 560),
    ((), (), 30),
    (((4, 4),), (), 180),
    ((), ((2, 8, 8),), 90),
]


def long_tailed(model_config, seed):
    """Rows from 16 to ~590 tokens, with images and videos (``LONG_TAILED``): dynamic CP's mix."""
    return [
        _sample(model_config, SampleSpec(images=i, videos=v, text_len=n), seed * 100 + k)
        for k, (i, v, n) in enumerate(LONG_TAILED)
    ]


class _OtherOnRank3:
    """``long_tailed``, but global rank 3 gets another third sample: the same sizes, other ids
    (as if a shard differed on one node)."""

    def __init__(self, model_config, seed):
        self.samples = long_tailed(model_config, seed)
        self.other = long_tailed(model_config, seed + 1)[2]

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, i):
        return self.other if i == 2 and dist.get_rank() == 3 else self.samples[i]


def long_tailed_other_on_rank3(model_config, seed):
    return _OtherOnRank3(model_config, seed)
