"""Mixed precision, ``parallelize(..., compute_dtype=torch.bfloat16)`` on a float32 model: bf16
compute, float32 parameters, gradients and AdamW state, for FSDP2, DDP and "none".

A CP step of the tiny Qwen3-VL on 2 gloo ranks against the float64 CP step of the same weights
(itself exact against one process, tests/hf). bf16 keeps 8 bits (unit round-off 2**-9 = 2e-3)
and the step rounds at every matmul input of 2 decoder layers, the tower and the head. Observed:
loss 1.5e-5 (FSDP2) / 3.8e-6 (autocast) relative, a mean over many tokens whose errors average
out; the whole gradient 1.2e-2 / 7.6e-3. Bounds 1e-3 and 5e-2. Pure bf16 (every parameter bf16
too) is as close here (8e-6, 9e-3): what mixed precision keeps is the update, which float32
master weights do not round away when it is below bf16's resolution.
"""

import copy

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from cpvlm.hf import ContextParallelVLM, build_model
from cpvlm.parallelize import build_mesh, mesh_groups, parallelize, sync_gradients
from cpvlm.verify import cp_loss_and_grads, rel_err, run_distributed, verify_batches


def _flat_grads(model):
    parts = []
    for p in model.parameters():
        g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        parts.append(g.detach().double().reshape(-1))
    return torch.cat(parts)


def _float64_reference(base, batch, doc_lens):
    model = copy.deepcopy(base).double()
    cp_model = ContextParallelVLM(model, dist.group.WORLD)
    _, loss, grads = cp_loss_and_grads(cp_model, batch, doc_lens)
    return loss, torch.cat([g.reshape(-1) for g in grads.values()])


def _mixed_step(rank, world_size, mode):
    base = build_model("qwen3-vl-tiny", dtype=torch.float32, seed=0)
    batch, doc_lens = verify_batches(base, torch.float32)["mixed"]
    ref_loss, ref_grads = _float64_reference(base, batch, doc_lens)

    model = copy.deepcopy(base)
    mesh = build_mesh(dp_shard=1, cp=world_size)
    groups = mesh_groups(mesh)
    cp_model = ContextParallelVLM(model, groups.cp_group)
    units = [*model.model.language_model.layers, model.model.visual]
    runner = parallelize(
        cp_model, mesh, data_parallel=mode, groups=groups, fsdp_units=units,
        compute_dtype=torch.bfloat16,
    )  # fmt: skip
    seen = []
    proj = model.model.language_model.layers[0].self_attn.q_proj
    hook = proj.register_forward_hook(lambda m, i, out: seen.append(out.dtype))
    out = runner(**batch, doc_lens=doc_lens)
    out.loss.backward()
    hook.remove()
    if mode == "none":
        sync_gradients(cp_model, groups)
    loss = out.loss.detach().double().clone()
    dist.all_reduce(loss)
    params = [p for p in cp_model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-3)
    grad_dtypes = {p.grad.dtype for p in params}
    grads = _flat_grads(cp_model)
    optimizer.step()
    state_dtypes = {t.dtype for s in optimizer.state.values() for t in s.values() if t.dim()}
    return {
        "compute": seen,
        "params": {p.dtype for p in params},
        "grads": grad_dtypes,
        "state": state_dtypes,
        "loss_err": rel_err(loss, ref_loss),
        "grad_err": rel_err(grads, ref_grads),
    }


@pytest.mark.parametrize("mode", ["fsdp", "ddp", "none"])
def test_bf16_compute_on_float32_parameters_and_optimizer_state(mode):
    for r in run_distributed(_mixed_step, 2, mode, timeout=300):
        assert r["compute"] == [torch.bfloat16], r["compute"]  # the projection ran in bf16
        assert r["params"] == r["grads"] == r["state"] == {torch.float32}, r
        assert r["loss_err"] <= 1e-3, r["loss_err"]
        assert r["grad_err"] <= 5e-2, r["grad_err"]
