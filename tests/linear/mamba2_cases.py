"""Shared by the Mamba-2 tests: a tiny NemotronH Mamba-2 mixer, the CP worker, the reference.

Legend: B batch, P padded length, D hidden size; "full" tensors are [B, P, ...] in padded global
order, shards are [B, S_loc, ...] in a rank's order.

The layer under test is transformers' ``NemotronHMamba2Mixer`` itself (built from a tiny
``NemotronHConfig``, every parameter random): the CP side runs ``cp_mamba2_mixer`` on it, the
reference runs its unmodified forward on each document alone, under ``in_float64`` (its float32
casts kept in float64, cpvlm/attention/linear/mamba2.py lists them), since a float64 comparison
at 1e-10 needs a float64 reference of the same definition.
"""

from __future__ import annotations

from contextlib import nullcontext
from unittest import mock

import torch
import torch.distributed as dist

from cpvlm import ShardPlan
from cpvlm.attention.linear import cp_mamba2_mixer, ssd
from cpvlm.hf.float64 import in_float64


def case(doc_lens, *, b=2, heads=4, head_dim=3, groups=2, state=5, width=4, chunk_size=4,
         limit=(0.0, float("inf")), bias=True, seed=0):  # fmt: skip
    return dict(
        doc_lens=list(doc_lens),
        b=b,
        heads=heads,
        head_dim=head_dim,
        groups=groups,
        state=state,
        width=width,
        chunk_size=chunk_size,
        limit=limit,
        bias=bias,
        seed=seed,
    )


def mixer(c, dtype=torch.float64):
    """The tiny mixer, every parameter drawn from the case's seed (the same on every rank)."""
    from transformers import NemotronHConfig
    from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHMamba2Mixer

    config = NemotronHConfig(
        hidden_size=16,
        num_hidden_layers=1,
        layer_types=["mamba"],
        vocab_size=32,
        mamba_num_heads=c["heads"],
        mamba_head_dim=c["head_dim"],
        n_groups=c["groups"],
        ssm_state_size=c["state"],
        conv_kernel=c["width"],
        chunk_size=c["chunk_size"],
        time_step_limit=c["limit"],
        use_bias=c["bias"],
        use_conv_bias=c["bias"],
    )
    layer = NemotronHMamba2Mixer(config, layer_idx=0)
    gen = torch.Generator().manual_seed(c["seed"])
    with torch.no_grad():
        for name, p in layer.named_parameters():
            value = torch.randn(p.shape, generator=gen, dtype=torch.float64)
            if name == "A_log":  # decays exp(-exp(A_log) dt) in (0, 1), some near 1, some not
                value = torch.linspace(-1.5, 1.0, p.numel(), dtype=torch.float64)
            elif name == "conv1d.weight":
                value = value * 0.5
            elif name in ("in_proj.weight", "out_proj.weight"):
                value = value * 0.4
            p.copy_(value)
    return layer.to(dtype).train()


def inputs(c, cp, dtype=torch.float64):
    """The plan, full padded hidden states and upstream gradient (random at padding too)."""
    plan = ShardPlan(sum(c["doc_lens"]), cp, doc_lens=c["doc_lens"])
    gen = torch.Generator().manual_seed(c["seed"] + 1000)
    shape = (c["b"], plan.padded_len, 16)
    hidden = torch.randn(shape, generator=gen, dtype=torch.float64)
    dout = torch.randn(shape, generator=gen, dtype=torch.float64)
    return plan, hidden.to(dtype), dout.to(dtype)


def _zero_states(maps_all, plan, cp_rank, batch):
    """What a CP wrapper that does not carry the state gives every piece: zeros."""
    n = maps_all.shape[0] // plan.cp_size
    return maps_all.new_zeros(n, maps_all.shape[1], maps_all.shape[2] - 1)


def run_cases(rank, world_size, cases, dtype="float64", carry=True):
    """On each rank: shard, CP mixer forward and backward. Returns per case the output shard, the
    input gradient shard and this rank's share of every parameter gradient.

    ``carry=False``: the same computation with each piece's initial state zero (the conv halo
    still exchanged), the bug the exactness check must catch."""
    group, results = dist.group.WORLD, []
    for c in cases:
        layer = mixer(c, getattr(torch, dtype))
        plan, hidden, dout = inputs(c, world_size, getattr(torch, dtype))
        x = plan.shard(hidden, rank).detach().requires_grad_()
        patch = nullcontext() if carry else mock.patch.object(ssd, "_piece_states", _zero_states)
        with patch:
            out = cp_mamba2_mixer(layer, x, plan=plan, group=group)
        (out * plan.shard(dout, rank)).sum().backward()
        grads = {n: p.grad.detach().clone() for n, p in layer.named_parameters()}
        results.append((out.detach(), x.grad.detach(), grads))
    return results


def reference(c, cp, dtype=torch.float64):
    """The unmodified mixer on each document alone (unpadded, zero state): the full padded output
    and input gradient (0 at padding) and every parameter's gradient."""
    layer = mixer(c, dtype)
    plan, hidden, dout = inputs(c, cp, dtype)
    forward = in_float64(layer) if dtype == torch.float64 else layer
    leaf = hidden.detach().requires_grad_()
    out = torch.zeros_like(hidden)
    for (start, _), n in zip(plan._doc_starts, plan.doc_lens):
        out[:, start : start + n] = forward(leaf[:, start : start + n])
    (out * dout).sum().backward()
    grads = {n: p.grad.detach().clone() for n, p in layer.named_parameters()}
    return plan, out.detach(), leaf.grad.detach(), grads


def no_grad_and_grad_outputs(rank, world_size, c):
    layer = mixer(c)
    plan, hidden, _ = inputs(c, world_size)
    x = plan.shard(hidden, rank)
    with torch.no_grad():
        no_grad = cp_mamba2_mixer(layer, x, plan=plan, group=dist.group.WORLD)
    return no_grad, cp_mamba2_mixer(layer, x, plan=plan, group=dist.group.WORLD).detach()
