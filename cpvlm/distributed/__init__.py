"""Mesh, sharding and differentiable collectives: the layer everything else stands on."""

from cpvlm.distributed.collectives import (
    differentiable_all_gather_dim0,
    ensure_requires_grad_for_cp_collective,
)
from cpvlm.distributed.shard_plan import PAD_DOC, ShardPlan, pad_and_shard

__all__ = [
    "PAD_DOC",
    "ShardPlan",
    "differentiable_all_gather_dim0",
    "ensure_requires_grad_for_cp_collective",
    "pad_and_shard",
]
