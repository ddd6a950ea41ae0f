"""The CP Mamba-2 mixer (conv halo + SSD state passing) on real gloo ranks against transformers'
unmodified ``NemotronHMamba2Mixer`` on each document alone.

float64 tolerance 1e-10: both sides do the same sums in float64 (the reference under
``in_float64``) in different orders (other kernel chunks, a cross-rank scan of the pieces'
states), measured at <= 4e-14; the same computation with the state not carried across pieces (each
from zero, the conv halo still exchanged) is off by >= 0.08 in the output and every gradient but
out_proj's bias (the sum of the upstream gradient, which no state reaches).
"""

import pytest
import torch
from mamba2_cases import case, no_grad_and_grad_outputs, reference, run_cases

from cpvlm.attention.linear import chunk_ssd_scan
from cpvlm.hf.float64 import in_float64
from cpvlm.testing import rel_err, run_distributed
from cpvlm.testing.attention_check import unshard


def doc_configs(cp):
    return {
        # three packed documents of odd lengths, several kernel chunks (4 rows) per CP piece
        "packed": case([7, 12, 5]),
        # one group for all heads, time_step_limit clamping, no biases, a document shorter than
        # the conv kernel and than 2*cp (some pieces padding only)
        "limits": case(
            [5 * cp + 3, 1], b=1, heads=2, groups=1, limit=(0.2, 1.5), bias=False, seed=1
        ),
        # halo wider than a piece: K-1 = 5 rows reach back over several pieces and ranks
        "wide halo": case([2, 9, 4 * cp + 1], width=6, chunk_size=3, seed=2),
    }


def errors(results, c, cp, dtype=torch.float64):
    """``{name: rel err}`` of the CP results against the reference, and the plan."""
    plan, out, dx, grads = reference(c, cp, dtype)
    got_out = unshard(plan, [results[r][0] for r in range(cp)], seq_dim=1)
    got_dx = unshard(plan, [results[r][1] for r in range(cp)], seq_dim=1)
    # Padding positions: outputs exactly 0 on the CP side.
    assert torch.all(got_out[:, plan.is_padding] == 0), f"output nonzero at padding, {c}"
    errs = {"out": rel_err(got_out, out), "dhidden": rel_err(got_dx, dx)}
    for name, expected in grads.items():
        # a replicated parameter: the CP gradient is the sum of the ranks' shares
        errs[f"d{name}"] = rel_err(sum(results[r][2][name] for r in range(cp)), expected)
    return errs


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_float64_mixer_matches_one_process_per_document(cp):
    cases = doc_configs(cp)
    results = run_distributed(run_cases, cp, list(cases.values()), timeout=180)
    for i, (label, c) in enumerate(cases.items()):
        errs = errors([r[i] for r in results], c, cp)
        worst = max(errs, key=errs.get)
        print(f"cp={cp} {label}: max rel err {errs[worst]:.1e} ({worst})")
        assert errs[worst] <= 1e-10, f"{worst} rel err {errs[worst]:.2e} for cp={cp} {label}"


@pytest.mark.parametrize("cp", [2, 3, 4])
def test_state_not_carried_fails_the_same_check(cp):
    """The same computation with every piece starting from a zero state (what a CP wrapper that
    only shards the sequence does to the scan) fails the check by far: the check can fail."""
    cases = doc_configs(cp)
    results = run_distributed(run_cases, cp, list(cases.values()), carry=False, timeout=180)
    for i, (label, c) in enumerate(cases.items()):
        errs = errors([r[i] for r in results], c, cp)
        print(f"cp={cp} {label}, not carried: out {errs['out']:.1e}, dhidden {errs['dhidden']:.1e}")
        for name, err in errs.items():
            if name != "dout_proj.bias":
                assert err > 1e-2, f"not carried, {name} is close ({err:.1e}): {label}"


def test_float32_mixer_matches_transformers_float32():
    """float32 (the scan and the norm in float32, as transformers computes them) against the
    unmodified float32 mixer: within the float32 bound of docs/architecture.md, "Exactness"."""
    cp = 2
    cases = doc_configs(cp)
    results = run_distributed(run_cases, cp, list(cases.values()), "float32", timeout=180)
    for i, (label, c) in enumerate(cases.items()):
        errs = errors([r[i] for r in results], c, cp, torch.float32)
        worst = max(errs, key=errs.get)
        print(f"float32 cp={cp} {label}: max rel err {errs[worst]:.1e} ({worst})")
        assert errs[worst] <= 1e-5, f"{worst} rel err {errs[worst]:.2e} for {label}"


def test_no_grad_forward_matches_grad_mode():
    """Evaluation (no autograd, no backward collective) gives the same outputs."""
    cp = 3
    c = case([1, 2 * cp - 1, 10 * cp + 3], seed=7)
    for no_grad, grad in run_distributed(no_grad_and_grad_outputs, cp, c, timeout=120):
        assert torch.equal(no_grad, grad)


def test_chunk_ssd_scan_is_the_recurrence_and_transformers_chunk_scan():
    """The local kernel, from given initial states over segments of one stream: outputs and final
    states equal the recurrence run token by token (written here) and transformers'
    ``mamba2_chunk_scan`` (in float64) on each segment with ``initial_states``."""
    from transformers.models.nemotron_h import modeling_nemotron_h as hf

    gen = torch.Generator().manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    t, h, p, n = 23, 4, 3, 5
    x, b, c = rand(t, h, p), rand(t, h, n), rand(t, h, n)
    dt = torch.rand(t, h, generator=gen, dtype=torch.float64) * 2
    a = -torch.rand(h, generator=gen, dtype=torch.float64) * 2
    cu = torch.tensor([0, 7, 8, 19, 23])
    start = rand(4, h, p, n)
    y, final = chunk_ssd_scan(x, dt, a, b, c, initial_state=start, cu_seqlens=cu, chunk_size=4)

    scan = in_float64(hf.mamba2_chunk_scan)
    for i in range(4):
        s, e = cu[i], cu[i + 1]
        state = start[i]
        for j in range(s, e):
            state = (a * dt[j]).exp()[:, None, None] * state
            state = state + (dt[j, :, None] * x[j])[..., None] * b[j, :, None, :]
            assert rel_err(y[j], (state * c[j, :, None, :]).sum(-1)) <= 1e-13
        assert rel_err(final[i], state) <= 1e-13
        hf_y, hf_final = scan(
            *(z[None, s:e] for z in (x, dt)),
            a,
            *(z[None, s:e] for z in (b, c)),
            chunk_size=4,
            initial_states=start[i : i + 1],
            return_final_states=True,
        )
        assert rel_err(y[s:e], hf_y[0]) <= 1e-13
        assert rel_err(final[i], hf_final[0]) <= 1e-13
