"""The CP side of a check, on every rank: one step of ``ContextParallelVLM``, and its loss and
gradients summed over the ranks (what the dp x cp gradient sync does), to be compared with the
one-process reference (``cpvlm.verify.reference``). Under tensor parallelism the CP group is the
ranks of one tp rank: a TP-split gradient is gathered whole over TP, a replicated one is not
summed there (the ``tp_summed`` modules' are, as training does)."""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from cpvlm.parallelize.tensor_parallel import sync_tp_gradients


def _whole(p: torch.Tensor) -> torch.Tensor:
    """This rank's gradient of ``p`` at its place in the whole parameter: an expert-parallel
    ``Shard(0)`` DTensor's slice in zeros elsewhere (the sum over ranks fills in every expert)."""
    if not isinstance(p, DTensor):
        return (p.grad if p.grad is not None else torch.zeros_like(p)).clone()
    if "tp" in p.device_mesh.mesh_dim_names:  # TP shards: the same tokens, gathered whole
        return (p.grad if p.grad is not None else torch.zeros_like(p)).full_tensor()
    local = p.to_local() if p.grad is None else p.grad.to_local()
    whole = local.new_zeros(p.shape)
    if p.grad is not None:
        start = p.device_mesh.get_local_rank() * local.shape[0]
        whole[start : start + local.shape[0]] = local
    return whole


def summed_gradients(model: torch.nn.Module, group=None) -> dict[str, torch.Tensor]:
    """Every trainable parameter's gradient (zeros where it got none) summed over ``group``, on
    every rank; experts sharded by expert parallelism, and TP shards, whole. Collective: call it on
    every rank of the world (the group holds every rank of its EP groups; TP gathers are over
    each parameter's tp mesh)."""
    grads = {}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        g = _whole(p)
        dist.all_reduce(g, group=group)
        grads[name] = g
    return grads


def cp_loss_and_grads(
    cp_model,
    batch: Mapping[str, torch.Tensor],
    doc_lens=None,
    *,
    tp_summed=(),
    tp_group=None,
    **kwargs,
):
    """``cp_model``'s forward on ``batch`` (``kwargs`` passed on) and its backward; returns
    ``(output, loss, grads)``: the forward's output, and the loss shares and every trainable
    gradient summed over ``cp_model.cp_group``. ``tp_summed`` / ``tp_group``: the modules
    ``apply_tensor_parallel`` returned, whose gradients are summed over the TP group. Collective:
    call it on every rank."""
    out = cp_model(**batch, doc_lens=doc_lens, **kwargs)
    out.loss.backward()
    if tp_group is not None:
        sync_tp_gradients(tp_summed, tp_group)
    loss = out.loss.detach().clone()
    dist.all_reduce(loss, group=cp_model.cp_group)
    return out, loss, summed_gradients(cp_model.model, cp_model.cp_group)
