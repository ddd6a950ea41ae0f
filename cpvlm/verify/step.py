"""The CP side of a check, on every rank: one step of ``ContextParallelVLM``, and its loss and
gradients summed over the ranks (what the dp x cp gradient sync does), to be compared with the
one-process reference (``cpvlm.verify.reference``)."""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor


def _whole(p: torch.Tensor) -> torch.Tensor:
    """This rank's gradient of ``p`` at its place in the whole parameter: an expert-parallel
    ``Shard(0)`` DTensor's slice in zeros elsewhere (the sum over ranks fills in every expert)."""
    if not isinstance(p, DTensor):
        return (p.grad if p.grad is not None else torch.zeros_like(p)).clone()
    local = p.to_local() if p.grad is None else p.grad.to_local()
    whole = local.new_zeros(p.shape)
    if p.grad is not None:
        start = p.device_mesh.get_local_rank() * local.shape[0]
        whole[start : start + local.shape[0]] = local
    return whole


def summed_gradients(model: torch.nn.Module, group=None) -> dict[str, torch.Tensor]:
    """Every trainable parameter's gradient (zeros where it got none) summed over ``group``, on
    every rank; experts sharded by expert parallelism whole. Collective: call it on every rank of
    the group (which holds every rank of its EP groups)."""
    grads = {}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        g = _whole(p)
        dist.all_reduce(g, group=group)
        grads[name] = g
    return grads


def cp_loss_and_grads(cp_model, batch: Mapping[str, torch.Tensor], doc_lens=None, **kwargs):
    """``cp_model``'s forward on ``batch`` (``kwargs`` passed on) and its backward; returns
    ``(output, loss, grads)``: the forward's output, and the loss shares and every trainable
    gradient summed over ``cp_model.cp_group``. Collective: call it on every CP rank."""
    out = cp_model(**batch, doc_lens=doc_lens, **kwargs)
    out.loss.backward()
    loss = out.loss.detach().clone()
    dist.all_reduce(loss, group=cp_model.cp_group)
    return out, loss, summed_gradients(cp_model.model, cp_model.cp_group)
