"""Apply data parallelism (FSDP2, HSDP, DDP) and expert parallelism to a CP model on a
(dp_replicate, dp_shard, cp) mesh."""

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
    "parallelize_experts",
    "sync_expert_gradients",
    "sync_gradients",
]
