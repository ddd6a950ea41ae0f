"""The process groups of dynamic CP: every aligned block of every row CP size, made once.

Legend: C the CP size; c a row's CP size, a divisor of C; a *block* of size c is one of the C / c
aligned runs of CP ranks ``b * c .. b * c + c - 1`` of one DP replica (``cpvlm.data.dynamic_cp``).

A row of a dynamic-CP step runs on one block; every collective of its forward and backward runs
on the block's group. Groups are made by every rank of the world, in the same order
(``dist.new_group`` is collective), at start-up, never mid-step: for each DP replica's CP group and
each divisor c < C its C / c blocks (c = C is the CP group itself; c = 1 a group of one rank, on
which a row runs as at ``--cp 1``).
"""

from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist

from cpvlm.parallelize.mesh import MeshGroups


def row_groups(
    groups: MeshGroups, *, timeout: timedelta | None = None
) -> dict[int, dist.ProcessGroup]:
    """``{c: group}``: this rank's block group of each divisor c of the CP size (the CP group
    for c = C), for ``ContextParallelVLM(row_groups=)``. Collective: call it on every rank, in the
    same order, once. Not with TP (a block would cut a TP group's shared tokens)."""
    sizes = groups.sizes
    if sizes.tp > 1:
        raise ValueError(f"row_groups: dynamic CP does not run with TP (tp={sizes.tp})")
    cp, me = sizes.cp, dist.get_rank()
    replicas = groups.mesh.mesh.reshape(-1, cp).tolist()  # each replica's CP ranks, in order
    out = {cp: groups.cp_group}
    for c in (c for c in range(1, cp) if cp % c == 0):
        for ranks in replicas:
            for b in range(cp // c):
                block = ranks[b * c : (b + 1) * c]
                group = dist.new_group(block, timeout=timeout)
                if me in block:
                    out[c] = group
    return out
