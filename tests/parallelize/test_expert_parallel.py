"""Expert parallelism under CP on real gloo ranks, against one process, in float64.

Every rank holds other tokens (a CP shard), so the (token, expert) pairs travel to the experts'
ranks and back. Checked: a toy experts module with skewed routing (a rank whose experts get no
pair, a rank with no token at all); the MoE families' experts sharded over EP groups of the CP
ranks, for every MoE family (each rank holds 1/ep of every expert parameter; the experts'
gradients, summed over the ranks, equal the one-process ones); under FSDP2 at dp 2 x cp 2 x ep 2,
the experts sharded over the ranks that hold them (1/(dp x cp) of the expert parameters per rank,
the gradients FSDP2 reduce-scatters equal to the one-process ones); ``cpvlm verify --ep``; and bad
sizes, an error on every rank.
Tolerance: 1e-10 relative; the EP run adds the same terms in another order (observed <= 2e-15);
GLM-4.5V's float32 router: cpvlm verify's float32 bound.
"""

import re

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from cpvlm.parallelize import (
    build_mesh,
    mesh_groups,
    parallelize,
    parallelize_experts,
    sync_expert_gradients,
)
from cpvlm.testing import rel_err, run_distributed
from cpvlm.verify.compare import FLOAT32_IN_FLOAT64

TOL = 1e-10
DIM, TOP_K = 6, 2


class ToyExperts(torch.nn.Module):
    """The fused-experts contract: ``num_experts``, ``[E, ...]`` parameters, and
    ``forward(x, top_k_index, top_k_weights)`` summing the weighted outputs of the chosen experts."""

    def __init__(self, num_experts):
        super().__init__()
        self.num_experts = num_experts
        g = torch.Generator().manual_seed(1)
        self.up_proj = torch.nn.Parameter(torch.randn(num_experts, DIM, DIM, generator=g).double())
        self.down_proj = torch.nn.Parameter(
            torch.randn(num_experts, DIM, DIM, generator=g).double()
        )

    def forward(self, x, top_k_index, top_k_weights):
        out = torch.zeros_like(x)
        for k in range(top_k_index.shape[1]):
            e = top_k_index[:, k]
            h = torch.tanh(torch.einsum("nd,nfd->nf", x, self.up_proj[e]))
            out = out + top_k_weights[:, k, None] * torch.einsum("nf,ndf->nd", h, self.down_proj[e])
        return out


def _toy_tokens(world, routing):
    """Every rank's tokens, routes and weights (rank r holds ``counts[r]`` tokens)."""
    g = torch.Generator().manual_seed(2)
    counts = [5, 0, 3, 4][:world] if routing == "one_rank_empty" else [5, 3, 4, 2][:world]
    x = torch.randn(sum(counts), DIM, generator=g, dtype=torch.float64)
    if routing == "all_to_rank0":  # ranks > 0 hold experts that no pair reaches
        index = torch.stack([torch.zeros(len(x)), torch.ones(len(x))], 1).long()
    else:
        index = torch.stack([torch.randperm(4, generator=g)[:TOP_K] for _ in range(len(x))])
    weights = torch.softmax(torch.randn(len(x), TOP_K, generator=g, dtype=torch.float64), -1)
    return x, index, weights, counts


def _toy_rank(rank, world, ep, routing):
    x, index, weights, counts = _toy_tokens(world, routing)
    rows = slice(sum(counts[:rank]), sum(counts[: rank + 1]))
    experts = ToyExperts(4)
    groups = mesh_groups(build_mesh(dp_shard=1, cp=world, ep=ep), ep=ep)
    parallelize_experts(experts, groups.ep_mesh["ep"])
    assert experts.num_experts == 4 // ep
    x_loc = x[rows].clone().requires_grad_()
    w_loc = weights[rows].clone().requires_grad_()
    out = experts(x_loc, index[rows], w_loc)
    (out * torch.arange(1.0, DIM + 1, dtype=torch.float64)).sum().backward()
    sync_expert_gradients(experts, groups)
    grads = {n: p.grad.full_tensor() for n, p in experts.named_parameters()}
    return out.detach(), x_loc.grad, w_loc.grad, grads


@pytest.mark.parametrize(
    "world, ep, routing",
    [(2, 2, "random"), (2, 2, "all_to_rank0"), (4, 2, "one_rank_empty"), (4, 4, "all_to_rank0")],
)
def test_toy_experts_dispatched_and_combined_exactly(world, ep, routing):
    x, index, weights, counts = _toy_tokens(world, routing)
    experts = ToyExperts(4)
    x, weights = x.requires_grad_(), weights.requires_grad_()
    ref = experts(x, index, weights)
    (ref * torch.arange(1.0, DIM + 1, dtype=torch.float64)).sum().backward()
    results = run_distributed(_toy_rank, world, ep, routing, timeout=120)
    out = torch.cat([r[0] for r in results])
    assert rel_err(out, ref) <= TOL
    assert rel_err(torch.cat([r[1] for r in results]), x.grad) <= TOL
    assert rel_err(torch.cat([r[2] for r in results]), weights.grad) <= TOL
    for name, p in experts.named_parameters():
        for r in results:  # every expert replica holds the summed gradient
            assert rel_err(r[3][name], p.grad) <= TOL, name


def _model_rank(rank, world, model_name, ep):
    from cpvlm.hf import ContextParallelVLM, build_model, kit_for
    from cpvlm.parallelize import expert_parameters
    from cpvlm.verify.batches import verify_batches
    from cpvlm.verify.step import cp_loss_and_grads

    model = build_model(model_name, dtype=torch.float64, seed=0)
    kit_for(model).float64_islands(model)
    whole = {n: p.numel() for n, p in model.named_parameters()}
    groups = mesh_groups(build_mesh(dp_shard=1, cp=world, ep=ep), ep=ep)
    sharded = parallelize_experts(model, groups.ep_mesh["ep"])
    names = {id(p): n for n, p in model.named_parameters()}
    assert sharded and {id(p) for p in sharded} == {id(p) for p in expert_parameters(model)}
    for p in sharded:  # this rank's slice: 1/ep of every expert parameter, no more
        assert isinstance(p, DTensor)
        assert p.to_local().numel() * ep == whole[names[id(p)]]
    batch, doc_lens = verify_batches(model, torch.float64)["mixed"]
    cp_model = ContextParallelVLM(model, groups.cp_group)
    _, loss, grads = cp_loss_and_grads(cp_model, batch, doc_lens)
    held = sum(p.to_local().numel() for p in sharded)
    return loss, grads if rank == 0 else None, held, [names[id(p)] for p in sharded]


@pytest.mark.parametrize(
    "model_name, world, ep, tol",
    [
        ("qwen3-vl-moe-tiny", 2, 2, TOL),
        ("qwen3-vl-moe-tiny", 4, 4, TOL),
        ("qwen3.5-moe-tiny", 4, 2, TOL),
        ("qwen3-omni-moe-tiny", 2, 2, TOL),
        ("nemotron-omni-tiny", 2, 2, TOL),  # experts without a gate projection
        # GLM-4.5V's router computes in float32 whatever the dtype: cpvlm verify's float32 bound
        ("glm4v-moe-tiny", 2, 2, FLOAT32_IN_FLOAT64),
    ],
)
def test_each_rank_holds_its_experts_and_their_gradients_are_exact(model_name, world, ep, tol):
    from cpvlm.hf import build_model, kit_for
    from cpvlm.verify.batches import verify_batches
    from cpvlm.verify.reference import reference

    model = build_model(model_name, dtype=torch.float64, seed=0)
    kit_for(model).float64_islands(model)
    ref_loss, ref_grads = reference(model, *verify_batches(model, torch.float64)["mixed"])
    results = run_distributed(_model_rank, world, model_name, ep, timeout=300)
    loss, grads, _, names = results[0]
    expert_numel = sum(dict(model.named_parameters())[n].numel() for n in names)
    assert [r[2] * ep for r in results] == [expert_numel] * world
    assert names and all("experts" in n for n in names)
    assert abs(float(loss) - float(ref_loss)) <= tol * abs(float(ref_loss))
    for name in names:  # the experts, whole: the sum over ranks of each rank's slice
        assert rel_err(grads[name], ref_grads[name]) <= tol, name
    zero = [re.compile(z) for z in kit_for(model).zero_gradients]  # zero in exact arithmetic
    rest = [n for n in ref_grads if not any(z.fullmatch(n) for z in zero)]
    assert max(rel_err(grads[n], ref_grads[n]) for n in rest) <= tol


class ToyMoE(torch.nn.Module):
    """A root around the toy experts: FSDP2 wraps the experts as their own unit under it."""

    def __init__(self):
        super().__init__()
        self.experts = ToyExperts(4)

    def forward(self, x, top_k_index, top_k_weights):
        return self.experts(x, top_k_index, top_k_weights)


def _fsdp_experts_rank(rank, world, routing):
    from torch.distributed.fsdp import FSDPModule

    x, index, weights, counts = _toy_tokens(world, routing)
    rows = slice(sum(counts[:rank]), sum(counts[: rank + 1]))
    model = ToyMoE()
    groups = mesh_groups(build_mesh(dp_shard=2, cp=2, ep=2), ep=2)
    parallelize(model, groups.mesh, data_parallel="fsdp", groups=groups)
    assert isinstance(model.experts, FSDPModule)  # its own unit, over the expert replicas
    held = {n: p.to_local().numel() for n, p in model.named_parameters()}
    out = model(x[rows], index[rows], weights[rows])
    (out * torch.arange(1.0, DIM + 1, dtype=torch.float64)).sum().backward()
    sync_expert_gradients(model, groups)  # FSDP2 reduced them: a no-op, not a second sum
    grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
    return (
        out.detach(),
        held,
        {n: p.grad.to_local().numel() for n, p in model.named_parameters()},
        grads,
    )


@pytest.mark.parametrize("routing", ["one_rank_empty", "all_to_rank0"])
def test_fsdp_shards_the_experts_over_their_replicas(routing):
    """dp 2 x cp 2 x ep 2: each rank holds 1/(dp x cp) of the expert parameters (half of its
    EP group's two experts), and FSDP2's reduce-scatter over the two ranks that hold the same
    experts gives the one-process gradient, also where a rank's experts get no pair."""
    x, index, weights, _ = _toy_tokens(4, routing)
    model = ToyMoE()
    ref = model(x, index, weights)
    (ref * torch.arange(1.0, DIM + 1, dtype=torch.float64)).sum().backward()
    results = run_distributed(_fsdp_experts_rank, 4, routing, timeout=120)
    assert rel_err(torch.cat([r[0] for r in results]), ref) <= TOL
    for name, p in model.named_parameters():
        for _, held, grad_held, grads in results:
            assert held[name] == grad_held[name] == p.numel() // 4, name
            assert rel_err(grads[name], p.grad) <= TOL, name


def _model_fsdp_rank(rank, world, model_name):
    from cpvlm.hf import build_model
    from cpvlm.parallelize import expert_parameters

    model = build_model(model_name, dtype=torch.float64, seed=0)
    groups = mesh_groups(build_mesh(dp_shard=2, cp=2, ep=2), ep=2)
    parallelize(model, groups.mesh, data_parallel="fsdp", groups=groups)
    return sum(p.to_local().numel() for p in expert_parameters(model))


@pytest.mark.parametrize("model_name", ["qwen3-vl-moe-tiny", "qwen3.5-moe-tiny"])
def test_each_rank_holds_a_quarter_of_the_experts_at_dp2_cp2_ep2(model_name):
    from cpvlm.hf import build_model
    from cpvlm.parallelize.expert_parallel import expert_modules

    model = build_model(model_name, dtype=torch.float64, seed=0)
    total = sum(p.numel() for m in expert_modules(model) for p in m.parameters(recurse=False))
    assert (
        total and run_distributed(_model_fsdp_rank, 4, model_name, timeout=180) == [total // 4] * 4
    )


def test_verify_ep_exits_0_with_every_group_within_1e10(capsys):
    from cpvlm.verify.command import main

    assert main(["--model", "qwen3-vl-moe-tiny", "--cp", "2", "--ep", "2"]) == 0
    out = capsys.readouterr().out
    assert "OK: the loss and every gradient are within tolerance (float64)" in out
    rows = [line.split() for line in out.splitlines() if line.lstrip().startswith("2 ")]
    assert len(rows) == 8  # ring, allgather, ulysses, hybrid x the mixed and packed batches
    for row in rows:  # the tolerance column (float64's), then the error of every group
        errors = row[row.index("1e-10") + 1 :]
        assert len(errors) == 10 and all(float(e) <= TOL for e in errors), row


def _bad_sizes_rank(rank, world, case):
    try:
        if case == "ep_not_dividing_ranks":
            build_mesh(dp_shard=1, cp=world, ep=3)
        elif case == "groups_ep_not_dividing_ranks":
            mesh_groups(build_mesh(dp_shard=1, cp=world), ep=4)
        elif case == "ep_not_dividing_experts":
            groups = mesh_groups(build_mesh(dp_shard=1, cp=world, ep=2), ep=2)
            parallelize_experts(ToyExperts(3), groups.ep_mesh["ep"])
        else:
            groups = mesh_groups(build_mesh(dp_shard=1, cp=world, ep=2), ep=2)
            parallelize_experts(torch.nn.Linear(2, 2), groups.ep_mesh["ep"])
    except ValueError as err:
        dist.barrier()  # every rank got here: none is left waiting in a collective
        return str(err)
    return None


@pytest.mark.parametrize(
    "case, message",
    [
        ("ep_not_dividing_ranks", "build_mesh: ep=3 must divide dp_shard x cp = 1 x 2 = 2"),
        ("groups_ep_not_dividing_ranks", "mesh_groups: ep=4 must divide dp_shard x cp"),
        ("ep_not_dividing_experts", "ep = 2: must divide the model's 3 experts"),
        ("not_moe", "expert parallelism needs a MoE model"),
    ],
)
def test_bad_sizes_raise_on_every_rank(case, message):
    errors = run_distributed(_bad_sizes_rank, 2, case, timeout=60)
    assert all(e is not None and message in e for e in errors), errors


@pytest.mark.usefixtures("no_training_process")
@pytest.mark.parametrize(
    "argv, message",
    [
        (["--cp", "2", "--ep", "3"], "parallel.ep = 3 (--ep): must divide the 2 ranks of --dp 1"),
        (["--cp", "4", "--dp", "2", "--ep", "8"], "parallel.ep = 8 (--ep): must divide the model"),
        (["--cp", "2", "--ep", "2", "--data-parallel", "ddp"], "fsdp or none, not ddp"),
        (["--cp", "2", "--ep", "0"], "parallel.ep = 0 (--ep): must be an integer >= 1"),
    ],
)
def test_bad_train_flags_get_a_clear_message(capsys, argv, message):
    from cpvlm.train.command import main as train_main

    assert train_main(["--model", "qwen3-vl-moe-tiny", *argv]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.usefixtures("no_training_process")
def test_ep_on_a_dense_model_is_refused(capsys):
    from cpvlm.train.command import main as train_main
    from cpvlm.verify.command import main as verify_main

    assert train_main(["--model", "qwen3-vl-tiny", "--cp", "2", "--ep", "2"]) == 2
    assert "parallel.ep = 2 (--ep): expert parallelism needs a MoE model" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        verify_main(["--model", "qwen3-vl-tiny", "--cp", "2", "--ep", "2"])
    assert "ep = 2 (--ep): expert parallelism needs a MoE model" in capsys.readouterr().err
