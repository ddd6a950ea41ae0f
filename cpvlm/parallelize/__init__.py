"""Apply data parallelism (FSDP2, HSDP, DDP), expert and tensor parallelism to a CP model on a
(dp_replicate, dp_shard, cp, tp) mesh."""

from cpvlm.parallelize.data_parallel import DATA_PARALLEL, parallelize, sync_gradients
from cpvlm.parallelize.expert_parallel import (
    expert_parameters,
    parallelize_experts,
    sync_expert_gradients,
)
from cpvlm.parallelize.mesh import (
    MESH_DIM_NAMES,
    MeshGroups,
    MeshSizes,
    build_mesh,
    mesh_groups,
    mesh_sizes,
)
from cpvlm.parallelize.tensor_parallel import parallelize_decoder_layers, sync_tp_gradients

__all__ = [
    "DATA_PARALLEL",
    "MESH_DIM_NAMES",
    "MeshGroups",
    "MeshSizes",
    "build_mesh",
    "expert_parameters",
    "mesh_groups",
    "mesh_sizes",
    "parallelize",
    "parallelize_decoder_layers",
    "parallelize_experts",
    "sync_expert_gradients",
    "sync_gradients",
    "sync_tp_gradients",
]
