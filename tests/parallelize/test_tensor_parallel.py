"""Tensor parallelism of the decoder layers under CP on real gloo ranks, against one process.

cp 2 x tp 2 (4 ranks, ``build_mesh(cp=2, tp=2)``: a TP group is 2 consecutive ranks, a CP group
the ranks of one tp rank): the decoder's q/k/v, o and MLP projections split by the model's plan
(qwen2.5-vl-tiny: the text config's ``base_model_tp_plan``; qwen3-vl-tiny: cpvlm's, with the q/k
norms replicated and their gradients summed over TP), attention on the CP ring over each rank's
heads. The loss and every gradient (split ones gathered over TP, all summed over the CP group)
equal the one-process run in float64 to 1e-10 (the rowwise sums add the same products in another
order; observed ~1e-15); without the TP sum, the q/k norms' gradients would not. The mesh's groups
per tp slice; and the errors of plans and sizes that cannot be split, on every rank.
"""

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from cpvlm.parallelize import build_mesh, mesh_groups
from cpvlm.parallelize.tensor_parallel import (
    decoder_layer_plan,
    parallelize_decoder_layers,
    sync_tp_gradients,
)
from cpvlm.testing import rel_err, run_distributed

TOL = 1e-10


def _groups_rank(rank, world, sizes):
    groups = mesh_groups(build_mesh(**sizes))
    ranks = dist.get_process_group_ranks
    return (
        ranks(groups.cp_group),
        ranks(groups.dp_group),
        ranks(groups.tp_mesh.get_group()),
        ranks(groups.grad_sync_group),
        groups.hsdp_mesh.mesh.tolist(),
        (groups.dp_rank, groups.cp_rank, groups.tp_rank),
    )


@pytest.mark.parametrize(
    "sizes, expected",
    [  # rank 1's (cp group, dp group, tp group, gradient sync group, HSDP mesh, (dp, cp, tp) ranks)
        (dict(dp_shard=1, cp=2, tp=2), ([1, 3], [1], [0, 1], [1, 3], [[1, 3]], (0, 0, 1))),
        (dict(dp_shard=2, cp=1, tp=2), ([1], [1, 3], [0, 1], [1, 3], [[1, 3]], (0, 0, 1))),
        (
            dict(dp_replicate=2, dp_shard=1, tp=2),
            ([1], [1, 3], [0, 1], [1, 3], [[1], [3]], (0, 0, 1)),
        ),
        (dict(dp_shard=1, cp=1, tp=4), ([1], [1], [0, 1, 2, 3], [1], [[1]], (0, 0, 1))),
    ],
)
def test_tp_is_innermost_and_the_other_groups_are_per_tp_slice(sizes, expected):
    assert run_distributed(_groups_rank, 4, sizes, timeout=60)[1] == expected


def _cp_tp_rank(rank, world, name, cp, tp):
    from cpvlm.hf import ContextParallelVLM, build_model, kit_for
    from cpvlm.hf.tensor_plan import apply_tensor_parallel
    from cpvlm.verify.batches import verify_batches

    model = build_model(name, dtype=torch.float64, seed=0)
    kit_for(model).float64_islands(model)
    groups = mesh_groups(build_mesh(dp_shard=1, cp=cp, tp=tp))
    summed = apply_tensor_parallel(model, groups.tp_mesh)
    split = [n for n, p in model.named_parameters() if isinstance(p, DTensor)]
    for p in model.parameters():  # a planned parameter: 1/tp of it here (numel: the whole)
        assert p.to_local().numel() * tp == p.numel() if isinstance(p, DTensor) else True
    batch, doc_lens = verify_batches(model, torch.float64)["mixed"]
    out = ContextParallelVLM(model, groups.cp_group)(**batch, doc_lens=doc_lens)
    out.loss.backward()
    unsummed = [p.grad.clone() for m in summed for p in m.parameters()]  # layer, q before k
    sync_tp_gradients(summed, groups.tp_mesh.get_group())
    loss = out.loss.detach().clone()
    dist.all_reduce(loss, group=groups.cp_group)
    grads = {}
    for n, p in model.named_parameters():
        g = p.grad if p.grad is not None else torch.zeros_like(p)
        g = g.full_tensor() if isinstance(g, DTensor) else g.clone()  # whole over TP
        dist.all_reduce(g, group=groups.cp_group)  # replicated over TP: not summed there
        grads[n] = g
    for g in unsummed:
        dist.all_reduce(g, group=groups.cp_group)
    return loss, grads, split, unsummed


@pytest.mark.parametrize("name", ["qwen2.5-vl-tiny", "qwen3-vl-tiny"])
def test_cp2_tp2_loss_and_every_gradient_equal_one_process(name):
    from cpvlm.hf import build_model, kit_for
    from cpvlm.verify.batches import verify_batches
    from cpvlm.verify.reference import reference

    model = build_model(name, dtype=torch.float64, seed=0)
    kit_for(model).float64_islands(model)
    ref_loss, ref_grads = reference(model, *verify_batches(model, torch.float64)["mixed"])
    norms = [n for n in ref_grads if n.endswith(("q_norm.weight", "k_norm.weight"))]
    results = run_distributed(_cp_tp_rank, 4, name, 2, 2, timeout=300)
    for loss, grads, split, unsummed in results:
        assert any("q_proj" in n for n in split) and any("down_proj" in n for n in split)
        assert abs(float(loss) - float(ref_loss)) <= TOL * abs(float(ref_loss))
        assert max(rel_err(grads[n], ref_grads[n]) for n in ref_grads) <= TOL
        assert len(unsummed) == len(norms)  # Qwen3: every q/k norm; Qwen2.5 has none
        # one rank's heads only: the TP sum is needed
        assert all(rel_err(g, ref_grads[n]) > 1e-3 for g, n in zip(unsummed, norms))


def _bad_rank(rank, world, name, tp):
    from cpvlm.hf import build_model

    model = build_model(name, dtype=torch.float64, seed=0)
    text = model.config.get_text_config()
    mesh = DeviceMesh("cpu", torch.arange(world).reshape(-1, tp), mesh_dim_names=("cp", "tp"))
    try:
        parallelize_decoder_layers(
            model.model.language_model.layers,
            text.base_model_tp_plan,
            mesh["tp"],
            num_heads=text.num_attention_heads,
            num_kv_heads=text.num_key_value_heads,
        )
    except ValueError as err:
        dist.barrier()  # every rank got here: none waits in a collective
        return str(err)
    return None


@pytest.mark.parametrize(
    "name, tp, message",
    [
        # transformers 5.25's Qwen3-VL text config plans only its embedding
        ("qwen3-vl-tiny", 2, "has no 'layers.*.<path>' entries"),
        ("qwen2.5-vl-tiny", 4, "tp = 4 must divide the model's num_kv_heads=2"),
        # its sparse MoE layers have no mlp.gate_proj: the plan does not fit every layer
        ("qwen3-vl-moe-tiny", 2, "has no ['mlp.gate_proj', 'mlp.up_proj', 'mlp.down_proj']"),
    ],
)
def test_plans_that_cannot_be_split_raise_on_every_rank(name, tp, message):
    errors = run_distributed(_bad_rank, 4, name, tp, timeout=120)
    assert all(e is not None and message in e for e in errors), errors


def test_styles_that_tp_cannot_apply_are_refused():
    plan = {"layers.*.self_attn.q_proj": "colwise", "layers.*.self_attn.q_norm": "replicated"}
    with pytest.raises(ValueError, match="styles {'self_attn.q_norm': 'replicated'}"):
        decoder_layer_plan(plan)
    plan = {"embed_tokens": "embedding_rowwise", "layers.*.mlp.up_proj": "colwise"}
    assert decoder_layer_plan(plan) == {"mlp.up_proj": "colwise"}  # the embedding: replicated


def test_a_family_plan_is_its_own_class_s_and_moe_is_refused():
    from cpvlm.hf import TINY_MODELS
    from cpvlm.hf.tensor_plan import check_tp, tp_plan

    assert tp_plan(TINY_MODELS["qwen3-vl-tiny"]())["layers.*.self_attn.q_norm"] == (
        "replicated_with_grad_allreduce"
    )
    # Qwen3-VL-MoE's adapter subclasses Qwen3-VL's: not its plan (its sparse layers have experts)
    assert "layers.*.self_attn.q_norm" not in tp_plan(TINY_MODELS["qwen3-vl-moe-tiny"]())
    with pytest.raises(ValueError, match="tp = 2: tensor parallelism of MoE layers"):
        check_tp(2, TINY_MODELS["qwen3-vl-moe-tiny"](), "tp")
    with pytest.raises(ValueError, match="tp = 3 must divide the model's num_attention_heads=4"):
        check_tp(3, TINY_MODELS["qwen3-vl-tiny"](), "tp")


def test_verify_tp_exits_0_with_every_group_within_1e10(capsys):
    from cpvlm.verify.command import main

    assert main(["--model", "qwen3-vl-tiny", "--cp", "2", "--tp", "2"]) == 0
    out = capsys.readouterr().out
    assert "OK: the loss and every gradient are within tolerance (float64)" in out
    rows = [line.split() for line in out.splitlines() if line.lstrip().startswith("2 ")]
    assert len(rows) == 8  # ring, allgather, ulysses, hybrid x the mixed and packed batches
    for row in rows:  # the tolerance column (float64's), then the error of every group
        errors = row[row.index("1e-10") + 1 :]
        assert len(errors) == 8 and all(float(e) <= TOL for e in errors), row


def test_verify_refuses_a_tp_that_cannot_split_the_model(capsys):
    from cpvlm.verify.command import main

    with pytest.raises(SystemExit):
        main(["--model", "qwen3-vl-tiny", "--cp", "2", "--tp", "4"])
    assert "tp (--tp) = 4 must divide the model's num_key_value_heads=2" in capsys.readouterr().err
