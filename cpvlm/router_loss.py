"""The MoE router's load-balancing loss under context parallelism, from CP-global statistics.

Legend: n tokens on this rank, E experts, K experts per token, M MoE layers.

transformers' ``load_balancing_loss_func`` (Switch Transformer, eq. 4-6; Qwen3-VL-MoE,
Qwen3.5-MoE and GLM-4.5V use it) pools the MoE layers of one forward over its valid tokens:

    C_e = sum over layers and valid tokens of [e in top-K(softmax(logits))]      (counts)
    P_e = sum over layers and valid tokens of softmax(logits)_e                  (probabilities)
    T   = M * (number of valid tokens)
    aux = E * sum_e (C_e / T) * (P_e / T)

C and T are sums over the whole batch. A CP rank holds only its shard's tokens; the same formula
on its own C, P and T (the per-shard loss) is another number with other router gradients. Here
every rank sums C and T (no gradient) over the CP group and returns its share

    share_r = E * sum_e C_e * P_e^r / T**2

P enters linearly, so the shares of the CP ranks add up to aux, and the gradient of a share is
exactly this rank's part of the gradient of aux: no differentiable collective is needed, and the
gradient sync's sum over CP ranks gives the one-process router gradients.

The loss is defined per forward batch (the rows given to one call), as transformers defines it.
Everything is computed in the logits' dtype (transformers' own function sums in float32).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist


def router_statistics(
    router_logits: Sequence[torch.Tensor], real_mask: torch.Tensor, top_k: int
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """``(C [E] counts, P [E] probability sums, T)`` over the tokens where ``real_mask`` is True.

    ``router_logits``: one ``[n, E]`` tensor per MoE layer, rows in the row-major order of the
    ``[B, L]`` ``real_mask``. C is detached (top-k has no gradient); P carries the gradient.
    """
    layers = list(router_logits or ())
    if not layers:
        raise ValueError(
            "router load-balancing loss: the decoder returned no router logits; pass "
            "output_router_logits=True to the text model"
        )
    keep = real_mask.reshape(-1).to(layers[0].device)
    num_experts = layers[0].shape[-1]
    counts = torch.zeros(num_experts, dtype=torch.float64, device=keep.device)
    probs_sum = layers[0].new_zeros(num_experts)
    for i, logits in enumerate(layers):
        if logits.dim() != 2 or logits.shape != (keep.numel(), num_experts):
            raise ValueError(
                f"router logits of MoE layer {i} have shape {tuple(logits.shape)}; expected "
                f"[{keep.numel()}, {num_experts}] (one row per token of the [B, L] batch)"
            )
        probs = torch.softmax(logits[keep], dim=-1)
        chosen = torch.topk(probs, top_k, dim=-1).indices.reshape(-1)
        counts += torch.bincount(chosen, minlength=num_experts).to(counts.dtype)
        probs_sum = probs_sum + probs.sum(0)
    return counts, probs_sum, len(layers) * int(keep.sum())


def _aux(counts: torch.Tensor, probs_sum: torch.Tensor, tokens: float) -> torch.Tensor:
    if tokens == 0:  # no valid token: 0 with a gradient path, so every rank's backward matches
        return probs_sum.sum() * 0
    num_experts = probs_sum.shape[0]
    return num_experts * (counts.to(probs_sum.dtype) * probs_sum).sum() / tokens**2


def load_balancing_loss(
    router_logits: Sequence[torch.Tensor], real_mask: torch.Tensor, *, top_k: int
) -> torch.Tensor:
    """aux of the tokens given, on one process (a whole batch, or one shard alone)."""
    counts, probs_sum, tokens = router_statistics(router_logits, real_mask, top_k)
    return _aux(counts, probs_sum, tokens)


def load_balancing_loss_share(
    router_logits: Sequence[torch.Tensor],
    real_mask: torch.Tensor,
    *,
    top_k: int,
    group: dist.ProcessGroup | None,
) -> torch.Tensor:
    """This rank's share of the batch's aux, its tokens spread over ``group``; the shares of the
    group's ranks sum to the one-process ``load_balancing_loss`` of the whole batch."""
    counts, probs_sum, tokens = router_statistics(router_logits, real_mask, top_k)
    stats = torch.cat([counts, counts.new_tensor([tokens])])
    dist.all_reduce(stats, group=group)
    return _aux(stats[:-1], probs_sum, float(stats[-1]))
