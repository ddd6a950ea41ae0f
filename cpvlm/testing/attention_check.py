"""CP attention in a low-precision dtype against a float64 one-process reference, on any device.

Legend: B batch, Hq/Hkv heads, P padded length, D head dim; "full" tensors are [B, H, P, D] in
padded global order. Used by the CUDA tests and ``benchmarks/gpu``: the same inputs, rounded to
the dtype under test, go through every rank's ring schedule (``simulate_cp_attention``, so the
device's own block kernels run inside the real segment/merge machinery) and through dense
float64 attention with the per-document mask; the errors are max-abs relative (``rel_err``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from cpvlm.distributed import compat
from cpvlm.distributed.shard_plan import ShardPlan
from cpvlm.testing.cp_simulation import simulate_cp_attention
from cpvlm.verify.compare import rel_err

CP_TOLERANCES = {torch.float32: 1e-5, torch.bfloat16: 8 * 2**-8, torch.float16: 8 * 2**-11}
"""Largest relative error of out, dq, dk, dv of CP attention on a fused CUDA kernel, by dtype.

fp32 (memory-efficient kernel, 3xTF32 tensor-core products, float32 accumulation): 1e-5, as for
float32 everywhere in cpvlm (round-off 6e-8; sums over ~2k keys stay near 1e-6). bf16 / fp16
(flash): the kernel rounds P to the input dtype before P @ V, dS before the gradient products,
and its outputs, each a relative u (bf16 2**-8, fp16 2**-11) of the largest entry: ~4u for one
call; under CP every block's partial out, dq, dk, dv is rounded once more before its float32
merge, and up to W = 8 of them per row add like a random walk (sqrt(8) u): 8u. A wrong mask
entry, a dropped rectangle or a scrambled lse moves results by O(1e-1) or more.
"""


def random_inputs(
    plan: ShardPlan, *, batch=1, hq=32, hkv=8, d=128, seed=0, device="cpu", dtype=torch.float64
) -> list[torch.Tensor]:
    """Full padded q, k, v and an upstream gradient, N(0, 1) drawn in float64, rounded to dtype.

    Padding positions hold random values too: the kernels must ignore them, not rely on zeros.
    """
    gen = torch.Generator(device=device).manual_seed(seed)
    p = plan.padded_len
    shapes = [(batch, hq, p, d), (batch, hkv, p, d), (batch, hkv, p, d), (batch, hq, p, d)]
    return [
        torch.randn(s, generator=gen, dtype=torch.float64, device=device).to(dtype) for s in shapes
    ]


def reference_attention(
    plan: ShardPlan, q, k, v, dout, *, causal: bool, scale: float | None = None
) -> list[torch.Tensor]:
    """out, dq, dk, dv of dense float64 attention over the real tokens, with the mask: same
    document and (not causal or key <= query). Full padded tensors, zero at padding."""
    real = plan.padded_index.to(q.device)
    doc = plan.doc_ids.to(q.device)[real]
    mask = doc[:, None] == doc[None, :]
    if causal:
        mask = mask.tril()
    q_r, k_r, v_r = (t.double()[:, :, real].requires_grad_() for t in (q, k, v))
    g = q.shape[1] // k.shape[1]
    out = F.scaled_dot_product_attention(
        q_r, k_r.repeat_interleave(g, 1), v_r.repeat_interleave(g, 1), attn_mask=mask, scale=scale
    )
    out.backward(dout.double()[:, :, real])
    full = []
    for t, like in ((out, q), (q_r.grad, q), (k_r.grad, k), (v_r.grad, v)):
        f = torch.zeros(like.shape, dtype=torch.float64, device=like.device)
        f[:, :, real] = t.detach()
        full.append(f)
    return full


def cp_errors(
    plan: ShardPlan,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dout: torch.Tensor,
    *,
    causal: bool,
    kernel: compat.FusedAttentionKernel | None = None,
) -> dict[str, float]:
    """Relative errors of out, dq, dk, dv of every rank's ring schedule in the inputs' dtype
    against ``reference_attention`` of the same (rounded) inputs."""
    shards = [[plan.shard(t, r, seq_dim=2) for r in range(plan.cp_size)] for t in (q, k, v, dout)]
    got = simulate_cp_attention(*shards, plan=plan, causal=causal, kernel=kernel)
    expected = reference_attention(plan, q, k, v, dout, causal=causal)
    return {
        name: rel_err(unshard(plan, got[j]), expected[j])
        for j, name in enumerate(("out", "dq", "dk", "dv"))
    }


def unshard(plan: ShardPlan, shards: list[torch.Tensor], seq_dim: int = 2) -> torch.Tensor:
    """The full padded tensor from every rank's shard (rank order), zero at padding, offline
    (``ShardPlan.unshard`` is the collective); the sequence on ``seq_dim`` (2: ``[B, H, S, D]``,
    1: ``[B, S, ...]``)."""
    shape = list(shards[0].shape)
    shape[seq_dim] = plan.padded_len
    full = shards[0].new_zeros(shape)
    for r, shard in enumerate(shards):
        full[(slice(None),) * seq_dim + (plan.indices(r).to(shard.device),)] = shard
    return full
