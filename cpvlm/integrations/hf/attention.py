"""The text attention of the VLMs under CP, registered with transformers' AttentionInterface.

Legend: q [B,Hq,S_loc,D], k/v [B,Hkv,S_loc,D] (GQA not expanded), output [B,S_loc,Hq,D].

``ContextParallelVLM`` selects ``CP_ATTENTION`` for the language model only (the vision tower
keeps its own attention) and passes a ``CPAttentionContext`` as the ``cpvlm_cp`` keyword of the
language model's forward; transformers hands that keyword to every attention call. Without it
(the model used on one device, generation) the function is exactly transformers' sdpa attention,
and the mask function registered under the same name is sdpa's, so the model stays usable.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from cpvlm.attention import cp_attention, impl_label, resolve_impl
from cpvlm.distributed.shard_plan import ShardPlan

CP_ATTENTION = "cpvlm_context_parallel"
"""The attention implementation name (no "flash" in it: transformers gives flash names special
treatment such as unpadding)."""


@dataclass(frozen=True)
class CPAttentionContext:
    """What the attention of one CP forward needs besides q, k, v: the plan, the CP group, and the
    ``cp_attention`` implementation with its options, passed through as they are."""

    plan: ShardPlan
    group: dist.ProcessGroup | None
    impl: str = "ring"
    options: Mapping[str, Any] = field(default_factory=dict)
    ran: set[str] = field(default_factory=set, compare=False)
    """Filled by the attention calls: the implementations they ran (``impl="auto"``: its picks)."""
    cp_rank: int | None = None  # default: this process's rank in ``group`` (checked if given)


def context_parallel_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    cpvlm_cp: CPAttentionContext | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    if cpvlm_cp is None:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    if dropout:
        raise ValueError(
            f"attention dropout {dropout} is not supported under context parallelism; set the "
            "text config's attention_dropout to 0"
        )
    if kwargs.get("sliding_window"):
        raise ValueError("sliding-window attention is not supported under context parallelism")
    # The plan's causal per-document mask replaces attention_mask (None here unless transformers
    # built one from a 2-D mask, which ContextParallelVLM never passes).
    plan = cpvlm_cp.plan
    options = dict(cpvlm_cp.options)
    impl, options["ulysses_size"] = resolve_impl(
        cpvlm_cp.impl, plan, True, query, key, options.get("ulysses_size")
    )
    cpvlm_cp.ran.add(impl_label(impl, options["ulysses_size"], plan.cp_size))
    out = cp_attention(
        query,
        key,
        value,
        plan=plan,
        group=cpvlm_cp.group,
        cp_rank=cpvlm_cp.cp_rank,
        impl=impl,
        causal=True,
        scale=scaling,
        **options,
    )
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(CP_ATTENTION, context_parallel_attention)
AttentionMaskInterface.register(CP_ATTENTION, sdpa_mask)
