"""Apply data parallelism (FSDP2, HSDP, DDP) to a CP model on a (dp_replicate, dp_shard, cp) mesh."""

from cpvlm.parallelize.data_parallel import DATA_PARALLEL, parallelize, sync_gradients
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
    "mesh_groups",
    "mesh_sizes",
    "parallelize",
    "sync_gradients",
]
