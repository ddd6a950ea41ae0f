"""The CP side of a check, on every rank: one step of ``ContextParallelVLM``, and its loss and
gradients summed over the ranks (what the dp x cp gradient sync does), to be compared with the
one-process reference (``cpvlm.verify.reference``)."""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.distributed as dist


def summed_gradients(model: torch.nn.Module, group=None) -> dict[str, torch.Tensor]:
    """Every trainable parameter's gradient (zeros where it got none) summed over ``group``, on
    every rank. Collective: call it on every rank of the group."""
    grads = {}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        g = (p.grad if p.grad is not None else torch.zeros_like(p)).clone()
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
