"""The (dp_replicate, dp_shard, cp, tp) device mesh, and the process groups a training step needs.

Legend: R = dp_replicate, S = dp_shard, C = cp, T = tp; the world has R * S * C * T ranks, tp
innermost and cp next, so that a TP group is T consecutive ranks and a CP group is C ranks T apart
(one node, where the attention and TP traffic is heaviest). The T ranks of one (dp, cp) coordinate
hold the same tokens; everything below is per tp slice (the R * S * C ranks of one tp rank).

Every CP rank of a data-parallel replica holds a copy of the parameters and computes part of the
same batch, so the gradient sync runs over the flattened R x S x C group, and FSDP2 shards over the
flattened S x C group (HSDP: replicate over R, shard over S x C). Only the batch and its valid-label
count are split over data parallelism alone (R x S). The flattened groups are built with the public
``DeviceMesh`` constructor from the ranks of the mesh: no private mesh-flattening API. With T > 1
the FSDP2 meshes and the tp mesh are slices of one ``(dp_replicate, dp_shard_cp, tp)`` mesh, as
FSDP2 needs for parameters that are already tensor-parallel DTensors (torchtitan's pattern).

Expert parallelism (``ep``, torchtitan's way) borrows its ranks from S x C: an EP group is ep
consecutive ranks of the flattened S x C (at cp 2, ep 2 the CP pair; at dp_shard 2, cp 2, ep 4
all four), and the ranks that hold the same experts, one per EP group (R * S * C / ep of them),
are the *expert replicas* (see ``cpvlm.parallelize.expert_parallel``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

MESH_DIM_NAMES = ("dp_replicate", "dp_shard", "cp", "tp")
"""Names of the mesh dims, outermost first."""


@dataclass(frozen=True)
class MeshSizes:
    """Sizes of the mesh dims (1 for a dim the mesh does not have)."""

    dp_replicate: int
    dp_shard: int
    cp: int
    tp: int = 1

    @property
    def dp(self) -> int:
        """Data-parallel replicas of the batch: dp_replicate * dp_shard."""
        return self.dp_replicate * self.dp_shard

    @property
    def world(self) -> int:
        return self.dp_replicate * self.dp_shard * self.cp * self.tp


def _check_size(
    name: str, value: object, *, allow_infer: bool = False, where: str = "build_mesh"
) -> int:
    ok = isinstance(value, int) and not isinstance(value, bool) and value >= 1
    if not ok and not (allow_infer and value == -1):
        infer = " (or -1 to use the ranks the other dims leave)" if allow_infer else ""
        raise ValueError(f"{where}: {name} must be a positive int{infer}, got {value!r}")
    return value


def check_ep(ep: object, dp_shard: int, cp: int, where: str = "build_mesh") -> int:
    """``ep`` must be a positive int dividing dp_shard * cp (the ranks it borrows)."""
    ep = _check_size("ep", ep, where=where)
    if (dp_shard * cp) % ep:
        divisors = [d for d in range(1, dp_shard * cp + 1) if (dp_shard * cp) % d == 0]
        raise ValueError(
            f"{where}: ep={ep} must divide dp_shard x cp = {dp_shard} x {cp} = {dp_shard * cp} "
            f"(an EP group is ep of those ranks); use ep in {divisors}"
        )
    return ep


def check_tp(tp: object, ep: int = 1, where: str = "build_mesh") -> int:
    """``tp`` must be a positive int; expert parallelism does not combine with it."""
    tp = _check_size("tp", tp, where=where)
    if tp > 1 and ep > 1:
        raise ValueError(
            f"{where}: tp={tp} with ep={ep}: tensor and expert parallelism do not combine yet; "
            "use tp 1 or ep 1"
        )
    return tp


def build_mesh(
    *,
    dp_replicate: int = 1,
    dp_shard: int = -1,
    cp: int = 1,
    ep: int = 1,
    tp: int = 1,
    device_type: str = "cpu",
) -> DeviceMesh:
    """A ``DeviceMesh`` named ``("dp_replicate", "dp_shard", "cp")`` over the whole world, with
    a fourth, innermost dim ``"tp"`` when ``tp > 1``.

    ``dp_shard=-1`` takes the ranks left by the other dims. ``ep`` is checked here (it must
    divide dp_shard * cp) and its groups are built by ``mesh_groups(mesh, ep=ep)``. Call it on
    every rank after ``torch.distributed.init_process_group`` ("cpu" with gloo, "cuda" with NCCL).
    """
    if not dist.is_initialized():
        raise ValueError(
            "build_mesh: torch.distributed is not initialised; call "
            "torch.distributed.init_process_group first (torchrun sets up its environment)"
        )
    world = dist.get_world_size()
    dp_replicate = _check_size("dp_replicate", dp_replicate)
    cp = _check_size("cp", cp)
    tp = check_tp(tp, _check_size("ep", ep))
    dp_shard = _check_size("dp_shard", dp_shard, allow_infer=True)
    others = dp_replicate * cp * tp
    if dp_shard == -1:
        if world % others:
            raise ValueError(
                f"build_mesh: dp_replicate={dp_replicate} x cp={cp} x tp={tp} = {others} does "
                f"not divide the world size {world}; choose sizes whose product divides {world}"
            )
        dp_shard = world // others
    if dp_shard * others != world:
        raise ValueError(
            f"build_mesh: dp_replicate={dp_replicate} x dp_shard={dp_shard} x cp={cp} x tp={tp} "
            f"= {dp_shard * others} ranks, but the world has {world}; choose sizes whose "
            f"product is {world}, or pass dp_shard=-1 to fill the rest"
        )
    check_ep(ep, dp_shard, cp)
    shape, names = (dp_replicate, dp_shard, cp, tp), MESH_DIM_NAMES
    if tp == 1:
        shape, names = shape[:3], names[:3]
    return init_device_mesh(device_type, shape, mesh_dim_names=names)


def mesh_sizes(mesh: DeviceMesh) -> MeshSizes:
    """Validate ``mesh`` and return its sizes.

    Accepted: a mesh over the whole world whose dims are named with a subset of
    ``MESH_DIM_NAMES``, in that order (a missing dim has size 1).
    """
    if not isinstance(mesh, DeviceMesh):
        raise ValueError(
            f"expected a DeviceMesh, got {type(mesh).__name__}; build one with "
            "cpvlm.parallelize.build_mesh(dp_replicate=..., dp_shard=..., cp=...)"
        )
    names = mesh.mesh_dim_names
    hint = (
        "build it with cpvlm.parallelize.build_mesh(dp_replicate=..., dp_shard=..., cp=...) or "
        f"init_device_mesh(..., mesh_dim_names={MESH_DIM_NAMES})"
    )
    if names is None:
        raise ValueError(f"the mesh has no dim names; {hint}")
    unknown = [n for n in names if n not in MESH_DIM_NAMES]
    if unknown:
        raise ValueError(
            f"mesh dims {list(names)}: {unknown} not understood; cpvlm knows {list(MESH_DIM_NAMES)} "
            f"(a pipeline-parallel dim is not supported here); {hint}"
        )
    if list(names) != sorted(names, key=MESH_DIM_NAMES.index) or len(set(names)) != len(names):
        raise ValueError(
            f"mesh dims {list(names)} must appear once each, in the order {list(MESH_DIM_NAMES)} "
            f"(tp innermost, then cp, so that TP and CP groups lie within a node); {hint}"
        )
    shape = dict(zip(names, mesh.mesh.shape))
    sizes = MeshSizes(*(int(shape.get(n, 1)) for n in MESH_DIM_NAMES))
    world = dist.get_world_size()
    if sizes.world != world:
        raise ValueError(
            f"the mesh {dict(shape)} has {sizes.world} ranks but the world has {world}; cpvlm "
            f"needs a mesh over every rank, with sizes whose product is {world}"
        )
    return sizes


@dataclass(frozen=True)
class MeshGroups:
    """The groups of one (dp_replicate, dp_shard, cp, tp) mesh, as this rank sees them.

    ``cp_group``: the ranks that split one sequence (``cp_attention``, ``ShardPlan``, vision).
    ``dp_group``: the replicas of the batch (R x S): count valid labels over it; ``dp_rank``
    says which part of the global batch this rank loads. ``dp_cp_mesh``: 1-d, the R x S x C ranks
    of this tp slice, the gradient sync group of DDP and of FSDP with R = 1. ``hsdp_mesh``: 2-d
    ``(dp_replicate, dp_shard_cp)``, the mesh of HSDP. ``tp_mesh``: with ``tp > 1``, the 1-d mesh
    of this rank's TP group (T consecutive ranks that hold the same tokens), a slice of the same
    mesh as the two above; None without TP. ``ep_mesh``: with ``ep > 1``, the 2-d
    ``(ep_replica, ep)`` mesh of expert parallelism: ``ep_mesh["ep"]`` is this rank's EP group
    (ep consecutive ranks of dp_shard x cp), ``ep_mesh["ep_replica"]`` the ranks that hold the
    same experts; None without EP.
    """

    mesh: DeviceMesh
    sizes: MeshSizes
    cp_group: dist.ProcessGroup
    cp_rank: int
    dp_group: dist.ProcessGroup
    dp_rank: int
    dp_cp_mesh: DeviceMesh
    hsdp_mesh: DeviceMesh
    ep_mesh: DeviceMesh | None = None
    tp_mesh: DeviceMesh | None = None

    @property
    def grad_sync_group(self) -> dist.ProcessGroup:
        return self.dp_cp_mesh.get_group()

    @property
    def ep(self) -> int:
        return 1 if self.ep_mesh is None else self.ep_mesh["ep"].size()

    @property
    def tp_rank(self) -> int:
        return 0 if self.tp_mesh is None else self.tp_mesh.get_local_rank()


def mesh_groups(mesh: DeviceMesh, *, ep: int = 1) -> MeshGroups:
    """Build the groups of ``mesh`` (and of expert parallelism over ``ep`` ranks of dp_shard x
    cp; of tensor parallelism over the mesh's "tp" dim). Collective: call it on every rank, in the
    same order.

    Each call creates process groups; build them once per mesh and pass them around.
    """
    sizes = mesh_sizes(mesh)
    ep = check_ep(ep, sizes.dp_shard, sizes.cp, where="mesh_groups")
    check_tp(sizes.tp, ep, where="mesh_groups")
    r, s, c, t = sizes.dp_replicate, sizes.dp_shard, sizes.cp, sizes.tp
    device = mesh.device_type
    ranks_RSCT = mesh.mesh.reshape(r, s, c, t)
    tp_mesh = ep_mesh = None
    if t > 1:  # (check_tp: no EP)
        dp_x_cp = DeviceMesh(
            device, ranks_RSCT.reshape(r * s, c, t), mesh_dim_names=("dp", "cp", "tp")
        )
        # one parent mesh for FSDP2's and TP's meshes (FSDP2 requires it of DTensor parameters)
        root = DeviceMesh(
            device,
            ranks_RSCT.reshape(r, s * c, t),
            mesh_dim_names=("dp_replicate", "dp_shard_cp", "tp"),
        )
        hsdp, tp_mesh, dp_cp = root["dp_replicate", "dp_shard_cp"], root["tp"], root["dp_shard_cp"]
        if r > 1:  # DDP / "none" only (FSDP2 at R > 1 is HSDP): a plain group per tp slice
            dp_cp = DeviceMesh(
                device, ranks_RSCT.reshape(r * s * c, t), mesh_dim_names=("dp_cp", "tp")
            )["dp_cp"]
    else:
        ranks_RSC = ranks_RSCT.reshape(r, s, c)
        dp_x_cp = DeviceMesh(device, ranks_RSC.reshape(r * s, c), mesh_dim_names=("dp", "cp"))
        dp_cp = DeviceMesh(device, ranks_RSC.reshape(-1), mesh_dim_names=("dp_cp",))
        hsdp = DeviceMesh(
            device, ranks_RSC.reshape(r, s * c), mesh_dim_names=("dp_replicate", "dp_shard_cp")
        )
        if ep > 1:  # cp innermost: ep consecutive ranks lie within one replica's dp_shard x cp
            ep_mesh = DeviceMesh(
                device, ranks_RSC.reshape(-1, ep), mesh_dim_names=("ep_replica", "ep")
            )
    return MeshGroups(
        mesh=mesh,
        sizes=sizes,
        cp_group=dp_x_cp.get_group("cp"),
        cp_rank=dp_x_cp.get_local_rank("cp"),
        dp_group=dp_x_cp.get_group("dp"),
        dp_rank=dp_x_cp.get_local_rank("dp"),
        dp_cp_mesh=dp_cp,
        hsdp_mesh=hsdp,
        ep_mesh=ep_mesh,
        tp_mesh=tp_mesh,
    )
