"""Shared by the attention tests: cases, the worker that runs them on gloo ranks, the reference.

Legend: B batch, H heads, P padded length, D head dim; "full" tensors are [B,H,P,D] in padded
global order, shards are [B,H,S_loc,D] in a rank's local order.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from cpvlm import ShardPlan
from cpvlm.attention import cp_attention
from cpvlm.testing import rel_err
from cpvlm.testing.attention_check import unshard

DTYPES = {"float64": torch.float64, "float32": torch.float32, "bfloat16": torch.bfloat16}


def case(
    doc_lens,
    impl,
    causal,
    hq=8,
    hkv=2,
    d=32,
    dtype="float64",
    b=2,
    seed=0,
    scale=None,
    layout="head_tail",
    ulysses_size=None,
):
    return dict(
        doc_lens=list(doc_lens),
        impl=impl,
        causal=causal,
        hq=hq,
        hkv=hkv,
        d=d,
        dtype=dtype,
        b=b,
        seed=seed,
        scale=scale,
        layout=layout,
        ulysses_size=ulysses_size,
    )


def inputs(c, cp):
    """Full padded q, k, v and the upstream gradient g, rounded to the case dtype.

    Padding positions hold random values too: the kernel must ignore them, not rely on zeros.
    """
    plan = ShardPlan(sum(c["doc_lens"]), cp, doc_lens=c["doc_lens"], layout=c["layout"])
    gen = torch.Generator().manual_seed(c["seed"])
    b, p, d = c["b"], plan.padded_len, c["d"]
    shapes = [(b, c["hq"], p, d), (b, c["hkv"], p, d), (b, c["hkv"], p, d), (b, c["hq"], p, d)]
    dtype = DTYPES[c["dtype"]]
    return plan, [torch.randn(s, generator=gen, dtype=torch.float64).to(dtype) for s in shapes]


def run_cases(rank, world_size, cases, cp=None):
    """On each rank: shard, cp_attention forward and backward, return out and grads (shards).

    ``cp`` < world_size splits the world into CP groups of ``cp`` consecutive ranks.
    """
    group, cp_rank, cp = dist.group.WORLD, rank, cp or world_size
    if cp != world_size:
        groups = [dist.new_group(list(range(s, s + cp))) for s in range(0, world_size, cp)]
        group, cp_rank = groups[rank // cp], rank % cp
    results = []
    for c in cases:
        plan, (q, k, v, g) = inputs(c, cp)
        q_loc, k_loc, v_loc = (
            plan.shard(t, cp_rank, seq_dim=2).detach().requires_grad_() for t in (q, k, v)
        )
        out = cp_attention(
            q_loc,
            k_loc,
            v_loc,
            plan=plan,
            cp_rank=cp_rank,
            group=group,
            impl=c["impl"],
            causal=c["causal"],
            scale=c["scale"],
            ulysses_size=c["ulysses_size"],
        )
        (out * plan.shard(g, cp_rank, seq_dim=2)).sum().backward()
        results.append([t.detach() for t in (out, q_loc.grad, k_loc.grad, v_loc.grad)])
    return results


def dense_mask(plan, causal):
    """[P, P] bool: i sees j iff same document, neither is padding, and (not causal or j <= i)."""
    doc = plan.doc_ids
    pos = torch.arange(plan.padded_len)
    mask = (doc[:, None] == doc[None, :]) & (doc[:, None] >= 0)
    if causal:
        mask &= pos[None, :] <= pos[:, None]
    return mask


def real_mask(doc_lens, causal):
    """[S, S] bool on the real tokens in order, from the document lengths alone (not the plan):
    i sees j iff same document and (not causal or j <= i)."""
    doc = torch.repeat_interleave(torch.arange(len(doc_lens)), torch.tensor(doc_lens))
    mask = doc[:, None] == doc[None, :]
    if causal:
        mask &= torch.ones_like(mask).tril()
    return mask


def reference(c, cp):
    """out, dq, dk, dv on one process: SDPA on the real tokens with the dense mask, in float64.

    Returned as full padded tensors with zeros at padding: the outputs there must be zero (finite)
    and no gradient may reach a padding position or come from one.
    """
    plan, tensors = inputs(c, cp)
    q, k, v, g = (t.double() for t in tensors)
    real = plan.padded_index
    q_r, k_r, v_r = (t[:, :, real].clone().requires_grad_() for t in (q, k, v))
    rep = c["hq"] // c["hkv"]
    out = F.scaled_dot_product_attention(
        q_r,
        k_r.repeat_interleave(rep, 1),
        v_r.repeat_interleave(rep, 1),
        attn_mask=real_mask(c["doc_lens"], c["causal"]),
        scale=c["scale"],
    )
    (out * g[:, :, real]).sum().backward()
    full = []
    for t, like in ((out, q), (q_r.grad, q), (k_r.grad, k), (v_r.grad, v)):
        f = torch.zeros_like(like)
        f[:, :, real] = t.detach()
        full.append(f)
    return plan, full


def run_and_reference(rank, world_size, cases):
    """``run_cases`` on every rank, and the one-process reference of every world_size-th case
    (rank r takes cases r, r + world_size, ...): the references run in parallel, one thread each."""
    refs = {i: reference(c, world_size)[1] for i, c in enumerate(cases) if i % world_size == rank}
    return run_cases(rank, world_size, cases), refs


def errors(cases, ranks, cp):
    """Yield (case, name, error, padding exact) from ``run_distributed(run_and_reference, ...)``.

    The error is relative, except for a gradient that is mathematically zero (every document of
    one token: a softmax over a single key has no gradient), where both sides hold round-off noise
    of ~1e-17 and the absolute error is the meaningful figure.
    """
    refs = {i: ref for _, part in ranks for i, ref in part.items()}
    for i, c in enumerate(cases):
        plan = ShardPlan(sum(c["doc_lens"]), cp, doc_lens=c["doc_lens"], layout=c["layout"])
        for j, name in enumerate(("out", "dq", "dk", "dv")):
            got, expected = unshard(plan, [results[i][j] for results, _ in ranks]), refs[i][j]
            padding_zero = bool(torch.all(got[:, :, plan.is_padding] == 0))
            if max(c["doc_lens"]) == 1 and name in ("dq", "dk"):
                err = (got.double() - expected.double()).abs().max().item()
            else:
                err = rel_err(got, expected)
            yield c, name, err, padding_zero
