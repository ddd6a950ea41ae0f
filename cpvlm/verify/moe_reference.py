"""The MoE router load-balancing loss on one process, written out from transformers' definition.

A float64 transcription of ``load_balancing_loss_func`` (transformers 5.x, Switch Transformer eq.
4-6), independent of ``cpvlm.router_loss``: the reference the CP shares are tested against. It is
the one piece of a reference that mirrors transformers instead of running its code (its float32
sums are the thing to avoid); ``tests/hf/test_moe_router_loss.py`` checks it against
transformers' own aux loss and names ``MIRRORS`` and ``WRITTEN_AGAINST`` when they part.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

MIRRORS = "transformers' load_balancing_loss_func (the MoE models' aux_loss)"
WRITTEN_AGAINST = "5.24"


def switch_load_balancing_loss(
    router_logits: Sequence[torch.Tensor], keep: torch.Tensor | None, num_experts: int, top_k: int
) -> torch.Tensor:
    """transformers' ``load_balancing_loss_func``, in the logits' dtype: per layer the softmax,
    its top-k one-hot counts and probability sums over the kept tokens, pooled over layers, then
    ``num_experts * sum(tokens_per_expert * prob_per_expert)``."""
    dtype = router_logits[0].dtype
    tokens = torch.zeros(num_experts, dtype=dtype)
    probs = torch.zeros(num_experts, dtype=dtype)
    rows = 0.0
    for layer in router_logits:
        weights = torch.softmax(layer, dim=-1)
        chosen = torch.topk(weights, top_k, dim=-1).indices
        mask = (
            torch.ones(layer.shape[0], dtype=dtype) if keep is None else keep.reshape(-1).to(dtype)
        )
        one_hot = F.one_hot(chosen, num_experts).to(dtype).sum(1)  # [n, E]
        tokens = tokens + (one_hot * mask[:, None]).sum(0)
        probs = probs + (weights * mask[:, None]).sum(0)
        rows += float(mask.sum())
    return num_experts * torch.sum((tokens / rows) * (probs / rows))
