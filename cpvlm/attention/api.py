"""``cp_attention``: context-parallel attention over a ShardPlan, checked, then dispatched.

Legend: q [B,Hq,S_loc,D], k/v [B,Hkv,S_loc,D] (Hq a multiple of Hkv), S_loc = plan.local_len.
Implementations: ring, all-gather (K/V moved, queries stay), Ulysses (heads moved, the sequence
gathered), hybrid (Ulysses in groups x ring across), and auto (one of them, by a cost model).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch.profiler import record_function

from cpvlm.attention.allgather import allgather_attention
from cpvlm.attention.cost import Shapes, choose_impl
from cpvlm.attention.hybrid import hybrid_attention
from cpvlm.attention.mask_spec import MaskSpec, as_mask
from cpvlm.attention.ring import ring_attention
from cpvlm.attention.schedule import attention_schedule
from cpvlm.attention.ulysses import ulysses_attention
from cpvlm.constants import ATTN_IMPLS
from cpvlm.distributed.collectives import (
    StepAgreement,
    agree,
    ensure_requires_grad_for_cp_collective,
)
from cpvlm.distributed.shard_plan import ShardPlan
from cpvlm.options import check_ulysses_size

_BY_SCHEDULE = {"ring": ring_attention, "allgather": allgather_attention}


def cp_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    plan: ShardPlan,
    group: dist.ProcessGroup | None,
    cp_rank: int | None = None,
    impl: str = "ring",
    causal: bool | None = None,
    scale: float | None = None,
    ulysses_size: int | None = None,
    step: StepAgreement | None = None,
    mask: MaskSpec | None = None,
) -> torch.Tensor:
    """Exact attention of this rank's shard of queries over the whole (sharded) sequence.

    Token i sees token j iff both lie in the same document of ``plan`` and ``mask`` lets i see j
    (``cpvlm.attention.mask_spec``: causal or not, a sliding window, bidirectional spans), on
    global padded positions. Padding positions are never seen by real tokens; their own outputs
    are 0 and send no gradient anywhere. K/V keep their Hkv heads on the wire.

    Args:
        q: ``[B, Hq, S_loc, D]``; k, v: ``[B, Hkv, S_loc, D]``, this rank's shard from ``plan``.
        plan: the layout every rank of ``group`` shares.
        group: the CP process group (``None``: the default group).
        cp_rank: this rank's index in ``group``; derived from the group when omitted.
        impl: ``"ring"`` (K/V passed around, overlapped with compute), ``"allgather"`` (K/V
            gathered once), ``"ulysses"`` (an all-to-all gives each rank some heads over the
            whole sequence; any head count), ``"hybrid"`` (Ulysses inside groups of
            ``ulysses_size`` consecutive ranks, a ring across them) or ``"auto"`` (the one
            ``cpvlm.attention.cost.choose_impl`` estimates fastest for these shapes).
        causal: ``mask=None``: causal (True, the default) or bidirectional within each
            document, i.e. ``MaskSpec(causal=causal)``; with a mask it may be omitted, and
            must equal ``mask.causal`` if given.
        scale: score scale, default ``D ** -0.5``.
        ulysses_size: ``"hybrid"`` only: ranks per Ulysses group, a divisor of the group size.
        step: the CP step of a model forward (see ``StepAgreement``): once its first collective
            agreed on the plan, the decoder layers' calls skip their own agreement.
        mask: the mask within each document (window, spans); None: ``MaskSpec(causal)``.

    Every rank of the group must call this with the same plan, impl, mask, shapes and dtype,
    forward and backward: the collectives are matched rank to rank. The ranks check that first
    (one small all-reduce), so a rank with other inputs makes every rank raise the same error.
    """
    if cp_rank is None:
        cp_rank = dist.get_rank(group)
    q, k, v = _autocast_inputs(q, k, v)
    try:
        mask = as_mask(mask, causal)
        facts, error = _check(q, k, v, plan, cp_rank, group, impl, mask, scale), None
        # The rule of every entry point's options (cpvlm.options), in impl's name.
        check_ulysses_size(impl, ulysses_size, plan.cp_size, attn_name="impl", where="cp_attention")
        facts["ulysses_size"] = ulysses_size
    except ValueError as err:
        facts, error = {}, str(err)
    agree("cp_attention", group, facts, error=error, step=step, follows_from_step=True)
    if scale is None:
        scale = q.shape[-1] ** -0.5
    impl, ulysses_size = resolve_impl(impl, plan, mask, q, k, ulysses_size)
    # A rank whose inputs happen not to require grad would skip the backward collectives and hang
    # the others; grad mode is the same everywhere, so it decides.
    q, k, v = (ensure_requires_grad_for_cp_collective(t) for t in (q, k, v))
    kw = dict(cp_rank=cp_rank, group=group, scale=scale)
    # Inputs are cast already (``_autocast_inputs``), as SDPA takes them.
    with record_function("cpvlm.attention"), torch.autocast(q.device.type, enabled=False):
        if impl in _BY_SCHEDULE:
            return _BY_SCHEDULE[impl](q, k, v, schedule=attention_schedule(plan, mask), **kw)
        if impl == "ulysses":
            return ulysses_attention(q, k, v, plan=plan, mask=mask, **kw)
        return hybrid_attention(q, k, v, plan=plan, mask=mask, ulysses_size=ulysses_size, **kw)


def resolve_impl(
    impl: str,
    plan: ShardPlan,
    mask: MaskSpec | bool,
    q: torch.Tensor,
    k: torch.Tensor,
    ulysses_size: int | None = None,
) -> tuple[str, int | None]:
    """The (impl, ulysses_size) that ``cp_attention`` runs for these inputs: ``impl="auto"``
    becomes ``choose_impl``'s pick (the same on every rank: a pure function of the plan, the
    mask, the shapes and the dtype); any other impl is returned as it is. ``mask``: a MaskSpec,
    or a bool for ``MaskSpec(causal=mask)``."""
    if impl != "auto":
        return impl, ulysses_size
    shapes = Shapes(q.shape[0], q.shape[1], k.shape[1], q.shape[3], q.dtype)
    return choose_impl(plan, mask, shapes, q.device.type)


def impl_label(impl: str, ulysses_size: int | None, cp_size: int) -> str:
    """How reports name an implementation: ``"ring"``, ..., ``"hybrid 2x4"`` (Ulysses x ring)."""
    return impl if impl != "hybrid" else f"hybrid {ulysses_size}x{cp_size // ulysses_size}"


def _autocast_inputs(q, k, v):
    """Under ``torch.autocast``, q, k, v in its dtype, as ``scaled_dot_product_attention``
    takes them (a model's q and k may leave their norms in float32, v its projection in bf16)."""
    if not isinstance(q, torch.Tensor) or not torch.is_autocast_enabled(q.device.type):
        return q, k, v
    dtype = torch.get_autocast_dtype(q.device.type)
    return tuple(t.to(dtype) if isinstance(t, torch.Tensor) else t for t in (q, k, v))


def _check(q, k, v, plan, cp_rank, group, impl, mask: MaskSpec, scale) -> dict:
    """Raise ValueError naming what is wrong; else the facts every rank must share."""
    if impl not in ATTN_IMPLS:
        raise ValueError(f"cp_attention: impl must be one of {list(ATTN_IMPLS)}, got {impl!r}")
    if not isinstance(plan, ShardPlan):
        raise ValueError(f"cp_attention: plan must be a ShardPlan, got {type(plan).__name__}")
    group_size = dist.get_world_size(group)
    if group_size != plan.cp_size:
        raise ValueError(
            f"cp_attention: the group has {group_size} ranks but the plan has cp_size={plan.cp_size}"
        )
    group_rank = dist.get_rank(group)
    if cp_rank != group_rank:
        raise ValueError(
            f"cp_attention: cp_rank={cp_rank!r} but this process is rank {group_rank} of the group"
        )
    mask.check(plan)
    if scale is not None and (
        isinstance(scale, bool)
        or not isinstance(scale, (int, float))
        or not math.isfinite(scale)
        or scale <= 0
    ):
        raise ValueError(f"cp_attention: scale must be a positive finite number, got {scale!r}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(
                f"cp_attention: {name} must be a 4-d [B, H, S_loc, D] tensor, got {shape}"
            )
    if not q.is_floating_point() or q.dtype != k.dtype or q.dtype != v.dtype:
        raise ValueError(
            f"cp_attention: q, k, v must share one floating dtype, got {q.dtype}, {k.dtype}, {v.dtype}"
        )
    if q.device != k.device or q.device != v.device:
        raise ValueError(
            f"cp_attention: q, k, v must be on one device, got {q.device}, {k.device}, {v.device}"
        )
    if k.shape != v.shape:
        raise ValueError(
            f"cp_attention: k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}"
        )
    (b, hq, s, d), (bk, hkv, sk, dk) = q.shape, k.shape
    if b != bk or d != dk:
        raise ValueError(
            f"cp_attention: q {tuple(q.shape)} and k {tuple(k.shape)} must agree on batch and head dim"
        )
    if hkv == 0 or hq % hkv:
        raise ValueError(
            f"cp_attention: query heads ({hq}) must be a multiple of key/value heads ({hkv})"
        )
    if s != plan.local_len or sk != plan.local_len:
        raise ValueError(
            f"cp_attention: q has {s} and k {sk} positions but {plan!r} gives each rank "
            f"local_len={plan.local_len} (pad and shard with the plan first)"
        )
    return {
        "plan": (plan.cp_size, plan.doc_lens),
        "impl": impl,
        **mask.facts(),
        "scale": scale,
        "q shape": tuple(q.shape),
        "k shape": tuple(k.shape),
        "dtype": q.dtype,
    }
