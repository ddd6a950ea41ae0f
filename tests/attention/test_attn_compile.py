"""The fused CUDA path under fake tensors and torch.compile, on CPU.

compat wraps each fused call (flash, memory-efficient; forward, backward) as a custom op with its
own fake kernel, so tracing never reaches torch's meta kernels of the aten ops (torch 2.13's meta
kernel of _efficient_attention_backward lacks its ``out`` argument and fails with "got multiple
values for argument 'scale'"). Here every rank's ring schedule runs compat's real CUDA call sites
(kernel=compat.CUDA_FLASH / CUDA_EFFICIENT) on fake tensors, then on the CPU kernels of
cpvlm.testing.EmulatedKernel under torch.compile, against the float64 reference (1e-10).
"""

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from cpvlm import ShardPlan
from cpvlm.distributed import compat
from cpvlm.testing import EmulatedKernel, simulate_cp_attention
from cpvlm.testing.attention_check import cp_errors, random_inputs, reference_attention, unshard
from cpvlm.verify import rel_err

DOCS = [10, 1, 25, 12]


@pytest.mark.parametrize(
    "kernel, dtype", [(compat.CUDA_EFFICIENT, torch.float32), (compat.CUDA_FLASH, torch.bfloat16)]
)
def test_every_ranks_ring_schedule_traces_the_cuda_calls_on_fake_tensors(kernel, dtype):
    plan = ShardPlan(sum(DOCS), 2, doc_lens=DOCS)
    with FakeTensorMode():
        shards = [
            [torch.empty(1, h, plan.local_len, 64, dtype=dtype) for _ in range(2)]
            for h in (4, 2, 2, 4)  # q, k, v, dout of each rank
        ]
        out, dq, dk, dv = simulate_cp_attention(*shards, plan=plan, causal=True, kernel=kernel)
    for got, like in zip((out, dq, dk, dv), (shards[0], shards[0], shards[1], shards[2])):
        for g, x in zip(got, like):
            assert isinstance(g, FakeTensor) and g.shape == x.shape and g.dtype == dtype
    # Nothing fake stays behind in the caches (call layouts, rng tensors): a real run after it.
    tensors = random_inputs(plan, hq=4, hkv=2, d=64)
    errors = cp_errors(plan, *tensors, causal=True, kernel=EmulatedKernel(kernel.name).kernel)
    assert max(errors.values()) <= 1e-10, errors


def test_the_fused_calls_trace_where_the_aten_meta_kernel_fails():
    with FakeTensorMode():
        q = torch.empty(1, 40, 4, 64)
        lse = torch.empty(1, 4, 64)
        seed = torch.empty((), dtype=torch.long)
        try:  # torch 2.13's meta kernel; a torch that fixed it passes here
            torch.ops.aten._efficient_attention_backward(
                q, q, q, q, None, q, None, None, 40, 40, lse, 0.0, seed, seed, 1, False, scale=0.1
            )
        except TypeError as e:
            assert "multiple values for argument 'scale'" in str(e)
        out, lse = compat.CUDA_EFFICIENT.forward(q, q, q, causal=True, scale=0.1)
        grads = compat.CUDA_EFFICIENT.backward(q, q, q, q, out, lse, causal=True, scale=0.1)
    assert lse.shape == (1, 4, 40) and lse.is_contiguous()
    assert [g.shape for g in grads] == [q.shape] * 3


def test_the_ring_schedule_on_the_cuda_call_sites_compiles_exactly():
    # One rank (its blocks still hold packed calls of three documents): compiling takes long.
    torch._dynamo.reset()
    plan = ShardPlan(sum(DOCS), 1, doc_lens=DOCS)
    q, k, v, dout = random_inputs(plan, hq=4, hkv=2, d=16, seed=3)
    kernel = EmulatedKernel("efficient").kernel

    def step(q, k, v, dout):
        got = simulate_cp_attention([q], [k], [v], [dout], plan=plan, causal=True, kernel=kernel)
        return [unshard(plan, g) for g in got]

    shards = [plan.shard(t, 0, seq_dim=2) for t in (q, k, v, dout)]
    got = torch.compile(step, backend="aot_eager")(*shards)
    expected = reference_attention(plan, q, k, v, dout, causal=True)
    for name, g, want in zip(("out", "dq", "dk", "dv"), got, expected):
        assert rel_err(g, want) <= 1e-10, name
