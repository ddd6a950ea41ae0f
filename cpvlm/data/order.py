"""The order in which samples are read: epochs of a seeded permutation, resumable anywhere.

Stream position ``p`` is sample ``perm_e[p % N]`` of epoch ``e = p // N``, where ``perm_e`` is a
permutation drawn from ``(seed, e)`` alone. A position therefore names the same sample on every
rank, in every run, at any DP x CP size: the global position is all a checkpoint needs to keep.
An endless source (no length) is read in order.
"""

from __future__ import annotations

import hashlib

import torch


def _epoch_seed(seed: int, epoch: int) -> int:
    # torch's CPU generator keeps 32 bits of a seed, so (seed, epoch) are hashed into 32.
    digest = hashlib.blake2b(f"cpvlm-order:{seed}:{epoch}".encode(), digest_size=4).digest()
    return int.from_bytes(digest, "little")


class SampleOrder:
    """``order[p]``: the source index at stream position ``p`` (see the module docstring)."""

    def __init__(self, num_samples: int | None, *, seed: int = 0, shuffle: bool = True):
        if num_samples is not None and num_samples < 1:
            raise ValueError(f"SampleOrder: num_samples must be >= 1, got {num_samples}")
        self.num_samples, self.seed = num_samples, seed
        self.shuffle = shuffle and num_samples is not None
        self._epoch, self._perm = -1, None

    def epoch(self, position: int) -> int:
        return 0 if self.num_samples is None else position // self.num_samples

    def __getitem__(self, position: int) -> int:
        if self.num_samples is None:
            return position
        epoch, i = divmod(position, self.num_samples)
        if not self.shuffle:
            return i
        if epoch != self._epoch:
            g = torch.Generator().manual_seed(_epoch_seed(self.seed, epoch))
            self._epoch, self._perm = epoch, torch.randperm(self.num_samples, generator=g).tolist()
        return self._perm[i]
