"""cp_attention under MaskSpec masks (sliding windows, bidirectional spans) on real gloo ranks,
float64, against one-process SDPA with the dense mask of the rule (mask_cases.rule_mask, built
from the document lengths and span offsets alone, not from the schedule).

Tolerance 1e-10, as in test_attn_exact: both sides sum the same float64 terms in different
orders (blockwise log-sum-exp merges vs one softmax), ~1e-15 apart; one wrong mask entry moves
the results by O(1e-2). Cases: cp 1..4, every impl (hybrid at cp 4), windows smaller than a
chunk (3) and larger than one, spans across a head-tail chunk boundary and a rank boundary
(mask_cases.span_offsets), one document with padding, packed documents (head-tail and
balanced), GQA and Hq not a multiple of cp.
"""

import pytest
import torch
import torch.nn.functional as F
from mask_cases import rule_mask, spans_of

from cpvlm import ShardPlan
from cpvlm.attention import MaskSpec, cp_attention
from cpvlm.testing import EmulatedKernel, rel_err, run_distributed, simulate_cp_attention
from cpvlm.testing.attention_check import unshard

MASKS = {
    # name: (causal, window (None, "small" = 3 or "wide" = beyond a chunk), spans)
    "window < chunk": (True, "small", False),
    "window > chunk": (True, "wide", False),
    "spans (Gemma 3 full)": (True, None, True),
    "window < span, spans (Gemma 3/4 sliding)": (True, "small", True),
    "window > chunk, spans": (True, "wide", True),
    "bidirectional window": (False, "small", False),
    "bidirectional window, spans": (False, "wide", True),
}


def _docs(cp):
    return {
        "single": ([14 * cp + 3], "head_tail"),
        "packed": ([5, 2 * cp - 1, 16 * cp + 3, 1], "head_tail"),
        "balanced": ([9, 3, 16 * cp + 5, 2, 7], "balanced"),
    }


def _impls(cp):
    return [("ring", None), ("allgather", None), ("ulysses", None)] + (
        [("hybrid", 2)] if cp == 4 else []
    )


def _cases(cp):
    """Every mask with every impl; the document configurations take turns, so that each mask
    and each impl meets each of them."""
    cases, docs = [], list(_docs(cp).values())
    for m, mask_name in enumerate(MASKS):
        for i, (impl, u) in enumerate(_impls(cp)):
            n = len(cases)
            (doc_lens, layout), (hq, hkv) = docs[(m + i) % len(docs)], ((4, 2), (3, 1))[n % 2]
            cases.append(
                dict(mask=mask_name, docs=doc_lens, layout=layout, impl=impl, u=u, hq=hq, hkv=hkv)
            )
            cases[-1]["seed"] = n
    # impl="auto" picks one of the above from the cost model (which counts the windowed work).
    auto = dict(cases[-1], impl="auto", u=None, seed=len(cases))
    return cases + [auto]


def _setup(c, cp):
    plan = ShardPlan(sum(c["docs"]), cp, doc_lens=c["docs"], layout=c["layout"])
    causal, window, with_spans = MASKS[c["mask"]]
    chunk = max(plan.padded_doc_lens) // (2 * cp)
    window = {None: None, "small": 3, "wide": 2 * chunk + 3}[window]
    per_doc, spans = spans_of(plan, cp)
    if not with_spans:
        per_doc, spans = [[]] * len(per_doc), ()
    gen = torch.Generator().manual_seed(c["seed"])
    b, p, d = 1 + c["seed"] % 2, plan.padded_len, 8
    shapes = [(b, c["hq"], p, d), (b, c["hkv"], p, d), (b, c["hkv"], p, d), (b, c["hq"], p, d)]
    tensors = [torch.randn(s, generator=gen, dtype=torch.float64) for s in shapes]
    return plan, (causal, window, per_doc, spans), tensors


def _reference(c, cp):
    """Full padded out, dq, dk, dv (zero at padding) of SDPA on the real tokens."""
    plan, (causal, window, per_doc, _), (q, k, v, g) = _setup(c, cp)
    real = plan.padded_index
    q_r, k_r, v_r = (t[:, :, real].clone().requires_grad_() for t in (q, k, v))
    rep = c["hq"] // c["hkv"]
    out = F.scaled_dot_product_attention(
        q_r,
        k_r.repeat_interleave(rep, 1),
        v_r.repeat_interleave(rep, 1),
        attn_mask=rule_mask(plan.doc_lens, per_doc, causal, window),
    )
    (out * g[:, :, real]).sum().backward()
    full = []
    for t, like in ((out, q), (q_r.grad, q), (k_r.grad, k), (v_r.grad, v)):
        f = torch.zeros_like(like)
        f[:, :, real] = t.detach()
        full.append(f)
    return full


def _run(rank, world_size, cases):
    """cp_attention forward + backward of every case (shards), and the references of every
    world_size-th case (computed in parallel on the ranks)."""
    results, refs = [], {}
    for n, c in enumerate(cases):
        plan, (causal, window, _, spans), (q, k, v, g) = _setup(c, world_size)
        mask = MaskSpec(causal=causal, window=window, spans=spans)
        q_l, k_l, v_l = (plan.shard(t, rank, seq_dim=2).requires_grad_() for t in (q, k, v))
        out = cp_attention(
            q_l, k_l, v_l, plan=plan, group=None, impl=c["impl"], ulysses_size=c["u"], mask=mask
        )
        (out * plan.shard(g, rank, seq_dim=2)).sum().backward()
        results.append([t.detach() for t in (out, q_l.grad, k_l.grad, v_l.grad)])
        if n % world_size == rank:
            refs[n] = _reference(c, world_size)
    return results, refs


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_every_mask_kind_and_impl_matches_one_process_sdpa(cp):
    cases = _cases(cp)
    ranks = run_distributed(_run, cp, cases, timeout=300)
    refs = {n: ref for _, part in ranks for n, ref in part.items()}
    for n, c in enumerate(cases):
        plan = ShardPlan(sum(c["docs"]), cp, doc_lens=c["docs"], layout=c["layout"])
        for j, name in enumerate(("out", "dq", "dk", "dv")):
            got = unshard(plan, [results[n][j] for results, _ in ranks])
            err = rel_err(got, refs[n][j])
            assert err <= 1e-10, f"{name} rel err {err:.2e}, cp={cp}, {c}"
            assert torch.all(got[:, :, plan.is_padding] == 0), f"{name} nonzero at padding, {c}"


@pytest.mark.parametrize("cp", [2, 4])
def test_fused_kernel_path_runs_every_mask_kind(cp):
    """The CUDA path's calling convention (attention/fused.py: packed calls of row-disjoint
    rectangles, dense masked calls for the window's edges) on the emulated efficient kernel,
    every rank's ring in one process; float64, same tolerance."""
    for n, mask_name in enumerate(MASKS):
        c = dict(mask=mask_name, docs=_docs(cp)["packed"][0], layout="head_tail", hq=4, hkv=2)
        c["seed"] = n
        plan, (causal, window, _, spans), tensors = _setup(c, cp)
        shards = [[plan.shard(t, r, seq_dim=2) for r in range(cp)] for t in tensors]
        kernel = EmulatedKernel("efficient")
        mask = MaskSpec(causal=causal, window=window, spans=spans)
        got = simulate_cp_attention(*shards, plan=plan, mask=mask, kernel=kernel.kernel)
        expected = _reference(c, cp)
        assert kernel.calls, "the emulated kernel was not called"
        for j, name in enumerate(("out", "dq", "dk", "dv")):
            err = rel_err(unshard(plan, got[j]), expected[j])
            assert err <= 1e-10, f"{name} rel err {err:.2e}, cp={cp}, {mask_name}"


def _bad_inputs(rank, world_size):
    """Each bad call on every rank; the message each rank raised (None: no error)."""
    plan = ShardPlan(21, world_size, doc_lens=[13, 8])  # documents at padded [0, 13), [16, 24)
    q = torch.randn(1, 2, plan.local_len, 4, dtype=torch.float64)

    def attend(**kw):
        return cp_attention(q, q, q, plan=plan, group=None, **kw)

    calls = {
        "span into padding": lambda: attend(mask=MaskSpec(spans=((11, 14),))),
        "span across documents": lambda: attend(mask=MaskSpec(spans=((12, 18),))),
        "window on one rank": lambda: attend(mask=MaskSpec(window=4 + (rank == 1))),
        "spans on one rank": lambda: attend(mask=MaskSpec(spans=((2, 5 + (rank == 1)),))),
        "causal contradicts mask": lambda: attend(causal=False, mask=MaskSpec(window=3)),
    }
    messages = {}
    for name, call in calls.items():
        try:
            call()
            messages[name] = None
        except ValueError as err:
            messages[name] = str(err)
    return messages


def test_bad_masks_raise_the_same_value_error_on_every_rank():
    expected = {
        "span into padding": "mask.spans[0] = (11, 14) is not inside one document",
        "span across documents": "mask.spans[0] = (12, 18) is not inside one document",
        "window on one rank": "mask.window",
        "spans on one rank": "mask.spans",
        "causal contradicts mask": "causal=False contradicts mask.causal=True",
    }
    ranks = run_distributed(_bad_inputs, 2, timeout=60)
    for name, fragment in expected.items():
        assert ranks[0][name] is not None, f"{name}: no error"
        assert ranks[0][name] == ranks[1][name], f"{name}: the ranks raised different errors"
        assert fragment in ranks[0][name], f"{name}: {ranks[0][name]}"


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        (dict(window=0), "MaskSpec.window must be None or an int >= 1"),
        (dict(window=-3), "MaskSpec.window must be None or an int >= 1"),
        (dict(window=2.5), "MaskSpec.window"),
        (dict(window=True), "MaskSpec.window"),
        (dict(causal=1), "MaskSpec.causal must be a bool"),
        (dict(spans=((3, 3),)), r"MaskSpec.spans\[0\] = \(3, 3\)"),
        (dict(spans=((-1, 2),)), r"MaskSpec.spans\[0\]"),
        (dict(spans=((0, 4), (3, 6))), r"MaskSpec.spans\[1\] = \(3, 6\) starts before"),
        (dict(spans=((5, 8), (0, 2))), r"MaskSpec.spans\[1\] = \(0, 2\) starts before"),
        (dict(spans=(3, 4)), "MaskSpec.spans must be \\(start, stop\\) pairs"),
    ],
)
def test_mask_spec_is_validated_when_built(kwargs, fragment):
    with pytest.raises(ValueError, match=fragment):
        MaskSpec(**kwargs)


def test_mask_spec_takes_lists_and_is_hashable():
    mask = MaskSpec(window=4, spans=[[1, 3], (5, 9)])
    assert mask.spans == ((1, 3), (5, 9)) and hash(mask) == hash(
        MaskSpec(True, 4, ((1, 3), (5, 9)))
    )
