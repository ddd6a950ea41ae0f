"""build_mesh, mesh validation and parallelize's argument checks: clear errors, raised on every rank."""

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

from cpvlm.parallelize import MeshSizes, build_mesh, mesh_groups, mesh_sizes, parallelize
from cpvlm.testing import run_distributed


def _try(call):
    """The ValueError message of ``call()``, or the repr of what it returned."""
    try:
        return repr(call())
    except ValueError as e:
        return f"ValueError: {e}"


def _build_meshes(rank, world_size, kwargs_list):
    return [_try(lambda kw=kw: mesh_sizes(build_mesh(**kw))) for kw in kwargs_list]


def test_build_mesh_sizes_and_errors():
    kwargs_list = [
        {"cp": 2},
        {"dp_replicate": 2, "dp_shard": 1, "cp": 2},
        {"dp_shard": 3, "cp": 2},
        {"cp": 3},
        {"cp": 0},
        {"dp_shard": True},
        {"cp": 2, "tp": 2},
        {"dp_shard": 1, "cp": 2, "tp": 3},
        {"cp": 2, "tp": 2, "ep": 2},
    ]
    results = run_distributed(_build_meshes, 4, kwargs_list)
    assert all(r == results[0] for r in results)  # every rank raises the same error
    ok_fsdp, ok_hsdp, product, divide, zero, boolean, ok_tp, tp_product, tp_ep = results[0]
    assert ok_tp == repr(MeshSizes(dp_replicate=1, dp_shard=1, cp=2, tp=2))
    assert "x cp=2 x tp=3 = 6 ranks, but the world has 4" in tp_product
    assert "tp=2 with ep=2: tensor and expert parallelism do not combine yet" in tp_ep
    assert ok_fsdp == repr(MeshSizes(dp_replicate=1, dp_shard=2, cp=2))
    assert ok_hsdp == repr(MeshSizes(dp_replicate=2, dp_shard=1, cp=2))
    assert "dp_replicate=1 x dp_shard=3 x cp=2 x tp=1 = 6 ranks, but the world has 4" in product
    assert "dp_shard=-1 to fill the rest" in product
    assert "x cp=3 x tp=1 = 3 does not divide the world size 4" in divide
    assert "cp must be a positive int, got 0" in zero
    assert "dp_shard must be a positive int (or -1" in boolean


def test_build_mesh_needs_an_initialised_process_group():
    with pytest.raises(ValueError, match="init_process_group first"):
        build_mesh(cp=2)


def _named_meshes(rank, world_size, specs):
    out = [
        _try(
            lambda shape=shape, names=names: mesh_sizes(
                init_device_mesh("cpu", shape, mesh_dim_names=names)
            )
        )
        for shape, names in specs
    ]
    return [*out, _try(lambda: mesh_sizes("not a mesh"))]


def test_mesh_validation_names_what_is_wrong():
    specs = [
        ((2, 2), ("dp_shard", "cp")),  # a subset, in order: fine
        ((4,), ("cp",)),
        ((2, 2), ("cp", "dp_shard")),
        ((2, 2), ("dp_shard", "pp")),
        ((4,), None),
    ]
    subset, cp_only, order, unknown, unnamed, not_mesh = run_distributed(_named_meshes, 4, specs)[0]
    assert subset == repr(MeshSizes(1, 2, 2))
    assert cp_only == repr(MeshSizes(1, 1, 4))
    assert "must appear once each, in the order ['dp_replicate', 'dp_shard', 'cp', 'tp']" in order
    assert "['pp'] not understood" in unknown
    assert "no dim names" in unnamed and "build_mesh(" in unnamed
    assert "expected a DeviceMesh, got str" in not_mesh


def _submesh_is_not_the_world(rank, world_size):
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "cp"))
    return _try(lambda: mesh_sizes(mesh["cp"]))


def test_a_mesh_must_cover_the_world():
    msg = run_distributed(_submesh_is_not_the_world, 4)[0]
    assert "has 2 ranks but the world has 4" in msg


class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(2, 2) for _ in range(2))
        self.inner = torch.nn.Sequential(torch.nn.Linear(2, 2))


def _parallelize_errors(rank, world_size):
    hsdp_mesh = build_mesh(dp_replicate=2, dp_shard=1, cp=2)
    mesh = build_mesh(dp_shard=2, cp=2)
    net = _Net()
    calls = [
        lambda: parallelize(net, hsdp_mesh, data_parallel="fsdp"),
        lambda: parallelize(net, mesh, data_parallel="zero3"),
        lambda: parallelize(net, mesh, fsdp_units=[torch.nn.Linear(2, 2)]),
        lambda: parallelize(net, mesh, fsdp_units=[net]),
        lambda: parallelize(net, mesh, fsdp_units=[net.inner, net.inner[0]]),
        lambda: parallelize(net, mesh, fsdp_units=lambda m: [m.blocks[0], m.blocks[0]]),
        lambda: parallelize(net, mesh, groups=mesh_groups(hsdp_mesh)),
    ]
    return [_try(call) for call in calls]


def test_parallelize_rejects_what_it_cannot_do():
    fsdp_rep, mode, foreign, root, order, dup, groups = run_distributed(_parallelize_errors, 4)[0]
    assert "'fsdp' shards over dp_shard x cp, but the mesh has dp_replicate=2" in fsdp_rep
    assert "use data_parallel='hsdp'" in fsdp_rep and "dp_shard=2" in fsdp_rep
    assert "data_parallel='zero3'; choose one of ['fsdp', 'hsdp', 'ddp', 'none']" in mode
    assert "fsdp_units[0] (Linear) is not a submodule of the model" in foreign
    assert "fsdp_units[0] is the model itself" in root
    assert "fsdp_units[0] (Sequential) contains fsdp_units[1] (Linear)" in order
    assert "children before their parents" in order
    assert "fsdp_units[0] and fsdp_units[1] are the same" in dup
    assert "groups were built for another mesh" in groups
