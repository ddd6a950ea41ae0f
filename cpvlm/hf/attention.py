"""The text attention of the VLMs under CP, registered with transformers' AttentionInterface.

Legend: q [B,Hq,S_loc,D], k/v [B,Hkv,S_loc,D] (GQA not expanded), output [B,S_loc,Hq,D].

``ContextParallelVLM`` selects ``CP_ATTENTION`` for the language model only (the vision tower
keeps its own attention) and passes a ``CPAttentionContext`` as the ``cpvlm_cp`` keyword of the
language model's forward; transformers hands that keyword to every attention call. Without it
(the model used on one device, generation) the function is exactly transformers' sdpa attention,
and the mask function registered under the same name is sdpa's, so the model stays usable; in a
CP forward (``cp_forward``) it builds no mask.
"""

from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from cpvlm.attention import MaskSpec, cp_attention, impl_label, resolve_impl
from cpvlm.distributed.collectives import StepAgreement
from cpvlm.distributed.shard_plan import ShardPlan
from cpvlm.options import AttentionOptions

CP_ATTENTION = "cpvlm_context_parallel"
"""The attention implementation name (no "flash" in it: transformers gives flash names special
treatment such as unpadding)."""


@dataclass(frozen=True)
class CPAttentionContext:
    """What the attention of one CP forward needs besides q, k, v: the plan, the CP group, and the
    ``cp_attention`` options (its implementation and Ulysses size)."""

    plan: ShardPlan
    group: dist.ProcessGroup | None
    attention: AttentionOptions = AttentionOptions()
    step: StepAgreement | None = None  # the forward's agreement: layers after the first skip it
    ran: set[str] = field(default_factory=set, compare=False)
    """Filled by the attention calls: the implementations they ran (``impl="auto"``: its picks)."""
    cp_rank: int | None = None  # default: this process's rank in ``group`` (checked if given)
    spans: tuple[tuple[tuple[int, int], ...], ...] = ()
    """Per batch row, the global padded ``[start, stop)`` runs that attend bidirectionally (the
    images of a family with ``span_token_types``; ``PreparedBatch.spans``); () for none."""
    span_layers: str = "all"  # the spans apply on "all" layers or on the "sliding" ones only


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
    if kwargs.get("softcap") is not None:
        raise ValueError(
            "attention logit soft-capping is not supported under context parallelism; set the "
            "text config's attn_logit_softcapping to None"
        )
    # The plan's causal per-document mask, with the layer's window and the batch's spans,
    # replaces attention_mask (transformers' mask of the unwrapped model is not built under CP:
    # ContextParallelVLM passes attention_mask=None).
    plan = cpvlm_cp.plan
    outs = []
    for rows, mask in _masks(module, kwargs.get("sliding_window"), cpvlm_cp, query.shape[0]):
        q, k, v = (t if rows is None else t[rows[0] : rows[1]] for t in (query, key, value))
        chosen = cpvlm_cp.attention
        impl, ulysses_size = resolve_impl(chosen.impl, plan, mask, q, k, chosen.ulysses_size)
        cpvlm_cp.ran.add(impl_label(impl, ulysses_size, plan.cp_size))
        outs.append(
            cp_attention(
                q,
                k,
                v,
                plan=plan,
                group=cpvlm_cp.group,
                cp_rank=cpvlm_cp.cp_rank,
                impl=impl,
                mask=mask,
                scale=scaling,
                step=cpvlm_cp.step,
                ulysses_size=ulysses_size,
            )
        )
    out = outs[0] if len(outs) == 1 else torch.cat(outs)
    return out.transpose(1, 2).contiguous(), None


def _masks(module, window, ctx: CPAttentionContext, batch: int):
    """``[(rows, MaskSpec)]`` of one layer: the whole batch at once (rows None), or one
    call per batch row when the rows' spans differ (every rank makes the same calls: the spans
    come from the replicated batch).

    The rule is the model's own (transformers 5.24): ``window`` is the ``sliding_window`` the
    layer passes (its ``module.sliding_window``, None on full layers); a sliding layer sees
    ``sliding_window_overlay`` (``kv > q - w``, masking_utils.py) AND (causal OR same span), a
    full layer causal OR same span; the spans apply on every layer or on the sliding layers only
    (the adapter's ``span_layers``, read from each family's ``create_masks_for_vision_model``).
    """
    with_spans = bool(ctx.spans) and (ctx.span_layers == "all" or window is not None)
    rows = ctx.spans if with_spans else ((),) * batch
    if len(rows) != batch:
        raise ValueError(f"CPAttentionContext has spans of {len(rows)} rows, the batch {batch}")
    if all(r == rows[0] for r in rows):
        return [(None, MaskSpec(causal=True, window=window or None, spans=rows[0]))]
    return [
        ((b, b + 1), MaskSpec(causal=True, window=window or None, spans=r))
        for b, r in enumerate(rows)
    ]


_IN_CP_FORWARD: ContextVar[bool] = ContextVar("cpvlm_in_cp_forward", default=False)


@contextmanager
def cp_forward():
    """Within it (``ContextParallelVLM``'s decoder call), transformers builds no attention mask:
    ``context_parallel_mask`` returns None."""
    token = _IN_CP_FORWARD.set(True)
    try:
        yield
    finally:
        _IN_CP_FORWARD.reset(token)


def context_parallel_mask(*args, **kwargs) -> torch.Tensor | None:
    """sdpa's mask function (``sdpa_mask``), except in a CP forward (``cp_forward``): None there.

    The CP attention ignores ``attention_mask`` (the plan's mask replaces it), but transformers
    builds it before the first layer: for a family whose masks are not plain causal (sliding
    windows, image spans) sdpa's is a dense ``[B, 1, S_loc, S_loc]`` bool per mask kind: 1 GiB a
    kind at S_loc = 32k, 16 GiB at 128k, held by the step and never read."""
    return None if _IN_CP_FORWARD.get() else sdpa_mask(*args, **kwargs)


AttentionInterface.register(CP_ATTENTION, context_parallel_attention)
AttentionMaskInterface.register(CP_ATTENTION, context_parallel_mask)
