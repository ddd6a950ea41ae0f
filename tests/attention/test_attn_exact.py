"""cp_attention in float64 on real gloo ranks against one-process SDPA with the dense mask.

Tolerance 1e-10: both sides compute the same sums in float64 in different orders (blockwise
log-sum-exp merging vs one softmax), so they agree to a few ulps (~1e-15 measured); 1e-10 leaves
room for accumulation over longer rows while still catching any wrong mask entry, which moves
results by O(1e-2) or more.
"""

import pytest
import torch
from attn_cases import case, reference, run_cases, unshard

from cpvlm.testing import rel_err

HEADS = [(8, 2, 32), (8, 2, 64), (4, 4, 32), (4, 4, 64)]  # (Hq, Hkv, D): GQA and MHA


def doc_configs(cp):
    return {
        # one sequence whose length is not a multiple of 2*cp: padding at its end
        "single": [6 * cp + 1],
        # packed: documents shorter than 2*cp, and two long enough for fused per-document calls
        "packed": [1, 2 * cp - 1, 40 * cp + 3, 24 * cp + 1],
        # every document shorter than cp: the last rank holds only padding
        "pad-only rank": [max(1, cp - 1), 1],
        # many tiny documents: grouped into masked calls
        "tiny docs": [3] * 12 + [8 * cp],
    }


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_float64_out_and_grads_match_one_process(cp):
    from cpvlm.testing import run_distributed

    cases = [
        case(docs, impl, causal, hq, hkv, d, seed=i)
        for i, (impl, causal, docs, (hq, hkv, d)) in enumerate(
            (impl, causal, docs, heads)
            for impl in ("ring", "allgather")
            for causal in (True, False)
            for docs in doc_configs(cp).values()
            for heads in HEADS
        )
    ]
    cases.append(case([5 * cp + 2, 3], "ring", True, scale=0.37, seed=99))
    results = run_distributed(run_cases, cp, cases, timeout=120)
    for i, c in enumerate(cases):
        plan, expected = reference(c, cp)
        for j, name in enumerate(("out", "dq", "dk", "dv")):
            got = unshard(plan, [results[r][i][j] for r in range(cp)])
            err = rel_err(got, expected[j])
            assert err <= 1e-10, f"{name} rel err {err:.2e} for cp={cp} {c}"
            # Padding: outputs exactly 0, and not one gradient bit reaches or leaves it.
            assert torch.all(got[:, :, plan.is_padding] == 0), f"{name} nonzero at padding, {c}"
