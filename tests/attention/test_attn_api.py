"""cp_attention's contract: input checks, no-grad use, mixed requires_grad, strided inputs."""

import torch
import torch.distributed as dist
from attn_cases import case, reference, run_cases, unshard

from cpvlm import ShardPlan
from cpvlm.attention import cp_attention
from cpvlm.testing import rel_err, run_distributed


def _errors(rank, world_size):
    plan = ShardPlan(16, world_size)
    n = plan.local_len
    ok = dict(plan=plan, cp_rank=rank, group=dist.group.WORLD)

    def t(*shape, dtype=torch.float32):
        return torch.randn(*shape, dtype=dtype)

    q, kv = t(1, 4, n, 8), t(1, 2, n, 8)
    bad = {
        "impl": lambda: cp_attention(q, kv, kv, impl="zigzag", **ok),
        "plan": lambda: cp_attention(q, kv, kv, plan=16, cp_rank=rank, group=dist.group.WORLD),
        "rank": lambda: cp_attention(
            q, kv, kv, plan=plan, cp_rank=rank + 1, group=dist.group.WORLD
        ),
        "group": lambda: cp_attention(
            q, kv, kv, plan=ShardPlan(16, world_size + 1), cp_rank=rank, group=dist.group.WORLD
        ),
        "dims": lambda: cp_attention(q[0], kv, kv, **ok),
        "dtype": lambda: cp_attention(q, kv.double(), kv, **ok),
        "int": lambda: cp_attention(q.long(), kv.long(), kv.long(), **ok),
        "heads": lambda: cp_attention(t(1, 3, n, 8), kv, kv, **ok),
        "length": lambda: cp_attention(
            t(1, 4, n + 1, 8), t(1, 2, n + 1, 8), t(1, 2, n + 1, 8), **ok
        ),
        "kv": lambda: cp_attention(q, kv, t(1, 2, n, 4), **ok),
        "head dim": lambda: cp_attention(q, t(1, 2, n, 4), t(1, 2, n, 4), **ok),
        "scale": lambda: cp_attention(q, kv, kv, scale=-1.0, **ok),
        "causal": lambda: cp_attention(q, kv, kv, causal="yes", **ok),
    }
    messages = {}
    for name, call in bad.items():
        try:
            call()
            messages[name] = None
        except ValueError as e:
            messages[name] = str(e)
    return messages


def test_bad_inputs_raise_value_errors_naming_the_problem():
    expected = {
        "impl": "impl must be one of ['ring', 'allgather', 'ulysses', 'hybrid', 'auto'], got 'zigzag'",
        "plan": "plan must be a ShardPlan, got int",
        "rank": "cp_rank=",
        "group": "the group has 2 ranks but the plan has cp_size=3",
        "dims": "q must be a 4-d [B, H, S_loc, D] tensor, got (4, 8, 8)",
        "dtype": "share one floating dtype",
        "int": "share one floating dtype",
        "heads": "query heads (3) must be a multiple of key/value heads (2)",
        "length": "q has 9 and k 9 positions but ShardPlan(seq_len=16, cp_size=2) gives each rank local_len=8",
        "kv": "k and v must have the same shape",
        "head dim": "must agree on batch and head dim",
        "scale": "scale must be a positive finite number, got -1.0",
        "causal": "causal must be a bool or None, got 'yes'",
    }
    for messages in run_distributed(_errors, 2):
        for name, fragment in expected.items():
            assert messages[name] is not None, f"{name}: no error"
            assert fragment in messages[name], f"{name}: {messages[name]}"


def _modes(rank, world_size):
    """Grad mode, no-grad mode, a rank whose inputs need no grad, and strided q/k/v."""
    plan = ShardPlan(37, world_size, doc_lens=[20, 17])
    g = torch.Generator().manual_seed(7)
    x_BSHD = torch.randn(2, plan.local_len, 12, 16, dtype=torch.float64, generator=g)
    dout = torch.randn(2, 8, plan.local_len, 16, dtype=torch.float64, generator=g)
    # Strided, as a model produces them: [B,S,H,D] split into heads, then transposed.
    q, k, v = x_BSHD.transpose(1, 2).split([8, 2, 2], dim=1)
    contiguous = [t.contiguous() for t in (q, k, v)]
    kw = dict(plan=plan, cp_rank=rank, group=dist.group.WORLD)

    def grads(inputs, need_grad):
        leaves = [t.detach().requires_grad_(need_grad) for t in inputs]
        out = cp_attention(*leaves, **kw)
        (out * dout).sum().backward()
        return out.detach(), [t.grad for t in leaves]

    out, ref_grads = grads(contiguous, True)
    strided_out, strided_grads = grads((q, k, v), True)
    # Rank 0's inputs need no grad: its backward must still join the others' ring.
    mixed_out, mixed_grads = grads(contiguous, rank != 0)
    with torch.no_grad():
        no_grad_out = cp_attention(*contiguous, **kw)
    return dict(
        strided=max(
            rel_err(strided_out, out), *(rel_err(a, b) for a, b in zip(strided_grads, ref_grads))
        ),
        mixed=rel_err(mixed_out, out),
        mixed_grads=None
        if rank == 0
        else max(rel_err(a, b) for a, b in zip(mixed_grads, ref_grads)),
        no_grad=rel_err(no_grad_out, out),
        no_grad_requires_grad=no_grad_out.requires_grad,
    )


def test_no_grad_mixed_requires_grad_and_strided_inputs_give_the_same_results():
    for rank, r in enumerate(run_distributed(_modes, 3)):
        assert r["strided"] == 0.0
        assert r["mixed"] == 0.0 and r["no_grad"] == 0.0
        assert rank == 0 or r["mixed_grads"] == 0.0
        assert not r["no_grad_requires_grad"]


def test_cp_groups_that_are_subgroups_of_the_world():
    """4 ranks as 2 data-parallel replicas x CP=2: each pair runs its own ring in a subgroup."""
    c = case([9, 14], "ring", True, seed=4)
    results = run_distributed(run_cases, 4, [c], cp=2)
    plan, expected = reference(c, 2)
    for pair in (results[0:2], results[2:4]):
        for j in range(4):
            assert rel_err(unshard(plan, [r[0][j] for r in pair]), expected[j]) <= 1e-10
