"""Tensor parallelism of the decoder layers under CP on real gloo ranks, against one process.

cp 2 x tp 2 (4 ranks; a CP group is the ranks of one tp rank): the decoder's q/k/v, o and MLP
projections split by the model's ``base_model_tp_plan`` (each rank holds 1/tp of them), attention
on the CP ring over each rank's heads. The loss and every gradient (planned ones gathered over
TP, all summed over the CP group) equal the one-process run in float64 to 1e-10 (the rowwise sums
add the same products in another order; observed ~1e-15). And the errors of plans that cannot be
split, on every rank.
"""

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from cpvlm.parallelize.tensor_parallel import decoder_layer_plan, parallelize_decoder_layers
from cpvlm.testing import rel_err, run_distributed

TOL = 1e-10


def _tp_model(name, world, cp, tp):
    from cpvlm.hf import adapter_for, build_model, kit_for

    model = build_model(name, dtype=torch.float64, seed=0)
    kit_for(model).float64_islands(model)
    mesh = DeviceMesh("cpu", torch.arange(world).reshape(cp, tp), mesh_dim_names=("cp", "tp"))
    text = model.config.get_text_config()
    parallelize_decoder_layers(
        adapter_for(model).decoder_layers(model),
        text.base_model_tp_plan,
        mesh["tp"],
        num_heads=text.num_attention_heads,
        num_kv_heads=text.num_key_value_heads,
    )
    return model, mesh


def _cp_tp_rank(rank, world, name, cp, tp):
    from cpvlm.hf import ContextParallelVLM
    from cpvlm.verify.batches import verify_batches

    model, mesh = _tp_model(name, world, cp, tp)
    split = [n for n, p in model.named_parameters() if isinstance(p, DTensor)]
    for p in model.parameters():  # a planned parameter: 1/tp of it here (numel: the whole)
        assert p.to_local().numel() * tp == p.numel() if isinstance(p, DTensor) else True
    batch, doc_lens = verify_batches(model, torch.float64)["mixed"]
    out = ContextParallelVLM(model, mesh.get_group("cp"))(**batch, doc_lens=doc_lens)
    out.loss.backward()
    loss = out.loss.detach().clone()
    dist.all_reduce(loss, group=mesh.get_group("cp"))
    grads = {}
    for n, p in model.named_parameters():
        g = p.grad if p.grad is not None else torch.zeros_like(p)
        g = g.full_tensor() if isinstance(g, DTensor) else g.clone()  # whole over TP
        dist.all_reduce(g, group=mesh.get_group("cp"))  # replicated over TP: not summed there
        grads[n] = g
    return loss, grads, split


def test_cp2_tp2_loss_and_every_gradient_equal_one_process():
    from cpvlm.hf import build_model, kit_for
    from cpvlm.verify.batches import verify_batches
    from cpvlm.verify.reference import reference

    name = "qwen2.5-vl-tiny"
    model = build_model(name, dtype=torch.float64, seed=0)
    kit_for(model).float64_islands(model)
    ref_loss, ref_grads = reference(model, *verify_batches(model, torch.float64)["mixed"])
    results = run_distributed(_cp_tp_rank, 4, name, 2, 2, timeout=300)
    for loss, grads, split in results:
        assert any("q_proj" in n for n in split) and any("down_proj" in n for n in split)
        assert abs(float(loss) - float(ref_loss)) <= TOL * abs(float(ref_loss))
        assert max(rel_err(grads[n], ref_grads[n]) for n in ref_grads) <= TOL


def _bad_rank(rank, world, name, tp):
    try:
        _tp_model(name, world, world // tp, tp)
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
    ],
)
def test_plans_that_cannot_be_split_raise_on_every_rank(name, tp, message):
    errors = run_distributed(_bad_rank, 4, name, tp, timeout=120)
    assert all(e is not None and message in e for e in errors), errors


def test_styles_that_need_a_tp_gradient_sum_are_refused():
    plan = {"layers.*.self_attn.q_proj": "colwise", "layers.*.self_attn.q_norm": "replicated"}
    with pytest.raises(ValueError, match="styles {'self_attn.q_norm': 'replicated'}"):
        decoder_layer_plan(plan)
    plan = {"embed_tokens": "embedding_rowwise", "layers.*.mlp.up_proj": "colwise"}
    assert decoder_layer_plan(plan) == {"mlp.up_proj": "colwise"}  # the embedding: replicated
