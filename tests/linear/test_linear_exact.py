"""The CP linear-attention layer (conv halo + delta-rule state passing) on real gloo ranks against
transformers' one-process functions on each document alone.

float64 tolerance 1e-10: both sides do the same sums in float64 (transformers' chunked delta rule
read in float64, see ``in_float64``) in different orders (other kernel chunks, a cross-rank
scan of affine maps), measured at <= 3e-15; a wrong halo row, a missing state or a gradient that
does not travel back moves results by 1e-2 or more (the naive CP below: >= 0.1).
"""

import pytest
import torch
from linear_cases import (
    case,
    naive_cp,
    no_grad_and_grad_outputs,
    reference,
    run_cases,
)

from cpvlm.hf.float64 import in_float64
from cpvlm.testing import rel_err, run_distributed
from cpvlm.testing.attention_check import unshard

NAMES = ("out", "dx", "dg", "dbeta", "dweight", "dbias")


def doc_configs(cp):
    return {
        # one sequence, not a multiple of 2*cp, two rows
        "single": case([6 * cp + 1], b=2),
        # documents shorter than the conv kernel (1, 3) and than 2*cp; several kernel chunks per
        # CP chunk (chunk_size 8), grouped value heads (Hk=2, Hv=4), K != V
        "packed": case([1, 2 * cp - 1, 3, 40 * cp + 3, 17], chunk_size=8, seed=1),
        # every document shorter than cp: the last rank holds only padding
        "pad-only rank": case([max(1, cp - 1), 1], seed=2),
        # kernel width 1: no halo at all; equal heads and dims, no bias
        "width 1": case(
            [50 * cp], chunk_size=4, width=1, hk=2, hv=2, dk=6, dv=6, seed=3, bias=False
        ),
        # halo wider than a chunk: K-1 = 5 rows reach back over several chunks and ranks
        "wide halo": case([2, 9, 5 * cp], width=6, chunk_size=4, seed=4),
    }


def _check(results, cases, cp, delta, conv, tol, dtype=torch.float64):
    for i, c in enumerate(cases):
        plan, expected = reference(c, cp, conv, delta, dtype)
        for j, name in enumerate(NAMES):
            if expected[j] is None:
                continue
            if j < 4:
                got = unshard(plan, [results[r][i][j] for r in range(cp)], seq_dim=1)
                # Padding positions: outputs exactly 0, and no gradient reaches them.
                assert torch.all(got[:, plan.is_padding] == 0), f"{name} nonzero at padding, {c}"
            else:  # a replicated parameter: the CP gradient is the sum of the ranks' shares
                got = sum(results[r][i][j] for r in range(cp))
            err = rel_err(got, expected[j])
            assert err <= tol, f"{name} rel err {err:.2e} > {tol} for cp={cp} {c}"


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_float64_layer_matches_one_process_per_document(cp):
    from transformers.models.qwen3_5 import modeling_qwen3_5 as hf

    cases = list(doc_configs(cp).values())
    results = run_distributed(run_cases, cp, cases, timeout=180)
    _check(
        results,
        cases,
        cp,
        in_float64(hf.torch_chunk_gated_delta_rule),
        hf.causal_conv1d_fn,
        1e-10,
    )


def test_float32_layer_matches_transformers_float32():
    """float32 inputs (the delta rule in float32, as transformers computes it) against
    transformers' own float32 functions: measured <= 9e-7 for outputs and every gradient (and
    both are that far from float64); 1e-5 is the float32 bound of
    docs/architecture.md, "Exactness"."""
    from transformers.models.qwen3_5 import modeling_qwen3_5 as hf

    cp = 2
    cases = [case([6 * cp + 1], b=2, seed=5), case([1, 3, 3, 83, 17], chunk_size=8, seed=1)]
    results = run_distributed(run_cases, cp, cases, "float32", timeout=180)
    _check(
        results,
        cases,
        cp,
        hf.torch_chunk_gated_delta_rule,
        hf.causal_conv1d_fn,
        1e-5,
        torch.float32,
    )


@pytest.mark.parametrize("cp", [2, 4])
def test_naive_cp_from_zero_states_fails_the_same_check(cp):
    """Each rank running the layer on its own shard from a zero state and zero conv history (what
    a CP wrapper that only shards the sequence does) is far from the one-process result."""
    from transformers.models.qwen3_5 import modeling_qwen3_5 as hf

    delta = in_float64(hf.torch_chunk_gated_delta_rule)
    for name in ("single", "packed", "wide halo"):
        c = doc_configs(cp)[name]
        plan, got = naive_cp(c, cp)
        _, expected = reference(c, cp, hf.causal_conv1d_fn, delta)
        real = ~plan.is_padding
        err = rel_err(got[:, real], expected[0][:, real])
        assert err > 0.1, (
            f"naive CP is unexpectedly close ({err:.2e}) on {name}: the test cannot fail"
        )


def test_in_float64_is_the_token_by_token_recurrence():
    """The reference itself: transformers' chunked function read in float64 equals the delta
    rule's definition run token by token in float64 (written here), to float64 round-off."""
    from transformers.models.qwen3_5 import modeling_qwen3_5 as hf

    gen = torch.Generator().manual_seed(0)
    b, t, h, dk, dv = 2, 70, 3, 5, 4
    q, k = (torch.randn(b, t, h, dk, generator=gen, dtype=torch.float64) for _ in range(2))
    v = torch.randn(b, t, h, dv, generator=gen, dtype=torch.float64)
    g = -torch.rand(b, t, h, generator=gen, dtype=torch.float64)
    beta = torch.rand(b, t, h, generator=gen, dtype=torch.float64)
    out, _ = in_float64(hf.torch_chunk_gated_delta_rule)(
        q, k, v, g, beta, use_qk_l2norm_in_kernel=True
    )

    qn, kn = (x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6) for x in (q, k))
    qn = qn * dk**-0.5
    state = torch.zeros(b, h, dk, dv, dtype=torch.float64)
    expected = torch.empty_like(out)
    for i in range(t):
        state = state * g[:, i].exp()[..., None, None]
        kt = kn[:, i].unsqueeze(-1)  # [b, h, dk, 1]
        err = v[:, i] - (state * kt).sum(-2)
        state = state + kt * (beta[:, i, :, None] * err).unsqueeze(-2)
        expected[:, i] = (state * qn[:, i].unsqueeze(-1)).sum(-2)
    assert rel_err(out, expected) <= 1e-12  # measured 1e-15


def test_no_grad_forward_matches_grad_mode():
    """Evaluation (no autograd, no backward collective) gives the same outputs."""
    cp = 3
    c = case([1, 2 * cp - 1, 40 * cp + 3], chunk_size=8, seed=7)
    for no_grad, grad in run_distributed(no_grad_and_grad_outputs, cp, c, timeout=120):
        assert torch.equal(no_grad, grad)
