"""simulate_cp_attention (every rank's ring schedule in one process) against the gloo ring.

Float64 on CPU, bit for bit: the simulation runs the ring's own per-step functions in ring time,
so every accumulator gets the same additions in the same order, and the CPU kernels give the
same bits on the same thread count (the gloo workers use one thread, and so does the simulation
here; with two threads the CPU flash kernel splits its work differently, measured 1 ulp off).
Both are also checked against the one-process SDPA reference (1e-10, as in test_attn_exact), so
a simulation that agreed with a wrong ring would still fail.
"""

import pytest
import torch
from attn_cases import case, inputs, reference, run_cases, unshard

from cpvlm.testing import rel_err, run_distributed, simulate_cp_attention


def _cases(cp):
    docs = {
        "single": [5 * cp + 3],
        "packed": [1, 2 * cp - 1, 20 * cp + 3, 9],
        "tiny docs": [2] * 9 + [4 * cp + 1],
    }
    return [
        case(d, "ring", causal, hq, hkv, d=16, seed=i)
        for i, (causal, d, (hq, hkv)) in enumerate(
            (causal, d, heads)
            for causal in (True, False)
            for d in docs.values()
            for heads in ((8, 2), (4, 4))
        )
    ]


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_one_process_simulation_equals_the_gloo_ring_bit_for_bit(cp):
    cases = _cases(cp)
    ring = run_distributed(run_cases, cp, cases, timeout=120)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for i, c in enumerate(cases):
            plan, (q, k, v, g) = inputs(c, cp)
            shards = [[plan.shard(t, r, seq_dim=2) for r in range(cp)] for t in (q, k, v, g)]
            simulated = simulate_cp_attention(*shards, plan=plan, causal=c["causal"])
            _, expected = reference(c, cp)
            for j, name in enumerate(("out", "dq", "dk", "dv")):
                for r in range(cp):
                    assert torch.equal(simulated[j][r], ring[r][i][j]), f"{name} rank {r}, {c}"
                err = rel_err(unshard(plan, simulated[j]), expected[j])
                assert err <= 1e-10, f"{name} rel err {err:.2e}, {c}"
    finally:
        torch.set_num_threads(threads)


def test_forward_only_and_bad_shard_lists():
    c = case([13], "ring", True, 4, 2, d=8)
    plan, (q, k, v, _) = inputs(c, 2)
    shards = [[plan.shard(t, r, seq_dim=2) for r in range(2)] for t in (q, k, v)]
    (out,) = simulate_cp_attention(*shards, plan=plan)
    _, expected = reference(c, 2)
    assert rel_err(unshard(plan, out), expected[0]) <= 1e-10
    with pytest.raises(ValueError, match="k must hold one shard per rank"):
        simulate_cp_attention(shards[0], shards[1][:1], shards[2], plan=plan)
