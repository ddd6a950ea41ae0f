"""Shared by the linear-attention tests: cases, the CP worker, and the one-process references.

Legend: B batch, P padded length, C = 2*Hk*K + Hv*V conv channels, W kernel width; "full"
tensors are [B, P, ...] in padded global order, shards are [B, S_loc, ...] in a rank's order.

The layer under test is what Qwen3.5's Gated DeltaNet does between its projections: a causal
depthwise conv with SiLU over the mixed q|k|v channels, then the gated delta rule with q/k l2
normalisation. The reference is transformers' own code on each document alone:
``causal_conv1d_fn`` (which computes in the weight dtype) and ``torch_chunk_gated_delta_rule``
with its float32 cast turned into float64 (``in_float64``), since a float64 comparison at 1e-10
needs a float64 reference of the same definition.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from cpvlm import ShardPlan
from cpvlm.attention.linear import cp_causal_conv1d, cp_gated_delta_rule
from cpvlm.hf.float64 import in_float64
from cpvlm.testing.attention_check import unshard


def case(doc_lens, *, b=1, hk=2, hv=4, dk=8, dv=6, width=4, chunk_size=64, seed=0, bias=True):
    return dict(
        doc_lens=list(doc_lens),
        b=b,
        hk=hk,
        hv=hv,
        dk=dk,
        dv=dv,
        width=width,
        chunk_size=chunk_size,
        seed=seed,
        bias=bias,
    )


def inputs(c, cp, dtype=torch.float64):
    """Full padded x, g, beta, upstream gradient, and the conv weight and bias.

    Padding positions hold random values too: the layer must ignore them, not rely on zeros.
    Decays g = -U(0.05, 1) * softplus(.) as Qwen3.5 forms them, beta in (0, 1).
    """
    plan = ShardPlan(sum(c["doc_lens"]), cp, doc_lens=c["doc_lens"])
    gen = torch.Generator().manual_seed(c["seed"])
    b, p, hv = c["b"], plan.padded_len, c["hv"]
    channels = 2 * c["hk"] * c["dk"] + hv * c["dv"]

    def rand(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    decay_rate = torch.rand(hv, generator=gen, dtype=torch.float64) * 0.95 + 0.05
    full = {
        "x": rand(b, p, channels),
        "g": -decay_rate * torch.nn.functional.softplus(rand(b, p, hv)),
        "beta": torch.sigmoid(rand(b, p, hv)),
        "dout": rand(b, p, hv, c["dv"]),
    }
    params = {
        "weight": rand(channels, c["width"]) * 0.5,
        "bias": rand(channels) if c["bias"] else None,
    }
    full = {k: v.to(dtype) for k, v in full.items()}
    params = {k: None if v is None else v.to(dtype) for k, v in params.items()}
    return plan, full, params


def split_qkv(mixed, c):
    b, s, _ = mixed.shape
    q, k, v = torch.split(mixed, [c["hk"] * c["dk"], c["hk"] * c["dk"], c["hv"] * c["dv"]], -1)
    return (
        q.reshape(b, s, c["hk"], c["dk"]),
        k.reshape(b, s, c["hk"], c["dk"]),
        v.reshape(b, s, c["hv"], c["dv"]),
    )


def cp_layer(x, weight, bias, g, beta, c, plan, group):
    mixed = cp_causal_conv1d(x, weight, bias, plan=plan, group=group, activation="silu")
    q, k, v = split_qkv(mixed, c)
    return cp_gated_delta_rule(
        q, k, v, g, beta, plan=plan, group=group, use_qk_l2norm=True, chunk_size=c["chunk_size"]
    )


def run_cases(rank, world_size, cases, dtype="float64"):
    """On each rank: shard, CP layer forward and backward; return out and gradients.

    Shards of out, dx, dg, dbeta, and this rank's contributions to dweight and dbias.
    """
    group, results = dist.group.WORLD, []
    for c in cases:
        plan, full, params = inputs(c, world_size, getattr(torch, dtype))
        x, g, beta = (
            plan.shard(full[n], rank).detach().requires_grad_() for n in ("x", "g", "beta")
        )
        weight = params["weight"].detach().requires_grad_()
        bias = None if params["bias"] is None else params["bias"].detach().requires_grad_()
        out = cp_layer(x, weight, bias, g, beta, c, plan, group)
        (out * plan.shard(full["dout"], rank)).sum().backward()
        grads = [x.grad, g.grad, beta.grad, weight.grad, None if bias is None else bias.grad]
        results.append([out.detach(), *grads])
    return results


def reference(c, cp, conv_fn, delta_fn, dtype=torch.float64):
    """One process, each document alone (unpadded): out, dx, dg, dbeta full padded; dw, dbias."""
    plan, full, params = inputs(c, cp, dtype)
    leaves = {n: full[n].detach().requires_grad_() for n in ("x", "g", "beta")}
    weight = params["weight"].detach().requires_grad_()
    bias = None if params["bias"] is None else params["bias"].detach().requires_grad_()
    out = torch.zeros_like(full["dout"])
    starts = [s for s, _ in plan._doc_starts]
    for start, n in zip(starts, plan.doc_lens):
        x, g, beta = (leaves[k][:, start : start + n] for k in ("x", "g", "beta"))
        mixed = conv_fn(x.transpose(1, 2), weight, bias, activation="silu").transpose(1, 2)
        q, k, v = split_qkv(mixed, c)
        o, _ = delta_fn(q, k, v, g=g, beta=beta, use_qk_l2norm_in_kernel=True)
        out[:, start : start + n] = o
    (out * full["dout"]).sum().backward()
    grads = [leaves[n].grad for n in ("x", "g", "beta")]
    return plan, [out.detach(), *grads, weight.grad, None if bias is None else bias.grad]


def naive_cp(c, cp):
    """The bug this layer rules out: each rank runs the one-process layer on its own shard as if
    it were a sequence (zero conv history, zero initial state). Returns the full padded output."""
    from transformers.models.qwen3_5 import modeling_qwen3_5 as hf

    delta = in_float64(hf.torch_chunk_gated_delta_rule)
    plan, full, params = inputs(c, cp)
    shards = []
    for rank in range(cp):
        x, g, beta = (plan.shard(full[n], rank) for n in ("x", "g", "beta"))
        mixed = hf.causal_conv1d_fn(x.transpose(1, 2), params["weight"], params["bias"], "silu")
        q, k, v = split_qkv(mixed.transpose(1, 2), c)
        shards.append(delta(q, k, v, g=g, beta=beta, use_qk_l2norm_in_kernel=True)[0])
    return plan, unshard(plan, shards, seq_dim=1)


def no_grad_and_grad_outputs(rank, world_size, c):
    plan, full, params = inputs(c, world_size)
    x, g, beta = (plan.shard(full[n], rank) for n in ("x", "g", "beta"))
    args = (x, params["weight"], params["bias"], g, beta, c, plan, dist.group.WORLD)
    with torch.no_grad():
        no_grad = cp_layer(*args)
    return no_grad, cp_layer(*args).detach()
