"""The gated delta rule under CP: per-chunk affine maps, a scan across ranks, outputs from true states.

Legend: B batch, L = S_loc local length, Hk/Hv key/value heads (each key head serves Hv/Hk value
heads), K/V key/value head dims, W = cp_size, N = B * 2 * n_docs chunks on a rank, state S [K, V]
per head. The recurrence itself is in ``kernel.py``.

A chunk's recurrence is affine in its initial state: S_out = A S_in + B, with A [K, K] (dense:
the gates and the delta rule's rank-one corrections) and B [K, V] from the chunk alone; so is
each output, o_t = o_B,t + o_A,t S_in. One run of the local kernel per chunk with value width
V + K, from the initial state [0 | I] and values [v | 0], gives all four ([B | A] as the final
state, [o_B | o_A] as the output), for every chunk of every rank in parallel. One all-gather
gives every rank every chunk's map; each rank scans the 2W chunks of each document in global
order (from 0 at the document start) up to its own chunks, and its outputs are o_B + o_A S_in.

Backward, by recomputation under autograd (nothing of the kernel pass is kept from the forward):
the pass is rerun on the saved raw inputs; o = o_B + o_A S_in with the saved states as leaves
gives dS_in of every local chunk; the scan, rerun under autograd on the gathered maps, turns dS_in
into gradients of every chunk's (A, B); a reduce-scatter sums them at the chunks' owners; one
backward through the kernel pass with both cotangents (outputs and maps) gives the input
gradients. Saved per layer: the raw inputs, the local initial states and the gathered maps.

Bytes per rank and layer (elements; B rows, n_docs documents, compute dtype float32 or float64):
forward all-gather receives (W-1) * 2 * n_docs * B * Hv * K * (K + V); the backward's
reduce-scatter moves the same. The conv halo (conv.py) is separate. The maps grow with the number
of documents, not their length: many short documents move more map bytes than tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch
import torch.distributed as dist
from torch.autograd.function import once_differentiable

from cpvlm.attention.linear.kernel import DeltaRuleKernel, chunk_gated_delta_rule
from cpvlm.attention.linear.layout import chunk_owner, local_chunks
from cpvlm.distributed.collectives import (
    all_gather_dim0,
    ensure_requires_grad_for_cp_collective,
    reduce_scatter_dim0,
)
from cpvlm.distributed.shard_plan import ShardPlan


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 stays float64; everything else runs in float32 (as transformers' torch path)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


@dataclass(frozen=True)
class _Layout:
    """The local chunks of all rows as kernel segments, and as equal-length groups."""

    cu_seqlens: torch.Tensor  # [N+1] the chunks of every row, rows laid end to end
    groups: tuple[tuple[torch.Tensor, torch.Tensor], ...]  # (rows [n*c], chunks [n]) per length
    real: torch.Tensor  # [L] bool, False at padding positions


@lru_cache(maxsize=64)
def _layout(plan: ShardPlan, cp_rank: int, batch: int) -> _Layout:
    chunks = local_chunks(plan, cp_rank)
    lengths = [ch.length for ch in chunks] * batch
    by_length: dict[int, list[tuple[int, int]]] = {}
    for b in range(batch):
        for i, ch in enumerate(chunks):
            by_length.setdefault(ch.length, []).append(
                (b * len(chunks) + i, b * plan.local_len + ch.local_start)
            )
    groups = tuple(
        (
            (torch.tensor([s for _, s in items])[:, None] + torch.arange(c)).flatten(),
            torch.tensor([i for i, _ in items]),
        )
        for c, items in by_length.items()
    )
    return _Layout(
        cu_seqlens=torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()]),
        groups=groups,
        real=~plan.is_padding[plan.indices(cp_rank)],
    )


def _prepare(q, k, v, g, beta, *, scale, l2norm):
    """Raw [B,L,H,D] inputs -> the kernel's flat [B*L, Hv, D] stream in the compute dtype."""
    dtype = compute_dtype(q.dtype)
    rep = v.shape[2] // k.shape[2]
    q, k = (x.to(dtype).repeat_interleave(rep, dim=2) for x in (q, k))
    if l2norm:
        # transformers' l2norm (the FLA convention): x / sqrt(sum x^2 + 1e-6).
        q, k = (x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6) for x in (q, k))
    q = q * scale
    return [x.to(dtype).flatten(0, 1) for x in (q, k, v, g, beta)]


def _affine_pass(kernel, cu, q, k, v, g, beta):
    """The kernel from [0 | I] on values [v | 0]: outputs [T, Hv, V + K] and maps [N, Hv, K, V + K].

    Both are affine in a chunk's initial state S0: the true output is o[:, :, :V] + o[:, :, V:] S0
    and the true final state is maps[..., :V] + maps[..., V:] S0 = B + A S0.
    """
    dk, dv = k.shape[-1], v.shape[-1]
    v_aug = torch.cat([v, v.new_zeros(*v.shape[:2], dk)], dim=-1)
    eye = torch.eye(dk, dtype=v.dtype, device=v.device)
    start = torch.cat([v.new_zeros(dk, dv), eye], dim=-1)
    start = start.expand(len(cu) - 1, v.shape[1], dk, dv + dk).contiguous()
    return kernel(q, k, v_aug, g, beta, initial_state=start, cu_seqlens=cu)


def _scan(maps_all: torch.Tensor, plan: ShardPlan, cp_rank: int, batch: int, dv: int):
    """True initial states of this rank's chunks from every chunk's [B | A]: [N, Hv, K, V].

    ``maps_all`` is [W * N, ...], rank by rank, each in that rank's local chunk order.
    """
    w, n_docs = plan.cp_size, len(plan.doc_lens)
    maps = maps_all.view(w, batch, n_docs, 2, *maps_all.shape[1:])
    state = maps_all.new_zeros(batch, n_docs, *maps_all.shape[1:3], dv)
    starts = {}
    for j in range(2 * w - cp_rank):
        if j in (cp_rank, 2 * w - 1 - cp_rank):
            starts[j] = state
        rank, slot = chunk_owner(j, w)
        if j < 2 * w - 1 - cp_rank:
            b_map, a_map = maps[rank, :, :, slot, ..., :dv], maps[rank, :, :, slot, ..., dv:]
            state = a_map @ state + b_map
    # Local order: per row, per document, head then tail.
    return torch.stack([starts[cp_rank], starts[2 * w - 1 - cp_rank]], dim=2).flatten(0, 2)


def _outputs(o_aug: torch.Tensor, states: torch.Tensor, layout: _Layout, shape) -> torch.Tensor:
    """o = o_B + o_A S0 per chunk -> [B, L, Hv, V], 0 at padding."""
    dv, heads, dk = shape[-1], o_aug.shape[1], o_aug.shape[2] - shape[-1]
    o = o_aug[..., :dv]
    for rows, chunks in layout.groups:
        rows, chunks = rows.to(o.device), chunks.to(o.device)
        o_a = o_aug[..., dv:].index_select(0, rows).view(len(chunks), -1, heads, dk)
        fix = torch.einsum("nchk,nhkv->nchv", o_a, states.index_select(0, chunks))
        o = o.index_add(0, rows, fix.flatten(0, 1))
    return o.view(shape) * layout.real.to(o.device).view(1, -1, 1, 1).to(o.dtype)


class _CPDeltaRule(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, g, beta, plan, group, rank, kernel, scale, l2norm):
        layout = _layout(plan, rank, q.shape[0])
        prepared = _prepare(q, k, v, g, beta, scale=scale, l2norm=l2norm)
        o_aug, maps = _affine_pass(kernel, layout.cu_seqlens, *prepared)
        maps_all = all_gather_dim0(maps, group)
        states = _scan(maps_all, plan, rank, q.shape[0], v.shape[-1])
        o = _outputs(o_aug, states, layout, v.shape)
        if any(ctx.needs_input_grad[:5]):
            ctx.save_for_backward(q, k, v, g, beta, states, maps_all)
        ctx.args = (plan, group, rank, kernel, scale, l2norm, layout)
        return o.to(v.dtype)

    @staticmethod
    @once_differentiable
    def backward(ctx, dout):
        q, k, v, g, beta, states, maps_all = ctx.saved_tensors
        plan, group, rank, kernel, scale, l2norm, layout = ctx.args
        with torch.enable_grad():
            raw = [x.detach().requires_grad_() for x in (q, k, v, g, beta)]
            o_aug, maps = _affine_pass(
                kernel, layout.cu_seqlens, *_prepare(*raw, scale=scale, l2norm=l2norm)
            )
            o_leaf, s0 = o_aug.detach().requires_grad_(), states.detach().requires_grad_()
            o = _outputs(o_leaf, s0, layout, v.shape)
            d_o_aug, d_s0 = torch.autograd.grad(o, [o_leaf, s0], dout.to(o.dtype))
            gathered = maps_all.detach().requires_grad_()
            (d_maps_all,) = torch.autograd.grad(
                _scan(gathered, plan, rank, q.shape[0], v.shape[-1]), gathered, d_s0
            )
            # Every rank's scan read every rank's maps: a map's gradient is the sum over ranks.
            d_maps = reduce_scatter_dim0(d_maps_all.contiguous(), group)
            grads = torch.autograd.grad([o_aug, maps], raw, [d_o_aug, d_maps], allow_unused=True)
        return (*grads, *([None] * 6))


def cp_gated_delta_rule(
    q_BLHK: torch.Tensor,
    k_BLHK: torch.Tensor,
    v_BLHV: torch.Tensor,
    g_BLH: torch.Tensor,
    beta_BLH: torch.Tensor,
    *,
    plan: ShardPlan,
    group: dist.ProcessGroup | None,
    scale: float | None = None,
    use_qk_l2norm: bool = False,
    chunk_size: int = 64,
    kernel: DeltaRuleKernel | None = None,
) -> torch.Tensor:
    """Exact gated delta rule of this rank's shard, each document from a zero state.

    Args:
        q_BLHK, k_BLHK: ``[B, L, Hk, K]``; v_BLHV: ``[B, L, Hv, V]`` with Hv a multiple of Hk;
            g_BLH: log decay (<= 0) and beta_BLH: write strength, ``[B, L, Hv]``. This rank's
            shard of ``plan``, as transformers' ``torch_chunk_gated_delta_rule`` takes them.
        plan: the layout every rank of ``group`` shares; the recurrence restarts at every
            document start.
        group: the CP group (``None``: the default group).
        scale: query scale, default ``K ** -0.5`` (applied after the l2 norm).
        use_qk_l2norm: l2-normalise q and k first (Qwen3.5's ``use_qk_l2norm_in_kernel=True``).
        chunk_size: rows per kernel chunk of the default kernel.
        kernel: a local kernel with ``kernel.DeltaRuleKernel``'s signature (default: cpvlm's
            plain-torch ``chunk_gated_delta_rule``).

    Returns ``[B, L, Hv, V]`` in v's dtype, computed in float64 for float64 inputs and float32
    otherwise; 0 at padding positions. Every rank of the group must call this with the same plan,
    shapes and dtype, forward and backward.
    """
    _check(q_BLHK, k_BLHK, v_BLHV, g_BLH, beta_BLH, plan, group, chunk_size)
    rank = dist.get_rank(group)
    if scale is None:
        scale = q_BLHK.shape[-1] ** -0.5
    if kernel is None:

        def kernel(*args, **kwargs):
            return chunk_gated_delta_rule(*args, chunk_size=chunk_size, **kwargs)

    inputs = (q_BLHK, k_BLHK, v_BLHV, g_BLH, beta_BLH)
    if torch.is_grad_enabled():
        # A rank whose inputs do not require grad would skip the backward reduce-scatter.
        inputs = tuple(ensure_requires_grad_for_cp_collective(x) for x in inputs)
    return _CPDeltaRule.apply(*inputs, plan, group, rank, kernel, float(scale), use_qk_l2norm)


def _check(q, k, v, g, beta, plan, group, chunk_size) -> None:
    op = "cp_gated_delta_rule"
    if not isinstance(plan, ShardPlan):
        raise ValueError(f"{op}: plan must be a ShardPlan, got {type(plan).__name__}")
    if dist.get_world_size(group) != plan.cp_size:
        raise ValueError(
            f"{op}: the group has {dist.get_world_size(group)} ranks but the plan has "
            f"cp_size={plan.cp_size}"
        )
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"{op}: chunk_size must be a positive int, got {chunk_size!r}")
    named = {"q": q, "k": k, "v": v, "g": g, "beta": beta}
    for name, x in named.items():
        want = 3 if name in ("g", "beta") else 4
        if not isinstance(x, torch.Tensor) or x.dim() != want or not x.is_floating_point():
            shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"{op}: {name} must be a floating {want}-d tensor, got {shape}")
    b, s, hk, dk = q.shape
    hv = v.shape[2]
    if s != plan.local_len:
        raise ValueError(
            f"{op}: the shard has {s} positions but {plan!r} gives each rank "
            f"local_len={plan.local_len} (pad and shard with the plan first)"
        )
    if tuple(k.shape) != (b, s, hk, dk) or v.shape[:2] != (b, s):
        raise ValueError(
            f"{op}: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} must agree on "
            "[B, L] and q, k on heads and head dim"
        )
    if hv % hk:
        raise ValueError(f"{op}: value heads ({hv}) must be a multiple of key heads ({hk})")
    for name in ("g", "beta"):
        if tuple(named[name].shape) != (b, s, hv):
            raise ValueError(
                f"{op}: {name} must be [B, L, Hv] = {(b, s, hv)}, got {tuple(named[name].shape)}"
            )
    devices = {x.device for x in named.values()}
    if len(devices) > 1:
        raise ValueError(f"{op}: all inputs must be on one device, got {sorted(map(str, devices))}")
